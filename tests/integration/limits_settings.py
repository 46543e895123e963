"""``project.settings`` with TASKHOSTER's limits taken from ``TASKHOSTER_TEST_LIMITS`` (JSON),
for the servers of ``test_limits.py``: every limit a server enforces comes from its settings."""

import json
import os

from project.settings import *  # noqa: F403

TASKHOSTER = {**TASKHOSTER, **json.loads(os.environ.get("TASKHOSTER_TEST_LIMITS", "{}"))}  # noqa: F405
