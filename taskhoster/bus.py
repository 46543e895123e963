"""News between processes: "queue Q has claimable items", "item X reached a verdict",
"item X was removed (deleted, timed out)".

Every process that changes items publishes; server processes with ``/work`` sockets listen.

- With ``REDIS_URL``: Redis pub/sub on one channel, so server processes on any host hear it.
  (Plain pub/sub rather than a channel-layer group: a group membership silently expires after
  a day, and publishing from a plain management command needs no event loop.) The channel is
  the installation's (``news_channel``: named by the identity its database and state root
  share), so installations that share one Redis never hear each other.
- Without it (the embedded default): a doorbell. Each listening process binds a Linux
  abstract-namespace datagram socket and registers its name as an empty file in
  ``<root>/.doorbell/``; a publisher sends one datagram to each registered name. The registry
  is re-read only when the directory changes, and a name nobody answers is removed.

A listener ignores its own news (it was delivered in-process already). News is a hint that
makes a waiting party look now; losing one costs latency (a backstop re-check catches it),
never correctness.

The bus only carries news: what a process does with what it hears is ``events``'s business,
which publishes through the bus and gives it, once, where heard news goes (``hear_with``).
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import contextlib
import functools
import hashlib
import json
import logging
import math
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .conf import get_conf
from .osthread import name_os_thread

log = logging.getLogger(__name__)
ORIGIN = f"{os.getpid()}-{secrets.token_hex(4)}"
REDIS_CHANNEL = "taskhoster:news"  # then ":" and the installation's identity (news_channel)
MAX_DATAGRAM = 65536
# How often a Redis listener on a state root without an identity yet looks for one.
IDENTITY_RECHECK_SECONDS = 1.0
MESSAGE_NEWS = 500  # news per message: a datagram stays well under MAX_DATAGRAM
# Messages waiting for Redis (``_RedisPublisher``), in bytes at most; the oldest are dropped
# beyond. Sent SEND_MOST (or SEND_MOST_BYTES) to a round trip.
PENDING_MOST_BYTES = 8 << 20
SEND_MOST = 500
SEND_MOST_BYTES = 1 << 20
# After a failed send to Redis, the publisher waits this long before the next try.
SEND_AGAIN_AFTER_SECONDS = 0.5
# Lost messages are warned of at most this often.
LOST_WARNING_SECONDS = 10.0
# At a process's exit, what waits for Redis is given this long to be sent.
FLUSH_AT_EXIT_SECONDS = 2.0
# A listener that heard nothing from Redis for this long asks it a PING; with no answer in
# LISTENER_ANSWER_SECONDS more, its connection is given up and a new one made.
LISTENER_QUIET_SECONDS = 5.0
LISTENER_ANSWER_SECONDS = 5.0

News = tuple[str, str, str]
Handler = Callable[[Sequence[News]], None]
# Handed to the handler by a listener whose subscription Redis has just confirmed (the first,
# one made again after a lost connection, one moved to the installation's channel): news
# published before may not have been heard, so whoever waits on news looks again now.
LOOK_AGAIN = "look-again"


def _encode(news: Sequence[News]) -> list[bytes]:
    """One message per ``MESSAGE_NEWS`` pieces of news."""
    return [
        json.dumps({"o": ORIGIN, "n": list(news[start : start + MESSAGE_NEWS])}).encode()
        for start in range(0, len(news), MESSAGE_NEWS)
    ]


def _decode(data: bytes) -> list[News] | None:
    try:
        message = json.loads(data)
        if message.get("o") == ORIGIN:
            return None
        return [(str(k), str(q), str(i or "")) for k, q, i in message["n"]]
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


# -- publishing -----------------------------------------------------------------------------


_sending: socket.socket | None = None


def _sending_socket() -> socket.socket:
    """The one socket this process rings every doorbell with (a datagram names its
    destination), closed at exit."""
    global _sending
    if _sending is None:
        _sending = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        _sending.setblocking(False)
        atexit.register(_sending.close)
    return _sending


class _Doorbell:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.names: list[str] = []
        self.seen_mtime: float | None = None
        self.lock = threading.Lock()

    def _refresh(self) -> None:
        try:
            mtime = self.directory.stat().st_mtime
        except FileNotFoundError:
            self.names, self.seen_mtime = [], None
            return
        if mtime != self.seen_mtime:
            self.seen_mtime = mtime
            self.names = [n for n in os.listdir(self.directory) if n.startswith("th-")]

    def ping(self) -> None:
        """Nothing to reach: the doorbell is this host's own sockets."""

    def publish(self, data: bytes) -> None:
        own = f"th-{ORIGIN}"  # this process's (or, from a committer process, its server's)
        with self.lock:
            self._refresh()
            sock = _sending_socket()
            for name in list(self.names):
                if name == own:
                    continue  # it would only drop its own news: a wake-up for nothing
                try:
                    sock.sendto(data, "\0" + _abstract_name(self.directory, name))
                except (ConnectionRefusedError, FileNotFoundError):
                    with contextlib.suppress(OSError):
                        (self.directory / name).unlink()  # its process is gone
                except (BlockingIOError, OSError):
                    continue  # a full or slow listener: news is a hint


def _abstract_name(directory: Path, name: str) -> str:
    # An abstract socket name is at most 107 bytes: the state root is named by its hash.
    digest = hashlib.sha256(str(directory).encode()).hexdigest()[:20]
    return f"taskhoster:{digest}:{name}"


class _RedisPublisher:
    """Publishes to Redis on a thread of its own: whoever announces news (a group's commit,
    a socket's end on daphne's event loop) hands it over and goes on at once. Redis that is
    slow, hung or away (an address that drops packets) used to hold each of them for the
    client's timeout (2 s), every post of every process included. Messages waiting are
    sent together, ``SEND_MOST`` (or ``SEND_MOST_BYTES``) to a round trip; at most
    ``PENDING_MOST_BYTES`` of them wait, the oldest dropped beyond that (news is a hint: the
    sockets' backstop finds what it would have said). A failed send is not made again: its
    messages are dropped (the next send makes a new connection)."""

    def __init__(self, url: str) -> None:
        import redis

        self.client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
        self._waiting: collections.deque[bytes] = collections.deque()
        self._waiting_bytes = 0
        self._changed = threading.Condition()
        self._sending = False  # a batch taken from ``_waiting`` is being sent
        self._lost = 0  # messages dropped or failed since the last warning
        self._why = ""  # why the last of them were lost
        self._warned_at = -math.inf
        threading.Thread(target=self._send_forever, name="taskhoster-news", daemon=True).start()

    def ping(self) -> None:
        self.client.ping()

    def publish(self, data: bytes) -> None:
        with self._changed:
            dropped = False
            while self._waiting and self._waiting_bytes + len(data) > PENDING_MOST_BYTES:
                self._waiting_bytes -= len(self._waiting.popleft())
                self._lost += 1
                self._why = "Redis did not take them: too many waiting"
                dropped = True
            self._waiting.append(data)
            self._waiting_bytes += len(data)
            self._changed.notify_all()
        if dropped:
            self._warn()

    def flush(self, timeout: float) -> bool:
        """Wait until every message handed over was sent (or given up), at most ``timeout``
        seconds; whether it was."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while self._waiting or self._sending:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._changed.wait(remaining)
        return True

    def _send_forever(self) -> None:
        name_os_thread()
        while True:
            with self._changed:
                self._sending = False
                self._changed.notify_all()  # (``flush``)
                while not self._waiting:
                    self._changed.wait()
                batch: list[bytes] = []
                size = 0
                while self._waiting and len(batch) < SEND_MOST and size < SEND_MOST_BYTES:
                    batch.append(self._waiting.popleft())
                    size += len(batch[-1])
                self._waiting_bytes -= size
                self._sending = True
            try:
                channel = news_channel()
                pipe = self.client.pipeline(transaction=False)
                for data in batch:
                    pipe.publish(channel, data)
                pipe.execute()
            except Exception as exc:  # a lost hint; the backstop re-check catches up
                with self._changed:
                    self._lost += len(batch)
                    self._why = str(exc) or type(exc).__name__
                self._warn()
                time.sleep(SEND_AGAIN_AFTER_SECONDS)  # what comes meanwhile goes in one try
            else:
                self._warn()  # what was lost since the last warning, if anything

    def _warn(self) -> None:
        """Say what was lost: at once the first time, then at most every
        ``LOST_WARNING_SECONDS`` (Redis away fails every batch)."""
        now = time.monotonic()
        with self._changed:
            lost, why = self._lost, self._why
            if not lost or now - self._warned_at < LOST_WARNING_SECONDS:
                return
            self._lost, self._warned_at = 0, now
        log.warning(
            "could not publish news to Redis: %d message(s) lost (the last: %s); other processes' "
            "sockets find what they said at their backstop re-check",
            lost,
            why,
        )


_publishers: dict[tuple[str, str], Any] = {}
_publishers_lock = threading.Lock()


def _flush_at_exit() -> None:
    """News handed to Redis's publisher just before a process ends (a ``manage.py``
    command's) is sent, unless Redis does not take it within ``FLUSH_AT_EXIT_SECONDS``."""
    for publisher in list(_publishers.values()):
        if isinstance(publisher, _RedisPublisher):
            publisher.flush(FLUSH_AT_EXIT_SECONDS)


def _forget_publishers() -> None:
    """In a forked child: its parent's publishers' and listener's threads are not there (new
    ones are made), and its news is its own (the parent would ignore it as its own)."""
    global _publishers_lock, _background_lock, ORIGIN
    _publishers.clear()
    _publishers_lock = threading.Lock()
    _background.clear()
    _background_lock = threading.Lock()
    ORIGIN = f"{os.getpid()}-{secrets.token_hex(4)}"


atexit.register(_flush_at_exit)
os.register_at_fork(after_in_child=_forget_publishers)


@functools.lru_cache(maxsize=8)
def _resolved(root: Path) -> Path:
    return root.resolve()


def _doorbell_dir() -> Path:
    return _resolved(get_conf().root) / ".doorbell"


_channels: dict[Path, str] = {}


def news_channel() -> str:
    """The Redis channel of this installation's news: ``taskhoster:news:<identity>``, the
    identity its database and its state root share (``taskhoster.identity``, checked at
    every server, committer and sweep start). Pub/sub ignores Redis's database numbers, so
    two installations that share one Redis would otherwise wake each other's sockets (a
    claim each, for nothing). Read from the state root once per process. A state root
    without one yet (nothing has checked it: a first start whose database did not answer, an
    embedding before its first queue) has ``taskhoster:news``: publishers look again at
    every publish, and a listener every ``IDENTITY_RECHECK_SECONDS``, then moves."""
    root = _resolved(get_conf().root)
    channel = _channels.get(root)
    if channel is None:
        from .identity import StateRootTaken, read_file

        try:
            found = read_file(root)
        except StateRootTaken:  # unreadable: the checks at start say so
            found = None
        if found is None:
            return REDIS_CHANNEL  # not kept: the identity is written at the first check
        channel = _channels[root] = f"{REDIS_CHANNEL}:{found}"
    return channel


def _publisher() -> Any:
    conf = get_conf()
    key = ("redis", conf.redis_url) if conf.redis_url else ("doorbell", str(_doorbell_dir()))
    with _publishers_lock:
        publisher = _publishers.get(key)
        if publisher is None:
            publisher = _RedisPublisher(key[1]) if key[0] == "redis" else _Doorbell(Path(key[1]))
            _publishers[key] = publisher
        return publisher


def ping() -> None:
    """Raise if the bus this process publishes to does not answer (``/healthz``)."""
    _publisher().ping()


def publish(news: Sequence[News]) -> None:
    publisher = _publisher()
    for data in _encode(news):
        publisher.publish(data)


# -- listening (server processes) ----------------------------------------------------------

_background: dict[tuple[str, str], Listener] = {}
_background_lock = threading.Lock()
_hear: Handler | None = None


def hear_with(handler: Handler) -> None:
    """Where the news heard in the background goes (``events`` gives its delivery here)."""
    global _hear
    _hear = handler


def listen_in_background() -> None:
    """Hear other processes' news in this process, from now on: one listener, on an event
    loop of a thread of its own, hands what it hears to the handler of ``hear_with``
    (``events.deliver(remote=True)``), whence it reaches long-polls and the ``/work``
    dispatcher alike. Idempotent (one per bus and state root)."""
    handler = _hear
    if handler is None:
        raise RuntimeError("nothing takes the news heard on the bus (see bus.hear_with)")
    conf = get_conf()
    key = ("redis", conf.redis_url) if conf.redis_url else ("doorbell", str(_doorbell_dir()))
    with _background_lock:
        if key in _background:
            return
        loop = asyncio.new_event_loop()
        listener = Listener(handler)
        started = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(loop)
            listener.start(loop)
            started.set()
            loop.run_forever()

        threading.Thread(target=run, name="taskhoster-bus", daemon=True).start()
        started.wait(10)
        _background[key] = listener


class Listener:
    """Delivers other processes' news to ``handler`` on the running event loop."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.sock: socket.socket | None = None
        self.registration: Path | None = None
        self.task: asyncio.Task[None] | None = None
        self.away_since: float | None = None  # (time.monotonic) the connection was lost
        self.warned_at = -math.inf

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        conf = get_conf()
        if conf.redis_url:
            self.task = loop.create_task(self._listen_redis(conf.redis_url))
        else:
            self._listen_doorbell(loop)

    def _listen_doorbell(self, loop: asyncio.AbstractEventLoop) -> None:
        directory = _doorbell_dir()
        directory.mkdir(parents=True, exist_ok=True)
        name = f"th-{ORIGIN}"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind("\0" + _abstract_name(directory, name))
        sock.setblocking(False)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        self.sock = sock
        self.registration = directory / name
        self.registration.touch()
        loop.add_reader(sock.fileno(), self._drain)

    def _drain(self) -> None:
        assert self.sock is not None
        while True:
            try:
                data = self.sock.recv(MAX_DATAGRAM)
            except (BlockingIOError, InterruptedError):
                return
            news = _decode(data)
            if news:
                self.handler(news)

    async def _listen_redis(self, url: str) -> None:
        """Hear Redis for ever: a lost connection is made again a second later. Its loss is
        warned of at once, then (Redis still away) at most every ``LOST_WARNING_SECONDS``;
        its return is logged once."""
        import redis.asyncio as aioredis

        while True:
            client = aioredis.Redis.from_url(
                url,
                socket_timeout=LISTENER_ANSWER_SECONDS,
                socket_connect_timeout=2,
            )
            pubsub = client.pubsub()
            try:
                await self._hear_redis(pubsub)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._lost(exc)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()
                    await client.aclose()
            await asyncio.sleep(1)

    def _lost(self, exc: Exception) -> None:
        now = time.monotonic()
        if self.away_since is None:
            self.away_since = self.warned_at = now
            log.warning("news from Redis interrupted (%s); connecting again", exc)
        elif now - self.warned_at >= LOST_WARNING_SECONDS:
            self.warned_at = now
            log.warning(
                "news from Redis still interrupted after %.0f s (%s); connecting again",
                now - self.away_since,
                exc,
            )

    async def _hear_redis(self, pubsub: Any) -> None:
        """Hear the installation's channel until the connection fails, or goes quiet: after
        ``LISTENER_QUIET_SECONDS`` with nothing heard it is asked a ``PING``, and with no
        answer in ``LISTENER_ANSWER_SECONDS`` more it is given up (and a new one made).
        Without that, a connection whose far end was lost without a word (a Redis failed
        over or restarted while the network between was down, a NAT that forgot it) was
        listened to for ever: this process heard no other's news again, its sockets got
        other processes' posts only at their backstop. Each subscription Redis confirms is
        handed on as ``LOOK_AGAIN``: what was said before it may not have been heard."""
        loop = asyncio.get_running_loop()
        channel = news_channel()
        await pubsub.subscribe(channel)
        heard = looked = loop.time()
        pinged = False
        while True:
            # Woken only when there is something to do: a PING to ask, or one unanswered.
            due = heard + LISTENER_QUIET_SECONDS + (LISTENER_ANSWER_SECONDS if pinged else 0)
            wait = due - loop.time()
            if channel == REDIS_CHANNEL:
                wait = min(wait, looked + IDENTITY_RECHECK_SECONDS - loop.time())
            message = await pubsub.get_message(timeout=max(0.01, wait))
            now = loop.time()
            if message is not None:
                heard, pinged = now, False  # (a subscription's answer or a PONG, too)
                if message.get("type") == "message":
                    self._heard_redis(message)
                elif message.get("type") == "subscribe":
                    # What was published while this process was not subscribed (Redis
                    # restarting, this connection being made again) was not heard; without
                    # this, its sockets found it only at their backstop re-check.
                    if self.away_since is not None:
                        log.warning(
                            "news from Redis heard again, after %.1f s",
                            time.monotonic() - self.away_since,
                        )
                        self.away_since = None
                    self.handler([(LOOK_AGAIN, "", "")])
            elif pinged and now - heard >= LISTENER_QUIET_SECONDS + LISTENER_ANSWER_SECONDS:
                raise ConnectionError(
                    f"Redis did not answer a PING within {LISTENER_ANSWER_SECONDS:g} s"
                )
            elif now - heard >= LISTENER_QUIET_SECONDS and not pinged:
                await pubsub.ping()
                pinged = True
            if channel == REDIS_CHANNEL and now - looked >= IDENTITY_RECHECK_SECONDS:
                # No identity yet: the state root's is written at its first check, which may
                # come after this listener starts (an embedding's first socket; a database
                # that did not answer at the server's start). Look again every second, and
                # move to the installation's channel once it has one.
                looked = now
                found = news_channel()
                if found != channel:
                    await pubsub.subscribe(found)
                    await pubsub.unsubscribe(channel)
                    channel = found

    def _heard_redis(self, message: dict[str, Any]) -> None:
        news = _decode(message.get("data") or b"")
        if news:
            self.handler(news)

    def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
        if self.sock is not None:
            with contextlib.suppress(Exception):
                asyncio.get_event_loop().remove_reader(self.sock.fileno())
            self.sock.close()
        if self.registration is not None:
            with contextlib.suppress(OSError):
                self.registration.unlink()
