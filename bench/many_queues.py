"""Many queues, many idle sockets: what idle costs, and what a post costs beside them.

A benchmark, not a test. One daphne on a fresh database and state root (fsync on unless
``--no-fsync``). For each configuration of idle sockets, in turn:

- ``queues=N`` (N in ``--sockets``, e.g. 10,100,1000,10000): N queues, one idle socket on each
  (capacity 1), held by a separate process (``--idle`` mode of this script);
- ``one-queue=N``: N idle sockets all on one queue;
- ``none``: no idle socket (the baseline).

and measures, beside them:

- ``idle CPU``: the CPU daphne and its committer process use while nothing is posted, over
  ``--idle-seconds``, as a share of one core (from ``/proc``);
- ``post→worker``: single posts paced at ``--rate`` (100/s) for ``--seconds`` (10) to another
  queue with one socket of its own (``work_socket.measure_latency``), p50 and p99;
- ``fan-out``: one post to each of the (up to ``--fan-out-max``, 1000) idle queues, from 8
  keep-alive connections, and the time until each reached its socket; beside it, the same
  number of posts to one queue, for the ratio.

::

    .venv/bin/python bench/many_queues.py                                  # 10,100,1000
    .venv/bin/python bench/many_queues.py --sockets 10,100,1000,10000 --configs queues,none
    .venv/bin/python bench/many_queues.py \\
        --database-url postgres://postgres@127.0.0.1:5432/postgres \\
        --redis-url redis://127.0.0.1:6379/0
"""

# ruff: noqa: E402
from __future__ import annotations

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
import resource
import shutil
import signal
import statistics
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench.core import (
    REPO,
    BenchError,
    Daphne,
    Environment,
    _interrupt,
    destroy_environment,
    load_average,
    make_client,
    make_environment,
    migrate,
    percentile,
    say,
    setup_django,
)
from bench.work_socket import LATENCY_QUEUE, measure_latency, ws_url

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


# -- the idle sockets, in a process of their own -----------------------------------------


async def hold_idle(url: str, key: str, queues: list[str], ready_file: Path) -> None:
    """Open one socket per entry of ``queues`` (capacity 1), answer any item at once, and
    write how many items arrived to ``ready_file`` (first "ready N" once all subscribed)."""
    import websockets

    received = 0
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)

    async def one(queue: str, opened: asyncio.Event) -> None:
        nonlocal received
        name, _, capacity = queue.partition(":")  # "name" or "name:capacity"
        async with websockets.connect(
            ws_url(url),
            additional_headers={"Authorization": f"Token {key}"},
            ping_interval=None,
            open_timeout=60,
        ) as ws:
            frame = {"type": "subscribe", "queues": [name], "capacity": int(capacity or 1)}
            await ws.send(json.dumps(frame))
            opened.set()
            async for text in ws:
                frame = json.loads(text)
                if frame.get("type") == "item":
                    received += 1
                    await ws.send(json.dumps({"type": "result", "id": frame["id"], "result": 1}))

    tasks = []
    for start in range(0, len(queues), 200):  # open them in waves: the handshake costs
        opened = [asyncio.Event() for _ in queues[start : start + 200]]
        tasks += [
            asyncio.create_task(one(q, e))
            for q, e in zip(queues[start : start + 200], opened, strict=True)
        ]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in opened)), 120)
    ready_file.write_text(f"ready {len(tasks)}\n")
    while not stop.is_set():
        ready_file.write_text(f"received {received}\n")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.05)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class IdleSockets:
    def __init__(self, env: Environment, url: str, key: str, queues: list[str]) -> None:
        tag = f"{len(queues)}-{queues[0].replace(':', '-')}"
        self.state = env.tmp / f"idle-{tag}.txt"
        self.state.unlink(missing_ok=True)
        names = env.tmp / f"idle-{tag}.json"
        names.write_text(json.dumps(queues))
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--idle", url, str(names), str(self.state)],
            cwd=REPO,
            env=dict(os.environ, BENCH_KEY=key, PYTHONPATH=str(REPO)),
            start_new_session=True,
        )
        deadline = time.monotonic() + 60 + len(queues) / 20
        while not self.state.exists() or not self.state.read_text().startswith(("ready", "rec")):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise BenchError("the idle sockets did not open")
            time.sleep(0.2)

    def received(self) -> int:
        text = self.state.read_text().split()
        return int(text[1]) if len(text) == 2 and text[0] == "received" else 0

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


# -- measurements --------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU of ``pid`` and its children (the committer process)."""
    total = 0.0
    pids = [pid]
    with contextlib.suppress(OSError):
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        pids += [int(c) for c in children]
    for one in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{one}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    return total


def idle_cpu(pid: int, seconds: float) -> float:
    """The share of one core daphne and its committer use over ``seconds`` of idle."""
    time.sleep(min(3.0, seconds))  # let the opening of the sockets settle
    before, t0 = cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)
    return (cpu_seconds(pid) - before) / (time.monotonic() - t0)


def fan_out(url: str, key: str, queues: list[str], idle: IdleSockets | None) -> dict[str, float]:
    """One post to each of ``queues`` from 8 connections: seconds until all were answered,
    and (with ``idle``) until each reached its socket."""
    before = idle.received() if idle is not None else 0
    lock = threading.Lock()
    todo = list(queues)
    latencies: list[float] = []
    refused = [0]
    clients = [make_client(url, key) for _ in range(8)]

    def producer(client: httpx.Client) -> None:
        while True:
            with lock:
                if not todo:
                    return
                queue = todo.pop()
            t0 = time.perf_counter()
            while True:
                # (a 503 overloaded did nothing: sent again as it is)
                answer = client.post(f"/api/queues/{queue}/items", json={"payload": {"q": queue}})
                if answer.status_code != 503:
                    break
                with lock:  # overloaded: as a client does, after Retry-After
                    refused[0] += 1
                time.sleep(float(answer.headers.get("Retry-After") or 1))
            if answer.status_code not in (200, 201):
                raise BenchError(f"post to {queue}: {answer.status_code} {answer.text[:200]}")
            with lock:
                latencies.append(time.perf_counter() - t0)

    started = time.perf_counter()
    threads = [threading.Thread(target=producer, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    answered = time.perf_counter() - started
    delivered = float("nan")
    if idle is not None:
        deadline = time.monotonic() + 120
        while idle.received() - before < len(queues) and time.monotonic() < deadline:
            time.sleep(0.02)
        delivered = time.perf_counter() - started
    for c in clients:
        c.close()
    latencies.sort()
    return {
        "posts": len(queues),
        "answered_s": round(answered, 3),
        "delivered_s": round(delivered, 3),
        "post_p50_ms": round(percentile(latencies, 0.5), 2),
        "post_p99_ms": round(percentile(latencies, 0.99), 2),
        "refused_503": refused[0],
    }


def latency(args: argparse.Namespace, url: str, key: str, label: str) -> dict[str, Any]:
    """``--latency-rounds`` measurements; the median p50 and p99, and each round's."""
    rows = [measure_latency(args, url, key, label) for _ in range(args.latency_rounds)]
    return {
        "p50_ms": statistics.median(r.p50_ms for r in rows),
        "p99_ms": statistics.median(r.p99_ms for r in rows),
        "p99_rounds_ms": [r.p99_ms for r in rows],
        "missing": sum(r.missing for r in rows),
    }


def profiler(args: argparse.Namespace, pid: int, name: str) -> subprocess.Popen[bytes] | None:
    """py-spy on daphne and its committer (``--profile DIR``), raw stacks to DIR/name.txt."""
    if not args.profile:
        return None
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    args.profile.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        [
            spy,
            "record",
            "--subprocesses",
            "-p",
            str(pid),
            "-r",
            "200",
            "-f",
            "raw",
            "-o",
            str(args.profile / f"{name}.txt"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def stop_profiler(spy: subprocess.Popen[bytes] | None) -> None:
    if spy is not None:
        spy.send_signal(signal.SIGINT)
        spy.wait(30)


def make_queues(url: str, key: str, names: list[str]) -> None:
    with make_client(url, key) as client:
        for name in names:
            answer = client.put(f"/api/queues/{name}", json={})
            if answer.status_code not in (200, 201):
                raise BenchError(f"PUT {name}: {answer.status_code} {answer.text[:200]}")


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    env = make_environment(args)
    server: Daphne | None = None
    results: list[dict[str, Any]] = []
    try:
        migrate(env)
        setup_django(env)
        from taskhoster.keys import create_key

        key = create_key(name="bench", scopes=["produce", "work", "manage"])[1]
        extra = ("--websocket_timeout", "-1", *args.daphne_args.split())
        server = Daphne(env, fsync=args.fsync, extra_args=extra)
        if args.redis_url:
            server.env["REDIS_URL"] = args.redis_url
        server.start()
        assert server.proc is not None
        make_queues(server.url, key, [LATENCY_QUEUE, "fan-one"])
        biggest = max(args.sockets)
        made: list[str] = []
        configs: list[tuple[str, int]] = []
        for n in args.sockets:
            if "queues" in args.configs:
                configs.append(("queues", n))
            if "one-queue" in args.configs:
                configs.append(("one-queue", n))
        if "none" in args.configs:
            configs.append(("none", 0))
        for kind, n in configs:
            label = f"{kind}={n}" if kind != "none" else "none"
            say(f"{label}: {load_average()}")
            queues = [f"q{i:05d}" for i in range(n)] if kind == "queues" else []
            if len(made) < len(queues):
                make_queues(server.url, key, queues[len(made) :])
                made = queues
            subscribed = queues if kind == "queues" else ["fan-one"] * n
            idle = IdleSockets(env, server.url, key, subscribed) if n else None
            try:
                result: dict[str, Any] = {"config": label, "sockets": n}
                result["idle_cpu_pct"] = round(
                    100 * idle_cpu(server.proc.pid, args.idle_seconds), 2
                )
                result.update(latency(args, server.url, key, label))
                if kind == "queues":
                    fan = queues[: args.fan_out_max]
                    spy = profiler(args, server.proc.pid, f"fan-out-{n}")
                    try:
                        result["fan_out"] = fan_out(server.url, key, fan, idle)
                    finally:
                        stop_profiler(spy)
                    # The same posts to one queue, whose one socket takes them all.
                    one = IdleSockets(env, server.url, key, [f"fan-one:{len(fan)}"])
                    try:
                        result["one_queue"] = fan_out(server.url, key, ["fan-one"] * len(fan), one)
                    finally:
                        one.close()
            finally:
                if idle is not None:
                    idle.close()
            say(json.dumps(result))
            results.append(result)
        del biggest
    finally:
        if server is not None:
            server.stop()
        destroy_environment(env, keep=args.keep)
    return results


def print_table(results: list[dict[str, Any]]) -> None:
    print()
    print(
        f"{'config':<18} {'idle CPU %':>10} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'fan-out posts':>13} {'answered s':>10} {'delivered s':>11} {'1 queue s':>11}"
    )
    for r in results:
        fan = r.get("fan_out") or {}
        one = r.get("one_queue") or {}
        print(
            f"{r['config']:<18} {r['idle_cpu_pct']:>10.2f} {r['p50_ms']:>8.2f} "
            f"{r['p99_ms']:>8.2f} {fan.get('posts', ''):>13} {fan.get('answered_s', ''):>10} "
            f"{fan.get('delivered_s', ''):>11} {one.get('delivered_s', ''):>11}"
        )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sockets", default="10,100,1000", help="idle socket counts")
    parser.add_argument(
        "--configs", default="queues,one-queue,none", help="queues, one-queue and/or none"
    )
    parser.add_argument("--idle-seconds", type=float, default=10.0)
    parser.add_argument("--seconds", type=float, default=10.0, help="post→worker: how long")
    parser.add_argument(
        "--latency-rounds", type=int, default=3, help="post→worker: measurements per config"
    )
    parser.add_argument("--rate", type=float, default=100.0, help="post→worker: posts per second")
    parser.add_argument("--producers", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--max-items", type=int, default=20_000)
    parser.add_argument("--payload-bytes", type=int, default=200)
    parser.add_argument("--fan-out-max", type=int, default=1000)
    parser.add_argument("--fsync", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--database-url")
    parser.add_argument("--redis-url")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--daphne-args", default="", help="more options for daphne")
    parser.add_argument("--profile", type=Path, help="py-spy the fan-out into this directory")
    parser.add_argument("--tmpdir")
    parser.add_argument("--keep", action="store_true")
    parser.add_argument(
        "--idle", nargs=3, metavar=("URL", "QUEUES", "STATE"), help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.idle:
        return args
    args.sockets = [int(x) for x in args.sockets.split(",") if x.strip()]
    args.configs = [x.strip() for x in args.configs.split(",") if x.strip()]
    if set(args.configs) - {"queues", "one-queue", "none"}:
        parser.error("--configs takes queues, one-queue and none")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Ten thousand sockets need descriptors, in this process and in daphne (inherited).
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 65536)), hard))
    if args.idle:
        url, names, state = args.idle
        queues = json.loads(Path(names).read_text())
        asyncio.run(hold_idle(url, os.environ["BENCH_KEY"], queues, Path(state)))
        return 0
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)
    say(f"many queues: sockets {args.sockets}, configs {args.configs}, fsync {args.fsync}")
    results = run(args)
    print_table(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
