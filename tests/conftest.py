"""Shared fixtures: a fresh state root per test, API clients with keys, queue factories, and
a real daphne server subprocess sharing the test database."""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import gc
import http.client
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from django.conf import settings
from rest_framework.test import APIClient

from taskhoster import engine
from taskhoster.engine.pacing import ForegroundMark
from taskhoster.engine.pacing import _marks as pacing_marks
from taskhoster.engine.removal import RECLAIM_THREAD
from taskhoster.keys import create_key

REPO = Path(__file__).resolve().parent.parent
WS_MAX = (1024 * 1024 + 64 * 1024) * 2  # daphne's WebSocket limit, as scripts/serve sets it


@pytest.fixture(scope="session")
def django_db_setup(django_db_setup: None, django_db_blocker: Any) -> Iterator[None]:
    """pytest-django's, and before the test database is dropped, no other session on it.

    PostgreSQL refuses to drop a database another session holds (after waiting 5 s), and the
    suite starts hundreds of server, committer and sweep processes and threads; one still
    holding a connection as the session ends (a pooled connection a thread has not given
    back) would turn a green run red at teardown, for a reason no test names. So every
    process a test starts names its sessions after that test (``PGAPPNAME``, set below), and
    a session still there at the end fails the run with the name of the test that left it
    (after ending it, so the database can still be dropped).
    """
    yield
    from django.db import connection

    with django_db_blocker.unblock():
        if connection.vendor != "postgresql":
            return
        # This process's pool keeps idle sessions open by design: close it, and look from a
        # connection of our own.
        from django.db import connections
        from django.db.backends.postgresql.base import DatabaseWrapper

        wrapper = connections["default"]
        assert isinstance(wrapper, DatabaseWrapper)
        wrapper.close()
        wrapper.close_pool()
        db = wrapper.settings_dict
        with (
            psycopg.connect(
                dbname=db["NAME"],
                user=db.get("USER") or None,
                password=db.get("PASSWORD") or None,
                host=db.get("HOST") or "127.0.0.1",
                port=db.get("PORT") or 5432,
                application_name="the end of the test session",
                autocommit=True,
            ) as own,
            own.cursor() as cursor,
        ):
            # A session closed a moment ago is still listed until its backend has exited:
            # only one still there after a while was left open.
            deadline = time.monotonic() + 15
            while True:
                cursor.execute(
                    "SELECT pid, application_name, client_port, state, left(query, 80) "
                    "FROM pg_stat_activity WHERE datname = current_database() "
                    "AND pid <> pg_backend_pid()"
                )
                # (this process's own threads, which may keep a pooled session past the
                # pool's close, are not what this looks for: the processes tests started)
                ours = own_tcp_ports()
                others = [row for row in cursor.fetchall() if row[2] not in ours]
                if not others or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            if others:
                cursor.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid()"
                )
        if others:
            pytest.fail(
                "sessions were left on the test database (ended now); each is named "
                f"(application_name) after the test whose process opened it: {others}",
                pytrace=False,
            )


def own_tcp_ports() -> set[int]:
    """The local ports of this process's TCP sockets (Linux, from /proc)."""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/self/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as handle:
            for line in handle.readlines()[1:]:
                fields = line.split()
                if len(fields) > 9 and fields[9] in inodes:
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Every database session a process of this test opens is named after it (libpq reads
    ``PGAPPNAME``; the last 63 characters, PostgreSQL's limit), so a session left behind
    says which test left it."""
    os.environ["PGAPPNAME"] = item.nodeid[-63:]


_FAILED = pytest.StashKey[bool]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    if report.when == "call" and report.failed:
        item.stash[_FAILED] = True
    return report


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Before a test's fixtures end: a queue it deleted in this process is reclaimed by a
    thread behind the answer; let it finish, or its statements meet the flush of the test
    database (on PostgreSQL a deadlock with the TRUNCATE).

    And a test that failed may have left what it would have closed open (its assertion came
    first: a websocket, a client): collected here, quietly, not at some later test's
    garbage collection, where the ``ResourceWarning`` would fail that test too."""
    for thread in threading.enumerate():
        if thread.name == RECLAIM_THREAD:
            thread.join(60)
    if item.stash.get(_FAILED, False):
        # pytest keeps the failure (for a debugger) until the next test: its frames hold
        # what the test had open.
        for name in ("last_type", "last_value", "last_traceback", "last_exc"):
            with contextlib.suppress(AttributeError):
                delattr(sys, name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            gc.collect()


def quiesce_engine(within: float = 60.0) -> None:
    """Wait until this process's committer has answered everything handed to it (a test may
    have stopped waiting for an answer: a timeout, a failure), then drop the metrics it
    counted and has not written. Run before a test's database is emptied: a committer
    that wrote its counts afterwards would write them into the next test's database, whose
    ``/metrics`` would then show work it never did."""
    from taskhoster import metrics
    from taskhoster.engine import admission

    committer = admission.current()
    if committer is not None:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline and (
            committer.waiting() or getattr(committer, "busy", False)
        ):
            time.sleep(0.01)
    with metrics._lock:
        metrics._pending.clear()


@pytest.fixture(autouse=True)
def state_root(tmp_path: Path, settings: Any) -> Iterator[Path]:
    root = tmp_path / "state"
    # Engine calls made by the tests themselves commit in a thread of this process (servers
    # the tests start use a committer process, as in production).
    settings.TASKHOSTER = {
        **settings.TASKHOSTER,
        "ROOT": str(root),
        "LONG_POLL_INTERVAL": 0.05,
        "COMMITTER": "thread",
    }
    yield root
    # (A test marked django_db has its database emptied after this; one that asks for
    # ``transactional_db`` through ``server_factory`` is quiesced there.)
    quiesce_engine()
    # The host-wide mark of foreground work kept for this root (``engine.pacing``).
    ForegroundMark.path(root).unlink(missing_ok=True)
    pacing_marks.pop(root, None)


@pytest.fixture
def make_key(db: None) -> Callable[..., str]:
    def make(scopes: str = "produce,work,manage", queues: list[str] | None = None) -> str:
        return create_key(name="test", scopes=scopes.split(","), queues=queues)[1]

    return make


@pytest.fixture
def api(make_key: Callable[..., str]) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {make_key()}")
    return client


@pytest.fixture
def make_queue(db: None) -> Callable[..., Any]:
    def make(name: str = "q", **settings_: Any) -> Any:
        return engine.upsert_queue(name=name, body=settings_)[0]

    return make


# Ports the tests' servers listen on: below Linux's range of ephemeral ports (32768-60999
# by default), so that no outgoing connection of this machine (the tests' own clients, by
# the thousand) is given one as its source port between ``free_port`` and the server's bind.
TEST_PORTS = range(20000, 32000)
# Each port handed out is reserved by a lock on a file of its own (``flock``), held by this
# process, so that a suite running beside this one (CI runs two) never picks it too. The
# lock goes when the file is closed or the process ends; the oldest are let go past this
# many (long after their servers stopped).
_PORT_LOCKS_KEPT = 256
_port_locks: list[Any] = []


def _let_ports_go() -> None:
    while _port_locks:
        _port_locks.pop().close()


atexit.register(_let_ports_go)


def free_port() -> int:
    """A port no other test process holds and nothing listens on now, for a server the
    test starts (it binds it a moment later)."""
    folder = Path(tempfile.gettempdir()) / "taskhoster-test-ports"
    folder.mkdir(exist_ok=True)
    for _attempt in range(1000):
        port = random.choice(TEST_PORTS)
        lock = open(folder / str(port), "a")  # noqa: SIM115 (kept open: the reservation)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock.close()  # another process's
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                lock.close()  # something listens there (or lingers)
                continue
        _port_locks.append(lock)
        while len(_port_locks) > _PORT_LOCKS_KEPT:
            _port_locks.pop(0).close()
        return port
    raise RuntimeError(f"no free port in {TEST_PORTS}")


def database_url() -> str:
    db = settings.DATABASES["default"]
    if "sqlite" in str(db["ENGINE"]):
        return f"sqlite:///{db['NAME']}"
    user = db.get("USER") or ""
    password = f":{db['PASSWORD']}" if db.get("PASSWORD") else ""
    host = db.get("HOST") or "127.0.0.1"
    port = db.get("PORT") or 5432
    return f"postgres://{user}{password}@{host}:{port}/{db['NAME']}"


def needs_postgresql(why: str) -> pytest.MarkDecorator:
    """Skip where the test database is SQLite: ``why`` names what the test needs a database
    server for."""
    return pytest.mark.skipif(database_url().startswith("sqlite"), reason=why)


def python_in_project(
    *args: str,
    env: dict[str, str] | None = None,
    without: tuple[str, ...] = (),
    check: bool = False,
    timeout: float = 60,
) -> subprocess.CompletedProcess[str]:
    """``python *args`` from the repository with the project's settings, in this process's
    environment changed by ``env`` and less the variables named in ``without``, its output
    captured as text."""
    environment = {**os.environ, "DJANGO_SETTINGS_MODULE": "project.settings", **(env or {})}
    for name in without:
        environment.pop(name, None)
    return subprocess.run(
        [sys.executable, *args],
        cwd=REPO,
        env=environment,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=check,
    )


def stop_process(proc: subprocess.Popen[Any], within: float = 10.0) -> None:
    """Stop a process a test started: SIGTERM, then SIGKILL if it has not exited ``within``
    seconds, and reap it."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(within)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def server_env(root: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "DATABASE_URL": database_url(),
            "TASKHOSTER_ROOT": str(root),
            "DJANGO_SETTINGS_MODULE": "project.settings",
            "PYTHONPATH": str(REPO),
        }
    )
    env.update(extra)
    return env


class PortTaken(Exception):
    """Another process bound the port ``free_port`` chose before daphne did."""


def daphne_listens(proc: subprocess.Popen[bytes], log: Path, start: int, port: int) -> bool:
    """Whether the daphne ``proc``, logging to ``log`` from offset ``start``, says it listens
    on ``port`` (until it does, whatever answers there is another process). ``PortTaken``
    if it exited because another process had bound the port; ``RuntimeError`` if it exited
    otherwise."""
    exited = proc.poll() is not None  # before the log is read: all it said is in it then
    with open(log, "rb") as written:
        written.seek(start)
        said = written.read().decode(errors="replace")
    if exited:
        if f"Couldn't listen on 127.0.0.1:{port}" in said:
            raise PortTaken(port)
        raise RuntimeError(f"daphne exited: {log.read_text(errors='replace')[-2000:]}")
    return f"Listening on TCP address 127.0.0.1:{port}" in said


class Server:
    """A daphne subprocess serving the project on a free port."""

    def __init__(self, root: Path, **env: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.root = root
        self.env = server_env(root, **env)
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = root.parent / f"daphne-{self.port}.log"

    def start(self, *, healthy: bool = True) -> Server:
        """Start it and wait until ``/healthz`` answers 200 (any answer: ``healthy=False``).

        ``free_port`` lets its port go before daphne binds it, and another process (CI runs
        two suites side by side) may take it in between, if rarely: then daphne says so and
        exits, and it is started again on another port (a few times). Until daphne says it
        listens, whatever answers on the port is not it, and is not asked. Refused while it
        runs: the running daphne would be lost to ``stop`` and outlive the test."""
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"daphne (pid {self.proc.pid}) is running: stop it first")
        for _attempt in range(4):
            try:
                return self._start(healthy=healthy)
            except PortTaken:
                self._wait_for_group()  # its committer process, if it got that far
                self.port = free_port()
                self.url = f"http://127.0.0.1:{self.port}"
        return self._start(healthy=healthy)

    def _start(self, *, healthy: bool) -> Server:
        with open(self.log, "ab") as log:
            start = log.tell()
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "daphne",
                    "-b",
                    "127.0.0.1",
                    "-p",
                    str(self.port),
                    # As scripts/serve starts it: twice the largest /work frame.
                    "--websocket-max-message-size",
                    str(WS_MAX),
                    "--websocket-max-frame-size",
                    str(WS_MAX),
                    "project.asgi:application",
                ],
                cwd=REPO,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                # A process group of its own, with its committer process: ``stop`` and
                # ``kill`` wait for the whole group.
                start_new_session=True,
            )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if not daphne_listens(self.proc, self.log, start, self.port):
                time.sleep(0.05)  # not bound yet: an answer on the port would be another's
                continue
            try:
                status = _healthz_status(self.port)
            except (OSError, http.client.HTTPException):
                time.sleep(0.1)
                continue
            if status == 200 or not healthy:
                return self
            # Not ready yet (its committer process starts beside it): asked again shortly,
            # not at once. Each answer costs the starting server CPU, which its committer's
            # start needs.
            time.sleep(0.02)
        raise RuntimeError("daphne did not start")

    def kill(self) -> None:
        """SIGKILL daphne, as a crash would; its committer process, left with the pipe
        closed, finishes what it was handed and exits (waited for: ``_wait_for_group``)."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self._wait_for_group()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        self._wait_for_group()

    def _wait_for_group(self, within: float = 20.0) -> None:
        """Until no process of the server's group is left (its committer process writes
        what it counted as it exits: that must land before the test's database is
        emptied, never in the next test's); SIGKILL for what is still there after
        ``within`` seconds."""
        if self.proc is None:
            return
        group = self.proc.pid  # start_new_session: the group is named by daphne's pid
        deadline = time.monotonic() + within
        while _group_alive(group):
            if time.monotonic() > deadline:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(group, signal.SIGKILL)
                deadline = time.monotonic() + within
            time.sleep(0.02)


def _healthz_status(port: int) -> int:
    """The status of ``GET /healthz`` on ``port``, over a plain connection: cheap to ask
    while the server starts."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        connection.request("GET", "/healthz")
        return connection.getresponse().status
    finally:
        connection.close()


def _group_alive(group: int) -> bool:
    """Whether a process of process group ``group`` is still running (not a zombie). (The
    directory is closed on the early return too: an unclosed one warns, and under
    ``filterwarnings = error`` failed whichever test was running when it was collected.)"""
    with os.scandir("/proc") as entries:
        for entry in entries:
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == group and fields[0] != "Z":
                return True
    return False


@pytest.fixture
def server_factory(transactional_db: None, state_root: Path) -> Iterator[Callable[..., Server]]:
    started: list[Server] = []

    def start(*, healthy: bool = True, **env: str) -> Server:
        """A server, once ``/healthz`` answers 200 (any answer: ``healthy=False``)."""
        server = Server(state_root, **env)
        started.append(server)
        return server.start(healthy=healthy)

    yield start
    for server in started:
        server.stop()
    quiesce_engine()  # before ``transactional_db`` empties the database


@pytest.fixture
def manage(
    transactional_db: None, state_root: Path
) -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run ``manage.py`` in a subprocess against the test database and state root."""

    def run(*args: str, check: bool = True, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "manage.py", *args],
            cwd=REPO,
            env=server_env(state_root, **env),
            capture_output=True,
            text=True,
            check=check,
            timeout=120,
        )

    return run
