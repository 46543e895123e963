"""Crash points for fault-injection tests.

``crash_point("claim.after_rename")`` kills this process with SIGKILL when the environment
variable ``TASKHOSTER_CRASH_AT`` names that point, so tests can prove recovery from a crash
between two writes. Unset (always, in production) it costs one dictionary lookup.
"""

from __future__ import annotations

import os
import signal

CRASH_POINTS = (
    "post.after_files",
    "post.after_index",
    "claim.after_rename",
    "claim.after_commit",
    "result.after_done_file",
    "result.after_commit",
    "requeue.after_pending_file",
)


def crash_point(name: str) -> None:
    if os.environ.get("TASKHOSTER_CRASH_AT") == name:
        os.kill(os.getpid(), signal.SIGKILL)
