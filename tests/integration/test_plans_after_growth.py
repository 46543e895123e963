"""PostgreSQL: the engine's statements keep using the item table's indexes after it grows.

The engine's statements are kept prepared on their connection (``prepare_threshold``), and
PostgreSQL may then plan a statement once for any values (a "generic" plan) and keep that
plan until the table is analyzed again. A plan made while the table was small reads the
whole table (for a few rows, that is cheapest); once a burst of posts has grown it to
hundreds of thousands of rows, and until autovacuum's next ANALYZE (up to a minute or
more), every claim and every verdict read all of it: ``bench/background.py`` saw the
post→worker latency on another queue go from 6 ms to 190 ms, PostgreSQL busy on a core.

So a server is warmed up on a small item table (its statements prepared, their plans
made), the table grows by ``GROWN`` rows in another queue with autovacuum held off, and
posts claimed and finished through the server must then not read the table through:
PostgreSQL's own count of rows read by sequential scans of the item table
(``pg_stat_user_tables.seq_tup_read``) must not grow by one table's worth.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest
from django.db import connection

from taskhoster import engine

from ..conftest import database_url
from .wsclient import connect, recv, send, subscribe

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        database_url().startswith("sqlite"), reason="PostgreSQL's prepared statements' plans"
    ),
]

GROWN = 20_000
ROUNDS = 30


def item_table_reads() -> tuple[int, int]:
    """(rows read by sequential scans, index scans) of the item table, as PostgreSQL's
    statistics say now (each call its own snapshot: Django's autocommit)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT seq_tup_read, coalesce(idx_scan, 0) FROM pg_stat_user_tables "
            "WHERE relname = 'taskhoster_item'"
        )
        seq_rows, index_scans = cursor.fetchone()
    return int(seq_rows), int(index_scans)


def settled_reads(deadline_seconds: float = 20.0) -> tuple[int, int]:
    """The counts once every backend has reported its statistics: unchanged over two
    seconds (a busy backend reports at most once a second; an idle one within a second)."""
    deadline = time.monotonic() + deadline_seconds
    before = item_table_reads()
    while time.monotonic() < deadline:
        time.sleep(2.0)
        now = item_table_reads()
        if now == before:
            return now
        before = now
    raise AssertionError("PostgreSQL's statistics of the item table did not settle")


def post_claim_finish(server: Any, key: str, rounds: int) -> None:
    """``rounds`` items, each posted, pushed to one socket, and finished with a result."""

    async def run() -> None:
        ws = await connect(server, key)
        await subscribe(ws, ["small"], 1)
        async with httpx.AsyncClient(
            base_url=server.url, headers={"Authorization": f"Token {key}"}, timeout=30
        ) as http:
            for n in range(rounds):
                answer = await http.post("/api/queues/small/items", json={"payload": n})
                assert answer.status_code == 201, answer.text
                frame = await recv(ws, timeout=30)
                assert frame["type"] == "item", frame
                await send(ws, {"type": "result", "id": frame["id"], "result": {"n": n}})
                ack = await recv(ws, timeout=30)
                assert (ack["type"], ack["id"], ack["accepted"]) == ("ack", frame["id"], True)
        await ws.close()

    asyncio.run(run())


def test_statements_prepared_on_a_small_item_table_use_its_indexes_once_it_has_grown(
    server_factory, make_key
):
    with connection.cursor() as cursor:
        # Held off so that no ANALYZE (which makes the server plan its statements again)
        # comes between the growth and the count.
        cursor.execute("ALTER TABLE taskhoster_item SET (autovacuum_enabled = false)")
        cursor.execute("ANALYZE taskhoster_item")
    try:
        engine.upsert_queue(name="small", body={})
        engine.upsert_queue(name="big", body={})
        server = server_factory()
        key = make_key()
        post_claim_finish(server, key, ROUNDS)  # prepared, and planned, on a small table
        for start in range(0, GROWN, 1000):
            engine.post_items(
                queue_name="big",
                items=[engine.NewItem(payload=start + n) for n in range(1000)],
            )
        seq_rows_before, index_scans_before = settled_reads()
        post_claim_finish(server, key, ROUNDS)
        seq_rows, index_scans = settled_reads()
    finally:
        with connection.cursor() as cursor:
            cursor.execute("ALTER TABLE taskhoster_item RESET (autovacuum_enabled)")
    assert index_scans > index_scans_before, "the rounds' statements were counted"
    read = seq_rows - seq_rows_before
    print(f"\n{ROUNDS} rounds on a table grown by {GROWN:,} rows: {read:,} rows read by scans")
    assert read < GROWN, (
        f"{ROUNDS} posts claimed and finished read {read:,} rows of the item table by "
        f"sequential scans ({read / GROWN:.0f} times the {GROWN:,} rows it grew by)"
    )
