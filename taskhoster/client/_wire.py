"""The producers' HTTP/1.1 over plain ``http://``: the standard library's sockets, connections
kept alive in a small pool.

A post of one item is the call a web request makes most, and httpx spent most of the
producer's CPU on it (``docs/performance.md``, "The producer's client"); this sends each
request as one write (its line, headers and body together, so the server reads it at once)
and reads the answer: :class:`Wire` (the blocking ``Producer``'s) with
:class:`http.client.HTTPResponse`, :class:`AsyncWire` (``AsyncProducer``'s) with a parser of
its own on the running event loop. It does only what a producer needs: no TLS, no proxies,
no redirects, no cookies, no compression. Each producer uses it for an ``http://`` address
when no HTTP proxy is set and no ``transport`` was given; everything else goes through httpx
as before.

A call that gets no complete answer raises :class:`WireError`, whose ``never_sent`` says
whether the request surely did not leave (the connection could not be made): only then may a
call that is not safe to resend be sent again (a call on a closed producer raises
``RuntimeError``). As httpx did, a connection idle for more than ``KEEP_IDLE_SECONDS`` is not used
again (a firewall or load balancer may have forgotten it without a word), and one kept is
looked at before it is used: one the server has closed (or written to unasked) while it sat
idle is closed and another made, so a server's restart does not cost a call that is not safe
to resend (unless its close crosses the call on the way); a request the server answers
before reading all of it and then closes (daphne's 413 ``too_large`` for a body over its
limit) is answered with that answer, not with the broken write, where the system keeps
what was received after the reset (Linux does); and the timeout bounds each write of a
body, not the whole upload.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import socket
import threading
import time
import urllib.request
import weakref
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlencode, urlsplit

#: At most this many idle connections are kept (more are closed as their calls end).
KEEP_IDLE = 8
#: An idle connection is not used again after this many seconds (httpx's keep-alive expiry).
KEEP_IDLE_SECONDS = 5.0


class WireError(Exception):
    """A call that got no complete answer. ``never_sent``: the connection could not be made,
    so the server cannot have seen the request."""

    def __init__(self, message: str, *, never_sent: bool) -> None:
        super().__init__(message)
        self.never_sent = never_sent


class Answer:
    """A complete answer: what :class:`~._http.Attempt` reads of one (the names are httpx's
    ``Response``'s)."""

    __slots__ = ("content", "headers", "reason_phrase", "status_code")

    def __init__(
        self, status_code: int, reason_phrase: str, headers: Mapping[str, str], content: bytes
    ) -> None:
        self.status_code = status_code
        self.reason_phrase = reason_phrase
        self.headers = headers  # lower-cased names
        self.content = content

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")

    def json(self) -> Any:
        return json.loads(self.content)


def plain_http(url: str) -> bool:
    """Whether the wire can serve this base address: ``http://``, with no HTTP proxy set
    (in the environment, or the system's on macOS and Windows, as httpx reads them). Where
    one is, httpx carries the calls and decides, by ``NO_PROXY``, which go through it."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname or not parts.hostname.isascii():
        return False  # (an international name: httpx's IDNA encoding, not Python's codec)
    return not ({"http", "all"} & urllib.request.getproxies().keys())


def body_of(value: Any) -> bytes:
    """A JSON body as httpx encodes one (compact, UTF-8, no NaN)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


def _still_open(sock: socket.socket) -> bool:
    """Whether an idle connection may carry a call: nothing to read on it (the server has
    neither closed it nor written what no call asked for)."""
    timeout = sock.gettimeout()
    try:
        sock.setblocking(False)
        try:
            sock.recv(1, socket.MSG_PEEK)
        finally:
            sock.settimeout(timeout)
    except BlockingIOError:
        return True
    except OSError:
        return False
    return False


class _Pool:
    """Idle connections to one server, newest last, and whether the owner is closed: shared
    by any number of threads. The async wire's are each kept for the event loop that used
    it (a loop of another thread, or the next ``asyncio.run``, makes its own): Windows'
    default loop binds a socket to its completion port for good."""

    def __init__(self) -> None:
        # Each with when it was given back, and (async) a weak reference to its loop.
        self._idle: list[tuple[socket.socket, float, weakref.ref[Any] | None]] = []
        self._lock = threading.Lock()
        self._closed = False

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for sock, _, _ in idle:
            sock.close()

    def take(self, loop: object = None) -> socket.socket | None:
        """An idle connection (of this event loop) that may carry a call, or None: make one."""
        while True:
            with self._lock:
                if self._closed:
                    raise RuntimeError("the producer is closed")
                # Given back in time order: those expired are the oldest, closed all at once
                # (a burst's connections do not stay open under the one in use since), and
                # with them those whose loop is gone.
                fresh = time.monotonic() - KEEP_IDLE_SECONDS
                gone = [
                    entry
                    for entry in self._idle
                    if entry[1] < fresh or (entry[2] is not None and entry[2]() is None)
                ]
                for entry in gone:
                    self._idle.remove(entry)
                sock = None
                for at in range(len(self._idle) - 1, -1, -1):
                    owner = self._idle[at][2]
                    if (owner() if owner is not None else None) is loop:
                        sock = self._idle.pop(at)[0]
                        break
            for old, _, _ in gone:
                old.close()
            if sock is None or _still_open(sock):
                return sock
            sock.close()

    def give_back(self, sock: socket.socket, loop: object = None) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < KEEP_IDLE:
                owner = weakref.ref(loop) if loop is not None else None
                self._idle.append((sock, time.monotonic(), owner))
                return
        sock.close()


def _stalled(timeout: float) -> WireError:
    return WireError(f"sending: no progress in {timeout:g} s", never_sent=False)


def _unanswered(timeout: float) -> WireError:
    return WireError(f"no answer in {timeout:g} s", never_sent=False)


def _broken(failed: BaseException, *, sending: bool) -> WireError:
    """A call whose request was sent in part or whole and whose answer was not read whole."""
    step = "sending" if sending else "reading"
    return WireError(f"{step}: {type(failed).__name__}: {failed}", never_sent=False)


class _Target:
    """One server's address, and the request each call sends it."""

    def __init__(self, url: str, headers: Mapping[str, str]) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname or not parts.hostname.isascii():
            raise ValueError(f"not a plain http:// address with an ASCII host: {url!r}")
        self.host = parts.hostname
        self.port = parts.port or 80
        self.prefix = parts.path.rstrip("/")
        host = f"[{self.host}]" if ":" in self.host else self.host  # an IPv6 address
        fixed = {"Host": host if self.port == 80 else f"{host}:{self.port}", **headers}
        if any(set("\r\n") & set(f"{name}{value}") for name, value in fixed.items()):
            raise ValueError("a header name or value holds a line break")
        self._head = "".join(f"{name}: {value}\r\n" for name, value in fixed.items())
        self._pool = _Pool()

    def close(self) -> None:
        self._pool.close()

    def message(
        self, method: str, path: str, params: Mapping[str, str] | None, body: bytes | None
    ) -> bytes:
        """The request line, the headers and the body, to go in one write."""
        target = self.prefix + path + (f"?{urlencode(params)}" if params else "")
        head = f"{method} {target} HTTP/1.1\r\n{self._head}"
        if body is not None:
            head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        elif method in ("POST", "PUT", "PATCH"):
            head += "Content-Length: 0\r\n"
        return (head + "\r\n").encode("latin-1") + (body or b"")

    def _unreachable(self, exc: BaseException) -> WireError:
        return WireError(
            f"connecting to {self.host}:{self.port}: {type(exc).__name__}: {exc}",
            never_sent=True,
        )


class Wire(_Target):
    """Calls to one server, from any number of threads: each call takes an idle connection
    (or makes one) and gives it back once its answer is read whole."""

    def request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, str] | None,
        body: bytes | None,
        timeout: float,
    ) -> Answer:
        message = self.message(method, path, params, body)
        sock = self._take(timeout)
        response = None
        try:
            sock.settimeout(timeout)
            unsent: OSError | None = None
            try:
                _send(sock, message)
            except TimeoutError as exc:
                raise _stalled(timeout) from exc
            except OSError as exc:
                # The server may have answered before reading it all (413 for a body over
                # its limit) and closed: that answer is the call's, if it can be read.
                unsent = exc
            response = http.client.HTTPResponse(sock, method=method)
            try:
                response.begin()
                while 100 <= response.status < 200:
                    # begin() passes a 100 by itself, not a 102 or a 103 (early hints): the
                    # answer follows, on the same buffered reader.
                    if response.status == 101:
                        raise http.client.HTTPException("101 Switching Protocols, not asked for")
                    following = http.client.HTTPResponse(sock, method=method)
                    following.fp.close()
                    following.fp, response.fp = response.fp, None  # type: ignore[assignment]
                    response = following
                    response.begin()
                content = response.read()
            except TimeoutError as exc:
                raise _unanswered(timeout) from exc
            except (OSError, http.client.HTTPException) as exc:
                raise _broken(unsent or exc, sending=unsent is not None) from (unsent or exc)
            answer = Answer(
                response.status,
                response.reason,
                {name.lower(): value for name, value in response.getheaders()},
                content,
            )
        except BaseException:
            if response is not None:
                response.close()  # its file holds the socket open past sock.close()
            sock.close()
            raise
        smuggled = "transfer-encoding" in answer.headers and "content-length" in answer.headers
        if response.will_close or unsent is not None or smuggled:
            sock.close()  # (a length beside a coding: the connection is not to be trusted)
        else:
            self._pool.give_back(sock)
        return answer

    def _take(self, timeout: float) -> socket.socket:
        sock = self._pool.take()
        if sock is not None:
            return sock
        try:
            sock = socket.create_connection((self.host, self.port), timeout=timeout)
        except OSError as exc:
            raise self._unreachable(exc) from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock


def _send(sock: socket.socket, message: bytes) -> None:
    """All of ``message``, the socket's timeout bounding each write (as httpx's did), not
    the whole upload (``sendall``'s): a big body on a slow link goes while it moves."""
    view = memoryview(message)
    while view:
        view = view[sock.send(view) :]


#: The most an answer's status line and headers may take.
MAX_HEAD_BYTES = 64 * 1024
_HEX = re.compile(rb"[0-9A-Fa-f]{1,16}")
_DIGITS = re.compile(r"[0-9]{1,19}")
#: A body goes in writes of at most this much, each under the call's timeout.
_SEND_STEP = 256 * 1024


class AsyncWire(_Target):
    """:class:`Wire` for asyncio: the same calls, each awaited on the running loop, over
    non-blocking sockets the loop waits on (``loop.sock_*``, which every event loop of the
    standard library has). Any number of tasks, and of loops (in threads, or one
    ``asyncio.run`` after another), may share it; a connection is kept for its loop."""

    async def request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, str] | None,
        body: bytes | None,
        timeout: float,
    ) -> Answer:
        message = self.message(method, path, params, body)
        loop = asyncio.get_running_loop()
        sock = self._pool.take(loop) or await self._connect(loop, timeout)
        try:
            unsent: OSError | None = None
            try:
                view = memoryview(message)
                for start in range(0, len(view), _SEND_STEP):
                    async with asyncio.timeout(timeout):
                        await loop.sock_sendall(sock, view[start : start + _SEND_STEP])
            except TimeoutError as exc:
                raise _stalled(timeout) from exc
            except OSError as exc:
                unsent = exc  # the server may have answered before reading it all (Wire)
            reader = _Reader(loop, sock, timeout)
            try:
                answer, keep = await reader.answer(method)
            except TimeoutError as exc:
                raise _unanswered(timeout) from exc
            except (OSError, http.client.HTTPException) as exc:
                raise _broken(unsent or exc, sending=unsent is not None) from (unsent or exc)
        except BaseException:  # a cancelled call's connection too: its answer is unread
            sock.close()
            raise
        if keep and unsent is None:
            self._pool.give_back(sock, loop)
        else:
            sock.close()
        return answer

    async def _connect(self, loop: asyncio.AbstractEventLoop, timeout: float) -> socket.socket:
        """A connection to the first address that takes one (each address, and the name's
        lookup, under the timeout, as ``socket.create_connection`` does)."""
        try:
            async with asyncio.timeout(timeout):
                addresses = await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        except OSError as exc:  # the name not found, or the timeout (TimeoutError)
            raise self._unreachable(_named(exc)) from exc
        first: OSError | None = None
        for family, kind, proto, _, address in addresses:
            sock = socket.socket(family, kind, proto)
            try:
                sock.setblocking(False)
                async with asyncio.timeout(timeout):
                    await loop.sock_connect(sock, address)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError as exc:
                sock.close()
                first = first or _named(exc)
                continue
            except BaseException:
                sock.close()
                raise
            return sock
        failed = first or OSError(f"no address for {self.host}")
        raise self._unreachable(failed) from failed


def _named(exc: OSError) -> OSError:
    """``asyncio.timeout``'s TimeoutError says nothing; a socket's says "timed out"."""
    return TimeoutError("timed out") if isinstance(exc, TimeoutError) and not str(exc) else exc


_STATUS = re.compile(r"HTTP/1\.([01]) ([0-9]{3})(?: (.*))?")


class _Reader:
    """One answer read off a non-blocking socket, each wait for more under the timeout. What
    is not an HTTP/1.x answer raises ``http.client``'s exceptions, as :class:`Wire` does."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, timeout: float):
        self.loop = loop
        self.sock = sock
        self.timeout = timeout
        self.buffer = bytearray()
        self.ended = False
        self.began = False  # anything of the answer came

    async def _more(self) -> None:
        if self.ended:
            if self.began or self.buffer:
                raise http.client.IncompleteRead(bytes(self.buffer))
            raise http.client.RemoteDisconnected("Remote end closed connection without response")
        async with asyncio.timeout(self.timeout):
            data = await self.loop.sock_recv(self.sock, 65536)
        if data:
            self.buffer += data
        else:
            self.ended = True

    async def until(self, mark: bytes, most: int) -> bytes:
        """Up to and without ``mark``, which is read too."""
        while (at := self.buffer.find(mark, 0, most + len(mark))) < 0:
            if len(self.buffer) >= most + len(mark):
                raise http.client.LineTooLong(f"more than {most} bytes before {mark!r}")
            await self._more()
        part = bytes(self.buffer[:at])
        del self.buffer[: at + len(mark)]
        self.began = True
        return part

    async def exactly(self, size: int) -> bytes:
        while len(self.buffer) < size:
            await self._more()
        part = bytes(self.buffer[:size])
        del self.buffer[:size]
        return part

    async def to_end(self) -> bytes:
        while not self.ended:
            await self._more()
        part = bytes(self.buffer)
        self.buffer.clear()
        return part

    async def answer(self, method: str) -> tuple[Answer, bool]:
        """The answer (after any interim 1xx), and whether the connection may be kept."""
        while True:
            head = (await self.until(b"\r\n\r\n", MAX_HEAD_BYTES)).decode("latin-1")
            line, *lines = head.split("\r\n")
            status_line = _STATUS.fullmatch(line)
            if status_line is None:
                raise http.client.BadStatusLine(line[:100])
            minor, code, reason = status_line.groups()
            fields: list[tuple[str, str]] = []
            for field in lines:
                name, colon, value = field.partition(":")
                if not colon or not name or name != name.strip():
                    raise http.client.HTTPException(f"not a header: {field[:100]!r}")
                fields.append((name.lower(), value.strip()))
            status = int(code)
            if status == 101:  # (never asked for: what follows is not HTTP)
                raise http.client.HTTPException("101 Switching Protocols, not asked for")
            if not 100 <= status < 200:
                break
        headers = dict(fields)
        tokens = {t.strip().lower() for t in headers.get("connection", "").split(",")}
        keep = minor == "1" and "close" not in tokens
        lengths = {value for name, value in fields if name == "content-length"}
        codings = [
            t.strip().lower()
            for name, value in fields
            if name == "transfer-encoding"
            for t in value.split(",")
        ]
        if method == "HEAD" or status in (204, 304):
            content = b""
        elif codings:
            # The length of a body sent with a coding is the coding's: chunked last, else
            # the connection's end (RFC 9112 6.3); a length beside it is not to be trusted,
            # and neither is the connection.
            keep = keep and not lengths
            if codings[-1] == "chunked":
                content = await self._chunks()
            else:
                content, keep = await self.to_end(), False
        elif lengths:
            if len(lengths) > 1 or not _DIGITS.fullmatch(length := next(iter(lengths))):
                raise http.client.HTTPException(f"a Content-Length of {sorted(lengths)!r}")
            content = await self.exactly(int(length))
        else:
            content, keep = await self.to_end(), False
        if self.buffer:
            keep = False  # more than the answer came: nothing may be read after it
        return Answer(status, reason or "", headers, content), keep

    async def _chunks(self) -> bytes:
        parts: list[bytes] = []
        while True:
            size_line = (await self.until(b"\r\n", MAX_HEAD_BYTES)).split(b";")[0].strip()
            if not _HEX.fullmatch(size_line):
                raise http.client.HTTPException(f"a chunk's size of {size_line[:100]!r}")
            size = int(size_line, 16)
            if size == 0:
                while await self.until(b"\r\n", MAX_HEAD_BYTES):  # the trailers, if any
                    pass
                return b"".join(parts)
            parts.append(await self.exactly(size))
            if await self.exactly(2) != b"\r\n":
                raise http.client.HTTPException("a chunk not ended by CRLF")
