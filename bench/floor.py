"""A lone post beside the floors under it: daphne alone, daphne with Django, Taskhoster.

A measurement, not a test. One producer posts one item at a time in sequence (httpx, one
keep-alive connection: ``bench/core.py``'s ``post``), for ``--seconds`` against each of:

- ``daphne, bare ASGI app``: reads the body, parses its JSON, answers 201 with a small JSON
  object (``bench/floor_apps.py``: ``raw``). What daphne and the client cost alone;
- ``daphne + Django, one async view``: Django's ASGI handler, no middleware, no database,
  the same work in one ``async`` view (``floor_apps``: ``django``). What Django's request
  and response add;
- ``Taskhoster, fsync off``: the real server (its middleware, DRF, its view, the pipe to
  its committer process, the group's transaction and files), nothing flushed;
- ``Taskhoster, fsync on``: as shipped.

Each row gives p50 and p99 of the post's round trip, and the CPU per post of the server
(every thread of daphne and of its committer process, from ``/proc``) and of the client,
beside the disk's own durable create (create + write + ``fdatasync`` + directory ``fsync``,
``bench/flushcost.py``) measured in the same run, before and after. The issue's target for
a lone post is twice that durable create: the floors say how much of a post's time is spent
before Taskhoster's own work begins::

    .venv/bin/python bench/floor.py --seconds 8 --tmpdir DIR
    .venv/bin/python bench/floor.py --repeat 3          # each server 3 times, in turn
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
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from bench.core import (
    QUEUE,
    BenchError,
    Daphne,
    ThreadCPU,
    _interrupt,
    load_average,
    make_op,
    percentile,
    run_load,
    running,
    say,
)
from bench.flushcost import measure as flush_measure

FLOOR_SETTINGS = "bench.floor_apps"


@dataclass(frozen=True)
class Server:
    label: str
    app: str
    fsync: bool
    settings: str | None = None  # DJANGO_SETTINGS_MODULE, when not the project's


SERVERS = [
    Server("daphne, bare ASGI app", "bench.floor_apps:raw", False, FLOOR_SETTINGS),
    Server("daphne + Django, one async view", "bench.floor_apps:django", False, FLOOR_SETTINGS),
    Server("Taskhoster, fsync off", "project.asgi:application", False),
    Server("Taskhoster, fsync on", "project.asgi:application", True),
]


@dataclass
class Figure:
    label: str
    posts: int
    per_second: float
    p50_ms: float
    p99_ms: float
    server_cpu_us: float
    server_system_us: float
    client_cpu_us: float


def measure(
    args: argparse.Namespace, env: object, key: str, what: Server
) -> Figure:  # env: bench.core.Environment
    server = Daphne(env, fsync=what.fsync, app=what.app)  # type: ignore[arg-type]
    if what.settings:
        server.env["DJANGO_SETTINGS_MODULE"] = what.settings
    try:
        server.start()  # (stopped below should it fail to answer: it runs in its own session)
        assert server.proc is not None
        op, unit, _requests = make_op("post", args.payload_bytes)
        cpu = ThreadCPU({"daphne": server.proc.pid})
        client_before = time.process_time()
        cpu.start()
        outcome = run_load(
            server.url,
            key,
            op,
            threads=1,
            seconds=args.seconds,
            cap=args.max_items,
            unit=unit,
            warmup=args.warmup,
        )
        cpu.stop()
        client = time.process_time() - client_before
    finally:
        server.stop()
    if outcome.errors or not outcome.count:
        raise BenchError(f"{what.label}: {outcome.errors} errors: {outcome.note}")
    n = outcome.count
    return Figure(
        label=what.label,
        posts=n,
        per_second=n / outcome.seconds,
        p50_ms=percentile(outcome.latencies, 0.50),
        p99_ms=percentile(outcome.latencies, 0.99),
        server_cpu_us=sum(cpu.spent.values()) / n * 1e6,
        server_system_us=sum(cpu.system.values()) / n * 1e6,
        client_cpu_us=client / n * 1e6,
    )


def durable_create_us(directory: Path, rounds: int) -> float:
    directory.mkdir(exist_ok=True)
    return flush_measure(directory, rounds)["create+fdatasync+dirfsync"]["p50"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="per server")
    parser.add_argument("--repeat", type=int, default=1, help="each server this many times")
    parser.add_argument("--payload-bytes", type=int, default=200)
    parser.add_argument(
        "--warmup",
        type=int,
        default=10,
        help="untimed posts first (their CPU is counted with the rest: 10 against ~1,000)",
    )
    parser.add_argument("--max-items", type=int, default=50_000)
    parser.add_argument("--rounds", type=int, default=200, help="of the durable create")
    parser.add_argument("--tmpdir", help="where to create the run's temp dir")
    args = parser.parse_args(argv)
    # What bench.core's ``running`` reads: SQLite, the app as shipped.
    args.database_url, args.experiment, args.fsync, args.keep = "", "none", True, False
    # Ctrl-C and SIGTERM both unwind through the clean-up (daphne stopped, temp dir removed).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)
    figures: dict[str, list[Figure]] = {s.label: [] for s in SERVERS}
    try:
        with running(args) as (env, _server):
            from taskhoster import engine
            from taskhoster.keys import create_key

            engine.upsert_queue(name=QUEUE, body={})
            key = create_key(name="bench", scopes=["produce"])[1]
            load_before = load_average()
            create_before = durable_create_us(env.tmp / "flush-before", args.rounds)
            for round_ in range(args.repeat):
                for what in SERVERS:
                    figure = measure(args, env, key, what)
                    figures[what.label].append(figure)
                    say(
                        f"round {round_ + 1}: {what.label}: p50 {figure.p50_ms:.2f} ms, "
                        f"server {figure.server_cpu_us:,.0f} µs, "
                        f"client {figure.client_cpu_us:,.0f} µs"
                    )
            create_after = durable_create_us(env.tmp / "flush-after", args.rounds)
            load_after = load_average()
    except KeyboardInterrupt:
        say("interrupted; cleaned up")
        return 130
    except BenchError as exc:
        say(f"error: {exc}")
        return 1
    print(
        f"A lone post beside its floors: one producer posting in sequence, {args.seconds:g} s "
        f"a server, {args.repeat} round(s); load average {load_before} -> {load_after}"
    )
    print(
        f"the disk's durable create (create + write + fdatasync + directory fsync), p50: "
        f"{create_before:,.0f} µs before, {create_after:,.0f} µs after"
    )
    print(
        f"{'server':34} {'posts/s':>8} {'p50 ms':>7} {'p99 ms':>7} "
        f"{'CPU per post, µs: server (system)':>34} {'client':>7}"
    )
    for label, runs in figures.items():
        if not runs:
            continue

        def median(field: str, runs: list[Figure] = runs) -> float:
            return statistics.median(getattr(r, field) for r in runs)

        server_cpu = f"{median('server_cpu_us'):,.0f} ({median('server_system_us'):,.0f})"
        print(
            f"{label:34} {median('per_second'):8,.0f} {median('p50_ms'):7.2f} "
            f"{median('p99_ms'):7.2f} {server_cpu:>34} {median('client_cpu_us'):7,.0f}"
        )
    if args.repeat > 1:
        print("(medians of the rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
