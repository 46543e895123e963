"""PostgreSQL: a prepared statement's plan, kept or made again at each run.

A benchmark, not a test. The engine keeps its statements prepared on each connection
(``prepare_threshold``). PostgreSQL may then plan a statement once for any values (a
"generic" plan) and keep it until the table is next analyzed; ``plan_cache_mode`` decides.
In a scratch database, a table shaped like the item table's columns that a claim writes,
and the engine's statement for it (``UPDATE ... FROM unnest(...)`` of one row, prepared),
run under each mode, on its own connection:

- ``steady``: the table has ``--rows`` (200,000) rows and is analyzed; the statement's
  median time over ``--runs`` (3,000) runs (what planning at each run costs);
- ``grown``: the table has 300 rows and is analyzed, the statement runs 20 times (its plan
  settles), then the table grows by ``--rows`` rows with no ANALYZE between (a burst of
  posts before autovacuum's next look); the statement's median over 200 runs.

Each row is one connection's; the modes alternate, ``--rounds`` (3) times::

    .venv/bin/python bench/plans.py
    .venv/bin/python bench/plans.py --database-url postgres://postgres@127.0.0.1:5432/postgres
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
import datetime
import statistics
import time
from typing import Any
from urllib.parse import urlsplit

import psycopg
from psycopg.conninfo import make_conninfo

from bench.core import LOCAL_HOSTS, BenchError, _pg_execute, load_average, say

MODES = ("auto", "force_custom_plan", "force_generic_plan")
COLUMNS = (
    ("attempts", "int"),
    ("claimed_at", "timestamptz"),
    ("claimed_by", "varchar"),
    ("eligible", "bool"),
    ("lease", "varchar"),
    ("lease_expires_at", "timestamptz"),
    ("status", "varchar"),
    ("updated_at", "timestamptz"),
)
UPDATE = (
    "UPDATE plan_item AS t SET "
    + ", ".join(f'"{c}" = v."{c}"' for c, _ in COLUMNS)
    + " FROM unnest(%s::varchar[], "
    + ", ".join(f"%s::{t}[]" for _, t in COLUMNS)
    + ') AS v("id", '
    + ", ".join(f'"{c}"' for c, _ in COLUMNS)
    + ') WHERE t.id = v."id"'
)


def fill(conn: psycopg.Connection[Any], first: int, count: int) -> None:
    conn.execute(
        "INSERT INTO plan_item SELECT 'i' || g, 0, NULL, NULL, true, NULL, NULL, 'pending', "
        "now() FROM generate_series(%s::int, %s::int) g",
        [first, first + count - 1],
    )


def make_table(url: str, rows: int) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS plan_item")
        conn.execute(
            "CREATE TABLE plan_item (id varchar(64) PRIMARY KEY, "
            + ", ".join(f"{c} {t}" for c, t in COLUMNS)
            + ") WITH (autovacuum_enabled = false)"
        )
        fill(conn, 1, rows)
        conn.execute("ANALYZE plan_item")


def timed_runs(conn: psycopg.Connection[Any], runs: int, rows: int, skip: int = 0) -> float:
    """The median µs of ``runs`` runs of the statement (one row each), the first ``skip``
    not counted."""
    now = datetime.datetime.now(datetime.UTC)
    took = []
    for n in range(runs):
        values = [[f"i{(n * 7919) % rows + 1}"], [1], [now], ["w"], [False], ["l"], [now]]
        values += [["processing"], [now]]
        started = time.perf_counter()
        conn.execute(UPDATE, values, prepare=True)
        took.append(time.perf_counter() - started)
    return statistics.median(took[skip:]) * 1e6


def connect(url: str, mode: str) -> psycopg.Connection[Any]:
    return psycopg.connect(
        url, autocommit=True, options=f"-c plan_cache_mode={mode} -c synchronous_commit=off"
    )


def steady(url: str, mode: str, args: argparse.Namespace) -> float:
    with connect(url, mode) as conn:
        return timed_runs(conn, args.runs, args.rows, skip=100)


def grown(url: str, mode: str, args: argparse.Namespace) -> float:
    make_table(url, 300)
    with connect(url, mode) as conn:
        timed_runs(conn, 20, 300)
        fill(conn, 301, args.rows)
        return timed_runs(conn, 200, 300)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database-url", default="postgres://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--runs", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    if urlsplit(args.database_url).hostname not in LOCAL_HOSTS:
        raise BenchError("this benchmark only talks to 127.0.0.1: use a local PostgreSQL")
    name = f"bench_plans_{os.getpid()}"
    url = make_conninfo(args.database_url, dbname=name)
    results: dict[str, dict[str, list[float]]] = {m: {"steady": [], "grown": []} for m in MODES}
    _pg_execute(args.database_url, "CREATE DATABASE {}", name)
    try:
        with psycopg.connect(url) as conn:
            version = conn.execute("SHOW server_version").fetchone()
        say(f"PostgreSQL {version[0] if version else '?'}")
        for _ in range(args.rounds):
            make_table(url, args.rows)
            for mode in MODES:
                results[mode]["steady"].append(steady(url, mode, args))
            for mode in MODES:
                results[mode]["grown"].append(grown(url, mode, args))
            say({m: {k: [round(x) for x in v] for k, v in r.items()} for m, r in results.items()})
    finally:
        _pg_execute(args.database_url, "DROP DATABASE IF EXISTS {} WITH (FORCE)", name)
    print()
    print(f"one row's UPDATE ... FROM unnest, prepared: median µs of each round; {load_average()}")
    print(f"{'plan_cache_mode':<20} {'steady':<{8 * args.rounds}}  grown by {args.rows:,}")
    for mode in MODES:
        steady_us = "".join(f"{x:>8,.0f}" for x in results[mode]["steady"])
        grown_us = "".join(f"{x:>9,.0f}" for x in results[mode]["grown"])
        print(f"{mode:<20} {steady_us:<{8 * args.rounds}}  {grown_us}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchError as exc:
        say(f"error: {exc}")
        sys.exit(2)
