"""The blocking producer's HTTP/1.1 over plain ``http://``: the standard library's sockets and
response parser, connections kept alive in a small pool.

A post of one item is the call a web request makes most, and httpx spent most of the
producer's CPU on it (``docs/performance.md``, "The producer's client"); this sends each
request as one write (its line, headers and body together, so the server reads it at once)
and reads the answer with :class:`http.client.HTTPResponse`. It does only what the producer
needs: no TLS, no proxies, no redirects, no cookies, no compression. :class:`~.producer.
Producer` uses it for an ``http://`` address that no proxy variable of the environment
covers and no ``transport`` was given for; everything else goes through httpx as before.

Errors are :class:`WireError`, whose ``never_sent`` says whether the request surely did not
leave (the connection could not be made): only then may a call that is not safe to resend be
sent again. A connection kept from an earlier call is looked at before it is used: one the
server has closed (or written to unasked) while it sat idle is closed and another made, so a
server's restart or idle timeout does not cost a call that is not safe to resend.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import urllib.request
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlencode, urlsplit

#: At most this many idle connections are kept (more are closed as their calls end).
KEEP_IDLE = 8


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
    """Whether the wire can serve this base address: ``http://``, with no proxy set for it
    in the environment (httpx would honour one; this does not)."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        return False
    proxies = urllib.request.getproxies_environment()
    if not ({"http", "all"} & proxies.keys()):
        return True
    return bool(urllib.request.proxy_bypass(parts.hostname))


def body_of(value: Any) -> bytes:
    """A JSON body as httpx encodes one (compact, UTF-8, no NaN)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


def _still_open(sock: socket.socket) -> bool:
    """Whether an idle connection may carry a call: nothing to read on it (the server has
    neither closed it nor written what no call asked for)."""
    try:
        sock.setblocking(False)
        try:
            sock.recv(1, socket.MSG_PEEK)
        finally:
            sock.setblocking(True)
    except BlockingIOError:
        return True
    except OSError:
        return False
    return False


class Wire:
    """Calls to one server, from any number of threads: each call takes an idle connection
    (or makes one) and gives it back once its answer is read whole."""

    def __init__(self, url: str, headers: Mapping[str, str]) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"not a plain http:// address: {url!r}")
        self.host = parts.hostname
        self.port = parts.port or 80
        self.prefix = parts.path.rstrip("/")
        fixed = {"Host": parts.netloc, **headers}
        if any(set("\r\n") & set(f"{name}{value}") for name, value in fixed.items()):
            raise ValueError("a header name or value holds a line break")
        self._head = "".join(f"{name}: {value}\r\n" for name, value in fixed.items())
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()

    def request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, str] | None,
        body: bytes | None,
        timeout: float,
    ) -> Answer:
        target = self.prefix + path + (f"?{urlencode(params)}" if params else "")
        head = f"{method} {target} HTTP/1.1\r\n{self._head}"
        if body is not None:
            head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        elif method in ("POST", "PUT", "PATCH"):
            head += "Content-Length: 0\r\n"
        message = (head + "\r\n").encode("latin-1") + (body or b"")
        sock = self._take(timeout)
        response = None
        try:
            sock.settimeout(timeout)
            try:
                sock.sendall(message)
            except OSError as exc:
                raise WireError(f"sending: {type(exc).__name__}: {exc}", never_sent=False) from exc
            response = http.client.HTTPResponse(sock, method=method)
            try:
                response.begin()
                content = response.read()
            except TimeoutError as exc:
                raise WireError(f"no answer in {timeout:g} s", never_sent=False) from exc
            except (OSError, http.client.HTTPException) as exc:
                raise WireError(f"reading: {type(exc).__name__}: {exc}", never_sent=False) from exc
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
        if response.will_close:
            sock.close()
        else:
            self._give_back(sock)
        return answer

    def _take(self, timeout: float) -> socket.socket:
        while True:
            with self._lock:
                if self._closed:
                    raise WireError("the producer is closed", never_sent=True)
                sock = self._idle.pop() if self._idle else None
            if sock is None:
                break
            if _still_open(sock):
                return sock
            sock.close()
        try:
            sock = socket.create_connection((self.host, self.port), timeout=timeout)
        except OSError as exc:
            raise WireError(
                f"connecting to {self.host}:{self.port}: {type(exc).__name__}: {exc}",
                never_sent=True,
            ) from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def _give_back(self, sock: socket.socket) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < KEEP_IDLE:
                self._idle.append(sock)
                return
        sock.close()
