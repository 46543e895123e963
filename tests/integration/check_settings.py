"""``project.settings`` with SQLite's write transactions left DEFERRED (Django's default), for
``test_checks_command.py``'s taskhoster.W005."""

from project.settings import *  # noqa: F403

DATABASES["default"]["OPTIONS"].pop("transaction_mode", None)  # noqa: F405
