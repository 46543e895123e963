"""Background work beside foreground work: post→worker latency while a big removal runs.

A benchmark, not a test. One daphne on a fresh database and state root (fsync on unless
``--no-fsync``). A queue ``big`` is filled with ``--items`` (200,000) pending items (through
the engine in this process, fsync off, then ``os.sync()``). Then, each for ``--seconds``
(10), single posts paced at ``--rate`` (100/s) go to another queue whose one socket answers
at once (``work_socket.measure_latency``), and their post→worker latency is measured:

- ``baseline``: nothing else runs;
- ``queue delete``: ``DELETE /api/queues/big`` is sent as the probe starts (the server
  reclaims its rows and files behind the answer);
- ``status delete``: ``big`` is filled again, and ``POST /api/queues/big/items/delete
  {"status": "pending"}`` runs beside the probe (its files unlinked behind its answer).

For each removal the table gives the probe's p50 and p99, the ratio of p99 to the baseline's
(the target: at most 2x), the p50 and p99 of the posts' own answers (slow there: the
server's commit; slow only in the first: its delivery), how many files were still waiting
to be reclaimed when the probe ended, and how long the whole reclaim took (its rate)::

    .venv/bin/python bench/background.py                       # 200,000 items, SQLite
    .venv/bin/python bench/background.py --items 50000 --only queue
    .venv/bin/python bench/background.py \\
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
import contextlib
import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

from bench.core import (
    BenchError,
    Daphne,
    Environment,
    _interrupt,
    destroy_environment,
    fsync_probe,
    load_average,
    make_client,
    make_environment,
    migrate,
    say,
    setup_django,
)
from bench.work_socket import LATENCY_QUEUE, measure_latency

BIG = "big"


def fill(items: int) -> float:
    """``items`` pending items in ``big``, posted through the engine here (fsync off)."""
    from taskhoster import engine

    started = time.perf_counter()
    for start in range(0, items, 1000):
        n = min(1000, items - start)
        engine.post_items(
            queue_name=BIG,
            items=[engine.NewItem(payload={"n": start + i, "pad": "x" * 100}) for i in range(n)],
        )
    os.sync()
    return time.perf_counter() - started


def files_left(env: Environment) -> int:
    """Item files still on disk: in ``big``'s directories and in the trash."""
    count = 0
    for base in (env.root / BIG, env.root / ".trash"):
        if not base.exists():
            continue
        for directory, _dirs, files in os.walk(base):
            if os.path.basename(directory) in ("pending", "processing", "done"):
                count += sum(1 for f in files if f.endswith(".json"))
            if directory.endswith(".trash"):
                for name in files:
                    if name.endswith(".unlink"):
                        with contextlib.suppress(FileNotFoundError):  # reclaimed meanwhile
                            count += len((Path(directory) / name).read_text().splitlines())
    return count


def rows_left() -> int:
    from taskhoster.models import Item

    return int(Item.objects.filter(queue__name__in=[BIG]).count())


def wait_reclaimed(env: Environment, started: float, timeout: float) -> float:
    """Seconds from ``started`` until no file of ``big`` is left (nan past ``timeout``)."""
    while time.monotonic() - started < timeout:
        if files_left(env) == 0:
            return time.monotonic() - started
        time.sleep(0.5)
    return float("nan")


def probe(args: argparse.Namespace, url: str, key: str, label: str) -> dict[str, Any]:
    row = measure_latency(args, url, key, label)
    return {
        "p50_ms": row.p50_ms,
        "p99_ms": row.p99_ms,
        "max_ms": row.max_ms,
        # The post's own answer: slow here is the server's commit, not its delivery.
        "post_p50_ms": row.post_p50_ms,
        "post_p99_ms": row.post_p99_ms,
    }


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    env = make_environment(args)
    server: Daphne | None = None
    results: list[dict[str, Any]] = []
    try:
        migrate(env)
        setup_django(env)
        from taskhoster import engine
        from taskhoster.keys import create_key

        key = create_key(name="bench", scopes=["produce", "work", "manage"])[1]
        engine.upsert_queue(name=LATENCY_QUEUE, body={})
        server = Daphne(env, fsync=args.fsync, extra_args=("--websocket_timeout", "-1"))
        if args.redis_url:
            server.env["REDIS_URL"] = args.redis_url
        server.start()
        say(f"disk: create + write + fsync + directory fsync {fsync_probe(env.root):.2f} ms")
        base = probe(args, server.url, key, "baseline")
        results.append({"what": "baseline", **base})
        say(json.dumps(results[-1]))
        client = make_client(server.url, key)
        for what in args.only:
            engine.upsert_queue(name=BIG, body={})
            took = fill(args.items)
            say(f"{what}: filled {args.items:,} in {took:.0f} s; {load_average()}")
            started = time.monotonic()
            request: dict[str, Any] = {}

            def remove(what: str = what, request: dict[str, Any] = request) -> None:
                t0 = time.monotonic()
                if what == "queue":
                    answer = client.delete(f"/api/queues/{BIG}")
                else:
                    answer = client.post(
                        f"/api/queues/{BIG}/items/delete",
                        json={"status": "pending"},
                        timeout=600,
                    )
                request["status"] = answer.status_code
                request["seconds"] = round(time.monotonic() - t0, 3)

            remover = threading.Thread(target=remove)
            remover.start()
            during = probe(args, server.url, key, f"{what} delete")
            left = files_left(env)
            remover.join(600)
            reclaimed = wait_reclaimed(env, started, args.timeout)
            if request.get("status") not in (200, 204):
                raise BenchError(f"{what} delete answered {request}")
            results.append(
                {
                    "what": f"{what} delete",
                    **during,
                    "p99_ratio": round(during["p99_ms"] / base["p99_ms"], 2),
                    "request_s": request["seconds"],
                    "files_left_after_probe": left,
                    "reclaimed_s": round(reclaimed, 1),
                    "reclaim_per_s": round(args.items / reclaimed) if reclaimed == reclaimed else 0,
                }
            )
            say(json.dumps(results[-1]))
            if what == "status":
                client.delete(f"/api/queues/{BIG}")
                wait_reclaimed(env, time.monotonic(), args.timeout)
        client.close()
    finally:
        if server is not None:
            server.stop()
        destroy_environment(env, keep=args.keep)
    return results


def print_table(results: list[dict[str, Any]], items: int) -> None:
    print()
    print(f"post→worker beside removing {items:,} items")
    print(
        f"{'probe during':<16} {'p50 ms':>8} {'p99 ms':>8} {'p99 x':>6} {'post p50':>8} "
        f"{'post p99':>8} {'request s':>9} {'left at end':>11} {'reclaim s':>9} {'files/s':>8}"
    )
    for r in results:
        print(
            f"{r['what']:<16} {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} "
            f"{r.get('p99_ratio', 1.0):>6.2f} {r['post_p50_ms']:>8.2f} {r['post_p99_ms']:>8.2f} "
            f"{r.get('request_s', ''):>9} "
            f"{r.get('files_left_after_probe', ''):>11} {r.get('reclaimed_s', ''):>9} "
            f"{r.get('reclaim_per_s', ''):>8}"
        )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=200_000)
    parser.add_argument("--only", default="queue,status", help="queue and/or status")
    parser.add_argument("--seconds", type=float, default=10.0, help="the probe: how long")
    parser.add_argument("--rate", type=float, default=100.0, help="the probe: posts per second")
    parser.add_argument("--producers", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--max-items", type=int, default=20_000)
    parser.add_argument("--payload-bytes", type=int, default=200)
    parser.add_argument("--timeout", type=float, default=900.0, help="reclaim: give up after")
    parser.add_argument("--fsync", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--database-url")
    parser.add_argument("--redis-url")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--tmpdir")
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args(argv)
    args.only = [x.strip() for x in args.only.split(",") if x.strip()]
    if set(args.only) - {"queue", "status"}:
        parser.error("--only takes queue and/or status")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)
    results = run(args)
    print_table(results, args.items)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
