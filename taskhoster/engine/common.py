"""What the engine's modules share: the store of this process's settings."""

from __future__ import annotations

from datetime import timedelta
from functools import lru_cache
from pathlib import Path

from ..conf import get_conf
from ..store import StateStore


@lru_cache(maxsize=8)
def _store_for(root: Path, fsync: bool, flush: str) -> StateStore:
    return StateStore(root, fsync=fsync, flush=flush)  # resolves the root, once


def store() -> StateStore:
    conf = get_conf()
    return _store_for(conf.root, conf.fsync, conf.flush)


def seconds(value: float) -> timedelta:
    return timedelta(seconds=value)
