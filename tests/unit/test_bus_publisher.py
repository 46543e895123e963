"""The Redis publisher hands news to a thread of its own: a publish never waits for Redis,
what waits is bounded, and what Redis takes arrives whole and in order."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import redis

from taskhoster import bus

from ..integration.redishere import REDIS_URL, needs_redis


@pytest.fixture
def silent_redis() -> Iterator[str]:
    """A Redis address that takes connections and what is sent on them, and never answers
    (a Redis that hangs)."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)
    taken: list[socket.socket] = []
    done = threading.Event()

    def take() -> None:
        while not done.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            taken.append(conn)
            threading.Thread(target=_swallow, args=(conn,), daemon=True).start()

    taking = threading.Thread(target=take)
    taking.start()
    yield f"redis://127.0.0.1:{listener.getsockname()[1]}/0"
    done.set()
    taking.join()
    listener.close()
    for conn in taken:
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_RDWR)
        conn.close()


def _swallow(conn: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while conn.recv(65536):
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
    with publisher._changed:  # (what still waits would be tried against a closed port)
        publisher._waiting.clear()
        publisher._waiting_bytes = 0


@needs_redis
def test_what_redis_takes_arrives_whole_and_in_order(settings, tmp_path):
    settings.TASKHOSTER = {**settings.TASKHOSTER, "ROOT": str(tmp_path)}
    channel = bus.news_channel()
    listener = redis.Redis.from_url(REDIS_URL, socket_timeout=10).pubsub()
    listener.subscribe(channel)
    while (answer := listener.get_message(timeout=5)) is None or answer["type"] != "subscribe":
        assert answer is not None, "the subscription is answered"
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
        if message and message["type"] == "message" and message["data"].startswith(mark.encode()):
            heard.append(message["data"])
    listener.close()
    assert heard == sent
