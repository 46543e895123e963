"""The machine's Redis (CI's and the development machine's), for the tests that need one
whether or not the suite runs with ``REDIS_URL``; ``needs_redis`` skips them where none
answers."""

from __future__ import annotations

import os

import pytest
import redis

REDIS_URL = os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/0"


def _redis_answers() -> bool:
    try:
        client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2, socket_timeout=2)
        return bool(client.ping())
    except redis.RedisError:
        return False


needs_redis = pytest.mark.skipif(not _redis_answers(), reason=f"no Redis answers at {REDIS_URL}")
