"""What an item costs on disk: the state root's blocks and inodes, and the index, per item.

A measurement, not a test. On a fresh database and state root (in ``--tmpdir``, so on that
filesystem), ``--items`` (100,000) items with a ~100-byte payload are posted in batches of
1,000 through the engine, in this process (the files are the same as over HTTP); then, with
``--finished``, all of them are claimed and finished too (a finished item's file holds its
result as well). It prints the blocks (``du``), the apparent size and the inodes of the
state root, and the size of the index, each per item::

    .venv/bin/python bench/disk.py --items 100000
    .venv/bin/python bench/disk.py --items 100000 --database-url postgres://postgres@127.0.0.1:5432/postgres
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
import subprocess
import time

from bench.core import (
    QUEUE,
    destroy_environment,
    filesystem_of,
    make_environment,
    migrate,
    say,
    setup_django,
)

BATCH = 1000


def du(path: str, *flags: str) -> int:
    out = subprocess.run(["du", "-s", *flags, path], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=100_000)
    parser.add_argument("--finished", action="store_true", help="also claim and finish them")
    parser.add_argument("--database-url", default="")
    parser.add_argument("--tmpdir", default=None)
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args(argv)
    env = make_environment(args)
    try:
        migrate(env)
        setup_django(env)
        from django.db import connection

        from taskhoster import engine

        engine.upsert_queue(name=QUEUE, body={})
        started = time.monotonic()
        for start in range(0, args.items, BATCH):
            engine.post_items(
                queue_name=QUEUE,
                items=[
                    engine.NewItem(payload={"job": "email", "n": n, "to": "someone@example.com"})
                    for n in range(start, min(args.items, start + BATCH))
                ],
            )
        if args.finished:
            while claimed := engine.claim(queue_name=QUEUE, max_items=100):
                for item in claimed:
                    engine.submit_result(item_id=item.row.id, result={"ok": True})
        say(f"{args.items:,} items in {time.monotonic() - started:.0f} s")
        os.sync()
        root = str(env.root)
        blocks = du(root, "--block-size=1")
        apparent = du(root, "--block-size=1", "--apparent-size")
        inodes = du(root, "--inodes")
        with connection.cursor() as cursor:
            if connection.vendor == "postgresql":
                cursor.execute("SELECT pg_database_size(current_database())")
                index = int(cursor.fetchone()[0])
            else:
                index = sum(
                    os.path.getsize(env.tmp / name)
                    for name in os.listdir(env.tmp)
                    if name.endswith((".sqlite3", ".sqlite3-wal"))
                )
        n = args.items
        print(
            f"\n{n:,} items ({'finished' if args.finished else 'pending'}), ~100-byte payloads; "
            f"state root on {filesystem_of(env.root)}; index on {env.label}"
        )
        print("| what | total | per item |")
        print("|---|---|---|")
        print(f"| state root, blocks (du) | {blocks / 1e6:,.1f} MB | {blocks / n:,.0f} bytes |")
        print(
            f"| state root, apparent size | {apparent / 1e6:,.1f} MB | {apparent / n:,.0f} bytes |"
        )
        print(f"| state root, inodes | {inodes:,} | {inodes / n:.2f} |")
        print(f"| index ({env.label}) | {index / 1e6:,.1f} MB | {index / n:,.0f} bytes |")
        return 0
    finally:
        destroy_environment(env, keep=args.keep)


if __name__ == "__main__":
    sys.exit(main())
