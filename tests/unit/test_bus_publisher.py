"""The Redis publisher hands news to a thread of its own: a publish never waits for Redis,
what waits is bounded, and what Redis takes arrives whole and in order."""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import redis

from taskhoster import bus

from ..integration.test_bus_channels import REDIS_URL, needs_redis


@pytest.fixture
def silent_redis() -> Iterator[str]:
    """A Redis address that takes connections and what is sent on them, and never answers
    (a Redis that hangs)."""
    listener = socket.create_server(("127.0.0.1", 0))
    taken: list[socket.socket] = []
    done = threading.Event()

    def take() -> None:
        while not done.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            taken.append(conn)
            threading.Thread(target=_swallow, args=(conn,), daemon=True).start()

    threading.Thread(target=take, daemon=True).start()
    yield f"redis://127.0.0.1:{listener.getsockname()[1]}/0"
    done.set()
    listener.close()
    for conn in taken:
        conn.close()


def _swallow(conn: socket.socket) -> None:
    try:
        while conn.recv(65536):
            pass
    except OSError:
        pass


def test_a_publish_to_a_redis_that_hangs_returns_at_once_and_what_waits_is_bounded(
    silent_redis, caplog
):
    publisher = bus._RedisPublisher(silent_redis)
    message = b"x" * 1024
    with caplog.at_level(logging.WARNING, logger="taskhoster.bus"):
        began = time.monotonic()
        for _ in range(10):
            publisher.publish(message)
        # Each waited for nothing: for Redis's answer, it was 2 s at least.
        assert time.monotonic() - began < 0.5
        for _ in range(2 * bus.PENDING_MOST_BYTES // len(message)):
            publisher.publish(message)
        assert publisher._waiting_bytes <= bus.PENDING_MOST_BYTES
    assert "too many waiting" in caplog.text
    assert publisher.flush(0.1) is False  # Redis took none of it


@needs_redis
def test_what_redis_takes_arrives_whole_and_in_order(settings, tmp_path):
    settings.TASKHOSTER = {**settings.TASKHOSTER, "ROOT": str(tmp_path)}
    channel = bus.news_channel()
    listener = redis.Redis.from_url(REDIS_URL).pubsub(ignore_subscribe_messages=True)
    listener.subscribe(channel)
    assert listener.get_message(timeout=5) is None  # (the subscription's answer)
    publisher = bus._RedisPublisher(REDIS_URL)
    mark = uuid.uuid4().hex  # (other tests' news may share a channel without an identity)
    sent = [f"{mark} {n}".encode() for n in range(3 * bus.SEND_MOST)]  # several round trips
    for data in sent:
        publisher.publish(data)
    assert publisher.flush(10)
    heard: list[bytes] = []
    deadline = time.monotonic() + 10
    while len(heard) < len(sent) and time.monotonic() < deadline:
        message = listener.get_message(timeout=1)
        if message is not None and message["data"].startswith(mark.encode()):
            heard.append(message["data"])
    listener.close()
    assert heard == sent
