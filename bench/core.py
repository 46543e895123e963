"""Core throughput of Taskhoster over HTTP: posts, batch posts, claim+result round trips.

A benchmark, not a test. It starts a real daphne subprocess against a fresh database and a
fresh state root, fills the queue with N waiting items straight through the engine (fast, no
fsync), and then measures over HTTP with keep-alive, fsync on by default::

    .venv/bin/python bench/core.py --waiting 1000,100000 --seconds 5
    .venv/bin/python bench/core.py --database-url postgres://postgres@127.0.0.1:5432/postgres

See bench/README.md for what each figure means and how the waiting items are kept honest.
"""

# ruff: noqa: E402
from __future__ import annotations

# When a file of bench/ runs as a script, bench/ leads sys.path, where a module named like a
# standard one would shadow it. The repository's root goes there instead (for ``bench.*``).
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(_HERE)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

import argparse
import asyncio
import contextlib
import itertools
import json
import platform
import re
import shutil
import signal
import socket
import sqlite3
import subprocess
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx

from bench.flushcost import filesystem_of  # (also for the other scripts of bench/)

REPO = Path(__file__).resolve().parent.parent
QUEUE = "bench"
PREFILL_BATCH = 1000
BATCH_SIZE = 500
CONCURRENCY = 4
MAX_WAITING = 1_000_000
LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", None, ""}
MEASUREMENTS = {
    # name: (description, threads, unit)
    "post": ("post single item, 1 client", 1, "items"),
    "post-x4": (f"post single item, {CONCURRENCY} clients", CONCURRENCY, "items"),
    # The same post through the Python producer (taskhoster.client.Producer, no idempotency
    # key made up): on its own HTTP, as it calls an http:// server, and on httpx.
    "post-producer": ("post single item, Producer, 1 client", 1, "items"),
    "post-producer-httpx": ("post single item, Producer on httpx, 1 client", 1, "items"),
    # And through AsyncProducer, each call run to its end on the client thread's event loop.
    "post-async-producer": ("post single item, AsyncProducer, 1 client", 1, "items"),
    "post-async-producer-httpx": (
        "post single item, AsyncProducer on httpx, 1 client",
        1,
        "items",
    ),
    "batch500": (f"post batches of {BATCH_SIZE}, 1 client", 1, "items"),
    "claim": ("claim(max=1)+result, 1 worker", 1, "round trips"),
    "claim-x4": (f"claim(max=1)+result, {CONCURRENCY} workers", CONCURRENCY, "round trips"),
    "queue": ("GET /api/queues/bench (counts), 1 client", 1, "requests"),
    "queues": ("GET /api/queues (counts), 1 client", 1, "requests"),
    "metrics": ("GET /metrics (counts), 1 client", 1, "requests"),
}
READS = {"queue": f"/api/queues/{QUEUE}", "queues": "/api/queues", "metrics": "/metrics"}
JSON_HEADERS = {"Content-Type": "application/json"}


class BenchError(RuntimeError):
    pass


def say(*parts: Any) -> None:
    print(*parts, file=sys.stderr, flush=True)


# -- the environment: temp dir, database, state root ---------------------------------------


@dataclass
class Environment:
    tmp: Path
    root: Path
    database_url: str = ""
    label: str = "sqlite"
    pg_admin_url: str | None = None
    pg_name: str | None = None
    secret: str = field(default_factory=lambda: os.urandom(24).hex())

    def process_env(self, *, fsync: bool) -> dict[str, str]:
        env = dict(os.environ)
        for name in ("REDIS_URL", "TASKHOSTER_TEST_DB", "DJANGO_ALLOWED_HOSTS", "DJANGO_DEBUG"):
            env.pop(name, None)
        env.update(
            {
                "DATABASE_URL": self.database_url,
                "TASKHOSTER_ROOT": str(self.root),
                "TASKHOSTER_VAR": str(self.tmp / "var"),
                "TASKHOSTER_FSYNC": "1" if fsync else "0",
                "TASKHOSTER_LOG": "WARNING",
                "DJANGO_SECRET_KEY": f"bench-{self.secret}",
                "DJANGO_SETTINGS_MODULE": "project.settings",
                "PYTHONPATH": os.pathsep.join(
                    [
                        str(REPO),
                        *([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []),
                    ]
                ),
            }
        )
        return env


def make_environment(args: argparse.Namespace, suffix: str = "") -> Environment:
    parts = urlsplit(args.database_url or "")
    if args.database_url:
        if parts.scheme not in ("postgres", "postgresql", "pgsql"):
            raise BenchError("--database-url must be a postgres:// URL (SQLite is the default)")
        if parts.hostname not in LOCAL_HOSTS:
            raise BenchError("this benchmark only talks to 127.0.0.1: use a local PostgreSQL")
    tmp = Path(tempfile.mkdtemp(prefix="taskhoster-bench-", dir=args.tmpdir))
    env = Environment(tmp=tmp, root=tmp / "state")
    env.root.mkdir()
    if not args.database_url:
        env.database_url = f"sqlite:///{tmp / 'bench.sqlite3'}"
        return env
    env.label = "postgresql"
    env.pg_admin_url = args.database_url
    name = f"bench_core_{os.getpid()}{'_' + suffix if suffix else ''}"
    try:
        _pg_execute(args.database_url, "CREATE DATABASE {}", name)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    env.pg_name = name
    env.database_url = urlunsplit(parts._replace(path=f"/{name}"))
    return env


def _pg_execute(admin_url: str, statement: str, name: str) -> None:
    import psycopg
    from psycopg import sql

    try:
        with psycopg.connect(admin_url, autocommit=True, connect_timeout=10) as conn:
            conn.execute(sql.SQL(statement).format(sql.Identifier(name)))
    except psycopg.Error as exc:
        raise BenchError(f"PostgreSQL: {exc}".strip()) from exc


def destroy_environment(env: Environment, *, keep: bool) -> None:
    with contextlib.suppress(Exception):
        from django.db import connections

        connections.close_all()
    if env.pg_name and env.pg_admin_url:
        try:
            _pg_execute(env.pg_admin_url, "DROP DATABASE IF EXISTS {} WITH (FORCE)", env.pg_name)
        except Exception as exc:
            say(f"could not drop database {env.pg_name}: {exc}")
    if keep:
        say(f"kept {env.tmp}")
    else:
        shutil.rmtree(env.tmp, ignore_errors=True)
        with contextlib.suppress(Exception):  # the host's mark of foreground work (pacing)
            from taskhoster.engine.pacing import ForegroundMark

            ForegroundMark.path(env.root).unlink(missing_ok=True)


def migrate(env: Environment) -> None:
    done = subprocess.run(
        [sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"],
        cwd=REPO,
        env=env.process_env(fsync=False),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if done.returncode != 0:
        raise BenchError(f"migrate failed:\n{done.stdout}\n{done.stderr}")


def setup_django(env: Environment) -> None:
    """Configure Django in this process against the bench database, with fsync off."""
    os.environ.update(env.process_env(fsync=False))
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    import django

    django.setup()


# -- the server ----------------------------------------------------------------------------

ASGI_APP = "project.asgi:application"
REUSE_THREADS_APP = "bench.core:reuse_threads_application"
REUSED_THREADS = 8


def __getattr__(name: str) -> Any:
    """``bench.core:reuse_threads_application`` for daphne (``--experiment reuse-threads``)."""
    if name == "reuse_threads_application":
        return _reuse_threads_application()
    raise AttributeError(name)


def _reuse_threads_application() -> Any:
    """An EXPERIMENT, not the app: the project's ASGI application, but each HTTP request runs
    its sync code on one of a few long-lived threads instead of a thread of its own.

    Django's ASGI handler enters a ThreadSensitiveContext per request, so asgiref starts a new
    executor thread (and a second thread to join it) for every request, and Django's
    thread-local database connection is opened and closed with it. Entering a context with a
    caller-owned executor first makes Django's inner context a no-op; the threads, and with
    CONN_MAX_AGE on SQLite their connections, are then reused.
    """
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from asgiref.sync import ThreadSensitiveContext
    from django.conf import settings
    from django.db import connections

    from project.asgi import application

    db = settings.DATABASES["default"]
    if "sqlite" in str(db["ENGINE"]):
        db["CONN_MAX_AGE"] = None
        connections.settings["default"]["CONN_MAX_AGE"] = None
    executors = [ThreadPoolExecutor(max_workers=1) for _ in range(REUSED_THREADS)]
    free: list[Any] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await application(scope, receive, send)
            return
        if not free:
            free.append(asyncio.Queue())
            for executor in executors:
                free[0].put_nowait(executor)
        executor = await free[0].get()
        try:
            async with ThreadSensitiveContext(executor=executor):
                await application(scope, receive, send)
        finally:
            free[0].put_nowait(executor)

    return app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Daphne:
    def __init__(
        self,
        env: Environment,
        *,
        fsync: bool,
        app: str = ASGI_APP,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.app = app
        self.extra_args = extra_args
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = env.process_env(fsync=fsync)
        self.log = env.tmp / "daphne.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Daphne:
        with open(self.log, "ab") as log:
            # A session of its own: Ctrl-C reaches only us, and we stop daphne ourselves.
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "daphne",
                    "-b",
                    "127.0.0.1",
                    "-p",
                    str(self.port),
                    *self.extra_args,
                    self.app,
                ],
                cwd=REPO,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + 60
        with httpx.Client(trust_env=False, timeout=2) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise BenchError(f"daphne exited: {self.log.read_text()[-2000:]}")
                try:
                    if client.get(f"{self.url}/healthz").status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
        raise BenchError("daphne did not answer /healthz within 60 s")

    def stop(self) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


# -- the queue: prefill, counting, restoring between measurements --------------------------


def payload(n: int, size: int) -> dict[str, Any]:
    return {"job": "bench", "n": n, "data": "x" * size}


def pending_count() -> int:
    from taskhoster.models import Item

    return Item.objects.filter(queue__name=QUEUE, status="pending").count()


def fill_to(target: int, payload_bytes: int) -> tuple[int, float]:
    """Post through the engine (in this process, fsync off) until ``target`` items wait."""
    from taskhoster import engine

    started = time.perf_counter()
    have = pending_count()
    added = 0
    while have < target:
        k = min(PREFILL_BATCH, target - have)
        engine.post_items(
            queue_name=QUEUE,
            items=[engine.NewItem(payload=payload(have + i, payload_bytes)) for i in range(k)],
        )
        have += k
        added += k
    return added, time.perf_counter() - started


def settle_disk() -> float:
    """Write back what the unsynced prefill left dirty, so that no measurement pays for it
    (a batch post's syncfs, or ext4's journal commit under an fsync, would otherwise)."""
    started = time.perf_counter()
    os.sync()
    return time.perf_counter() - started


def drop_items(ids: list[str]) -> None:
    """Delete items (rows, files and counts) through the engine, a chunk at a time."""
    from taskhoster import engine

    for start in range(0, len(ids), 2000):
        engine.delete_items(item_ids=ids[start : start + 2000])


def drop_posted_since(marker: str) -> int:
    from taskhoster.models import Item

    ids = list(Item.objects.filter(queue__name=QUEUE, id__gt=marker).values_list("id", flat=True))
    drop_items(ids)
    return len(ids)


def drop_claimed() -> int:
    from taskhoster.models import Item

    ids = list(
        Item.objects.filter(queue__name=QUEUE)
        .exclude(status="pending")
        .values_list("id", flat=True)
    )
    drop_items(ids)
    return len(ids)


def analyze_database() -> None:
    """PostgreSQL's autovacuum would have analysed a table this size; do it now."""
    from django.db import connection

    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("ANALYZE")


def claim_plan() -> str:
    """How the database runs the claim query (``engine.rows.claim_query``), on one line."""
    from django.db import connection, transaction
    from django.utils import timezone

    from taskhoster.engine.rows import claim_query
    from taskhoster.models import Queue

    queue = Queue.objects.get(name=QUEUE, deleting=False)
    query, params = claim_query(queue.id, timezone.now(), 1)
    prefix = "EXPLAIN QUERY PLAN " if connection.vendor == "sqlite" else "EXPLAIN "
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(prefix + query, params)
        plan = "\n".join(" ".join(str(v) for v in row) for row in cursor.fetchall())
    return " | ".join(line.strip() for line in plan.splitlines() if line.strip())


def fsync_probe(directory: Path, rounds: int = 30) -> float:
    """Median milliseconds of write+fsync of a small file plus fsync of its directory."""
    times = []
    for n in range(rounds):
        path = directory / f".probe-{n}"
        started = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, b"x" * 300)
            os.fsync(fd)
        finally:
            os.close(fd)
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        times.append(time.perf_counter() - started)
        path.unlink()
    times.sort()
    return times[len(times) // 2] * 1000


# -- measuring -----------------------------------------------------------------------------


@dataclass
class Row:
    database: str
    waiting: int
    waiting_end: int
    what: str
    name: str
    unit: str
    count: int
    seconds: float
    per_second: float
    requests: int
    p50_ms: float
    p99_ms: float
    errors: int
    note: str = ""


def make_client(url: str, key: str) -> httpx.Client:
    return httpx.Client(
        base_url=url, trust_env=False, timeout=60, headers={"Authorization": f"Token {key}"}
    )


def expect(response: httpx.Response, status: int) -> httpx.Response:
    if response.status_code != status:
        raise BenchError(
            f"{response.request.method} {response.request.url.path}: "
            f"{response.status_code} {response.text[:300]}"
        )
    return response


Op = Callable[[Any], int]  # given its client; returns units done; 0 = nothing left to do
PRODUCER_POSTS = (
    "post-producer",
    "post-producer-httpx",
    "post-async-producer",
    "post-async-producer-httpx",
)


class AsyncProducerInThread:
    """An :class:`taskhoster.client.AsyncProducer` called from a client thread: each call run
    to its end on the thread's own event loop (the same for its wire and for httpx)."""

    def __init__(self, url: str, key: str, transport: httpx.AsyncBaseTransport | None) -> None:
        from taskhoster.client import AsyncProducer

        self.loop = asyncio.new_event_loop()
        self.producer = AsyncProducer(url, key, auto_key=False, retries=0, transport=transport)

    def post(self, queue: str, payload: Any) -> Any:
        return self.loop.run_until_complete(self.producer.post(queue, payload))

    def __enter__(self) -> AsyncProducerInThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.run_until_complete(self.producer.aclose())
        self.loop.run_until_complete(self.loop.shutdown_default_executor())
        self.loop.close()


def client_of(name: str) -> Callable[[str, str], Any]:
    """What a measurement's clients are opened with: an httpx client, or for the
    producers' posts a :class:`taskhoster.client.Producer` or ``AsyncProducer`` (on httpx
    for ``-httpx``)."""
    if name not in PRODUCER_POSTS:
        return make_client
    from taskhoster.client import Producer

    def producer(url: str, key: str) -> Any:
        from taskhoster.client._wire import plain_http

        if not plain_http(url):
            raise BenchError(f"{name}: an HTTP proxy is set (HTTP_PROXY, ALL_PROXY): unset it")
        on_httpx = name.endswith("-httpx")
        if name.startswith("post-async-"):
            return AsyncProducerInThread(url, key, httpx.AsyncHTTPTransport() if on_httpx else None)
        transport = httpx.HTTPTransport() if on_httpx else None
        return Producer(url, key, auto_key=False, retries=0, transport=transport)

    return producer


def make_op(name: str, payload_bytes: int) -> tuple[Op, int, int]:
    """The operation of a measurement, its units per call and its requests per call."""
    counter = itertools.count()
    items_url = f"/api/queues/{QUEUE}/items"
    if name in PRODUCER_POSTS:

        def post_by_producer(producer: Any) -> int:
            producer.post(QUEUE, payload(next(counter), payload_bytes))
            return 1

        return post_by_producer, 1, 1
    if name in ("post", "post-x4"):

        def post_one(client: httpx.Client) -> int:
            body = json.dumps({"payload": payload(next(counter), payload_bytes)})
            expect(client.post(items_url, content=body, headers=JSON_HEADERS), 201)
            return 1

        return post_one, 1, 1
    if name == "batch500":

        def post_batch(client: httpx.Client) -> int:
            body = json.dumps(
                {
                    "items": [
                        {"payload": payload(next(counter), payload_bytes)}
                        for _ in range(BATCH_SIZE)
                    ]
                }
            )
            expect(client.post(items_url, content=body, headers=JSON_HEADERS), 201)
            return BATCH_SIZE

        return post_batch, BATCH_SIZE, 1
    if name in READS:
        path = READS[name]

        def read(client: httpx.Client) -> int:
            expect(client.get(path), 200)
            return 1

        return read, 1, 1
    claim_url = f"/api/queues/{QUEUE}/claim"
    result_body = json.dumps({"result": {"ok": True}})

    def claim_and_result(client: httpx.Client) -> int:
        answer = expect(client.post(claim_url, content=b'{"max":1}', headers=JSON_HEADERS), 200)
        items = answer.json()["items"]
        if not items:
            return 0
        verdict = expect(
            client.post(
                f"/api/items/{items[0]['id']}/result", content=result_body, headers=JSON_HEADERS
            ),
            200,
        ).json()
        if verdict.get("accepted") is not True:
            raise BenchError(f"result not accepted: {verdict}")
        return 1

    return claim_and_result, 1, 2


@dataclass
class Outcome:
    count: int
    seconds: float
    latencies: list[float]
    errors: int
    note: str


def run_load(
    url: str,
    key: str,
    op: Op,
    *,
    threads: int,
    seconds: float,
    cap: int,
    unit: int,
    warmup: int,
    open_client: Callable[[str, str], Any] = make_client,
) -> Outcome:
    """Run ``op`` in ``threads`` threads (one keep-alive connection each, opened with
    ``open_client``) for ``seconds``, or until ``cap`` units are done, or until the op
    finds nothing left to do."""
    from taskhoster.client import TaskhosterError

    lock = threading.Lock()
    stop = threading.Event()
    barrier = threading.Barrier(threads + 1, timeout=120)
    state = {"issued": 0, "done": 0, "errors": 0}
    latencies: list[float] = []
    spans: list[tuple[float, float]] = []
    notes: list[str] = []

    def take() -> bool:
        with lock:
            if state["issued"] + unit > cap:
                return False
            state["issued"] += unit
            return True

    def worker() -> None:
        mine: list[float] = []
        try:
            with open_client(url, key) as client:
                for _ in range(warmup):  # opens the connection and warms the server's caches
                    op(client)
                barrier.wait()
                started = time.perf_counter()
                deadline = started + seconds
                while not stop.is_set() and time.perf_counter() < deadline and take():
                    t0 = time.perf_counter()
                    try:
                        done = op(client)
                    except (BenchError, httpx.HTTPError, TaskhosterError) as exc:
                        with lock:
                            state["errors"] += 1
                            if len(notes) < 3:
                                notes.append(str(exc)[:200])
                            if state["errors"] >= 10:
                                stop.set()
                        continue
                    mine.append(time.perf_counter() - t0)
                    if done == 0:
                        with lock:
                            notes.append("queue ran dry")
                        stop.set()
                        break
                    with lock:
                        state["done"] += done
                spans.append((started, time.perf_counter()))
        except threading.BrokenBarrierError:
            return
        except Exception as exc:
            with lock:
                notes.append(f"worker failed: {exc}"[:200])
            stop.set()
            with contextlib.suppress(threading.BrokenBarrierError):
                barrier.abort()
        finally:
            with lock:
                latencies.extend(mine)

    workers = [threading.Thread(target=worker, daemon=True) for _ in range(threads)]
    for w in workers:
        w.start()
    try:
        with contextlib.suppress(threading.BrokenBarrierError):
            barrier.wait()
        limit = time.monotonic() + seconds + 120
        for w in workers:
            while w.is_alive() and time.monotonic() < limit:
                w.join(0.2)
    except BaseException:
        stop.set()
        with contextlib.suppress(Exception):
            barrier.abort()
        raise
    stop.set()
    if not spans:
        raise BenchError("; ".join(notes) or "no worker ran")
    elapsed = max(end for _, end in spans) - min(start for start, _ in spans)
    return Outcome(
        count=state["done"],
        seconds=elapsed,
        latencies=sorted(latencies),
        errors=state["errors"],
        note="; ".join(dict.fromkeys(notes)),
    )


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return values[min(len(values) - 1, int(q * len(values)))] * 1000


def count_queries(key: str, payload_bytes: int) -> dict[str, list[str]]:
    """The SQL each kind of request runs, through Django's test client in this process
    (same views, middleware and auth as daphne; independent of the machine's load)."""
    from django.db import connection, connections
    from django.test import Client
    from django.test.utils import CaptureQueriesContext

    client = Client(HTTP_AUTHORIZATION=f"Token {key}")
    found: dict[str, list[str]] = {}

    def run(label: str, path: str, body: Any, status: int) -> Any:
        with CaptureQueriesContext(connection) as captured:
            response = client.post(path, data=json.dumps(body), content_type="application/json")
        if response.status_code != status:
            raise BenchError(f"{label}: {response.status_code} {response.content[:200]!r}")
        found[label] = [_squeeze(q["sql"]) for q in captured.captured_queries]
        return response.json()

    run("post 1 item", f"/api/queues/{QUEUE}/items", {"payload": payload(0, payload_bytes)}, 201)
    run(
        f"post batch of {BATCH_SIZE}",
        f"/api/queues/{QUEUE}/items",
        {"items": [{"payload": payload(n, payload_bytes)} for n in range(BATCH_SIZE)]},
        201,
    )
    claimed = run("claim max=1", f"/api/queues/{QUEUE}/claim", {"max": 1}, 200)
    item_id = claimed["items"][0]["id"]
    run("result", f"/api/items/{item_id}/result", {"result": {"ok": True}}, 200)
    connections.close_all()
    return found


def _squeeze(sql: str) -> str:
    sql = re.sub(r"\s+", " ", sql)
    sql = re.sub(r"SELECT .*? FROM", "SELECT … FROM", sql, count=1)
    return sql[:150] + ("…" if len(sql) > 150 else "")


def print_queries(found: dict[str, list[str]]) -> None:
    say(
        "\n== SQL statements per request (Django test client in the bench process; the server "
        "also opens and closes a connection per request)"
    )
    for label, queries in found.items():
        say(f"   {label}: {len(queries)} statements")
        shown = queries if len(queries) <= 16 else [*queries[:12], "…", *queries[-3:]]
        for q in shown:
            say(f"     {q}")


# -- profiling (py-spy, attached to daphne for one measurement at a time) -------------------


class Profiler:
    def __init__(
        self,
        pid: int,
        out: Path,
        seconds: float,
        rate: int,
        gil: bool = False,
        subprocesses: bool = False,
    ) -> None:
        """py-spy on ``pid``; with ``gil``, only the thread holding the GIL is sampled (where
        the interpreter's time goes), else every thread, idle ones included; with
        ``subprocesses``, its child processes too (the committer process)."""
        exe = shutil.which(
            "py-spy",
            path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        )
        if exe is None:
            raise BenchError("--profile needs py-spy: .venv/bin/pip install py-spy")
        self.out = out
        self.rate = rate
        self.proc = subprocess.Popen(
            [
                exe,
                "record",
                "--pid",
                str(pid),
                "--rate",
                str(rate),
                "--threads",
                "--gil" if gil else "--idle",
                "--format",
                "raw",
                "--duration",
                str(max(1, round(seconds))),
                "--output",
                str(out),
                "--nonblocking",
                *(["--subprocesses"] if subprocesses else []),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        time.sleep(0.5)  # let it attach before the clock starts

    def finish(self) -> None:
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")
Frame = tuple[str, str, int]  # qualified function, file, line
APP_FILES = ("django/", "rest_framework/", "taskhoster/", "asgiref/")


def _lines_calling(path: Path, needle: str) -> set[int]:
    try:
        return {n for n, text in enumerate(path.read_text().splitlines(), 1) if needle in text}
    except OSError:
        return set()


def _probes() -> list[tuple[str, Callable[[list[Frame]], bool]]]:
    """Named slices of a request, matched against a sample's stack (inclusive time)."""
    fsync_lines = _lines_calling(REPO / "taskhoster" / "store.py", "os.fsync(fd)")

    def any_frame(func: str, file: str = "") -> Callable[[list[Frame]], bool]:
        pattern = re.compile(func)
        return lambda frames: any(pattern.search(fn) and file in f for fn, f, _ in frames)

    def file_fsync(frames: list[Frame]) -> bool:
        fn, _file, line = frames[-1]
        return fn.endswith("StateStore.write") and line in fsync_lines

    return [
        ("fsync of the item file (os.fsync in StateStore.write)", file_fsync),
        ("fsync of the state directory (StateStore._fsync_dir)", any_frame(r"\._fsync_dir$")),
        ("syncfs of a batch (StateStore._sync_filesystem)", any_frame(r"\._sync_filesystem$")),
        ("StateStore.write, all of it", any_frame(r"StateStore\.write$")),
        ("StateStore.move (rename)", any_frame(r"StateStore\.move$")),
        ("StateStore.read", any_frame(r"StateStore\.read$")),
        (
            "DB: open a connection (per request thread)",
            any_frame(r"\.(connect|get_new_connection)$", "django/db/backends/"),
        ),
        (
            "DB: close the connection (request end)",
            any_frame(r"\._close$|\.close$", "django/db/backends/base/base.py"),
        ),
        ("DB: COMMIT", any_frame(r"\._commit$", "django/db/backends/")),
        (
            "DB: executing queries",
            any_frame(r"\._execute$|\._executemany$", "django/db/backends/utils.py"),
        ),
        (
            "auth: key lookup (keys.authenticate)",
            any_frame(r"(^|\.)authenticate$", "taskhoster/keys.py"),
        ),
        ("view: _item_queue_name lookup", any_frame(r"_item_queue_name$")),
        ("metrics.maybe_flush", any_frame(r"maybe_flush$", "taskhoster/metrics.py")),
        ("engine.post_items", any_frame(r"(^|\.)post_items$", "engine/posting.py")),
        ("engine.claim", any_frame(r"(^|\.)claim$", "engine/claiming.py")),
        ("engine.submit_result", any_frame(r"(^|\.)submit_result$", "engine/verdicts.py")),
        ("request parsing + validation (validated)", any_frame(r"(^|\.)validated$")),
        (
            "response: item_to_wire + JSON render",
            any_frame(r"(^|\.)item_to_wire$|JSONRenderer\.render$"),
        ),
    ]


def _parse_frame(text: str) -> Frame:
    match = FRAME.match(text.strip())
    if not match:
        return text.strip(), "", 0
    return match["func"], match["file"], int(match["line"] or 0)


def collapsed_stacks(path: Path) -> Iterator[tuple[str, list[Frame], int]]:
    """(thread, frames from the root, samples) for each line of a py-spy collapsed file."""
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        thread, *rest = stack.split(";")
        frames = [_parse_frame(f) for f in rest]
        if frames:
            yield thread, frames, int(count_text)


def _short(path: str) -> str:
    for marker in ("site-packages/", "lib/python3.11/", "lib/python3"):
        if marker in path:
            return path.split(marker, 1)[1]
    with contextlib.suppress(ValueError):
        return str(Path(path).relative_to(REPO))
    return path


def summarize_profile(path: Path, rate: int, ops: int, what: str) -> dict[str, Any]:
    """Where daphne's time went during one measurement, in milliseconds per operation.

    Django runs each request's sync code in a thread of its own (its ASGI handler opens a
    ThreadSensitiveContext per request), so the "request threads" are all threads but the
    main one; the main thread is daphne's reactor (HTTP parsing, asyncio, thread hand-offs).
    """
    if not path.exists():
        return {"what": what, "error": "py-spy wrote no profile"}
    ms = 1000 / rate / max(ops, 1)
    probes = _probes()
    main_busy = 0
    main_leaves: Counter[str] = Counter()
    req_busy = 0
    probe_hits: Counter[str] = Counter()
    functions: Counter[str] = Counter()
    leaves: Counter[str] = Counter()
    for thread, frames, count in collapsed_stacks(path):
        leaf = frames[-1]
        leaf_key = f"{leaf[0]} ({_short(leaf[1])}:{leaf[2]})"
        if thread.endswith("MainThread"):
            if not leaf[0].endswith("Selector.select"):
                main_busy += count
                main_leaves[leaf_key] += count
            continue
        if not any(marker in f for _, f, _ in frames for marker in APP_FILES):
            continue  # an executor thread idling before it exits
        req_busy += count
        leaves[leaf_key] += count
        for label, matches in probes:
            if matches(frames):
                probe_hits[label] += count
        for key in dict.fromkeys(f"{fn} ({_short(f)})" for fn, f, _ in frames):
            functions[key] += count
    return {
        "what": what,
        "ops": ops,
        "request_threads_ms_per_op": req_busy * ms,
        "reactor_busy_ms_per_op": main_busy * ms,
        "probes_ms_per_op": {k: round(v * ms, 3) for k, v in probe_hits.most_common()},
        "top_functions_ms_per_op": {
            k: round(v * ms, 3) for k, v in functions.most_common(80) if v < 0.9 * req_busy
        },
        "top_leaves_ms_per_op": {k: round(v * ms, 3) for k, v in leaves.most_common(12)},
        "reactor_top_leaves_ms_per_op": {
            k: round(v * ms, 3) for k, v in main_leaves.most_common(6)
        },
    }


def print_profile(report: dict[str, Any]) -> None:
    say(f"\n== profile: {report.get('what')}")
    if "error" in report:
        say(f"   {report['error']}")
        return
    say(
        f"   request threads {report['request_threads_ms_per_op']:.2f} ms per op; "
        f"daphne's reactor thread busy {report['reactor_busy_ms_per_op']:.2f} ms per op "
        f"({report['ops']} ops; wall time includes waiting on disk and locks)"
    )
    sections = [
        ("named slices (inclusive)", "probes_ms_per_op", 30),
        ("top functions (inclusive)", "top_functions_ms_per_op", 25),
        ("top leaf lines, request threads (self)", "top_leaves_ms_per_op", 12),
        ("top leaf lines, reactor thread (self)", "reactor_top_leaves_ms_per_op", 6),
    ]
    for title, key, limit in sections:
        say(f"   {title}, ms per op:")
        for k, v in list(report[key].items())[:limit]:
            say(f"     {v:7.3f}  {k}")


# -- the run -------------------------------------------------------------------------------


class ThreadCPU:
    """CPU time (user + system, from ``/proc``) spent by each thread of some processes and of
    their child processes between ``start`` and ``stop``, summed by the thread's name (the
    server names its threads: ``th-committer``, ``th-from-committer``...; a process's
    first thread is named after its program). What a per-item cost breakdown needs without
    a sampler slowing what it measures."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids  # a label for each process, e.g. {"daphne": pid, "worker 1": pid}
        self.before: dict[tuple[str, str], float] = {}
        self.spent: dict[tuple[str, str], float] = {}
        self.system: dict[tuple[str, str], float] = {}  # the system part of ``spent``

    def _sample(self) -> dict[tuple[str, str], float]:
        """User + system seconds by (process label, thread name); the system part under the
        key (label, name + "\0sys")."""
        found: dict[tuple[str, str], float] = defaultdict(float)
        tick = os.sysconf("SC_CLK_TCK")
        for label, pid in self.pids.items():
            for proc_pid, proc_label in [
                (pid, label),
                *((c, f"{label} child") for c in _children(pid)),
            ]:
                with contextlib.suppress(OSError):
                    for tid in os.listdir(f"/proc/{proc_pid}/task"):
                        with contextlib.suppress(OSError, ValueError, IndexError):
                            text = Path(f"/proc/{proc_pid}/task/{tid}/stat").read_text()
                            name = text[text.index("(") + 1 : text.rindex(")")]
                            fields = text.rsplit(")", 1)[1].split()
                            found[(proc_label, name)] += (int(fields[11]) + int(fields[12])) / tick
                            found[(proc_label, name + "\0sys")] += int(fields[12]) / tick
        return found

    def start(self) -> None:
        self.before = self._sample()

    def stop(self) -> None:
        after = self._sample()
        spent = {k: v - self.before.get(k, 0.0) for k, v in after.items()}
        self.spent = {k: v for k, v in spent.items() if not k[1].endswith("\0sys")}
        self.system = {(k[0], k[1][:-4]): v for k, v in spent.items() if k[1].endswith("\0sys")}

    def table(self, units: int, unit: str = "item", client_seconds: float | None = None) -> str:
        """Microseconds per ``unit`` by process and thread (threads under 1 µs left out), and
        the system part of each."""
        rows = [(k, v / units * 1e6) for k, v in self.spent.items() if v / units * 1e6 >= 1]
        if client_seconds is not None:
            rows.append((("this client", "all threads"), client_seconds / units * 1e6))
        rows.sort(key=lambda r: (r[0][0], -r[1]))
        total = sum(v for _k, v in rows)
        system = sum(self.system.get(k, 0.0) for k, _v in rows) / units * 1e6
        lines = [
            f"  CPU per {unit} (user + system), µs: {total:,.0f} in all ({system:,.0f} system)"
        ]
        lines += [
            f"    {label:20} {name:24} {value:8.0f}"
            + (
                f"  ({self.system[(label, name)] / units * 1e6:,.0f} system)"
                if (label, name) in self.system
                else ""
            )
            for (label, name), value in rows
        ]
        return "\n".join(lines)


def _children(pid: int) -> list[int]:
    found: list[int] = []
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                found += [
                    int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()
                ]
    return found


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def measure_once(
    args: argparse.Namespace,
    env: Environment,
    key: str,
    server: Daphne,
    waiting: int,
    name: str,
    run: int,
) -> tuple[Row, dict[str, Any] | None]:
    from django.db import connections

    what, threads, unit_name = MEASUREMENTS[name]
    op, unit, requests_per_op = make_op(name, args.payload_bytes)
    cap = args.max_items
    if name.startswith("claim"):
        # Claims consume the waiting items: stop at half, so "N waiting" stays >= N/2.
        cap = min(cap, max(1, waiting // 2))
    start_waiting = pending_count()
    marker = f"{time.time_ns() // 1000:014x}"  # every item posted from now on sorts after it
    connections.close_all()  # no connection of ours stays open while measuring
    profiler = None
    if args.profile and server.proc:
        out = args.profile / f"{env.label}-{waiting}-{name}-{run}.txt"
        profiler = Profiler(server.proc.pid, out, args.seconds, args.profile_rate)
    cpu = ThreadCPU({"daphne": server.proc.pid}) if args.cpu and server.proc else None
    client_before = time.process_time()
    if cpu:
        cpu.start()
    try:
        outcome = run_load(
            server.url,
            key,
            op,
            threads=threads,
            seconds=args.seconds,
            cap=cap,
            unit=unit,
            warmup=args.warmup,
            open_client=client_of(name),
        )
    finally:
        if cpu:
            cpu.stop()
        if profiler:
            profiler.finish()
    client_seconds = time.process_time() - client_before
    end_waiting = pending_count()
    ops = outcome.count // unit
    row = Row(
        database=env.label,
        waiting=start_waiting,
        waiting_end=end_waiting,
        what=what,
        name=name,
        unit=unit_name,
        count=outcome.count,
        seconds=round(outcome.seconds, 3),
        per_second=round(outcome.count / outcome.seconds, 1) if outcome.seconds else 0.0,
        requests=ops * requests_per_op,
        p50_ms=round(percentile(outcome.latencies, 0.50), 2),
        p99_ms=round(percentile(outcome.latencies, 0.99), 2),
        errors=outcome.errors,
        note=outcome.note,
    )
    if cpu and outcome.count:
        # (The warm-up operations are in the clients' and the server's time too: a few
        # against thousands.)
        say(f"{env.label}, {waiting:,} waiting, {what}:")
        say(cpu.table(outcome.count, unit_name.rstrip("s"), client_seconds))
    report = None
    if profiler:
        report = summarize_profile(
            profiler.out, args.profile_rate, ops, f"{env.label}, {waiting:,} waiting, {what}"
        )
    # Put the queue back to exactly N waiting for the next measurement.
    if name.startswith("claim"):
        drop_claimed()
        fill_to(waiting, args.payload_bytes)
    elif name not in READS:
        drop_posted_since(marker)
    connections.close_all()
    settle_disk()
    return row, report


def measure_all(
    args: argparse.Namespace,
    env: Environment,
    key: str,
    server: Daphne,
    rows: list[Row],
    runs: list[Row],
    profiles: list[dict[str, Any]],
) -> None:
    for waiting in args.waiting:
        added, took = fill_to(waiting, args.payload_bytes)
        analyze_database()
        synced = settle_disk()
        say(
            f"[{env.label}] {waiting:,} waiting (prefilled {added:,} in {took:.1f} s, "
            f"then sync {synced:.1f} s)"
        )
        if args.explain:
            say(f"   claim plan: {claim_plan()}")
        for name in args.only:
            mine: list[Row] = []
            for run in range(args.repeat):
                row, report = measure_once(args, env, key, server, waiting, name, run)
                mine.append(row)
                say("   " + format_row(row))
                if report is not None:
                    profiles.append(report)
                    print_profile(report)
            runs.extend(mine)
            ranked = sorted(mine, key=lambda r: r.per_second)
            median = ranked[len(ranked) // 2]
            if len(mine) > 1:
                low, high = ranked[0].per_second, ranked[-1].per_second
                spread = f"median of {len(mine)}: {low:g}-{high:g}/s"
                median = Row(
                    **{**asdict(median), "note": "; ".join(x for x in (spread, median.note) if x)}
                )
            rows.append(median)


HEADER = (
    f"{'database':<10} {'waiting':>9} {'what':<36} {'count':>7} {'seconds':>7} "
    f"{'per second':>10} {'p50 ms':>7} {'p99 ms':>7} {'errors':>6}"
)


def format_row(r: Row) -> str:
    waiting = f"{r.waiting:,}"
    what = f"{r.what} ({'items' if r.unit == 'items' else 'trips'})"
    text = (
        f"{r.database:<10} {waiting:>9} {what:<36} {r.count:>7} {r.seconds:>7.2f} "
        f"{r.per_second:>10.1f} {r.p50_ms:>7.2f} {r.p99_ms:>7.2f} {r.errors:>6}"
    )
    return text + (f"  [{r.note}]" if r.note else "")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--waiting",
        default="1000,100000",
        help="comma-separated counts of items waiting in the queue",
    )
    parser.add_argument("--seconds", type=float, default=5.0, help="per measurement")
    parser.add_argument(
        "--fsync",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="fsync in the server (default on, as in production)",
    )
    parser.add_argument(
        "--database-url",
        help="a local PostgreSQL URL to create (and drop) a bench database "
        "from, e.g. postgres://postgres@127.0.0.1:5432/postgres; "
        "default: a fresh SQLite file",
    )
    parser.add_argument(
        "--only",
        default=",".join(MEASUREMENTS),
        help=f"measurements to run, of: {', '.join(MEASUREMENTS)}",
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run each measurement this many times and report the median run",
    )
    parser.add_argument(
        "--max-items",
        type=int,
        default=50_000,
        help="cap on items (or round trips) per measurement",
    )
    parser.add_argument("--payload-bytes", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=3, help="untimed ops per client first")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--profile",
        type=Path,
        help="attach py-spy to daphne during each measurement; write raw "
        "profiles to this directory and print where the time goes (figures "
        "of a profiled run are slowed by the sampler)",
    )
    parser.add_argument("--profile-rate", type=int, default=250, help="py-spy samples/s")
    parser.add_argument(
        "--cpu",
        action="store_true",
        help="print each measurement's CPU per unit by process and thread (daphne, its "
        "committer process, this client), read from /proc: no sampler slows the run",
    )
    parser.add_argument(
        "--explain",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="print the claim query's plan at each waiting count",
    )
    parser.add_argument(
        "--hold-db-connection",
        action="store_true",
        help="SQLite: keep one idle connection to the database open in this "
        "process while measuring (what an always-connected process would do: "
        "the server's per-request connections then never close the last "
        "connection, so SQLite does not checkpoint and drop the WAL each time)",
    )
    parser.add_argument(
        "--experiment",
        choices=["none", "reuse-threads"],
        default="none",
        help="reuse-threads: serve through bench.core:reuse_threads_application "
        "(a few long-lived request threads with persistent SQLite connections "
        "instead of a new thread and connection per request); NOT the app as "
        "shipped, only to size a suggested fix",
    )
    parser.add_argument(
        "--count-queries",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="at the end, list the SQL each kind of request runs",
    )
    parser.add_argument("--tmpdir", help="where to create the run's temp dir")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (logs, state)")
    args = parser.parse_args(argv)
    try:
        args.waiting = sorted({int(x.replace("_", "")) for x in args.waiting.split(",") if x})
    except ValueError:
        parser.error("--waiting takes integers, e.g. 1000,100000")
    if not args.waiting or any(not 0 < n <= MAX_WAITING for n in args.waiting):
        parser.error(f"--waiting counts must be 1..{MAX_WAITING:,}")
    args.only = [x.strip() for x in args.only.split(",") if x.strip()]
    unknown = [x for x in args.only if x not in MEASUREMENTS]
    if unknown or not args.only:
        parser.error(f"--only takes some of {', '.join(MEASUREMENTS)}")
    if not 0 < args.seconds <= 600:
        parser.error("--seconds must be in (0, 600]")
    if not 1 <= args.repeat <= 20:
        parser.error("--repeat must be 1..20")
    if not 0 < args.max_items <= 1_000_000:
        parser.error("--max-items must be 1..1,000,000")
    if not 0 <= args.payload_bytes <= 100_000:
        parser.error("--payload-bytes must be 0..100000")
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    return args


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def running(args: argparse.Namespace) -> Iterator[tuple[Environment, Daphne]]:
    env: Environment | None = None
    server: Daphne | None = None
    try:
        env = make_environment(args)
        migrate(env)
        setup_django(env)
        app = REUSE_THREADS_APP if args.experiment == "reuse-threads" else ASGI_APP
        server = Daphne(env, fsync=args.fsync, app=app)
        yield env, server
    finally:
        if server is not None:
            server.stop()
        if env is not None:
            destroy_environment(env, keep=args.keep)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Ctrl-C and SIGTERM both unwind through the clean-up (SIGINT explicitly: a shell may
    # have started us with it ignored).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)
    rows: list[Row] = []
    runs: list[Row] = []
    profiles: list[dict[str, Any]] = []
    meta: dict[str, Any] = {}
    try:
        with running(args) as (env, server), contextlib.ExitStack() as stack:
            from taskhoster import engine
            from taskhoster.keys import create_key

            engine.upsert_queue(name=QUEUE, body={})
            key = create_key(name="bench", scopes=["produce", "work", "manage"])[1]
            meta = {
                "database": env.label,
                "fsync": args.fsync,
                "seconds": args.seconds,
                "payload_bytes": args.payload_bytes,
                "python": platform.python_version(),
                "cpus": os.cpu_count(),
                "filesystem": filesystem_of(env.root),
                "fsync_probe_ms": round(fsync_probe(env.root), 3),
                "load_before": load_average(),
                "profiled": bool(args.profile),
                "experiment": args.experiment,
                "held_db_connection": False,
            }
            say(
                f"[{env.label}] state root {env.root} ({meta['filesystem']}); "
                f"write+fsync+dir fsync ~ {meta['fsync_probe_ms']:.2f} ms; "
                f"load average {meta['load_before']}; {meta['cpus']} CPUs"
            )
            if args.hold_db_connection and env.label == "sqlite":
                holder = sqlite3.connect(env.database_url.removeprefix("sqlite:///"))
                holder.execute("SELECT count(*) FROM sqlite_master").fetchall()
                meta["held_db_connection"] = True
                stack.callback(holder.close)
            server.start()
            say(f"[{env.label}] daphne on {server.url} (fsync {'on' if args.fsync else 'off'})")
            say("   " + HEADER)
            measure_all(args, env, key, server, rows, runs, profiles)
            if args.count_queries:
                meta["queries"] = count_queries(key, args.payload_bytes)
                print_queries(meta["queries"])
            meta["load_after"] = load_average()
    except KeyboardInterrupt:
        say("interrupted; cleaned up")
        return 130
    except BenchError as exc:
        say(f"error: {exc}")
        return 1
    print(
        f"\nTaskhoster core benchmark: {meta.get('database')}, fsync "
        f"{'on' if args.fsync else 'off'}, {args.seconds:g} s per measurement"
        f"{f' (median of {args.repeat} runs)' if args.repeat > 1 else ''}, "
        f"load average {meta.get('load_before')} -> {meta.get('load_after')}"
        + (" (PROFILED: slowed by py-spy)" if args.profile else "")
        + (f" (EXPERIMENT {args.experiment})" if args.experiment != "none" else "")
        + (" (an idle SQLite connection held open)" if meta.get("held_db_connection") else "")
    )
    print(HEADER)
    for row in rows:
        print(format_row(row))
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "meta": meta,
                    "results": [asdict(r) for r in rows],
                    "runs": [asdict(r) for r in runs],
                    "profiles": profiles,
                },
                indent=2,
            )
        )
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
