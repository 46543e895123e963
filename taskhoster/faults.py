"""Crash points and injected faults, for tests that prove recovery.

``crash_point("claim.after_rename")`` kills this process with SIGKILL when the environment
variable ``TASKHOSTER_CRASH_AT`` names that point, so tests can prove recovery from a crash
between two writes. ``name@K`` kills at the K-th visit of the point instead of the first (the
earlier visits go on as usual: a test's acknowledged work before the crash, in the same
process). ``TASKHOSTER_CRASH_MIN_OPS`` counts only the visits of a group's points in a group
of at least that many operations. Before the kill the point says on stderr (the server's log)
which point, which visit and, for a group's points, the size of the group, so a test can check
where it crashed; ``TASKHOSTER_CRASH_DELAY`` (seconds) waits there first, so that anything the
process sent too early (an answer before its flush) reaches its client and the test sees it.

``fault("socket.result")`` is true when ``TASKHOSTER_FAULT`` names that fault: a
comma-separated list of names, each optionally ``=N`` to fire only the first N times in this
process, or ``@K`` to fire only the K-th time. The caller decides what the fault does (raise,
close the socket first, ...). Unset (always, in production) each costs one dictionary lookup.
"""

from __future__ import annotations

import os
import signal
import threading
import time

CRASH_POINTS = (
    "group.after_files",
    "group.before_commit",
    "group.after_commit",
    "post.after_files",
    "post.after_index",
    "claim.after_rename",
    "claim.after_commit",
    "result.after_done_file",
    "result.after_commit",
    "requeue.after_pending_file",
    # A schedule's slot (engine.group._fire): its item's file written, neither its row nor
    # the schedule's next slot committed; and both committed, the file not yet flushed.
    "schedule.after_post",
    "schedule.after_commit",
    # store.FileBatch: an item file's line appended, the file not yet renamed into its new
    # state's directory (every transition that writes a line: a verdict, a re-queue, ...).
    "file.after_append",
    # store.StateStore.barrier with FLUSH = "fsync": every written file fsynced, no directory
    # yet; and each touched directory fsynced, the next one not yet (its first visit: after the
    # first directory, before the second).
    "barrier.after_files",
    "barrier.after_directory",
)


class InjectedFault(RuntimeError):
    """An exception raised on purpose by a test's fault injection."""


# Read once: a process is started with its faults armed (reading the environment on every
# call would cost more than the rest of a crash point).
_CRASH_AT, _, _CRASH_VISIT = (os.environ.get("TASKHOSTER_CRASH_AT") or "").partition("@")
_CRASH_AT_VISIT = int(_CRASH_VISIT or 1)
# With this set, a crash point of a group fires only in a group of at least this many.
_CRASH_MIN_OPS = int(os.environ.get("TASKHOSTER_CRASH_MIN_OPS") or 0)
_CRASH_DELAY = float(os.environ.get("TASKHOSTER_CRASH_DELAY") or 0)
_FAULTS = os.environ.get("TASKHOSTER_FAULT")
_crash_visits = 0


def crash_point(name: str, *, group_size: int | None = None) -> None:
    if name == _CRASH_AT and (group_size is None or group_size >= _CRASH_MIN_OPS):
        _crash(name, group_size)


def _crash(name: str, group_size: int | None) -> None:
    global _crash_visits
    with _lock:
        _crash_visits += 1
        visit = _crash_visits
    if visit != _CRASH_AT_VISIT:
        return
    where = f"visit {visit}" + (f", group of {group_size}" if group_size is not None else "")
    os.write(2, f"taskhoster: crash point {name} reached ({where})\n".encode())
    if _CRASH_DELAY:
        time.sleep(_CRASH_DELAY)
    # In a committer process, its server dies with it: the two are one server.
    server = os.environ.get("TASKHOSTER_COMMITTER_CHILD")
    if server:
        os.kill(int(server), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


_fired: dict[str, int] = {}
_lock = threading.Lock()


def fault(name: str) -> bool:
    """True when ``TASKHOSTER_FAULT`` arms ``name`` (and its count is not used up)."""
    spec = _FAULTS
    if not spec:
        return False
    for entry in spec.split(","):
        armed, _, times = entry.strip().partition("=")
        armed, _, only = armed.partition("@")
        if armed != name:
            continue
        with _lock:
            hits = _fired.get(name, 0) + 1
            _fired[name] = hits
        if only:
            return hits == int(only)
        return not times or hits <= int(times)
    return False


# Tests: each group waits (at most 10 s) until this many operations are queued, so that a
# crash point "inside a crowded group" always meets a crowd.
GATHER = int(os.environ.get("TASKHOSTER_FAULT_GATHER") or 0)


def slow_seconds() -> float:
    """How long a fault that stalls (``committer.slow_group``, ``committer.slow_start``,
    ``post.slow_flush``: a group that posted, between its commit and its flush;
    ``rewrite.slow_flush``: a group that wrote files again, likewise; ``flush.slow``: a
    group's barrier, on whichever thread runs it;
    ``group.slow_put_back``: a group whose commit failed, before it puts its files back) stalls:
    ``TASKHOSTER_FAULT_SLOW_SECONDS``, 2 by default."""
    return float(os.environ.get("TASKHOSTER_FAULT_SLOW_SECONDS") or 2)


def raise_if_armed(name: str) -> None:
    if fault(name):
        raise InjectedFault(f"injected fault {name}")
