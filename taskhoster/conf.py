"""Taskhoster's settings, read lazily from ``settings.TASKHOSTER`` so ``override_settings`` works.

``project/settings.py`` fills ``TASKHOSTER`` from the environment (``TASKHOSTER_ROOT``,
``TASKHOSTER_FSYNC``); nothing here is read at import time.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.signals import setting_changed

DEFAULTS: dict[str, Any] = {
    "ROOT": "var/state",
    "FSYNC": True,
    # How a group's files are made durable: "syncfs" (one call for the whole filesystem,
    # Linux) or "fsync" (each written file and each touched directory).
    "FLUSH": "syncfs",
    # Where group commits run: "thread" (a thread of this process) or "process" (a process
    # of its own beside this one, so that it does not share the GIL: a server's choice).
    "COMMITTER": "thread",
    "MAX_PAYLOAD_BYTES": 1024 * 1024,
    "MAX_BATCH": 1000,
    "MAX_WAIT_SECONDS": 60,
    "MAX_CLAIM": 100,
    "SWEEP_CHUNK": 500,
    "REPAIR_GRACE_SECONDS": 60,
    "LONG_POLL_INTERVAL": 0.1,
    "PAGE_SIZE": 100,
    "MAX_PAGE_SIZE": 1000,
    "REDIS_URL": "",
    "SOCKET_BACKSTOP_SECONDS": 5.0,
    "MAX_CAPACITY": 1000,
}


@dataclass(frozen=True)
class Conf:
    root: Path
    fsync: bool
    flush: str
    committer: str
    max_payload_bytes: int
    max_batch: int
    max_wait_seconds: float
    max_claim: int
    sweep_chunk: int
    repair_grace_seconds: float
    long_poll_interval: float
    page_size: int
    max_page_size: int
    redis_url: str
    socket_backstop_seconds: float
    max_capacity: int


_cached: Conf | None = None


def get_conf() -> Conf:
    """The settings, read once and again whenever ``TASKHOSTER`` changes (``override_settings``
    sends ``setting_changed``)."""
    global _cached
    if _cached is None:
        _cached = _read()
    return _cached


def _forget(*, setting: str, **_kwargs: Any) -> None:
    global _cached
    if setting == "TASKHOSTER":
        _cached = None


setting_changed.connect(_forget)


def _read() -> Conf:
    user: dict[str, Any] = getattr(settings, "TASKHOSTER", {}) or {}
    merged = {**DEFAULTS, **user}
    return Conf(
        root=Path(merged["ROOT"]),
        fsync=bool(merged["FSYNC"]),
        flush=str(merged["FLUSH"]),
        committer=str(merged["COMMITTER"]),
        max_payload_bytes=int(merged["MAX_PAYLOAD_BYTES"]),
        max_batch=int(merged["MAX_BATCH"]),
        max_wait_seconds=float(merged["MAX_WAIT_SECONDS"]),
        max_claim=int(merged["MAX_CLAIM"]),
        sweep_chunk=int(merged["SWEEP_CHUNK"]),
        repair_grace_seconds=float(merged["REPAIR_GRACE_SECONDS"]),
        long_poll_interval=float(merged["LONG_POLL_INTERVAL"]),
        page_size=int(merged["PAGE_SIZE"]),
        max_page_size=int(merged["MAX_PAGE_SIZE"]),
        redis_url=str(merged["REDIS_URL"] or ""),
        socket_backstop_seconds=float(merged["SOCKET_BACKSTOP_SECONDS"]),
        max_capacity=int(merged["MAX_CAPACITY"]),
    )
