"""Push latency and end-to-end throughput of Taskhoster's ``/work`` socket (issue 4).

A benchmark, not a test. It starts a real daphne subprocess (``--websocket_timeout -1``)
against a fresh database and state root, with fsync on by default, and measures:

- ``latency``: one worker socket (capacity 16) in this process answers each item at once; a
  producer posts single items over keep-alive HTTP, paced at ``--rate`` per second, for
  ``--seconds``. Latency is the moment the item frame arrives minus the moment just before
  its POST was sent.
- ``throughput``: two worker processes (one socket each, capacity 16, answering at once);
  ``--items`` items are posted in batches of 500 as fast as the server takes them; the clock
  runs from the first post until ``GET /api/queues/bench`` shows them all finished.

::

    .venv/bin/python bench/work_socket.py
    .venv/bin/python bench/work_socket.py \
        --database-url postgres://postgres@127.0.0.1:5432/postgres \
        --redis-url redis://127.0.0.1:6379/0

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
import json
import signal
import subprocess
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from bench.core import (
    APP_FILES,
    ASGI_APP,
    JSON_HEADERS,
    LOCAL_HOSTS,
    QUEUE,
    REPO,
    BenchError,
    Daphne,
    Environment,
    Profiler,
    _interrupt,
    _short,
    collapsed_stacks,
    destroy_environment,
    expect,
    filesystem_of,
    fsync_probe,
    load_average,
    make_client,
    make_environment,
    migrate,
    percentile,
    print_profile,
    say,
    setup_django,
    summarize_profile,
)

CAPACITY = 16
# Items per pushed frame the bench's workers ask for (the subscribe frame's optional
# ``batch``), and so results per frame they send back (``results``): 1 is one frame per
# item each way, as a worker that uses neither extension gets.
FRAME_BATCH = int(os.environ.get("BENCH_SOCKET_BATCH", str(CAPACITY)))
LATENCY_QUEUE = "bench-latency"  # its own queue: the throughput run starts from an empty one
BATCH = 500
WORKER_PROCESSES = 2
RESULT = {"ok": True}
# The targets of the throughput work: post-to-receipt latency at 200 posts/s, and end to end.
TARGETS = {"p50_ms": 10.0, "p99_ms": 50.0, "items_per_second": 1500.0}


def ws_url(http_url: str) -> str:
    return http_url.replace("http://", "ws://", 1) + "/work"


# -- a worker socket: takes each item and answers it with a result at once -----------------


async def work(
    url: str,
    key: str,
    *,
    queue: str = QUEUE,
    on_item: Any = None,
    stop: asyncio.Event | None = None,
    ready: Any = None,
) -> Counter[str]:
    """Serve one socket until ``stop`` is set (or the server closes it)."""
    import websockets

    seen: Counter[str] = Counter()
    async with websockets.connect(
        ws_url(url),
        additional_headers={"Authorization": f"Token {key}"},
        max_size=8 * 1024 * 1024,
        ping_interval=None,
    ) as ws:
        subscribe: dict[str, Any] = {"type": "subscribe", "queues": [queue], "capacity": CAPACITY}
        if FRAME_BATCH > 1:
            subscribe["batch"] = FRAME_BATCH
        await ws.send(json.dumps(subscribe))
        if ready is not None:
            ready()

        async def close_on_stop() -> None:
            assert stop is not None
            await stop.wait()
            await ws.close()

        # One task watches ``stop``; the frames are read in a plain loop (a task and an
        # ``asyncio.wait`` per frame cost the worker as much as the frame itself).
        stopping = asyncio.ensure_future(close_on_stop()) if stop is not None else None
        try:
            async for text in ws:
                arrived = time.perf_counter()
                frame = json.loads(text)
                kind = frame.get("type")
                seen[kind] += 1
                if kind == "item":
                    if on_item is not None:
                        on_item(frame, arrived)
                    await ws.send(
                        json.dumps({"type": "result", "id": frame["id"], "result": RESULT})
                    )
                elif kind == "items":
                    items = frame["items"]
                    seen["item"] += len(items)
                    if on_item is not None:
                        for item in items:
                            on_item(item, arrived)
                    await ws.send(
                        json.dumps(
                            {
                                "type": "results",
                                "results": [{"id": i["id"], "result": RESULT} for i in items],
                            }
                        )
                    )
                elif kind == "ack" and not frame.get("accepted"):
                    seen["ack_refused"] += 1
                elif kind == "acks":
                    seen["ack"] += len(frame["acks"])
                    seen["ack_refused"] += sum(not a.get("accepted") for a in frame["acks"])
                elif kind == "error":
                    seen["error:" + str(frame.get("code"))] += 1
            if stop is None or not stop.is_set():
                seen["closed_by_server"] += 1
        except websockets.ConnectionClosed:
            if stop is None or not stop.is_set():
                seen["closed_by_server"] += 1
        finally:
            if stopping is not None:
                stopping.cancel()
    return seen


def client_worker(url: str, key: str, ready: Any, stop: asyncio.Event) -> Any:
    """The same worker written with ``taskhoster.client.Worker`` (``BENCH_WORKER=client``):
    capacity 16, ``batch`` FRAME_BATCH, a handler that returns the result at once."""
    import logging

    from taskhoster.client import Worker

    logging.getLogger("taskhoster.client").setLevel(logging.WARNING)  # a line per item
    worker = Worker(url, key, capacity=CAPACITY, batch=FRAME_BATCH, name="bench")
    seen: Counter[str] = Counter()

    @worker.handler(QUEUE)
    async def answer(job: Any) -> Any:
        seen["item"] += 1
        return RESULT

    async def run() -> Counter[str]:
        serving = asyncio.ensure_future(worker.serve())
        while not worker.connected and not serving.done():
            await asyncio.sleep(0.01)
        ready()
        await stop.wait()
        worker.stop()
        await serving
        return seen

    return run()


def worker_main(url: str) -> int:
    """``--worker URL``: one worker socket in a process of its own; the key comes from the
    environment (BENCH_KEY). Prints "ready" once subscribed and its frame counts as JSON
    when stdin closes or it is sent SIGTERM. ``BENCH_WORKER=client``: the worker is
    ``taskhoster.client.Worker`` (``client_worker``) instead of this file's own loop."""
    key = os.environ["BENCH_KEY"]

    async def run() -> Counter[str]:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        loop.add_signal_handler(signal.SIGINT, stop.set)

        def on_stdin() -> None:
            sys.stdin.read()
            stop.set()

        loop.add_reader(sys.stdin.fileno(), on_stdin)

        def ready() -> None:
            print("ready", flush=True)

        if os.environ.get("BENCH_WORKER") == "client":
            return Counter(await client_worker(url, key, ready, stop))
        return await work(url, key, stop=stop, ready=ready)

    seen = asyncio.run(run())
    print(json.dumps(dict(seen)), flush=True)
    return 0


class WorkerProcess:
    def __init__(self, url: str, key: str) -> None:
        env = dict(os.environ, BENCH_KEY=key, PYTHONPATH=str(REPO))
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", url],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )

    def wait_ready(self) -> None:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            raise BenchError(f"worker process did not start (said {line!r})")

    def finish(self) -> dict[str, int]:
        """Stop it and return its frame counts."""
        proc = self.proc
        try:  # closes its stdin: the worker stops and prints its counts
            out, _ = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self.kill()
            return {}
        with contextlib.suppress(ValueError, IndexError):
            return dict(json.loads(out.strip().splitlines()[-1]))
        return {}

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


# -- measurements ------------------------------------------------------------------------


@dataclass
class Row:
    config: str
    name: str
    what: str
    count: int
    seconds: float
    per_second: float
    p50_ms: float = float("nan")
    p99_ms: float = float("nan")
    post_p50_ms: float = float("nan")
    post_p99_ms: float = float("nan")
    max_ms: float = float("nan")
    missing: int = 0
    load_before: str = ""
    load_after: str = ""
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


class InProcessWorker:
    """A worker socket on an event loop in a thread of its own; records arrival times."""

    def __init__(self, url: str, key: str, queue: str) -> None:
        self.url, self.key, self.queue = url, key, queue
        self.arrived: dict[int, float] = {}
        self.lock = threading.Lock()
        self.loop = asyncio.new_event_loop()
        self.stop: asyncio.Event | None = None
        self.seen: Counter[str] = Counter()
        self.error: BaseException | None = None
        self.is_ready = threading.Event()
        self.thread = threading.Thread(target=self._run, name="bench-worker", daemon=True)

    def _on_item(self, frame: dict[str, Any], arrived: float) -> None:
        payload = frame.get("payload")
        if isinstance(payload, dict) and isinstance(payload.get("seq"), int):
            with self.lock:
                self.arrived[payload["seq"]] = arrived

    def _run(self) -> None:
        async def main() -> None:
            self.stop = asyncio.Event()
            self.seen = await work(
                self.url,
                self.key,
                queue=self.queue,
                on_item=self._on_item,
                stop=self.stop,
                ready=self.is_ready.set,
            )

        try:
            self.loop.run_until_complete(main())
        except BaseException as exc:  # reported by the caller
            self.error = exc
            self.is_ready.set()
        finally:
            self.loop.close()

    def start(self) -> InProcessWorker:
        self.thread.start()
        if not self.is_ready.wait(30) or self.error is not None:
            raise BenchError(f"worker socket did not start: {self.error!r}")
        return self

    def close(self) -> None:
        if self.thread.is_alive() and self.stop is not None:
            with contextlib.suppress(RuntimeError):
                self.loop.call_soon_threadsafe(self.stop.set)
            self.thread.join(10)


def wait_for(cond: Any, timeout: float, step: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(step)
    return cond()


def measure_latency(args: argparse.Namespace, url: str, key: str, config: str) -> Row:
    """Single posts paced at args.rate (open loop: post n is sent at start + n/rate, by the
    first of ``--producers`` threads that is free); latency = frame arrival - just before
    the POST."""
    items_url = f"/api/queues/{LATENCY_QUEUE}/items"
    worker = InProcessWorker(url, key, LATENCY_QUEUE).start()
    stop = threading.Event()
    sent: dict[int, float] = {}
    post_times: list[float] = []
    lock = threading.Lock()
    state = {"next": 0, "behind": 0, "errors": 0}
    notes: list[str] = []
    total = min(int(args.rate * args.seconds), args.max_items)
    interval = 1.0 / args.rate
    filler = "x" * args.payload_bytes

    def post(client: httpx.Client, n: int) -> float:
        body = json.dumps({"payload": {"seq": n, "data": filler}})
        t0 = time.perf_counter()
        with lock:
            sent[n] = t0
        expect(client.post(items_url, content=body, headers=JSON_HEADERS), 201)
        return time.perf_counter() - t0

    def producer(client: httpx.Client, started: float) -> None:
        while True:
            with lock:
                n = state["next"]
                if n >= total or state["errors"] >= 10 or stop.is_set():
                    return
                state["next"] += 1
            due = started + n * interval
            now = time.perf_counter()
            if due > now:
                stop.wait(due - now)
            elif now - due > interval:
                with lock:
                    state["behind"] += 1  # no producer was free in time: the pace slipped
            try:
                took = post(client, n)
            except Exception as exc:
                if stop.is_set():
                    return
                with lock:
                    state["errors"] += 1
                    sent.pop(n, None)
                    if len(notes) < 2:
                        notes.append(str(exc)[:200])
                continue
            with lock:
                post_times.append(took)

    clients = [make_client(url, key) for _ in range(args.producers)]
    threads: list[threading.Thread] = []
    try:
        # Warm up (connections, server caches, the dispatcher): untimed, negative seqs.
        for i, n in enumerate(range(-args.warmup, 0)):
            post(clients[i % len(clients)], n)
        wait_for(lambda: len(worker.arrived) >= args.warmup, 10)
        with lock:
            sent.clear()
        load_before = load_average()
        started = time.perf_counter() + 0.05
        threads.extend(
            threading.Thread(target=producer, args=(c, started), daemon=True) for c in clients
        )
        for t in threads:
            t.start()
        hard_stop = started + 3 * args.seconds + 10
        for t in threads:
            while t.is_alive():
                t.join(0.2)
                if time.perf_counter() > hard_stop and not stop.is_set():
                    stop.set()
                    notes.append(f"stopped posting after {3 * args.seconds + 10:g} s")
        posting = time.perf_counter() - started
        wait_for(lambda: all(n in worker.arrived for n in list(sent)), 10)
        load_after = load_average()
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        worker.close()
        for c in clients:
            c.close()
    errors, behind = state["errors"], state["behind"]
    latencies = sorted(worker.arrived[n] - t for n, t in sent.items() if n in worker.arrived)
    post_times.sort()
    missing = sum(1 for n in sent if n not in worker.arrived)
    if behind:
        notes.append(f"{behind} posts sent late (>1 interval behind; pace not kept)")
    if errors:
        notes.append(f"{errors} failed posts")
    frames = {k: v for k, v in worker.seen.items() if k not in ("item", "ack")}
    if frames:
        notes.append(f"frames {frames}")
    return Row(
        config=config,
        name="latency",
        what=f"post→item frame, {args.rate:g}/s single posts from {args.producers} "
        f"connections, 1 socket cap {CAPACITY}",
        count=len(latencies),
        seconds=round(posting, 2),
        per_second=round(len(sent) / posting, 1) if posting else 0.0,
        p50_ms=round(percentile(latencies, 0.50), 2),
        p99_ms=round(percentile(latencies, 0.99), 2),
        max_ms=round(latencies[-1] * 1000, 2) if latencies else float("nan"),
        post_p50_ms=round(percentile(post_times, 0.50), 2),
        post_p99_ms=round(percentile(post_times, 0.99), 2),
        missing=missing,
        load_before=load_before,
        load_after=load_after,
        note="; ".join(notes),
    )


def queue_counts(client: httpx.Client) -> dict[str, int]:
    return dict(expect(client.get(f"/api/queues/{QUEUE}"), 200).json()["counts"])


def measure_throughput(args: argparse.Namespace, url: str, key: str, config: str) -> Row:
    """N items in batches of 500 to two worker processes; first post to all finished."""
    items_url = f"/api/queues/{QUEUE}/items"
    workers = [WorkerProcess(url, key) for _ in range(WORKER_PROCESSES)]
    frames: list[dict[str, int]] = []
    try:
        for w in workers:
            w.wait_ready()
        with make_client(url, key) as client:
            before = queue_counts(client)
            if before.get("pending") or before.get("processing"):
                raise BenchError(f"queue not empty before the throughput run: {before}")
            target = before.get("finished", 0) + args.items
            filler = "x" * args.payload_bytes
            bodies = [
                json.dumps(
                    {
                        "items": [
                            {"payload": {"seq": n, "data": filler}}
                            for n in range(start, min(start + BATCH, args.items))
                        ]
                    }
                )
                for start in range(0, args.items, BATCH)
            ]
            load_before = load_average()
            started = time.perf_counter()
            post_times = []
            for body in bodies:
                t0 = time.perf_counter()
                expect(client.post(items_url, content=body, headers=JSON_HEADERS), 201)
                post_times.append(time.perf_counter() - t0)
            posted = time.perf_counter() - started
            deadline = started + args.timeout
            counts = queue_counts(client)
            while counts.get("finished", 0) < target and time.perf_counter() < deadline:
                time.sleep(0.1)
                counts = queue_counts(client)
            elapsed = time.perf_counter() - started
            load_after = load_average()
    finally:
        for w in workers:
            frames.append(w.finish())
    done = counts.get("finished", 0) - before.get("finished", 0)
    notes = [f"posting took {posted:.2f} s ({args.items / posted:.0f} items/s posted)"]
    if done < args.items:
        notes.append(f"TIMED OUT after {args.timeout:g} s: counts {counts}")
    if counts.get("failed"):
        notes.append(f"{counts['failed']} failed")
    per_worker = [f.get("item", 0) for f in frames]
    notes.append(f"items per worker {per_worker}")
    odd = {k: v for f in frames for k, v in f.items() if k not in ("item", "ack")}
    if odd:
        notes.append(f"frames {odd}")
    post_times.sort()
    return Row(
        config=config,
        name="throughput",
        what=f"batches of {BATCH} → {WORKER_PROCESSES} worker procs cap {CAPACITY}, end to end",
        count=done,
        seconds=round(elapsed, 2),
        per_second=round(done / elapsed, 1) if elapsed else 0.0,
        post_p50_ms=round(percentile(post_times, 0.50), 2),
        post_p99_ms=round(percentile(post_times, 0.99), 2),
        missing=args.items - done,
        load_before=load_before,
        load_after=load_after,
        note="; ".join(notes),
    )


# -- profiling: where daphne spends its time, per item -----------------------------------


def summarize_reactor(path: Path, rate: int, items: int) -> dict[str, Any]:
    """Inclusive time per function on each kind of daphne thread, in ms per item.

    The consumer and the dispatcher's pump run on daphne's main thread (the event loop);
    the engine calls (claim, submit_result) and post requests run on other threads.
    """
    ms = 1000 / rate / max(items, 1)
    groups: dict[str, Counter[str]] = {"main": Counter(), "other": Counter()}
    busy: Counter[str] = Counter()
    if not path.exists():
        return {}
    for thread, frames, count in collapsed_stacks(path):
        group = "main" if thread.endswith("MainThread") else "other"
        if group == "other" and not any(m in f for _, f, _ in frames for m in APP_FILES):
            continue  # an idle executor thread
        leaf = frames[-1][0]
        if leaf.endswith(("Selector.select", "select", "_wait_for_tstate_lock", "wait")) and (
            group == "main" or not any("taskhoster/" in f for _, f, _ in frames)
        ):
            continue  # idle
        busy[group] += count
        for key in dict.fromkeys(f"{fn} ({_short(f)})" for fn, f, _ in frames):
            groups[group][key] += count
    return {
        "main_busy_ms_per_item": round(busy["main"] * ms, 3),
        "other_busy_ms_per_item": round(busy["other"] * ms, 3),
        "main_top_ms_per_item": {k: round(v * ms, 3) for k, v in groups["main"].most_common(40)},
        "other_top_ms_per_item": {k: round(v * ms, 3) for k, v in groups["other"].most_common(40)},
    }


def print_reactor(report: dict[str, Any], limit: int) -> None:
    if not report:
        return
    say(
        f"   daphne main thread (event loop: consumer, dispatcher, HTTP) busy "
        f"{report['main_busy_ms_per_item']:.3f} ms per item; other threads busy "
        f"{report['other_busy_ms_per_item']:.3f} ms per item"
    )
    for title, key in (
        ("main thread, inclusive", "main_top_ms_per_item"),
        ("other threads, inclusive", "other_top_ms_per_item"),
    ):
        say(f"   {title}, ms per item:")
        for k, v in list(report[key].items())[:limit]:
            say(f"     {v:7.3f}  {k}")


@contextlib.contextmanager
def profiled(args: argparse.Namespace, server: Daphne, label: str, seconds: float) -> Any:
    """Attach py-spy to daphne for the block; yields a holder to fill with the item count."""
    holder: dict[str, Any] = {"items": 0}
    if not args.profile or server.proc is None:
        yield holder
        return
    out = args.profile / f"{label}.txt"
    profiler = Profiler(server.proc.pid, out, seconds, args.profile_rate)
    try:
        yield holder
    finally:
        if profiler.proc.poll() is None:
            profiler.proc.send_signal(signal.SIGINT)  # stop now and write what it has
        profiler.finish()
        profiler.kill()
    holder["core"] = summarize_profile(out, args.profile_rate, holder["items"], label)
    holder["threads"] = summarize_reactor(out, args.profile_rate, holder["items"])
    print_profile(holder["core"])
    print_reactor(holder["threads"], args.profile_top)


# -- the run -------------------------------------------------------------------------------

HEADER = (
    f"{'config':<22} {'what':<10} {'count':>6} {'secs':>6} {'per sec':>8} "
    f"{'p50 ms':>7} {'p99 ms':>7} {'max ms':>7} {'POST p50':>8} {'POST p99':>8} "
    f"{'miss':>4}  load before -> after"
)


def fmt(value: float, width: int) -> str:
    return f"{'-':>{width}}" if value != value else f"{value:>{width}.2f}"


def format_row(r: Row) -> str:
    text = (
        f"{r.config:<22} {r.name:<10} {r.count:>6} {r.seconds:>6.2f} {r.per_second:>8.1f} "
        f"{fmt(r.p50_ms, 7)} {fmt(r.p99_ms, 7)} {fmt(r.max_ms, 7)} {fmt(r.post_p50_ms, 8)} "
        f"{fmt(r.post_p99_ms, 8)} {r.missing:>4}  {r.load_before} -> {r.load_after}"
    )
    return text + (f"\n{'':<22} [{r.note}]" if r.note else "")


def verdicts(rows: list[Row]) -> list[str]:
    lines = []
    for r in rows:
        if r.name == "latency":
            lines.append(
                f"{r.config}: latency p50 {r.p50_ms:.2f} ms (target ≤ {TARGETS['p50_ms']:g}: "
                f"{'met' if r.p50_ms <= TARGETS['p50_ms'] else 'MISSED'}), p99 {r.p99_ms:.2f} ms "
                f"(target ≤ {TARGETS['p99_ms']:g}: "
                f"{'met' if r.p99_ms <= TARGETS['p99_ms'] else 'MISSED'})"
            )
        else:
            ok = r.per_second >= TARGETS["items_per_second"] and not r.missing
            lines.append(
                f"{r.config}: end to end {r.per_second:,.0f} items/s (target ≥ "
                f"{TARGETS['items_per_second']:,.0f}: {'met' if ok else 'MISSED'})"
            )
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="latency,throughput", help="latency,throughput")
    parser.add_argument("--seconds", type=float, default=10.0, help="latency: how long to post")
    parser.add_argument("--rate", type=float, default=200.0, help="latency: posts per second")
    parser.add_argument(
        "--producers",
        type=int,
        default=8,
        help="latency: keep-alive connections the paced posts are spread over (a post is "
        "sent on time by whichever is free; 1 = one sequential producer)",
    )
    parser.add_argument("--items", type=int, default=20_000, help="throughput: items to post")
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="throughput: give up after this long"
    )
    parser.add_argument("--repeat", type=int, default=1, help="run each measurement R times")
    parser.add_argument("--max-items", type=int, default=20_000, help="latency: cap on posts")
    parser.add_argument("--payload-bytes", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20, help="latency: untimed posts first")
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
        "--redis-url",
        help="give the server REDIS_URL (channel layer and news bus), e.g. "
        "redis://127.0.0.1:6379/0; default: none",
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--profile",
        type=Path,
        help="attach py-spy to daphne during each measurement, write raw stacks to this "
        "directory and print where the time goes in ms per item (slows the run)",
    )
    parser.add_argument("--profile-rate", type=int, default=200, help="py-spy samples/s")
    parser.add_argument("--profile-top", type=int, default=25, help="functions to list")
    parser.add_argument("--tmpdir", help="where to create the run's temp dir")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (logs, state)")
    parser.add_argument("--worker", metavar="URL", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return args
    args.only = [x.strip() for x in args.only.split(",") if x.strip()]
    if not args.only or set(args.only) - {"latency", "throughput"}:
        parser.error("--only takes latency and/or throughput")
    if not 0 < args.seconds <= 300:
        parser.error("--seconds must be in (0, 300]")
    if not 0 < args.rate <= 5000:
        parser.error("--rate must be in (0, 5000]")
    if not BATCH <= args.items <= 500_000:
        parser.error(f"--items must be {BATCH}..500,000")
    if not 0 < args.timeout <= 1800:
        parser.error("--timeout must be in (0, 1800]")
    if not 1 <= args.producers <= 64:
        parser.error("--producers must be 1..64")
    if not 1 <= args.repeat <= 10:
        parser.error("--repeat must be 1..10")
    if not 0 < args.max_items <= 100_000:
        parser.error("--max-items must be 1..100,000")
    if not 0 <= args.payload_bytes <= 100_000:
        parser.error("--payload-bytes must be 0..100000")
    if args.redis_url and urlsplit(args.redis_url).hostname not in LOCAL_HOSTS:
        parser.error("this benchmark only talks to 127.0.0.1: use a local Redis")
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args.worker)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)
    rows: list[Row] = []
    meta: dict[str, Any] = {"argv": [sys.executable, *sys.argv]}
    profiles: list[dict[str, Any]] = []
    env: Environment | None = None
    server: Daphne | None = None
    try:
        env = make_environment(args)
        migrate(env)
        setup_django(env)
        from taskhoster import engine
        from taskhoster.keys import create_key

        engine.upsert_queue(name=QUEUE, body={})
        engine.upsert_queue(name=LATENCY_QUEUE, body={})
        key = create_key(name="bench", scopes=["produce", "work", "manage"])[1]
        from django.db import connections

        connections.close_all()
        server = Daphne(
            env, fsync=args.fsync, app=ASGI_APP, extra_args=("--websocket_timeout", "-1")
        )
        if args.redis_url:
            server.env["REDIS_URL"] = args.redis_url
        config = env.label + ("+redis" if args.redis_url else "")
        meta.update(
            database=env.label,
            redis=bool(args.redis_url),
            fsync=args.fsync,
            cpus=os.cpu_count(),
            filesystem=filesystem_of(env.root),
            fsync_probe_ms=round(fsync_probe(env.root), 3),
            load_before=load_average(),
        )
        say(
            f"[{config}] state root {env.root} ({meta['filesystem']}); write+fsync+dir fsync "
            f"~ {meta['fsync_probe_ms']:.2f} ms; load average {meta['load_before']}; "
            f"{meta['cpus']} CPUs"
        )
        server.start()
        say(f"[{config}] daphne pid {server.proc.pid if server.proc else '?'} on {server.url}")
        say("   " + HEADER)
        for run in range(args.repeat):
            if "latency" in args.only:
                label = f"{config}-latency-{run}"
                with profiled(args, server, label, args.seconds) as prof:
                    row = measure_latency(args, server.url, key, config)
                    prof["items"] = row.count
                if "core" in prof:
                    profiles.append({"label": label, **prof})
                rows.append(row)
                say("   " + format_row(row))
            if "throughput" in args.only:
                label = f"{config}-throughput-{run}"
                with profiled(args, server, label, args.timeout) as prof:
                    row = measure_throughput(args, server.url, key, config)
                    prof["items"] = row.count
                if "core" in prof:
                    profiles.append({"label": label, **prof})
                rows.append(row)
                say("   " + format_row(row))
        meta["load_after"] = load_average()
    except KeyboardInterrupt:
        say("interrupted; cleaning up")
        return 130
    except BenchError as exc:
        say(f"error: {exc}")
        if env is not None:
            with contextlib.suppress(OSError):
                say((env.tmp / "daphne.log").read_text()[-3000:])
        return 1
    finally:
        if server is not None:
            server.stop()
        if env is not None:
            destroy_environment(env, keep=args.keep)
    print(
        f"\nTaskhoster socket benchmark: {' '.join(meta['argv'])}\n"
        f"{meta.get('database')}{' + Redis' if meta.get('redis') else ''}, fsync "
        f"{'on' if args.fsync else 'off'}, {meta.get('cpus')} CPUs, load average "
        f"{meta.get('load_before')} -> {meta.get('load_after')}, write+fsync probe "
        f"{meta.get('fsync_probe_ms')} ms"
        + (" (PROFILED: slowed by py-spy)" if args.profile else "")
    )
    print(HEADER)
    for row in rows:
        print(format_row(row))
    for line in verdicts(rows):
        print(line)
    if args.json:
        args.json.write_text(
            json.dumps(
                {"meta": meta, "results": [asdict(r) for r in rows], "profiles": profiles},
                indent=2,
            )
        )
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
