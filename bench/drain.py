"""Backlog drain through the ``/work`` socket: N items already queued, W workers drain them.

A benchmark, not a test. Against one real daphne (fresh database and state root, fsync on by
default): ``--items`` items are posted in batches of 500 over HTTP and the disk is synced;
then ``--workers`` worker processes (``bench/work_socket.py --worker``: one socket each,
capacity 16, answering every item with a result at once; they subscribe with ``batch`` 16, so
items may come several to a frame and their results go back several to a frame, unless
``BENCH_SOCKET_BATCH=1``, which is one frame per item each way; ``BENCH_WORKER=client``:
the workers are ``taskhoster.client.Worker``, with ``batch`` as above) start, and the clock
runs from the moment the first one is subscribed to the last item's ``finished_at``, once
``GET /api/queues/bench`` (asked every 0.1 s, so that the bench costs the server little)
counts every item finished. The figure is items per second, as the peer benchmark's
"backlog drain". Beside it, the CPU each process and thread spent per item (user + system,
and the system part, from ``/proc``: daphne's event loop, its other threads, its committer
process, the workers).

``--profile DIR`` records daphne and its committer process with py-spy during the drain,
sampling in each process only the thread that holds the GIL (one process runs one thread of
Python at a time: that time is the limit), and prints, per thread kind (the event loop, the
committer, the rest), the functions with the most time in microseconds per item::

    .venv/bin/python bench/drain.py --items 20000
    .venv/bin/python bench/drain.py --items 5000 --profile /tmp/drain-prof
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
import signal
import time
from collections import Counter, defaultdict
from pathlib import Path

import httpx

from bench.core import (
    JSON_HEADERS,
    QUEUE,
    BenchError,
    Daphne,
    Profiler,
    ThreadCPU,
    _interrupt,
    collapsed_stacks,
    destroy_environment,
    load_average,
    make_environment,
    migrate,
    say,
    setup_django,
)
from bench.work_socket import FRAME_BATCH, WorkerProcess, wait_for

BATCH = 500


def post_backlog(client: httpx.Client, items: int) -> float:
    started = time.monotonic()
    for start in range(0, items, BATCH):
        body = {
            "items": [
                {"payload": {"seq": n, "pad": "x" * 60}}
                for n in range(start, min(items, start + BATCH))
            ]
        }
        response = client.post(f"/api/queues/{QUEUE}/items", json=body, headers=JSON_HEADERS)
        if response.status_code != 201:
            raise BenchError(f"batch post answered {response.status_code}: {response.text[:200]}")
    return time.monotonic() - started


def counts(client: httpx.Client) -> dict[str, int]:
    return dict(client.get(f"/api/queues/{QUEUE}").json()["counts"])


def last_finished() -> float:
    """When the drain's last item was finished (epoch seconds), from the items' rows: the
    clock stops there, not at the poll that saw it (polls are 0.1 s apart, so that they cost
    the server being measured little)."""
    from django.db.models import Max

    from taskhoster.models import Item

    at = Item.objects.aggregate(last=Max("finished_at"))["last"]
    return at.timestamp() if at is not None else time.time()


GROUP_FIGURES = ("group_commits", "group_operations", "group_seconds")


def group_figures(client: httpx.Client) -> dict[str, float]:
    """The server's group-commit counters from ``/metrics`` (flushed once a second: read
    them ``FLUSH_INTERVAL`` after the work)."""
    found = dict.fromkeys(GROUP_FIGURES, 0.0)
    for line in client.get("/metrics").text.splitlines():
        for name in GROUP_FIGURES:
            if line.startswith(f"taskhoster_{name}_total "):
                found[name] = float(line.split()[1])
    return found


def group_line(before: dict[str, float], after: dict[str, float], elapsed: float) -> str:
    """The drain's groups: how many, their mean size and time, and the committer's share of
    the drain spent running them."""
    commits, ops, seconds = (after[n] - before[n] for n in GROUP_FIGURES)
    if commits <= 0:
        return "  groups: none counted"
    return (
        f"  groups: {commits:,.0f}, {ops / commits:.1f} operations and "
        f"{1000 * seconds / commits:.2f} ms each; running groups {100 * seconds / elapsed:.0f} % "
        "of the drain"
    )


def summarize(path: Path, rate: int, items: int, top: int) -> None:
    """Inclusive microseconds per item of the busiest functions, per kind of thread."""
    per_kind: dict[str, Counter[str]] = defaultdict(Counter)
    samples: Counter[str] = Counter()
    for thread, frames, count in collapsed_stacks(path):
        # --subprocesses: "process PID:COMMAND" (and the child's) come first, then the thread
        while thread.startswith("process ") and frames:
            thread, frames = frames[0][0], frames[1:]
        kind = (
            "committer"
            if "taskhoster-committer" in thread
            else "event loop"
            if any(fn.endswith("BaseEventLoop.run_forever") for fn, _f, _l in frames)
            else "other threads"
        )
        samples[kind] += count
        seen = set()
        for fn, file, _line in frames:
            name = f"{fn} ({file.rsplit('/', 2)[-2] if '/' in file else file})"
            if name not in seen:
                seen.add(name)
                per_kind[kind][name] += count
    us = 1e6 / rate / max(1, items)
    for kind in ("event loop", "committer", "other threads"):
        print(f"\n{kind}: {samples[kind] * us:.0f} us per item busy")
        for name, count in per_kind[kind].most_common(top):
            print(f"  {count * us:8.1f} us  {name}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=20000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--database-url", default="")
    parser.add_argument("--redis-url", default="")
    parser.add_argument("--tmpdir", default=None)
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--no-fsync", dest="fsync", action="store_false")
    parser.add_argument("--profile", type=Path, default=None)
    parser.add_argument("--profile-rate", type=int, default=200)
    parser.add_argument("--profile-top", type=int, default=25)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)
    env = None
    server = None
    workers: list[WorkerProcess] = []
    try:
        env = make_environment(args)
        migrate(env)
        setup_django(env)
        from taskhoster import engine
        from taskhoster.keys import create_key

        engine.upsert_queue(name=QUEUE, body={})
        key = create_key(name="bench", scopes=["produce", "work", "manage"])[1]
        server = Daphne(env, fsync=args.fsync, extra_args=("--websocket_timeout", "-1"))
        if args.redis_url:
            server.env["REDIS_URL"] = args.redis_url
        server.start()
        headers = {"Authorization": f"Token {key}"}
        with httpx.Client(
            base_url=server.url, headers=headers, timeout=60, trust_env=False
        ) as client:
            posting = post_backlog(client, args.items)
            os.sync()
            say(f"posted {args.items} in {posting:.1f} s; load average {load_average()}")
            profiler = None
            if args.profile:
                args.profile.mkdir(parents=True, exist_ok=True)
                assert server.proc is not None
                profiler = Profiler(
                    server.proc.pid,
                    args.profile / "drain.txt",
                    args.timeout,
                    args.profile_rate,
                    gil=True,
                    subprocesses=True,
                )
            load_before = load_average()
            time.sleep(1.1)  # the posts' groups counted first (metrics.FLUSH_INTERVAL)
            groups_before = group_figures(client)
            workers = [WorkerProcess(server.url, key) for _ in range(args.workers)]
            workers[0].wait_ready()
            assert server.proc is not None
            cpu = ThreadCPU(
                {"daphne": server.proc.pid}
                | {f"worker {n + 1}": w.proc.pid for n, w in enumerate(workers)}
            )
            cpu.start()
            started = time.time()
            for worker in workers[1:]:
                worker.wait_ready()
            done = wait_for(
                lambda: counts(client)["finished"] >= args.items, args.timeout, step=0.1
            )
            cpu.stop()
            elapsed = last_finished() - started
            final = counts(client)
            time.sleep(1.1)
            groups_after = group_figures(client)
            if profiler is not None:
                if profiler.proc.poll() is None:
                    profiler.proc.send_signal(signal.SIGINT)
                profiler.finish()
            shares = [w.finish() for w in workers]
            workers = []
        rate = final["finished"] / elapsed
        print(
            f"\nBacklog drain: {env.label}, fsync {'on' if args.fsync else 'off'}, "
            f"{args.items} items, {args.workers} socket workers of capacity 16, "
            f"{FRAME_BATCH} per frame (BENCH_SOCKET_BATCH)"
            + (", taskhoster.client.Worker" if os.environ.get("BENCH_WORKER") == "client" else "")
        )
        print(
            f"  {final['finished']} finished in {elapsed:.2f} s = {rate:,.0f} items/s"
            f"{'' if done else ' (TIMED OUT)'}"
        )
        print(f"  counts at the end: {final}; load average {load_before} -> {load_average()}")
        print(group_line(groups_before, groups_after, elapsed))
        print(f"  per worker: {[s.get('item', 0) for s in shares]} items")
        print(cpu.table(max(1, final["finished"])))
        if args.profile:
            summarize(
                args.profile / "drain.txt", args.profile_rate, final["finished"], args.profile_top
            )
        return 0 if done else 2
    except KeyboardInterrupt:
        say("interrupted")
        return 130
    except BenchError as exc:
        say(f"error: {exc}")
        return 1
    finally:
        for worker in workers:
            worker.kill()
        if server is not None:
            server.stop()
        if env is not None:
            destroy_environment(env, keep=args.keep)


if __name__ == "__main__":
    sys.exit(main())
