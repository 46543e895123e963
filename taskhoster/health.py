"""What ``/healthz`` reports: which database, news bus, channel layer and state root this
process uses, and whether each answers; it is the process's readiness.

With several server processes behind one address (or several hosts), a load balancer or an
operator asks each process in turn; every part is named (a URL without its password, a
path), so two processes that disagree about what they share show it at once.

The state root is ready only while a write to it succeeds and its free space and free inodes
(as an unprivileged process sees them) stay at or above ``MIN_FREE_BYTES`` and
``MIN_FREE_INODES``: a disk that refuses writes refuses every post, so the process says so
before a client learns it the hard way.

A server answers ``/healthz`` at once, whatever its load: a ``Monitor`` thread of its own
makes the report every ``HEALTH_INTERVAL`` and the server's handler serves the latest one
without queueing behind the requests (``taskhoster.asgi``). A load balancer whose check
timed out would take the server out exactly when it is busiest.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from django.conf import settings
from django.db import connection

from . import bus as news_bus
from . import engine, metrics
from .conf import get_conf
from .store import free_space, remove_left_behind


def _redacted(url: str) -> str:
    """``url`` without its password."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}{port}"))


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".strip()[:300]


def database() -> dict[str, Any]:
    db = settings.DATABASES["default"]
    answer: dict[str, Any] = {"vendor": connection.vendor, "name": str(db.get("NAME") or "")}
    if connection.vendor != "sqlite":
        answer["host"] = f"{db.get('HOST') or 'localhost'}:{db.get('PORT') or 5432}"
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        answer["reachable"] = True
    except Exception as exc:
        answer["reachable"] = False
        answer["error"] = _error(exc)
    return answer


def bus() -> dict[str, Any]:
    """The news bus that wakes sockets in other processes (``taskhoster.bus``)."""
    url = get_conf().redis_url
    answer: dict[str, Any] = (
        {"kind": "redis", "url": _redacted(url)}
        if url
        # The doorbell: abstract unix sockets, so only processes of this host hear it.
        else {"kind": "doorbell", "scope": "this host"}
    )
    try:
        news_bus.ping()
        answer["reachable"] = True
    except Exception as exc:
        answer["reachable"] = False
        answer["error"] = _error(exc)
    return answer


def channel_layer() -> dict[str, Any]:
    """The project's channel layer, for the operator's information: in-process, shared, or
    none. Taskhoster's own sockets use none (their news comes by ``taskhoster.bus``), so a
    project need not configure one."""
    layers = getattr(settings, "CHANNEL_LAYERS", None) or {}
    backend = str(layers.get("default", {}).get("BACKEND", ""))
    if not backend:
        return {"backend": "", "scope": "none"}
    shared = "InMemory" not in backend
    return {"backend": backend, "scope": "all processes" if shared else "this process"}


# The name of the write probe's file in the state root: this prefix, then 16 random hex digits.
PROBE_PREFIX = ".health."
PROBE_NAME = re.compile(rf"{re.escape(PROBE_PREFIX)}[0-9a-f]{{16}}")
# A probe's file that a killed process left is removed, after a monitor's first report, once
# it is this old, in seconds. A younger one may be another process's, probing now: processes
# of several hosts may share the root, and on a network filesystem a file's time is the file
# server's clock, compared with this host's.
PROBE_LEFT_AFTER = 3600.0


def _write_probe(root: Path) -> str | None:
    """Write and remove a small file in the state root: None, or why it failed. The file is
    this call's own (a random name, made with ``O_EXCL``): the monitor's thread and a
    request's thread (Django's view, before the monitor's first report) may probe at the same
    moment, and processes of two hosts that share the root may have one pid (containers').
    A file gone before its own unlink was written all the same: only another host whose
    clock is an hour ahead of the file server's can have taken it (``remove_left_probes``)."""
    path = root / f"{PROBE_PREFIX}{secrets.token_hex(8)}"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"ok\n")
        finally:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(path)
        return f"a write failed: {exc.strerror or exc}"
    return None


def remove_left_probes(root: Path) -> int:
    """Remove the write probes' files that killed processes left in the state root (those
    ``PROBE_LEFT_AFTER`` old or more), and say how many. A probe's file lives for a write and
    an unlink, so only a kill between the two leaves one; without this, each such kill would
    leave a file in the root for good. One pass over the root's own entries (its queues'
    directories, not their items), once the monitor's first report is made."""
    return remove_left_behind(root, PROBE_NAME, older_than=PROBE_LEFT_AFTER)


def state_root() -> dict[str, Any]:
    root = engine.store_root()  # resolved once, when the store was made
    answer: dict[str, Any] = {"path": str(root)}
    if not root.is_dir():
        answer["reachable"] = False
        answer["error"] = "missing: run manage.py bootstrap, or create it"
        return answer
    conf = get_conf()
    problems = []
    # access(2) also answers "no" on a read-only mount (EROFS).
    if not os.access(root, os.W_OK | os.X_OK):
        problems.append("not writable by this process")
    else:
        failed = _write_probe(root)
        if failed:
            problems.append(failed)
    free = free_space(root)
    if free is not None:
        answer["freeBytes"], answer["freeInodes"] = free
        if free[0] < conf.min_free_bytes:
            problems.append(f"{free[0]} bytes free, below MIN_FREE_BYTES ({conf.min_free_bytes})")
        if free[1] < conf.min_free_inodes:
            problems.append(
                f"{free[1]} inodes free, below MIN_FREE_INODES ({conf.min_free_inodes})"
            )
    unflushed = engine.unflushed_items()
    if unflushed:
        answer["unflushedItems"] = unflushed
        problems.append(
            f"a flush failed: {unflushed} items' files wait to be written again, and "
            "nothing is changed until they are"
        )
    answer["reachable"] = not problems
    if problems:
        answer["error"] = "; ".join(problems)
    return answer


def committer_backlog() -> dict[str, Any]:
    """This process's committer now: whether it is ready (a committer process that is still
    starting is not: the process is not ready for work yet), the items waiting for it, and
    the oldest one's wait."""
    items, oldest = engine.backlog()
    return {
        "ready": not engine.committer_starting(),
        "waitingItems": items,
        "oldestWaitSeconds": round(oldest, 3),
    }


def _with_committer(healthy: bool, body: dict[str, Any]) -> tuple[bool, dict[str, Any]]:
    """The report with the committer as it is now: not ready while it starts."""
    committer = committer_backlog()
    body = {**body, "committer": committer}
    if healthy and not committer["ready"]:
        healthy = False
        body["status"] = "unavailable"
    return healthy, body


def public(body: dict[str, Any]) -> dict[str, Any]:
    """What anyone may see of a report: whether the process is ready, and which part is not.
    The names of the database, the state root's path, the process's pid and the errors
    (which name hosts and paths) are for a caller with a key."""
    shown: dict[str, Any] = {"status": body["status"]}
    for part in ("database", "bus", "stateRoot"):
        if part in body:
            shown[part] = {"reachable": bool(body[part].get("reachable"))}
    if "committer" in body:
        shown["committer"] = {"ready": bool(body["committer"].get("ready"))}
    return shown


def report() -> tuple[bool, dict[str, Any]]:
    """(healthy, the body of ``/healthz``)."""
    return _with_committer(*_parts_report())


# Each part of the report, and its check (in the order checked).
PARTS: dict[str, Callable[[], dict[str, Any]]] = {
    "database": database,
    "bus": bus,
    "stateRoot": state_root,
}


def _parts_report(checking: Callable[[str], None] | None = None) -> tuple[bool, dict[str, Any]]:
    """(healthy, the body of ``/healthz``) but for the committer, which is added as it is
    when the report is read: ``_with_committer``. ``checking`` hears each part's name as its
    check begins."""
    parts: dict[str, dict[str, Any]] = {}
    for name, check in PARTS.items():
        if checking is not None:
            checking(name)
        parts[name] = check()
    healthy = all(part["reachable"] for part in parts.values())
    if checking is not None:
        checking("channelLayer")
    body: dict[str, Any] = {
        "status": "ok" if healthy else "unavailable",
        "process": metrics.PROCESS,
        "pid": os.getpid(),
        **parts,
        "channelLayer": channel_layer(),
    }
    return healthy, body


class Monitor:
    """Keeps this process's report fresh in a thread of its own (``HEALTH_INTERVAL``), so
    ``/healthz`` is answered at once from the latest, however busy the process is. A check
    that does not answer (a network that drops packets answers nothing for seconds) is
    itself the news: once it has waited three intervals, the report says that part does
    not answer, at once, rather than going stale."""

    def __init__(self) -> None:
        self.latest: tuple[float, bool, dict[str, Any]] | None = None
        # (the latest report, the part whose check is under way and since when): one value,
        # so that ``current`` never sees a new report beside an old check or the reverse.
        self.state: tuple[tuple[float, bool, dict[str, Any]] | None, tuple[str, float] | None]
        self.state = (None, None)
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()

    def start(self) -> None:
        with self.lock:
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(
                    target=self._run, name="taskhoster-health", daemon=True
                )
                self.thread.start()

    def current(self) -> tuple[bool, dict[str, Any]] | None:
        """The latest report, with the committer's backlog as it is now, if it is fresh (made
        within three intervals) or the check after it is under way; if that check has waited
        three intervals, the latest with that part not answering; None (Django's view
        answers) before the first report, or while the monitor is stuck outside a check."""
        latest, checking = self.state
        now, stale = time.monotonic(), 3 * get_conf().health_interval
        if latest is None or now - latest[0] > 10 * stale:
            return None  # none yet, or the monitor has failed for long: Django's view answers
        if checking is None and now - latest[0] > stale:
            return None  # the monitor is stuck elsewhere: Django's view answers
        if checking is None or now - checking[1] <= stale:
            # Fresh, or its next check is under way and not yet overdue.
            return _with_committer(latest[1], latest[2])
        part, since = checking
        body = {**latest[2], "status": "unavailable"}
        body[part] = {
            **body.get(part, {}),
            "reachable": False,
            "error": f"its check has not answered for {now - since:.0f} s",
        }
        return _with_committer(False, body)

    def _checking(self, part: str) -> None:
        self.state = (self.state[0], (part, time.monotonic()))

    def _log_changes(self, body: dict[str, Any]) -> None:
        """Say in the log when a part stops answering (with its error, which /healthz tells
        only a caller with a key) and when it answers again."""
        before = self.latest[2] if self.latest is not None else {}
        for part in ("database", "bus", "stateRoot"):
            now, then = body.get(part, {}), before.get(part, {"reachable": True})
            if now.get("reachable") == then.get("reachable"):
                continue
            if now.get("reachable"):
                log.warning("health: the %s answers again", part)
            else:
                details = {k: v for k, v in now.items() if k != "reachable"}
                log.warning("health: the %s does not answer: %s", part, details)

    def _run(self) -> None:
        from django.db import close_old_connections

        from .osthread import name_os_thread

        name_os_thread()
        looked_for_left_probes = False
        while True:
            started = time.monotonic()
            try:
                try:
                    healthy, body = _parts_report(self._checking)
                    body["checkedAt"] = round(time.time(), 3)
                    self._log_changes(body)
                    self.latest = (time.monotonic(), healthy, body)
                finally:
                    self.state = (self.latest, None)
                if not looked_for_left_probes:
                    looked_for_left_probes = True
                    self._remove_left_probes()
                close_old_connections()
            except Exception:
                log.exception("the health monitor could not make its report")
            time.sleep(max(0.05, get_conf().health_interval - (time.monotonic() - started)))

    def _remove_left_probes(self) -> None:
        """Once, after the first report (so a root that does not answer delays no report):
        as a check of the state root, so that should the root hang here, ``current`` says
        the state root does not answer, as the root's own check would."""
        self._checking("stateRoot")
        try:
            removed = remove_left_probes(engine.store_root())
            if removed:
                log.info("health: removed %d write probes' files killed processes left", removed)
        except Exception:
            log.exception("the health monitor could not look for write probes left behind")
        finally:
            self.state = (self.latest, None)


def _own_port_answer(request: bytes) -> bytes:
    """The whole HTTP answer to a request on ``HEALTH_LISTEN``: ``GET``/``HEAD /healthz``
    from the monitor's latest report (the public body), 404 for any other path."""
    line = request.split(b"\r\n", 1)[0].split(b" ")
    method = line[0] if line else b""
    path = line[1].split(b"?", 1)[0] if len(line) > 1 else b""
    body: dict[str, Any]
    if method not in (b"GET", b"HEAD"):
        status, body = 405, {"error": {"code": "method_not_allowed", "message": "GET only"}}
    elif path != b"/healthz":
        status, body = 404, {"error": {"code": "not_found", "message": "only /healthz"}}
    else:
        found = monitor.current()
        if found is None:
            status, body = 503, {"status": "unavailable", "reason": "no fresh report"}
        else:
            status, body = (200 if found[0] else 503), public(found[1])
    content = json.dumps(body, separators=(",", ":")).encode()
    reason = {200: b"OK", 404: b"Not Found", 405: b"Method Not Allowed"}.get(
        status, b"Service Unavailable"
    )
    head = (
        b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
        b"cache-control: no-store\r\nconnection: close\r\n\r\n" % (status, reason, len(content))
    )
    return head if method == b"HEAD" else head + content


class OwnPort:
    """``/healthz`` on a port of its own (``HEALTH_LISTEN``), answered by one thread: never
    behind the event loop's turn, however many connections the loop serves (with 512
    connections posting flat out, a ``/healthz`` on the main port waited a third of a second).

    It is deliberately small: one request per connection, read up to its headers (4 KiB at
    most, 2 s at most), answered and closed. Each step lets go of the GIL once; a fuller HTTP
    server took ten times as many turns at it, each up to 5 ms behind a busy loop."""

    def __init__(self) -> None:
        self.sock: socket.socket | None = None
        self.lock = threading.Lock()

    def start(self) -> None:
        listen = get_conf().health_listen
        with self.lock:
            if not listen or self.sock is not None:
                return
            host, _sep, port = listen.rpartition(":")
            try:
                sock = socket.create_server(
                    (host.strip("[]"), int(port)), reuse_port=False, backlog=64
                )
            except OSError as exc:
                log.error("health: could not listen on HEALTH_LISTEN %s: %s", listen, exc)
                return
            self.sock = sock
        threading.Thread(target=self._serve, name="taskhoster-health-port", daemon=True).start()
        log.info("health: /healthz also on %s", listen)

    def _serve(self) -> None:
        from .osthread import name_os_thread

        name_os_thread()
        assert self.sock is not None
        while True:
            try:
                conn, _peer = self.sock.accept()
            except OSError:
                return  # closed
            with conn:
                try:
                    conn.settimeout(2)
                    request = b""
                    while b"\r\n\r\n" not in request and len(request) < 4096:
                        chunk = conn.recv(4096)
                        if not chunk:
                            break
                        request += chunk
                    conn.sendall(_own_port_answer(request))
                except OSError:
                    continue  # a client that went away, or sent nothing for 2 s


log = logging.getLogger(__name__)
monitor = Monitor()
own_port = OwnPort()
