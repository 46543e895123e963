"""PostgreSQL: the engine's statements keep using the item table's indexes after it grows.

The engine's statements are kept prepared on their connection (``prepare_threshold``), and
PostgreSQL may then plan a statement once for any values (a "generic" plan) and keep that
plan until the table is analyzed again. A plan made while the table was small reads the
whole table (for a few rows, that is cheapest); once a burst of posts has grown it to
hundreds of thousands of rows, and until autovacuum's next ANALYZE (up to a minute or
more), every claim and every verdict read all of it: ``bench/background.py`` saw a post's
answer on another queue go from 6-9 ms to 104-188 ms, PostgreSQL busy on a core.

So a server is warmed up on a small item table (its statements prepared, their plans
made), the table grows by ``GROWN`` rows in another queue with autovacuum held off, and
posts claimed and finished through the server must then not read the table through:
PostgreSQL's own count of rows read by sequential scans of the item table
(``pg_stat_user_tables.seq_tup_read``), from before the warm-up to after the server has
stopped (a backend writes its counts as it exits), must stay under one table's worth. The
same run with ``plan_cache_mode=auto`` (PostgreSQL's default, the server's before) must read
it through many times: the test's own proof that its warm-up and growth make the hazard.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest
from django.db import connection

from taskhoster import engine
from taskhoster.models import Item, Queue

from ..conftest import Server, database_url, needs_postgresql
from .wsclient import connect, recv, send, subscribe

pytestmark = [
    pytest.mark.slow,
    needs_postgresql("PostgreSQL's prepared statements' plans"),
]

GROWN = 20_000
# Rounds before the growth: each statement run more than ten times on its connection (the
# driver prepares it at the fifth run; PostgreSQL weighs a plan for any values after five
# more). The small table's own scans are counted too: some 30 a round, of a few rows each.
WARM_UP = 15
ROUNDS = 30
# The server's database sessions' name (this process's pooled sessions have the test's).
SERVER_SESSIONS = "test_plans_after_growth: the server"


def item_table_seq_rows() -> int:
    """Rows read by sequential scans of the item table, as PostgreSQL's statistics say now
    (each call its own snapshot: Django's autocommit)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT seq_tup_read FROM pg_stat_user_tables WHERE relname = 'taskhoster_item'"
        )
        return int(cursor.fetchone()[0])


def sessions_named(name: str) -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE application_name = %s AND pid <> pg_backend_pid()",
            [name],
        )
        return int(cursor.fetchone()[0])


def stopped_and_counted(server: Server) -> int:
    """Stop ``server``, wait until its database sessions have ended (each writes its
    statistics as it exits, before it leaves ``pg_stat_activity``), and count."""
    server.stop()
    name = SERVER_SESSIONS
    deadline = time.monotonic() + 20
    while sessions_named(name) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not sessions_named(name), "the server's database sessions ended"
    return item_table_seq_rows()


def post_claim_finish(server: Server, key: str, rounds: int) -> None:
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


def grow_item_table() -> None:
    """``GROWN`` rows in queue ``big``, copies of an item of ``small`` made by one statement
    (posting them through the engine here would add this process's own reads to the
    count): rows that no statement of the server reads, but the planner counts."""
    template = Item.objects.filter(queue__name="small").values_list("id", flat=True)[0]
    big = Queue.objects.get(name="big").id
    others = [
        str(f.column) for f in Item._meta.concrete_fields if f.column not in ("id", "queue_id")
    ]
    columns = ", ".join(f'"{c}"' for c in others)
    copied = ", ".join("NULL" if c == "key" else f't."{c}"' for c in others)
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO taskhoster_item (id, queue_id, {columns}) "
            f"SELECT 'grown' || lpad(g::text, 8, '0'), %s, {copied} "
            "FROM taskhoster_item t, generate_series(1, %s) g WHERE t.id = %s",
            [big, GROWN, template],
        )
        assert cursor.rowcount == GROWN


def rows_read_after_growth(server_factory: Any, key: str, **env: str) -> int:
    """Rows of the item table read by sequential scans while a server (``env``) is warmed
    up on a small table, the table grows by ``GROWN`` rows, and ``ROUNDS`` more items are
    posted, claimed and finished."""
    with connection.cursor() as cursor:
        # Held off so that no ANALYZE (which makes the server plan its statements again)
        # comes between the growth and the count.
        cursor.execute("ALTER TABLE taskhoster_item SET (autovacuum_enabled = false)")
    try:
        with connection.cursor() as cursor:
            cursor.execute("ANALYZE taskhoster_item")
        engine.upsert_queue(name="small", body={})
        engine.upsert_queue(name="big", body={})
        before = item_table_seq_rows()
        # Prepared statements explicitly, whatever the caller's environment says.
        server = server_factory(TASKHOSTER_DB_PREPARE="1", PGAPPNAME=SERVER_SESSIONS, **env)
        post_claim_finish(server, key, WARM_UP)  # prepared, and planned, on a small table
        grow_item_table()
        post_claim_finish(server, key, ROUNDS)
        return stopped_and_counted(server) - before
    finally:
        with connection.cursor() as cursor:
            cursor.execute("ALTER TABLE taskhoster_item RESET (autovacuum_enabled)")


def test_statements_prepared_on_a_small_item_table_use_its_indexes_once_it_has_grown(
    server_factory, make_key
):
    read = rows_read_after_growth(server_factory, make_key())
    print(f"\n{ROUNDS} rounds on a table grown by {GROWN:,} rows: {read:,} rows read by scans")
    assert read < GROWN, (
        f"{ROUNDS} posts claimed and finished read {read:,} rows of the item table by "
        f"sequential scans ({read / GROWN:.0f} times the {GROWN:,} rows it grew by)"
    )


def test_with_plans_kept_for_any_values_the_grown_item_table_is_read_through(
    server_factory, make_key
):
    """The control: PostgreSQL's default ``plan_cache_mode`` (``auto``), through
    DATABASE_URL's options, keeps the plans made on the small table."""
    url = database_url() + "?options=-c%20plan_cache_mode%3Dauto"
    read = rows_read_after_growth(server_factory, make_key(), DATABASE_URL=url)
    print(f"\nwith plan_cache_mode=auto: {read:,} rows read by scans")
    assert read >= 10 * GROWN, f"only {read:,} rows read: the warm-up made no plan to keep"
