"""Taskhoster as a peer of the shared peer task-queue benchmark (../shared/peers).

A benchmark, not a test. It runs the shared harness's phases (``common.run_phases``: batch
enqueue, single enqueue, backlog drain, end to end, latency at a fixed rate) against a real
daphne on a free port, with a fresh database and state root (SQLite and fsync on by default,
the embedded default configuration), and writes the peers' JSON into ``BENCH_OUT``:

- enqueue = ``Producer.post`` of the Python client (``taskhoster.client``: one keep-alive
  connection, no idempotency key made up), as an application posts; batch enqueue =
  ``Producer.post_many``; with ``BENCH_CLIENT=httpx``, both are requests written by hand on
  one keep-alive httpx connection (the harness before 2026-12-06); purge = delete the
  queue's pending items;
- W (``BENCH_W``) worker processes, one ``/work`` socket each (capacity 16, and the socket's
  optional ``batch`` of 16 unless ``BENCH_SOCKET_BATCH=1``), call ``common.record(payload)``
  for each item pushed and answer it with a result at once (the results of one ``items``
  frame in one ``results`` frame);
- "completed" = the queue has nothing pending or processing (``GET /api/queues/bench``).

::

    BENCH_N=2000 .venv/bin/python bench/peer_taskhoster.py
    python3 ../shared/peers/report.py /tmp/peers-results
    bench/peers.sh 1      # with beanstalkd-binlog-f0 and huey-sqlite, interleaved by rounds

See bench/README.md.
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
import ctypes
import importlib.util
import json
import select
import signal
import subprocess
import time
import traceback
from collections import Counter
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit

import httpx

from bench.core import (
    ASGI_APP,
    JSON_HEADERS,
    LOCAL_HOSTS,
    QUEUE,
    REPO,
    BenchError,
    Daphne,
    Environment,
    destroy_environment,
    expect,
    make_client,
    make_environment,
    migrate,
    say,
    setup_django,
)
from bench.work_socket import FRAME_BATCH, WorkerProcess, work

PEERS_DIR = REPO.parent / "shared" / "peers"
PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Runs in a child before exec: the kernel sends it SIGTERM when the bench process dies,
    even by SIGKILL (``timeout -k``), so no daphne or worker outlives a run."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class GuardedDaphne(Daphne):
    """bench.core's Daphne (own session, log file, /healthz wait), stopped with the bench."""

    def start(self) -> GuardedDaphne:
        argv = [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(self.port)]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [*argv, *self.extra_args, self.app],
                cwd=REPO,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        deadline = time.monotonic() + 60
        with httpx.Client(trust_env=False, timeout=2) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise BenchError(f"daphne exited: {self.log.read_text()[-2000:]}")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{self.url}/healthz").status_code == 200:
                        return self
                time.sleep(0.1)
        raise BenchError("daphne did not answer /healthz within 60 s")


def start_server(
    args: argparse.Namespace, env: Environment
) -> tuple[GuardedDaphne, str, dict[str, Any]]:
    """Start daphne, create the queue over HTTP and return the server, a full-scope key and
    a description of the configuration."""
    from django.db import connections

    from taskhoster.keys import create_key

    key = create_key(name="bench", scopes=["produce", "work", "manage"])[1]
    connections.close_all()
    server = GuardedDaphne(
        env, fsync=args.fsync, app=ASGI_APP, extra_args=("--websocket_timeout", "-1")
    )
    if args.redis_url:
        server.env["REDIS_URL"] = args.redis_url
    try:
        server.start()
        with make_client(server.url, key) as client:
            expect(client.put(f"/api/queues/{QUEUE}", content=b"{}", headers=JSON_HEADERS), 201)
    except BaseException:
        server.stop()
        raise
    info = {
        "database": env.label,
        "redis": bool(args.redis_url),
        "fsync": args.fsync,
        "daphne_pid": server.proc.pid if server.proc else None,
        "url": server.url,
    }
    return server, key, info


# -- the peer's operations -------------------------------------------------------------------


class Ops:
    """The harness's producer side: the Python producer (or, with ``BENCH_CLIENT=httpx``,
    requests written by hand on httpx); purge and counts on httpx."""

    def __init__(self, url: str, key: str, queue: str = QUEUE) -> None:
        from taskhoster.client import Producer

        self.client = make_client(url, key)
        by_hand = os.environ.get("BENCH_CLIENT", "producer") == "httpx"
        self.producer = None if by_hand else Producer(url, key, auto_key=False, retries=0)
        self.queue = queue
        self.items_url = f"/api/queues/{queue}/items"
        self.queue_url = f"/api/queues/{queue}"
        self.phase = "setup"  # the last phase posted to: named when a run is aborted

    def enqueue(self, payload: dict[str, Any]) -> None:
        self.phase = str(payload.get("ph"))
        if self.producer is not None:
            self.producer.post(self.queue, payload)
            return
        body = json.dumps({"payload": payload})
        expect(self.client.post(self.items_url, content=body, headers=JSON_HEADERS), 201)

    def enqueue_batch(self, payloads: list[dict[str, Any]]) -> None:
        self.phase = str(payloads[0].get("ph")) if payloads else self.phase
        if self.producer is not None:
            self.producer.post_many(self.queue, payloads)
            return
        body = json.dumps({"items": [{"payload": p} for p in payloads]})
        expect(self.client.post(self.items_url, content=body, headers=JSON_HEADERS), 201)

    def purge(self) -> None:
        body = json.dumps({"status": "pending"})
        expect(
            self.client.post(f"{self.items_url}/delete", content=body, headers=JSON_HEADERS), 200
        )

    def counts(self) -> dict[str, int]:
        return dict(expect(self.client.get(self.queue_url), 200).json()["counts"])

    def done_extra(self, phase: str) -> Any:
        self.phase = phase

        def drained() -> bool:
            counts = self.counts()
            return counts.get("pending", 0) == 0 and counts.get("processing", 0) == 0

        return drained

    def close(self) -> None:
        self.client.close()
        if self.producer is not None:
            self.producer.close()


# -- the worker processes ------------------------------------------------------------------


class PeerWorker(WorkerProcess):
    """``peer_taskhoster.py --worker URL``: one /work socket in a process of its own, on the
    project venv's python (it needs websockets); stops when its stdin closes."""

    def __init__(self, url: str, key: str, recdir: Path, peers_dir: Path, log: Path) -> None:
        env = dict(os.environ, BENCH_KEY=key, BENCH_REC_DIR=str(recdir), PYTHONPATH=str(REPO))
        argv = [sys.executable, os.path.abspath(__file__), "--worker", url]
        with open(log, "ab") as err:
            self.proc = subprocess.Popen(
                [*argv, "--peers-dir", str(peers_dir)],
                cwd=REPO,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )

    def wait_ready(self, timeout: float = 30.0) -> None:
        assert self.proc.stdout is not None
        readable, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not readable:
            raise BenchError(f"worker pid {self.proc.pid} did not subscribe within {timeout:g} s")
        super().wait_ready()


def worker_main(args: argparse.Namespace) -> int:
    """One socket; each item is recorded with ``common.record(payload)`` and answered with a
    result at once (acks come back later, in order). Reconnects if the server drops it."""
    common = import_common(args.peers_dir)
    key = os.environ["BENCH_KEY"]

    def on_item(frame: dict[str, Any], arrived: float) -> None:
        common.record(frame["payload"])

    async def run() -> Counter[str]:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        loop.add_signal_handler(signal.SIGINT, stop.set)

        def stdin_closed() -> None:
            sys.stdin.read()
            stop.set()

        loop.add_reader(sys.stdin.fileno(), stdin_closed)
        said: list[bool] = []

        def ready() -> None:
            if not said:
                said.append(True)
                print("ready", flush=True)

        seen: Counter[str] = Counter()
        while not stop.is_set():
            try:
                seen.update(await work(args.worker, key, on_item=on_item, stop=stop, ready=ready))
            except Exception as exc:  # refused or dropped while connecting: try again
                seen[f"connect_error:{type(exc).__name__}"] += 1
            if stop.is_set():
                break
            seen["reconnects"] += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)
        return seen

    seen = asyncio.run(run())
    print(json.dumps(dict(seen)), flush=True)
    return 0


# -- resident memory, as the other peers record it -----------------------------------------


def tree_hwm(common: ModuleType, pid: int) -> dict[str, Any] | None:
    """``common.tree_hwm_mb`` (needs psutil); without psutil, the same sum over /proc."""
    if importlib.util.find_spec("psutil") is not None:
        result: dict[str, Any] | None = common.tree_hwm_mb(pid)
        return result
    pids, frontier = [pid], [pid]
    while frontier:
        parent = frontier.pop()
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{parent}/task"):
                with open(f"/proc/{parent}/task/{task}/children") as fh:
                    kids = [int(k) for k in fh.read().split()]
                pids += kids
                frontier += kids
    values = [v for v in (common.hwm_kb(p) for p in pids) if v]
    if not values:
        return None
    return {
        "procs": len(values),
        "sum_mb": round(sum(values) / 1024.0, 1),
        "max_mb": round(max(values) / 1024.0, 1),
    }


def combine_hwm(parts: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    found = [p for p in parts if p]
    if not found:
        return None
    return {
        "procs": sum(p["procs"] for p in found),
        "sum_mb": round(sum(p["sum_mb"] for p in found), 1),
        "max_mb": max(p["max_mb"] for p in found),
    }


# -- the run ---------------------------------------------------------------------------------


def import_common(peers_dir: Path) -> ModuleType:
    if not (peers_dir / "common.py").is_file():
        raise SystemExit(f"no common.py in {peers_dir}: give --peers-dir")
    sys.path.insert(0, str(peers_dir))
    import common  # type: ignore[import-not-found]

    return common


def peer_name(args: argparse.Namespace) -> str:
    name = "taskhoster-" + ("pg" if args.database_url else "sqlite")
    return name + ("-redis" if args.redis_url else "") + ("" if args.fsync else "-nofsync")


def describe(args: argparse.Namespace) -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        text = f"taskhoster {version('taskhoster')}"
    except PackageNotFoundError:
        text = "taskhoster"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        head = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        changed = subprocess.run(
            ["git", "-C", str(REPO), "diff", "--quiet", "HEAD", "--", "taskhoster", "project"],
            capture_output=True,
            timeout=10,
            check=False,
        ).returncode
        text += f" (git {head}{' + uncommitted changes' if changed else ''})"
    store = "PostgreSQL index" if args.database_url else "SQLite index"
    if args.redis_url:
        store += " + Redis (channel layer, news bus)"
    if args.fsync:
        durable = (
            "fsync on: a post is answered after its file and directory entry are flushed, a "
            "result after its done/ file is"
        )
    else:
        durable = "fsync off: a power cut may lose acknowledged posts"
    return {
        "version": text,
        "durability": f"one JSON file per item under a state root, {store}; {durable}; "
        f"socket push = lease (60 s), result = ack (at-least-once); workers take up to "
        f"{FRAME_BATCH} items per frame and send their results as many per frame",
        "server_argv": f"daphne --websocket_timeout -1 {ASGI_APP} (no sweep)",
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--peers-dir",
        type=Path,
        default=PEERS_DIR,
        help=f"the shared peer benchmark (its common.py); default {PEERS_DIR}",
    )
    parser.add_argument(
        "--fsync",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="fsync in the server (default on, as in production)",
    )
    parser.add_argument(
        "--database-url",
        help="a local PostgreSQL admin URL to create (and drop) a bench database from; "
        "default: a fresh SQLite file",
    )
    parser.add_argument(
        "--redis-url", help="give the server REDIS_URL, e.g. redis://127.0.0.1:6379/0"
    )
    parser.add_argument(
        "--tmpdir", help="where the run's temp dir goes (default: the peer's BENCH_DATA dir)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (logs, state)")
    parser.add_argument("--worker", metavar="URL", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.peers_dir = args.peers_dir.resolve()
    if args.redis_url and urlsplit(args.redis_url).hostname not in LOCAL_HOSTS:
        parser.error("this benchmark only talks to 127.0.0.1: use a local Redis")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)
    common = import_common(args.peers_dir)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    common.install_sigterm_exit()  # SIGTERM (e.g. from `timeout`) unwinds through finally
    peer = peer_name(args)
    c = common.cfg()
    data = Path(common.fresh_dir(peer))
    recdir = data / "rec"
    args.tmpdir = args.tmpdir or str(data)
    result: dict[str, Any] = {"config": dict(c), **describe(args)}
    env: Environment | None = None
    server: GuardedDaphne | None = None
    ops: Ops | None = None
    workers: list[PeerWorker] = []
    status = 0
    try:
        env = make_environment(args)
        migrate(env)
        setup_django(env)
        server, key, result["server"] = start_server(args, env)
        say(f"[{peer}] daphne on {server.url}; data in {data}; N={c['n']} W={c['workers']}")
        ops = Ops(server.url, key)

        def start_workers() -> list[int]:
            for i in range(c["workers"]):
                workers.append(
                    PeerWorker(server.url, key, recdir, args.peers_dir, data / f"worker{i}.log")
                )
            for w in workers:
                w.wait_ready()
            return [w.proc.pid for w in workers]

        common.run_phases(peer, ops, c, str(recdir), start_workers, result)
    except BaseException as exc:  # a failure, Ctrl-C or SIGTERM: still write what we have
        status = exc.code if isinstance(exc, SystemExit) and isinstance(exc.code, int) else 1
        status = 130 if isinstance(exc, KeyboardInterrupt) else status
        phase = ops.phase if ops is not None else "setup"
        result["aborted"] = {"phase": phase, "error": f"{type(exc).__name__}: {exc}"[:500]}
        result["timeouts"] = [*result.get("timeouts", []), f"aborted:{phase}"]
        say(f"[{peer}] aborted in phase {phase}: {type(exc).__name__}: {exc}")
        if not isinstance(exc, (KeyboardInterrupt, SystemExit, BenchError)):
            traceback.print_exc()
        if env is not None and not isinstance(exc, (KeyboardInterrupt, SystemExit)):
            with contextlib.suppress(OSError):
                say((env.tmp / "daphne.log").read_text()[-3000:])
    finally:
        # No second signal may cut the clean-up short.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        result["rss_workers"] = combine_hwm([tree_hwm(common, w.proc.pid) for w in workers])
        if server is not None and server.proc is not None:
            result["rss_broker"] = tree_hwm(common, server.proc.pid)
        result["worker_frames"] = [w.finish() for w in workers]
        for w in workers:
            w.kill()
        if ops is not None:
            ops.close()
        if server is not None:
            server.stop()
        if env is not None:
            destroy_environment(env, keep=args.keep)
    common.write_result(peer, result)
    return status


if __name__ == "__main__":
    sys.exit(main())
