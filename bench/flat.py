"""Do posts, claims and counts cost the same with 1,000 items waiting as with 1,000,000?

A benchmark, not a test. It starts two real daphnes side by side, each with its own fresh
database and state root (fsync on): one whose queue holds ``--small`` waiting items, one
``--big``. Both are filled over HTTP in batches of 1,000, the disk is synced, and then the
measurements alternate between the two servers, round after round, so that drift in this
machine's speed falls on both alike:

- ``post``: single posts from one client (latency per post);
- ``claim``: ``claim {"max": 1}`` then its result, one worker (latency per round trip);
- ``queue``, ``queues``, ``metrics``: ``GET /api/queues/bench``, ``GET /api/queues`` and
  ``GET /metrics``, whose counts once counted rows.

After each measurement the queue is put back to its size (claimed items re-posted, posted
ones deleted). The table gives the median p50 per server and the ratio big/small (the
target: at most 1.2)::

    .venv/bin/python bench/flat.py                       # 1,000 and 1,000,000, SQLite
    .venv/bin/python bench/flat.py --big 100000 --rounds 3 --seconds 3
    .venv/bin/python bench/flat.py --priorities 10 --only post,claim   # ten levels in use
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
import subprocess
import time
from dataclasses import dataclass, field

import httpx

from bench.core import (
    JSON_HEADERS,
    QUEUE,
    REPO,
    BenchError,
    Daphne,
    Environment,
    _interrupt,
    destroy_environment,
    load_average,
    make_environment,
    migrate,
    percentile,
    say,
)

FILL_BATCH = 1000
WHAT = ("post", "claim", "queue", "queues", "metrics")


@dataclass
class Side:
    label: str
    size: int
    env: Environment
    server: Daphne
    client: httpx.Client
    p50: dict[str, list[float]] = field(default_factory=dict)


def create_key(env: Environment) -> str:
    done = subprocess.run(
        [
            sys.executable,
            "manage.py",
            "createkey",
            "--name",
            "bench",
            "--scopes",
            "produce,work,manage",
        ],
        cwd=REPO,
        env=env.process_env(fsync=False),
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip()


PRIORITIES = [1]  # ``--priorities``: the waiting items' priorities cycle through this many levels


def fill(client: httpx.Client, count: int, start: int = 0) -> list[str]:
    ids: list[str] = []
    levels = PRIORITIES[0]
    for offset in range(0, count, FILL_BATCH):
        n = min(FILL_BATCH, count - offset)
        body = {
            "items": [
                {
                    "payload": {"n": k, "pad": "x" * 60},
                    **({"priority": k % levels} if levels > 1 else {}),
                }
                for k in range(start + offset, start + offset + n)
            ]
        }
        answer = client.post(f"/api/queues/{QUEUE}/items", json=body)
        if answer.status_code != 201:
            raise BenchError(f"fill: {answer.status_code} {answer.text[:200]}")
        ids += [item["id"] for item in answer.json()["items"]]
    return ids


def measure(side: Side, what: str, seconds: float) -> float:
    """The p50 in ms of one measurement, then the queue put back to its size."""
    client = side.client
    latencies: list[float] = []
    posted: list[str] = []
    claimed = 0
    deadline = time.perf_counter() + seconds
    n = 0
    while time.perf_counter() < deadline:
        started = time.perf_counter()
        if what == "post":
            answer = client.post(
                f"/api/queues/{QUEUE}/items",
                content=f'{{"payload": {{"n": {n}, "pad": "{"x" * 60}"}}}}',
                headers=JSON_HEADERS,
            )
            posted.append(answer.json()["id"])
        elif what == "claim":
            items = client.post(f"/api/queues/{QUEUE}/claim", json={"max": 1}).json()["items"]
            if not items:
                raise BenchError(f"{side.label}: nothing left to claim")
            client.post(f"/api/items/{items[0]['id']}/result", json={"result": 1})
            claimed += 1
        else:
            path = {"queue": f"/api/queues/{QUEUE}", "queues": "/api/queues", "metrics": "/metrics"}
            if client.get(path[what]).status_code != 200:
                raise BenchError(f"{side.label}: GET {path[what]} failed")
        latencies.append(time.perf_counter() - started)
        n += 1
    for start in range(0, len(posted), 10_000):
        client.post(
            f"/api/queues/{QUEUE}/items/delete", json={"ids": posted[start : start + 10_000]}
        )
    if claimed:
        client.post(f"/api/queues/{QUEUE}/items/delete", json={"status": "finished"})
        fill(client, claimed, start=side.size)
    return percentile(sorted(latencies), 0.5)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", type=int, default=1000)
    parser.add_argument("--big", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--only", default=",".join(WHAT))
    parser.add_argument("--database-url", default="")
    parser.add_argument("--tmpdir", default=None)
    parser.add_argument("--keep", action="store_true")
    parser.add_argument(
        "--priorities",
        type=int,
        default=1,
        help="the waiting items' priorities cycle through this many levels (1-10; 1: all 0)",
    )
    args = parser.parse_args(argv)
    PRIORITIES[0] = max(1, min(10, args.priorities))
    only = [w for w in args.only.split(",") if w]
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)
    sides: list[Side] = []
    try:
        for label, size in (("small", args.small), ("big", args.big)):
            env = make_environment(args, suffix=label)
            migrate(env)
            key = create_key(env)
            server = Daphne(env, fsync=True)
            sides.append(Side(label, size, env, server, httpx.Client()))
            server.start()
            client = httpx.Client(
                base_url=server.url,
                headers={"Authorization": f"Token {key}"},
                timeout=120,
                trust_env=False,
            )
            sides[-1].client = client
            client.put(f"/api/queues/{QUEUE}", json={})
            started = time.monotonic()
            fill(client, size)
            say(f"{label}: {size:,} waiting, filled in {time.monotonic() - started:.0f} s")
        os.sync()
        say(f"load average {load_average()}")
        for round_ in range(args.rounds):
            for what in only:
                for side in sides:
                    p50 = measure(side, what, args.seconds)
                    side.p50.setdefault(what, []).append(p50)
                    say(f"round {round_ + 1} {side.label:5} {what:8} p50 {p50:7.2f} ms")
        print(
            f"\nFlat from {args.small:,} to {args.big:,} waiting"
            f" ({PRIORITIES[0]} priority level{'s' if PRIORITIES[0] > 1 else ''}): "
            f"{sides[0].env.label}, fsync on, {args.rounds} alternating rounds of "
            f"{args.seconds:g} s, load average {load_average()}"
        )
        print("| what | p50 ms, small | p50 ms, big | big / small |")
        print("|---|---|---|---|")
        for what in only:
            small = statistics.median(sides[0].p50[what])
            big = statistics.median(sides[1].p50[what])
            print(f"| {what} | {small:.2f} | {big:.2f} | {big / small:.2f} |")
        return 0
    except KeyboardInterrupt:
        say("interrupted")
        return 130
    except BenchError as exc:
        say(f"error: {exc}")
        return 1
    finally:
        for side in sides:
            side.client.close()
            side.server.stop()
            destroy_environment(side.env, keep=args.keep)


if __name__ == "__main__":
    sys.exit(main())
