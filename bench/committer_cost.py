"""The committer's own cost per item, in one process: no HTTP, no socket, no pipe.

A measurement, not a test. Against a fresh database and state root (fsync on unless
``--no-fsync``), it runs the engine's real group commits (``runner.run_group``, the function
the committer runs for each group) directly in this process, so what it times is the group
alone: its transaction, its files, its flush, its answers' objects. Four figures:

- ``post``: ``--items`` items posted in groups of one post of 500 (µs per item);
- ``drain``: those items drained in groups shaped like a socket drain's: ``--claims`` claims
  of ``--per`` items each, with the results of the previous group's items (µs per item, a
  claim and a result each; a group holds ``claims * per`` of each);
- ``lone post``: 1,000 groups of one post of one item (µs per group, and the CPU they took,
  the user's and the kernel's);
- ``empty claim``: 1,000 groups of one claim of 16 that finds nothing (the queue drained),
  which a socket's freed slot costs when nothing waits (µs per group).

Beside ``bench/drain.py`` (the same work through daphne, the sockets and the committer
process) it says how much of a drained item's cost is the group's own, and how much the
hops around it::

    .venv/bin/python bench/committer_cost.py
    .venv/bin/python bench/committer_cost.py --per 16 --claims 2       # bigger groups
    .venv/bin/python bench/committer_cost.py --profile /tmp/committer.prof   # cProfile the drain
    .venv/bin/python bench/committer_cost.py --profile-empty /tmp/empty.prof  # ... the empty claims
    .venv/bin/python bench/committer_cost.py --profile-lone /tmp/lone.prof    # ... the lone posts
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
import cProfile
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from bench.core import destroy_environment, load_average, make_environment, migrate, setup_django

T = TypeVar("T")


def profiled(work: Callable[[], T], path: str) -> T:
    """Run ``work``; with a ``path``, under cProfile, its statistics written there."""
    if not path:
        return work()
    profile = cProfile.Profile()
    try:
        return profile.runcall(work)
    finally:
        profile.dump_stats(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=6000)
    parser.add_argument("--per", type=int, default=5, help="items per claim")
    parser.add_argument("--claims", type=int, default=2, help="claims per group")
    parser.add_argument("--no-fsync", dest="fsync", action="store_false")
    parser.add_argument("--database-url", default="")
    parser.add_argument("--tmpdir", default=None)
    parser.add_argument("--profile", default="", help="write a cProfile of the drain here")
    parser.add_argument(
        "--profile-empty", default="", help="write a cProfile of the empty claims here"
    )
    parser.add_argument(
        "--profile-lone", default="", help="write a cProfile of the lone posts here"
    )
    args = parser.parse_args(argv)
    env = make_environment(args)
    try:
        migrate(env)
        setup_django(env)  # (with fsync off, for the setup: set for the measurement below)
        from django.conf import settings
        from django.test.utils import override_settings

        with override_settings(TASKHOSTER={**settings.TASKHOSTER, "FSYNC": args.fsync}):
            return measure(args)
    finally:
        destroy_environment(env, keep=False)


def measure(args: argparse.Namespace) -> int:
    from taskhoster import engine
    from taskhoster.conf import get_conf
    from taskhoster.engine.ops import Claim, NewItem, Result
    from taskhoster.engine.runner import run_group
    from taskhoster.engine.transitions import prepare_post

    engine.upsert_queue(name="bench", body={})
    load_before = load_average()

    def run(ops: list[Any]) -> list[Any]:
        for op in ops:
            op.future = Future()
        run_group(ops, 0)
        return [op.future.result() for op in ops]

    started = time.perf_counter()
    for first in range(0, args.items, 500):
        items = [NewItem(payload={"n": first + k, "pad": "x" * 100}) for k in range(500)]
        run([prepare_post("bench", items)])
    post = (time.perf_counter() - started) / args.items

    def drain() -> int:
        held: list[Any] = []
        done = 0
        while True:
            ops: list[Any] = [
                Claim(queue_name="bench", max_items=args.per, holders=("w",) * args.per)
                for _ in range(args.claims)
            ]
            ops += [Result(item_id=c.row.id, result={"ok": 1}) for c in held]
            answers = run(ops)
            done += len(held)
            held = [c for claimed in answers[: args.claims] for c in claimed]
            if not held:
                return done

    started = time.perf_counter()
    drained = profiled(drain, args.profile)
    per_drained = (time.perf_counter() - started) / max(1, drained)

    # A claim that finds nothing (the queue is drained): what a socket's freed slot costs
    # the committer when nothing waits.
    def empty_claims() -> None:
        for _ in range(1000):
            run([Claim(queue_name="bench", max_items=16, holders=("w",) * 16)])

    started = time.perf_counter()
    profiled(empty_claims, args.profile_empty)
    empty = (time.perf_counter() - started) / 1000

    def lone_posts() -> None:
        for n in range(1000):
            run([prepare_post("bench", [NewItem(payload={"n": n})])])

    started = time.perf_counter()
    times_started = os.times()
    profiled(lone_posts, args.profile_lone)
    lone = (time.perf_counter() - started) / 1000
    times = os.times()
    lone_user = (times.user - times_started.user) / 1000
    lone_system = (times.system - times_started.system) / 1000

    print(
        f"committer cost in one process: fsync {'on' if get_conf().fsync else 'off'}, "
        f"load average {load_before} -> {load_average()}"
    )
    print(f"  post, groups of 500:           {post * 1e6:8.0f} µs per item")
    print(
        f"  drain, {args.claims} claims of {args.per} + results: "
        f"{per_drained * 1e6:8.0f} µs per item ({drained} items)"
    )
    print(
        f"  lone post, groups of one:      {lone * 1e6:8.0f} µs per group "
        f"(CPU: {lone_user * 1e6:.0f} µs user, {lone_system * 1e6:.0f} µs system)"
    )
    print(f"  empty claim, groups of one:    {empty * 1e6:8.0f} µs per group")
    return 0


if __name__ == "__main__":
    sys.exit(main())
