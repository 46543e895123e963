"""Item ids that sort as plain strings in arrival order.

An id is 14 hex digits of microseconds since the epoch, made strictly increasing within a
process, then 6 random hex digits so that two processes picking the same microsecond still
differ. A post that answered before another began was stamped earlier on the shared system
clock, so it sorts first; the members of one batch take consecutive microseconds.
"""

from __future__ import annotations

import re
import secrets
import threading
import time

from . import patterns

ID_PATTERN = re.compile(patterns.ID)

_lock = threading.Lock()
_last_micros = 0


def new_ids(count: int) -> list[str]:
    """Return ``count`` fresh ids, strictly increasing and later than any this process gave."""
    global _last_micros
    with _lock:
        start = max(time.time_ns() // 1000, _last_micros + 1)
        _last_micros = start + count - 1
    return [f"{start + n:014x}{secrets.randbelow(1 << 24):06x}" for n in range(count)]


def new_id() -> str:
    return new_ids(1)[0]


def is_valid_id(value: object) -> bool:
    return isinstance(value, str) and ID_PATTERN.fullmatch(value) is not None
