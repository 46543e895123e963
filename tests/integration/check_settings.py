"""``project.settings`` with SQLite's write transactions left DEFERRED (Django's default), for
``test_checks_command.py``'s taskhoster.W005."""

from project.settings import *  # noqa: F403

_options = DATABASES["default"]["OPTIONS"]  # noqa: F405
assert isinstance(_options, dict)
_options.pop("transaction_mode", None)
