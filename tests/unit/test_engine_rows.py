"""Writing rows back (``engine.rows.update_rows``), on whichever database the suite runs on:
on PostgreSQL every set of changed columns goes in one ``UPDATE ... FROM (VALUES ...)``, its
values cast to the columns' types; on SQLite, an ``executemany``. Either way each row reads
back exactly as it was changed."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.db import connection, transaction

from taskhoster import engine
from taskhoster.engine import rows as sql

pytestmark = pytest.mark.django_db


def _posted(queue: str, n: int) -> list[str]:
    posted = engine.post_items(
        queue_name=queue, items=[engine.NewItem(payload=i) for i in range(n)]
    )
    return [p.row.id for p in posted]


def test_rows_changed_in_one_shape_read_back_as_changed(make_queue: Any) -> None:
    make_queue("q")
    ids = _posted("q", 3)
    at = datetime(2026, 12, 1, 10, 0, 0, 123456, tzinfo=UTC)
    with transaction.atomic():
        rows = sql.select_rows(ids, lock=True)
        for n, item_id in enumerate(ids):
            # One shape for all three: a column NULL in every row (a VALUES column of NULLs
            # alone would be text), a time NULL in one row only, JSON, text and integers.
            rows[item_id].set(
                status="processing",
                lease=None,
                lease_expires_at=None if n == 0 else at + timedelta(seconds=n),
                claimed_at=at,
                origin={"n": n, "tags": ["a", "é"]},
                error=f"e{n}",
                attempts=n + 1,
            )
        sql.update_rows(rows.values())
    again = sql.select_rows(ids, lock=False)
    for n, item_id in enumerate(ids):
        row = again[item_id]
        assert row.status == "processing"
        assert row.lease is None
        assert row.lease_expires_at == (None if n == 0 else at + timedelta(seconds=n))
        assert row.claimed_at == at
        assert row.origin == {"n": n, "tags": ["a", "é"]}
        assert (row.error, row.attempts) == (f"e{n}", n + 1)


def test_rows_of_several_shapes_each_get_only_their_own_columns(make_queue: Any) -> None:
    make_queue("q")
    ids = _posted("q", 4)
    with transaction.atomic():
        rows = sql.select_rows(ids, lock=True)
        before = {i: (r.error, r.attempts) for i, r in rows.items()}
        rows[ids[0]].set(error="only this")
        rows[ids[1]].set(attempts=7)
        rows[ids[2]].set(error="both", attempts=9)
        sql.update_rows(rows.values())
    again = sql.select_rows(ids, lock=False)
    assert (again[ids[0]].error, again[ids[0]].attempts) == ("only this", before[ids[0]][1])
    assert (again[ids[1]].error, again[ids[1]].attempts) == (before[ids[1]][0], 7)
    assert (again[ids[2]].error, again[ids[2]].attempts) == ("both", 9)
    assert (again[ids[3]].error, again[ids[3]].attempts) == before[ids[3]]


def test_the_rules_read_every_queue_setting_declared_once() -> None:
    """``QueueInfo`` (what the rules read) has a field for each declared queue setting, in the
    order the engine's query reads them."""
    from dataclasses import fields

    from taskhoster.engine import QUEUE_SETTINGS
    from taskhoster.engine.rows import QUEUE_COLUMNS
    from taskhoster.engine.rules import QueueInfo

    declared = ("id", "name", *(s.field for s in QUEUE_SETTINGS), "deleting")
    assert tuple(f.name for f in fields(QueueInfo)) == declared == QUEUE_COLUMNS


@pytest.mark.parametrize("microsecond", [0, 123456])
def test_a_time_written_by_the_engine_is_the_text_djangos_adapter_writes_and_reads_back(
    microsecond: int,
) -> None:
    """The engine's short way with UTC times (SQLite's naive text without Django's adapter)
    writes what the adapter writes, and reads every form a time comes back in as the same
    aware UTC time."""
    from django.db import connection

    at = datetime(2026, 12, 3, 10, 21, 44, microsecond, tzinfo=UTC)
    assert sql.adapt_time(at) == connection.ops.adapt_datetimefield_value(at)
    assert sql.read_time(str(at.replace(tzinfo=None))) == at  # naive text (SQLite)
    assert sql.read_time(at.isoformat()) == at  # text with its zone
    assert sql.read_time(at.replace(tzinfo=None)) == at  # a naive datetime
    assert sql.read_time(at) == at
    back = sql.read_time(at.isoformat(" ").replace("+00:00", "-05:00"))
    assert back == at + timedelta(hours=5), "an offset in the text is kept, not taken for UTC"
    assert sql.read_time(at.isoformat().replace("+00:00", "Z")) == at
    assert sql.read_time("2026-12-03") == datetime(2026, 12, 3, tzinfo=UTC)
    assert sql.read_time(None) is None


def test_the_dialect_is_the_connections_and_is_found_again_when_databases_change() -> None:
    from django.conf import settings
    from django.core.signals import setting_changed
    from django.db import connection

    assert sql.dialect().vendor in (connection.vendor, "other")
    assert sql._dialect is not None
    # What the end of an override of DATABASES sends (Django warns against its start).
    setting_changed.send(sender=None, setting="DATABASES", value=settings.DATABASES, enter=False)
    assert sql._dialect is None
    assert sql.dialect() is sql.DIALECTS.get(connection.vendor, sql.OTHER)


def test_a_row_pickled_to_the_committer_process_and_back_keeps_every_field(
    make_queue: Any,
) -> None:
    import pickle
    from dataclasses import fields

    make_queue("q")
    (item_id,) = _posted("q", 1)
    with transaction.atomic():
        row = sql.select_rows([item_id], lock=True)[item_id]
    row.queue_name = "q"
    row.set(error="boom", origin={"from": ["a", 1]}, attempts=2)
    back = pickle.loads(pickle.dumps(row, protocol=pickle.HIGHEST_PROTOCOL))
    for f in fields(row):
        assert getattr(back, f.name) == getattr(row, f.name), f.name
    assert back.dirty is not row.dirty
    snapshot = row.snapshot()
    assert snapshot.dirty == set()
    assert snapshot is not row
    assert [getattr(snapshot, f.name) for f in fields(row)][:-1] == [
        getattr(row, f.name) for f in fields(row)
    ][:-1]
    row.set(attempts=3)
    assert snapshot.attempts == 2, "a snapshot does not follow later changes"


def test_engine_statements_raise_djangos_errors_and_whatever_records_queries_sees_them(
    make_queue: Any,
) -> None:
    """On SQLite the project's backend converts each distinct statement's ``%s`` marks once
    (``taskhoster.db.sqlite``), under Django's own cursor: a database error is still
    Django's (the committer tells a lost key race, ``IntegrityError``, from a dropped
    connection by it), a test or ``DEBUG`` that records queries and an ``execute_wrapper``
    still see every statement, and a statement run again is not converted again."""
    from django.db import DatabaseError, IntegrityError, connection
    from django.test.utils import CaptureQueriesContext

    make_queue("q")
    ids = _posted("q", 2)
    rows = sql.select_rows(ids, lock=False)
    with pytest.raises(IntegrityError), transaction.atomic():
        sql.insert_rows([rows[ids[0]]])  # its id is taken
    with CaptureQueriesContext(connection) as seen:
        again = sql.select_rows(ids, lock=False)
    assert set(again) == set(ids)
    assert any(sql.ITEM in q["sql"] for q in seen.captured_queries), seen.captured_queries
    wrapped: list[str] = []

    def watch(execute: Any, query: str, *args: Any) -> Any:
        wrapped.append(query)
        return execute(query, *args)

    with connection.execute_wrapper(watch):
        sql.select_rows(ids, lock=False)
    assert any(sql.ITEM in q for q in wrapped), wrapped
    # Statements that differ only in what they skip, bound as they should be.
    at = datetime.now(UTC) + timedelta(seconds=1)
    assert [r.id for r in sql.claim_candidates(rows[ids[0]].queue_id, at, 2)] == ids
    assert [r.id for r in sql.claim_candidates(rows[ids[0]].queue_id, at, 2, ids[:1])] == ids[1:]
    with pytest.raises(DatabaseError), transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SELECT id FROM taskhoster_no_such_table WHERE id = %s", [1])
    if sql.dialect() is sql.SQLITE:
        from taskhoster.db.sqlite.base import CursorWrapper, _qmark

        with connection.cursor() as cursor:
            assert isinstance(cursor.cursor, CursorWrapper)  # under Django's wrappers
        query = sql.claim_query(rows[ids[0]].queue_id, at, 2)[0]
        assert _qmark(query) is _qmark(query)  # converted once, kept
        assert "%s" not in _qmark(query)


def _copies(queue: str, n: int) -> list[Any]:
    """``n`` new rows (not yet in the table) like a posted item's, each with every kind of
    value a column holds: times (one NULL), JSON with text beyond ASCII, NULLs, a key."""
    from dataclasses import replace

    from taskhoster.ids import new_ids

    (model,) = sql.select_rows(_posted(queue, 1), lock=False).values()
    at = datetime(2026, 12, 4, 9, 30, 0, 654321, tzinfo=UTC)
    return [
        replace(
            model,
            id=item_id,
            key=f"k-{n}-{i}",
            seq=f"{model.seq}{i:04d}",
            claimed_at=None if i == 0 else at + timedelta(seconds=i),
            origin={"from": "é", "i": i},
            progress=None if i % 2 else {"done": i},
            error=None if i == 0 else "'quoted' \"text\", {braces} \\ back",
            priority=i % 10,
            dirty=set(),
        )
        for i, item_id in enumerate(new_ids(n))
    ]


@pytest.mark.parametrize("pipelined", [False, True], ids=["alone", "in-a-pipeline"])
@pytest.mark.parametrize("n", [1, 40])
def test_new_rows_read_back_as_written_in_and_out_of_a_pipeline(
    make_queue: Any, n: int, pipelined: bool
) -> None:
    """``insert_rows`` writes a row three ways (PostgreSQL: ``COPY`` alone, one array per
    column in a pipeline; SQLite: ``executemany`` either way); each reads back field for
    field as it was made, whatever the number of rows."""
    make_queue("q")
    rows = _copies("q", n)
    with sql.group_transaction(pipelined):
        sql.insert_rows(rows)
    again = sql.select_rows([r.id for r in rows], lock=False)
    for row in rows:
        got = again[row.id]
        wanted = {f: getattr(row, f) for f in sql.COLUMNS}
        assert {f: getattr(got, f) for f in sql.COLUMNS} == wanted


def test_an_error_in_a_pipeline_is_djangos_and_leaves_nothing(make_queue: Any) -> None:
    """A statement that fails in a pipeline (a taken id: what a lost key race meets) is
    raised as Django's ``IntegrityError`` where the answers are next read, so the committer
    still tells a lost race from a dropped connection; the transaction fails whole, and the
    connection serves the next group."""
    from django.db import IntegrityError

    make_queue("q")
    rows = _copies("q", 2)
    taken = sql.select_rows(_posted("q", 1), lock=False)

    def lose_a_race() -> None:
        with sql.group_transaction():
            sql.insert_rows(rows[:1])
            sql.insert_rows(list(taken.values()))
            sql.select_rows([rows[0].id], lock=True)

    with pytest.raises(IntegrityError):
        lose_a_race()
    assert sql.select_rows([r.id for r in rows], lock=False) == {}
    with sql.group_transaction():
        sql.insert_rows(rows)
    assert set(sql.select_rows([r.id for r in rows], lock=False)) == {r.id for r in rows}


@pytest.mark.parametrize("pipelined", [False, True], ids=["alone", "in-a-pipeline"])
def test_every_column_changed_reads_back_as_written_in_and_out_of_a_pipeline(
    make_queue: Any, pipelined: bool
) -> None:
    """``update_rows`` sets every column a change can touch (PostgreSQL: from one array per
    column, each text, NULL, time, JSON, flag and number passing through an array's
    quoting) and each row reads back field for field as it was set."""
    make_queue("q")
    rows = _copies("q", 6)
    with sql.group_transaction(pipelined):
        sql.insert_rows(rows)
    at = datetime(2026, 12, 4, 13, 0, 0, 1, tzinfo=UTC)
    odd = "{\"a\", 'b'} \\ NULL ,;()"
    with sql.group_transaction(pipelined):
        again = sql.select_rows([r.id for r in rows], lock=True)
        for i, row in enumerate(again.values()):
            row.set(
                status="failed" if i % 2 else "processing",
                eligible=bool(i % 2),
                thread_id=None if i % 3 else f"t {odd} {i}",
                key=None if i == 1 else f"k2 {odd} {i}",
                seq=f"s{i}",
                scheduled_at=at + timedelta(seconds=i),
                attempts=i * 1000,
                lease=None if i % 2 else "NULL",
                lease_expires_at=None if i % 2 else at,
                claimed_at=at - timedelta(days=i),
                finished_at=None if i == 0 else at,
                fetched_at=None,
                error=None if i == 2 else odd + "é" * i,
                origin=None if i == 3 else {"odd": odd, "i": i, "list": [None, True, 1.5]},
                dead_letter=None if i % 2 else "dl",
                rev=i + 100,
                updated_at=at,
                priority=9 - i,
                claimed_by=None if i == 4 else f"socket {odd}",
                progress={"p": [i, odd]} if i % 2 else None,
                cancel_reason=None if i % 3 else "NULL",
            )
        sql.update_rows(again.values())
    wanted = {r.id: {f: getattr(r, f) for f in sql.COLUMNS} for r in again.values()}
    read = sql.select_rows([r.id for r in rows], lock=False)
    assert {i: {f: getattr(r, f) for f in sql.COLUMNS} for i, r in read.items()} == wanted


def test_an_update_refuses_a_text_longer_than_its_column(make_queue: Any) -> None:
    """A text too long for its column is refused by the database where it enforces lengths
    (PostgreSQL), never cut short on the way (a cast of the whole array to the column's
    length would cut it); SQLite keeps it whole."""
    from django.db import DataError

    make_queue("q")
    (row,) = sql.select_rows(_posted("q", 1), lock=False).values()
    long = "x" * 201  # claimed_by is 200 characters at most

    def write() -> None:
        with sql.group_transaction():
            row.set(claimed_by=long)
            sql.update_rows([row])

    if connection.vendor == "postgresql":
        with pytest.raises(DataError):
            write()
        assert sql.select_rows([row.id], lock=False)[row.id].claimed_by is None
    else:
        write()
        assert sql.select_rows([row.id], lock=False)[row.id].claimed_by == long


def test_a_statement_on_many_ids_is_one_text_and_the_server_keeps_it_prepared(
    make_queue: Any,
) -> None:
    """On PostgreSQL a list of ids is bound as one array, so the statement that reads
    them is the same text for 1 or 40 ids, and once run a few times the server holds it
    prepared (``prepare_threshold`` in the project's settings): it is parsed once, not
    once a group. SQLite's statements are prepared by its own cache; nothing to see."""
    make_queue("q")
    ids = _posted("q", 40)
    seen: list[str] = []

    def record(execute: Any, query: str, params: Any, many: bool, context: Any) -> Any:
        seen.append(query)
        return execute(query, params, many, context)

    with connection.execute_wrapper(record):
        for n in (1, 40, 2, 3, 4, 5, 6):
            sql.select_rows(ids[:n], lock=False)
    if connection.vendor != "postgresql":
        assert len(seen) == 7
        return
    assert len(set(seen)) == 1, set(seen)
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_prepared_statements WHERE statement = %s",
            [seen[0].replace("%s", "$1")],
        )
        assert cursor.fetchone()[0] == 1


@pytest.mark.django_db(transaction=True)
def test_a_groups_transaction_on_postgresql_sets_autocommit_outside_its_pipeline(
    make_queue: Any, tmp_path: Any
) -> None:
    """A group's own transaction is begun and ended outside its pipeline: psycopg syncs a
    pipeline (sends ``Sync`` and waits for the server's answer, with nothing queued)
    whenever autocommit is set in one, and Django sets it as a transaction begins and
    after it ends, so each group waited twice for nothing. Read off the wire (libpq's trace
    of the connection): the group's first message is its ``BEGIN``, not a ``Sync``, and its
    ``COMMIT`` is its last, after the pipeline's end, with no ``Sync`` after it."""
    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL's pipeline mode")
    from psycopg import pq

    make_queue("q")
    rows = _copies("q", 2)
    connection.ensure_connection()
    pgconn = connection.connection.pgconn
    with open(tmp_path / "trace", "w+b") as trace:
        pgconn.trace(trace.fileno())
        pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)
        try:
            with sql.group_transaction():
                sql.insert_rows(rows[:1])
                assert set(sql.select_rows([rows[0].id], lock=True)) == {rows[0].id}
                sql.insert_rows(rows[1:])
        finally:
            pgconn.untrace()
        trace.seek(0)
        # Each message the client sent: its type, and what follows (a statement's text).
        sent = [
            line.split("\t", 3)[2:]
            for line in trace.read().decode().splitlines()
            if line.startswith("F\t")
        ]
    kinds = [message[0].strip() for message in sent]
    assert kinds[0] == "Parse", kinds
    assert '"BEGIN"' in sent[0][1], sent[0]
    commits = [at for at, message in enumerate(sent) if '"COMMIT"' in "".join(message)]
    assert commits == [len(sent) - 1], kinds
    assert "Sync" in kinds[: commits[0]], kinds  # the pipeline's end, before it
    assert set(sql.select_rows([r.id for r in rows], lock=False)) == {r.id for r in rows}
