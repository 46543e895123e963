"""The Redis publisher hands news to a thread of its own: a publish never waits for Redis,
what waits is bounded, and what Redis takes arrives whole and in order. A listener connected
again has its process look for what it missed."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from urllib.parse import urlsplit

import pytest
import redis

from taskhoster import bus

from ..integration.redishere import REDIS_URL, needs_redis
from ..integration.tcpproxy import TcpProxy


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


@needs_redis
def test_a_listener_connected_again_says_to_look_again_and_warns_once_while_redis_is_away(
    settings, tmp_path, caplog
):
    # News published while a listener is not subscribed is not heard: each subscription Redis
    # confirms is handed on as LOOK_AGAIN, so that the process looks for what it missed. A
    # Redis away for several of the listener's tries (one a second) is warned of once.
    settings.TASKHOSTER = {**settings.TASKHOSTER, "ROOT": str(tmp_path)}
    proxy = TcpProxy(urlsplit(REDIS_URL).port or 6379)
    heard: list[list[bus.News]] = []
    got = threading.Condition()

    def handler(news: Sequence[bus.News]) -> None:
        with got:
            heard.append(list(news))
            got.notify_all()

    def looks() -> int:
        return sum(piece[0] == bus.LOOK_AGAIN for news in heard for piece in news)

    def wait_for_looks(n: int) -> None:
        with got:
            assert got.wait_for(lambda: looks() >= n, timeout=10), heard

    url = urlsplit(REDIS_URL)._replace(netloc=f"{proxy.host}:{proxy.port}").geturl()
    loop = asyncio.new_event_loop()
    listener = bus.Listener(handler)
    task = loop.create_task(listener._listen_redis(url))

    def run() -> None:
        with contextlib.suppress(asyncio.CancelledError):  # (the test's end)
            loop.run_until_complete(task)

    running = threading.Thread(target=run, daemon=True)
    try:
        with caplog.at_level(logging.INFO, logger="taskhoster.bus"):
            running.start()
            wait_for_looks(1)  # the first subscription
            proxy.refuse = True  # Redis restarts
            proxy.drop_all()
            time.sleep(3.5)  # the listener tries every second meanwhile
            assert looks() == 1
            proxy.refuse = False
            wait_for_looks(2)
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert sum("interrupted" in w for w in warnings) == 1, warnings
        assert sum("heard again" in w for w in warnings) == 1, warnings
    finally:
        loop.call_soon_threadsafe(task.cancel)
        running.join(5)
        loop.close()
        proxy.close()
