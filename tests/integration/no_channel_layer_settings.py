"""``project.settings`` without ``CHANNEL_LAYERS``, for ``test_checks_command.py``: Taskhoster
needs no channel layer, so there is no check for a missing one."""

from project.settings import *  # noqa: F403

del CHANNEL_LAYERS  # noqa: F821
