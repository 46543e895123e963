"""Claims per second with threads versus without (issue 3), through the engine in-process.

A benchmark, not a test. In ONE run (same process, same database, same machine state) it
measures ``engine.claim(max_items=1)`` immediately followed by ``engine.submit_result`` for
the claimed item, with fsync on, for ``--seconds`` each, on three queues:

- ``plain``: 10,000 unthreaded items;
- ``threaded``: 1,000 threads of 10 members each (10,000 items; a result lets the next
  member of its thread become claimable);
- ``pathological``: one thread whose head is processing with 10,000 members waiting behind
  it, plus 10,000 unthreaded items; only the unthreaded ones can be claimed, and they should
  be as fast to claim as ``plain``.

::

    .venv/bin/python bench/threads.py
    .venv/bin/python bench/threads.py --database-url postgres://postgres@127.0.0.1:5432/postgres

See bench/README.md.
"""

# ruff: noqa: E402
from __future__ import annotations

# bench/work_socket.py is named like the standard library's socket module: when a file of this
# directory runs as a script, the directory must not be on sys.path, or ``import socket``
# would find bench/work_socket.py. The repository's root goes there instead (for ``bench.*``).
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(_HERE)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

import argparse
import contextlib
import json
import signal
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.core import (
    PREFILL_BATCH,
    BenchError,
    Environment,
    _interrupt,
    analyze_database,
    destroy_environment,
    filesystem_of,
    fsync_probe,
    load_average,
    make_environment,
    migrate,
    percentile,
    say,
    settle_disk,
    setup_django,
)

RESULT = {"ok": True}
SCENARIOS = {
    "plain": "10,000 unthreaded items",
    "threaded": "1,000 threads x 10 members",
    "pathological": "1 busy thread of 10,000 + 10,000 unthreaded",
}


@contextlib.contextmanager
def fsync(on: bool) -> Iterator[None]:
    """The engine reads settings.TASKHOSTER on every call (taskhoster.conf), so this switches
    fsync for the engine calls made inside the block, and only for them."""
    from django.conf import settings
    from django.test import override_settings

    with override_settings(TASKHOSTER={**settings.TASKHOSTER, "FSYNC": on}):
        yield


def post_all(queue: str, specs: list[tuple[int, str | None]], payload_bytes: int) -> None:
    from taskhoster import engine

    filler = "x" * payload_bytes
    for start in range(0, len(specs), PREFILL_BATCH):
        chunk = specs[start : start + PREFILL_BATCH]
        engine.post_items(
            queue_name=queue,
            items=[
                engine.NewItem(payload={"n": n, "data": filler}, thread_id=thread)
                for n, thread in chunk
            ],
        )


def prefill(args: argparse.Namespace) -> dict[str, str]:
    """Make the three queues and fill them (fsync off). Returns a note per scenario."""
    from taskhoster import engine

    n_threads, members, items = args.threads, args.members, args.threads * args.members
    notes: dict[str, str] = {}
    for name in SCENARIOS:
        engine.upsert_queue(name=name, body={})
    # plain: N unthreaded
    post_all("plain", [(n, None) for n in range(items)], args.payload_bytes)
    # threaded: posted round-robin (member m of every thread, then member m+1), as
    # producers interleave; only each thread's head is claimable at a time.
    post_all(
        "threaded",
        [(m * n_threads + t, f"t{t:05d}") for m in range(members) for t in range(n_threads)],
        args.payload_bytes,
    )
    # pathological: one thread of items + 1 members, its head claimed and left processing,
    # posted first so that the whole thread is older than every unthreaded item.
    post_all("pathological", [(n, "big") for n in range(items + 1)], args.payload_bytes)
    head = engine.claim(queue_name="pathological", max_items=1)
    if len(head) != 1 or head[0].row.thread_id != "big":
        raise BenchError(f"could not make the big thread's head processing: {head}")
    notes["pathological"] = f"head {head[0].row.id} of thread 'big' held processing"
    post_all("pathological", [(items + 1 + n, None) for n in range(items)], args.payload_bytes)
    return notes


@dataclass
class Row:
    database: str
    scenario: str
    what: str
    run: int
    claims: int
    seconds: float
    per_second: float
    p50_ms: float
    p99_ms: float
    empty_claims: int
    load_before: str
    load_after: str
    note: str = ""


def describe(args: argparse.Namespace, scenario: str) -> str:
    items = args.threads * args.members
    return {
        "plain": f"{items:,} unthreaded items",
        "threaded": f"{args.threads:,} threads x {args.members} members",
        "pathological": f"1 busy thread of {items:,} + {items:,} unthreaded",
    }[scenario]


def measure(args: argparse.Namespace, label: str, scenario: str, run: int) -> Row:
    from taskhoster import engine

    latencies: list[float] = []
    empty = 0
    wrong = 0
    load_before = load_average()
    with fsync(args.fsync):
        # warm up: a few untimed round trips
        for _ in range(args.warmup):
            for warm in engine.claim(queue_name=scenario, max_items=1):
                engine.submit_result(item_id=warm.row.id, result=RESULT)
        started = time.perf_counter()
        deadline = started + args.seconds
        count = 0
        while time.perf_counter() < deadline and count < args.max_claims:
            t0 = time.perf_counter()
            claimed = engine.claim(queue_name=scenario, max_items=1)
            if not claimed:
                empty += 1
                if empty >= 3:
                    break
                continue
            row = claimed[0].row
            if scenario == "pathological" and row.thread_id is not None:
                wrong += 1  # the busy thread's next member must never be claimable
            verdict = engine.submit_result(item_id=row.id, result=RESULT)
            if not verdict.accepted:
                raise BenchError(f"result for {row.id} not accepted: {verdict}")
            latencies.append(time.perf_counter() - t0)
            count += 1
        elapsed = time.perf_counter() - started
    latencies.sort()
    notes = []
    if empty:
        notes.append(f"{empty} empty claims" + (" (queue ran dry)" if empty >= 3 else ""))
    if wrong:
        notes.append(f"BUG: {wrong} members of the busy thread were claimed")
    return Row(
        database=label,
        scenario=scenario,
        what=describe(args, scenario),
        run=run,
        claims=count,
        seconds=round(elapsed, 3),
        per_second=round(count / elapsed, 1) if elapsed else 0.0,
        p50_ms=round(percentile(latencies, 0.50), 2),
        p99_ms=round(percentile(latencies, 0.99), 2),
        empty_claims=empty,
        load_before=load_before,
        load_after=load_average(),
        note="; ".join(notes),
    )


HEADER = (
    f"{'database':<10} {'scenario':<13} {'what':<44} {'run':>3} {'claims':>6} {'secs':>6} "
    f"{'claims/s':>8} {'p50 ms':>7} {'p99 ms':>7}  load before -> after"
)


def format_row(r: Row) -> str:
    text = (
        f"{r.database:<10} {r.scenario:<13} {r.what:<44} {r.run:>3} {r.claims:>6} "
        f"{r.seconds:>6.2f} {r.per_second:>8.1f} {r.p50_ms:>7.2f} {r.p99_ms:>7.2f}  "
        f"{r.load_before} -> {r.load_after}"
    )
    return text + (f"  [{r.note}]" if r.note else "")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="per measurement")
    parser.add_argument("--threads", type=int, default=1000, help="threads in 'threaded'")
    parser.add_argument("--members", type=int, default=10, help="members per thread")
    parser.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="rounds; each round measures every scenario once, in turn (the table shows all "
        "runs and the median per scenario)",
    )
    parser.add_argument("--max-claims", type=int, default=3000, help="cap per measurement")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--payload-bytes", type=int, default=200)
    parser.add_argument(
        "--fsync",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="fsync while measuring (default on; the prefill is always without)",
    )
    parser.add_argument(
        "--database-url",
        help="a local PostgreSQL admin URL to create (and drop) a bench database from; "
        "default: a fresh SQLite file",
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--tmpdir", help="where to create the run's temp dir")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir")
    args = parser.parse_args(argv)
    if not 0 < args.seconds <= 120:
        parser.error("--seconds must be in (0, 120]")
    if not 1 <= args.threads <= 10_000 or not 1 <= args.members <= 100:
        parser.error("--threads must be 1..10,000 and --members 1..100")
    if args.threads * args.members > 100_000:
        parser.error("at most 100,000 items per queue")
    if not 1 <= args.repeat <= 10:
        parser.error("--repeat must be 1..10")
    if not 1 <= args.max_claims <= 100_000:
        parser.error("--max-claims must be 1..100,000")
    if args.max_claims * args.repeat + args.warmup * args.repeat > args.threads * args.members:
        args.max_claims = max(1, args.threads * args.members // args.repeat - args.warmup)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)
    runs: list[Row] = []
    meta: dict[str, Any] = {"argv": [sys.executable, *sys.argv]}
    env: Environment | None = None
    try:
        env = make_environment(args)
        migrate(env)
        setup_django(env)  # the process starts with fsync off (TASKHOSTER_FSYNC=0)
        started = time.perf_counter()
        notes = prefill(args)
        analyze_database()
        synced = settle_disk()
        meta.update(
            database=env.label,
            fsync=args.fsync,
            cpus=os.cpu_count(),
            filesystem=filesystem_of(env.root),
            fsync_probe_ms=round(fsync_probe(env.root), 3),
            load_before=load_average(),
            prefill_seconds=round(time.perf_counter() - started, 1),
            notes=notes,
        )
        say(
            f"[{env.label}] prefilled 3 queues in {meta['prefill_seconds']} s (fsync off; then "
            f"sync {synced:.1f} s); write+fsync+dir fsync ~ {meta['fsync_probe_ms']} ms; load "
            f"average {meta['load_before']}; {meta['cpus']} CPUs"
        )
        say("   " + HEADER)
        for run in range(args.repeat):
            for scenario in SCENARIOS:
                row = measure(args, env.label, scenario, run)
                runs.append(row)
                say("   " + format_row(row))
        meta["load_after"] = load_average()
    except KeyboardInterrupt:
        say("interrupted; cleaning up")
        return 130
    except BenchError as exc:
        say(f"error: {exc}")
        return 1
    finally:
        if env is not None:
            destroy_environment(env, keep=args.keep)
    medians: dict[str, Row] = {}
    for scenario in SCENARIOS:
        mine = sorted((r for r in runs if r.scenario == scenario), key=lambda r: r.per_second)
        medians[scenario] = mine[len(mine) // 2]
    print(
        f"\nTaskhoster threads benchmark: {' '.join(meta['argv'])}\n"
        f"{meta['database']}, fsync {'on' if args.fsync else 'off'} while measuring, "
        f"engine in-process, claim(max=1)+submit_result, {args.seconds:g} s per measurement, "
        f"{args.repeat} round(s), {meta['cpus']} CPUs, load average {meta['load_before']} -> "
        f"{meta['load_after']}, write+fsync probe {meta['fsync_probe_ms']} ms"
    )
    print(HEADER)
    for row in runs:
        print(format_row(row))
    print("medians:")
    plain = medians["plain"].per_second or float("nan")
    for scenario, row in medians.items():
        ratio = row.per_second / plain
        print(
            f"  {scenario:<13} {row.per_second:>8.1f} claims/s  p50 {row.p50_ms:.2f} ms  "
            f"p99 {row.p99_ms:.2f} ms  = {ratio:.2f} x plain"
        )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "meta": meta,
                    "runs": [asdict(r) for r in runs],
                    "medians": {k: asdict(v) for k, v in medians.items()},
                },
                indent=2,
            )
        )
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
