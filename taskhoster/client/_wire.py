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
    by any number of threads (and, for the async wire, event loops: a socket kept idle is
    not tied to a loop)."""

    def __init__(self) -> None:
        self._idle: list[tuple[socket.socket, float]] = []  # and when it was given back
        self._lock = threading.Lock()
        self._closed = False

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for sock, _ in idle:
            sock.close()

    def take(self) -> socket.socket | None:
        """An idle connection that may carry a call, or None: make one."""
        while True:
            with self._lock:
                if self._closed:
                    raise RuntimeError("the producer is closed")
                # Given back in time order: those expired are the oldest, closed all at once
                # (a burst's connections do not stay open under the one in use since).
                fresh = time.monotonic() - KEEP_IDLE_SECONDS
                expired = [sock for sock, since in self._idle if since < fresh]
                del self._idle[: len(expired)]
                sock = self._idle.pop()[0] if self._idle else None
            for old in expired:
                old.close()
            if sock is None or _still_open(sock):
                return sock
            sock.close()

    def give_back(self, sock: socket.socket) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < KEEP_IDLE:
                self._idle.append((sock, time.monotonic()))
                return
        sock.close()


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
                raise WireError(f"sending: no progress in {timeout:g} s", never_sent=False) from exc
            except OSError as exc:
                # The server may have answered before reading it all (413 for a body over
                # its limit) and closed: that answer is the call's, if it can be read.
                unsent = exc
            response = http.client.HTTPResponse(sock, method=method)
            try:
                response.begin()
                content = response.read()
            except TimeoutError as exc:
                raise WireError(f"no answer in {timeout:g} s", never_sent=False) from exc
            except (OSError, http.client.HTTPException) as exc:
                failed = unsent or exc
                raise WireError(
                    f"{'sending' if unsent else 'reading'}: {type(failed).__name__}: {failed}",
                    never_sent=False,
                ) from failed
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
        if response.will_close or unsent is not None:
            sock.close()
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
    standard library has). Any number of tasks, and of loops in turn, may share it."""

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
        sock = self._pool.take() or await self._connect(loop, timeout)
        try:
            unsent: OSError | None = None
            try:
                view = memoryview(message)
                for start in range(0, len(view), _SEND_STEP):
                    async with asyncio.timeout(timeout):
                        await loop.sock_sendall(sock, view[start : start + _SEND_STEP])
            except TimeoutError as exc:
                raise WireError(f"sending: no progress in {timeout:g} s", never_sent=False) from exc
            except OSError as exc:
                unsent = exc  # the server may have answered before reading it all (Wire)
            reader = _Reader(loop, sock, timeout)
            try:
                answer, keep = await reader.answer(method)
            except TimeoutError as exc:
                raise WireError(f"no answer in {timeout:g} s", never_sent=False) from exc
            except (OSError, _BadAnswer) as exc:
                failed = unsent or exc
                raise WireError(
                    f"{'sending' if unsent else 'reading'}: {type(failed).__name__}: {failed}",
                    never_sent=False,
                ) from failed
        except BaseException:  # a cancelled call's connection too: its answer is unread
            sock.close()
            raise
        if keep and unsent is None:
            self._pool.give_back(sock)
        else:
            sock.close()
        return answer

    async def _connect(self, loop: asyncio.AbstractEventLoop, timeout: float) -> socket.socket:
        failed: BaseException | None = None
        try:
            async with asyncio.timeout(timeout):
                addresses = await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
                for family, kind, proto, _, address in addresses:
                    sock = socket.socket(family, kind, proto)
                    try:
                        sock.setblocking(False)
                        await loop.sock_connect(sock, address)
                    except BaseException as exc:
                        sock.close()
                        if not isinstance(exc, OSError) or isinstance(exc, TimeoutError):
                            raise
                        failed = exc
                        continue
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    return sock
        except OSError as exc:  # the name not found, or the timeout (TimeoutError)
            failed = exc
        raise self._unreachable(failed or OSError("no address")) from failed


class _BadAnswer(Exception):
    """What came back is not an HTTP/1.x answer."""


class _Reader:
    """One answer read off a non-blocking socket, each wait for more under the timeout."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, timeout: float):
        self.loop = loop
        self.sock = sock
        self.timeout = timeout
        self.buffer = bytearray()
        self.ended = False

    async def _more(self) -> None:
        if self.ended:
            raise _BadAnswer("the connection closed before the answer ended")
        async with asyncio.timeout(self.timeout):
            data = await self.loop.sock_recv(self.sock, 65536)
        if data:
            self.buffer += data
        else:
            self.ended = True

    async def until(self, mark: bytes, most: int) -> bytes:
        """Up to and without ``mark``, which is read too."""
        while (at := self.buffer.find(mark)) < 0:
            if len(self.buffer) > most:
                raise _BadAnswer(f"no {mark!r} in {most} bytes")
            await self._more()
        if at > most:
            raise _BadAnswer(f"no {mark!r} in {most} bytes")
        part = bytes(self.buffer[:at])
        del self.buffer[: at + len(mark)]
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
            version, _, rest = line.partition(" ")
            code, _, reason = rest.partition(" ")
            if version not in ("HTTP/1.1", "HTTP/1.0") or not (len(code) == 3 and code.isdigit()):
                raise _BadAnswer(f"not an HTTP/1.x status line: {line[:100]!r}")
            headers: dict[str, str] = {}
            for field in lines:
                name, colon, value = field.partition(":")
                if not colon or not name or name != name.strip():
                    raise _BadAnswer(f"not a header: {field[:100]!r}")
                headers[name.lower()] = value.strip()
            status = int(code)
            if not 100 <= status < 200:
                break
        tokens = {t.strip().lower() for t in headers.get("connection", "").split(",")}
        keep = version == "HTTP/1.1" and "close" not in tokens
        if method == "HEAD" or status in (204, 304):
            content = b""
        elif "chunked" in headers.get("transfer-encoding", "").lower():
            content = await self._chunks()
        elif (length := headers.get("content-length")) is not None:
            if not _DIGITS.fullmatch(length):
                raise _BadAnswer(f"a Content-Length of {length[:100]!r}")
            content = await self.exactly(int(length))
        else:
            content, keep = await self.to_end(), False
        if self.buffer:
            keep = False  # more than the answer came: nothing may be read after it
        return Answer(status, reason, headers, content), keep

    async def _chunks(self) -> bytes:
        parts: list[bytes] = []
        while True:
            size_line = (await self.until(b"\r\n", MAX_HEAD_BYTES)).split(b";")[0].strip()
            if not _HEX.fullmatch(size_line):
                raise _BadAnswer(f"a chunk's size of {size_line[:100]!r}")
            size = int(size_line, 16)
            if size == 0:
                while await self.until(b"\r\n", MAX_HEAD_BYTES):  # the trailers, if any
                    pass
                return b"".join(parts)
            parts.append(await self.exactly(size))
            if await self.exactly(2) != b"\r\n":
                raise _BadAnswer("a chunk not ended by CRLF")
