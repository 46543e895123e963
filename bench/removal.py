"""Removing many items at once: a whole queue, and a queue's items by status.

A benchmark, not a test. Against one real daphne (fresh database and state root, fsync on),
for ``--items`` (1,000,000) items posted over HTTP in batches of 1,000:

- ``DELETE /api/queues/bench``: how long the request takes, that every later call answers
  404 and that the name can be created again at once; then how long the rows and files take
  to be reclaimed behind it (polled through the database and the trash directory);
- ``POST /api/queues/bench/items/delete {"status": "pending"}``: how long one request takes
  for all of them, and the rate; then how long their files take to be unlinked behind it.

::

    .venv/bin/python bench/removal.py --items 1000000
    .venv/bin/python bench/removal.py --items 1000000 --only status
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
import sqlite3
import time

import httpx

from bench.core import (
    QUEUE,
    BenchError,
    Daphne,
    _interrupt,
    destroy_environment,
    load_average,
    make_environment,
    migrate,
    say,
)
from bench.flat import create_key, fill


def items_left(env: object, queue_id: int | None = None) -> int:
    url = env.database_url  # type: ignore[attr-defined]
    if url.startswith("sqlite:///"):
        with sqlite3.connect(url.removeprefix("sqlite:///")) as db:
            return int(db.execute("SELECT count(*) FROM taskhoster_item").fetchone()[0])
    import psycopg

    with psycopg.connect(url) as db:
        row = db.execute("SELECT count(*) FROM taskhoster_item").fetchone()
        assert row is not None  # a count(*) always has its one row
        return int(row[0])


def measure_queue_delete(args, env, client, lines) -> None:
    started = time.monotonic()
    fill(client, args.items)
    os.sync()
    say(f"filled {args.items:,} in {time.monotonic() - started:.0f} s")
    started = time.monotonic()
    answer = client.delete(f"/api/queues/{QUEUE}")
    took = time.monotonic() - started
    if answer.status_code != 204:
        raise BenchError(f"DELETE queue: {answer.status_code} {answer.text[:200]}")
    gone = client.get(f"/api/queues/{QUEUE}").status_code
    again = client.put(f"/api/queues/{QUEUE}", json={}).status_code
    lines.append(
        f"| DELETE a queue of {args.items:,} | {took * 1000:.0f} ms | then GET: {gone}, "
        f"PUT the same name: {again} |"
    )
    started = time.monotonic()
    while items_left(env) > 0 or any(env.root.joinpath(".trash").iterdir()):
        if time.monotonic() - started > args.timeout:
            raise BenchError("the deleted queue was not reclaimed in time")
        time.sleep(0.5)
    reclaimed = time.monotonic() - started
    lines.append(
        f"| reclaiming its rows and files behind it | {reclaimed:.1f} s | "
        f"{args.items / reclaimed:,.0f} items/s |"
    )


def measure_status_delete(args, env, client, lines) -> None:
    started = time.monotonic()
    fill(client, args.items)
    os.sync()
    say(f"filled {args.items:,} again in {time.monotonic() - started:.0f} s")
    started = time.monotonic()
    answer = client.post(f"/api/queues/{QUEUE}/items/delete", json={"status": "pending"})
    took = time.monotonic() - started
    if answer.status_code != 200:
        raise BenchError(f"delete by status: {answer.status_code} {answer.text[:200]}")
    deleted = answer.json()["deleted"]
    lines.append(
        f"| POST items/delete {{status: pending}}, {deleted:,} items | {took:.1f} s | "
        f"{deleted / took:,.0f} items/s |"
    )
    # Their files are unlinked behind the answer (lists under .trash/, see FileBatch).
    started = time.monotonic()
    pending_dir = env.root / QUEUE / "pending"
    while any(env.root.joinpath(".trash").glob("*.unlink")) or any(pending_dir.iterdir()):
        if time.monotonic() - started > args.timeout:
            raise BenchError("the deleted items' files were not reclaimed in time")
        time.sleep(0.5)
    reclaimed = time.monotonic() - started
    lines.append(f"| their files unlinked behind the answer | {reclaimed:.1f} s more | |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=1_000_000)
    parser.add_argument("--database-url", default="")
    parser.add_argument("--tmpdir", default=None)
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument(
        "--only", choices=["queue", "status"], default=None, help="one of the two measurements"
    )
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)
    env = None
    server = None
    lines: list[str] = []
    try:
        env = make_environment(args)
        migrate(env)
        key = create_key(env)
        server = Daphne(env, fsync=True)
        server.start()
        with httpx.Client(
            base_url=server.url,
            headers={"Authorization": f"Token {key}"},
            timeout=args.timeout,
            trust_env=False,
        ) as client:
            # -- a whole queue --------------------------------------------------------------
            client.put(f"/api/queues/{QUEUE}", json={})
            if args.only != "status":
                measure_queue_delete(args, env, client, lines)
            if args.only != "queue":
                measure_status_delete(args, env, client, lines)
        print(
            f"\nRemoving {args.items:,} items: {env.label}, fsync on, load average {load_average()}"
        )
        print("| what | took | note |")
        print("|---|---|---|")
        for line in lines:
            print(line)
        return 0
    except KeyboardInterrupt:
        say("interrupted")
        return 130
    except BenchError as exc:
        say(f"error: {exc}")
        for line in lines:
            print(line)
        return 1
    finally:
        if server is not None:
            server.stop()
        if env is not None:
            destroy_environment(env, keep=args.keep)


if __name__ == "__main__":
    sys.exit(main())
