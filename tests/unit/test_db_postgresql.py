"""The PostgreSQL backend's pool (``taskhoster.db.postgresql``): a wait for a connection ends
once the database is found away, but a connection the pool holds is still handed out."""

from __future__ import annotations

import time
from collections.abc import Iterator

import psycopg
import pytest
from django.conf import settings
from psycopg_pool import ConnectionPool

from taskhoster.db.postgresql.base import Checkout, Reachability, WatchedConnection, direct

from ..conftest import database_url

reachability = WatchedConnection.reachability

pytestmark = pytest.mark.skipif(
    "postgresql" not in str(settings.DATABASES["default"]["ENGINE"]), reason="PostgreSQL's pool"
)


@pytest.fixture(autouse=True)
def present_again() -> Iterator[None]:
    yield
    reachability.succeeded(time.monotonic())  # (leave it as the next test expects)


def _pool(conninfo: str, min_size: int) -> ConnectionPool[WatchedConnection]:
    pool = ConnectionPool(
        conninfo,
        connection_class=WatchedConnection,
        min_size=min_size,
        max_size=2,
        timeout=30,
        reconnect_timeout=2,
        open=False,
    )
    pool.open(wait=min_size > 0)
    return pool


def _ours() -> str:
    db = settings.DATABASES["default"]
    return (
        f"host={db.get('HOST') or '127.0.0.1'} port={db.get('PORT') or 5432} "
        f"dbname={db['NAME']} user={db.get('USER') or 'postgres'}"
    )


def test_a_wait_for_a_connection_ends_at_once_when_the_database_does_not_answer() -> None:
    pool = _pool("host=127.0.0.1 port=1 dbname=nowhere user=nobody connect_timeout=2", 0)
    try:
        began = time.monotonic()
        with pytest.raises(psycopg.OperationalError, match="the database does not answer"):
            Checkout(pool).getconn()  # the pool's own wait: 30 s
        assert time.monotonic() - began < 2
        assert reachability.away() is not None
        reachability.may_try()  # another caller's turn to try the database, not this one's
        began = time.monotonic()
        with pytest.raises(psycopg.OperationalError, match="the database does not answer"):
            Checkout(pool).getconn()
        assert time.monotonic() - began < 0.2, "known away: no wait"
    finally:
        pool.close()


def test_a_connection_the_pool_holds_is_handed_out_though_an_attempt_failed() -> None:
    """Marked away, a connection the pool already holds is still handed out (it may serve: an
    attempt can fail while the database answers)."""
    pool = _pool(_ours(), 1)
    try:
        reachability.failed(psycopg.OperationalError("the server went away"), time.monotonic())
        reachability.may_try()  # another caller's turn to try the database, not this one's
        conn = Checkout(pool).getconn()
        try:
            assert conn.execute("SELECT 1").fetchone() == (1,)
        finally:
            pool.putconn(conn)
    finally:
        pool.close()


def test_the_database_is_present_again_at_the_first_attempt_that_connects() -> None:
    reachability.failed(psycopg.OperationalError("away"), time.monotonic())
    pool = _pool(_ours(), 0)
    try:
        deadline = time.monotonic() + 5
        while True:  # one caller in RETRY_SECONDS tries; the others are refused meanwhile
            try:
                conn = Checkout(pool).getconn()
                break
            except psycopg.OperationalError:
                assert time.monotonic() < deadline, "never tried again"
                time.sleep(0.05)
        pool.putconn(conn)
        assert reachability.away() is None
    finally:
        pool.close()


def test_an_attempt_refused_for_want_of_room_or_older_than_a_success_changes_nothing() -> None:
    reach = Reachability()
    reach.failed(psycopg.OperationalError("FATAL:  sorry, too many clients already"), 1.0)
    assert reach.away() is None, "too many clients: the database answers"
    reach.succeeded(5.0)
    reach.failed(psycopg.OperationalError("timeout expired"), 2.0)  # began before the success
    assert reach.away() is None
    reach.failed(psycopg.OperationalError("connection refused"), 6.0)
    assert reach.away() is not None
    reach.succeeded(5.5)  # began before that failure
    assert reach.away() is not None
    reach.succeeded(7.0)
    assert reach.away() is None


def _pattern_indexes() -> list[str]:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT indexname FROM pg_indexes WHERE schemaname = current_schema()"
            " AND tablename = 'taskhoster_item' AND indexdef LIKE %s",
            ["%varchar_pattern_ops%"],
        )
        return [row[0] for row in cursor.fetchall()]


@pytest.mark.django_db(transaction=True)
def test_an_item_id_has_no_pattern_index_and_migrating_back_makes_it_again() -> None:
    # Every item row written paid for an index entry nothing reads (migration 0008).
    from django.db import connection
    from django.db.migrations.executor import MigrationExecutor

    assert _pattern_indexes() == []
    # Forward again to the latest migration, not to 0008: the later ones stay applied for
    # the rest of the session's tests.
    latest = MigrationExecutor(connection).loader.graph.leaf_nodes("taskhoster")
    try:
        MigrationExecutor(connection).migrate([("taskhoster", "0007_schedules")])
        assert _pattern_indexes() == ["taskhoster_item_id_59c89d8d_like"]
    finally:
        MigrationExecutor(connection).migrate(latest)
    assert _pattern_indexes() == []


def test_the_look_for_a_pooler_is_never_kept_prepared() -> None:
    """A connection that prepares every statement at its first run (``prepare_threshold``
    0, as a project embedding the app may set) does not prepare the look: through a pooler
    in transaction mode a prepared statement's Parse and its runs may reach different
    server processes."""
    with psycopg.connect(database_url(), autocommit=True, prepare_threshold=0) as conn:
        assert direct(conn)
        assert direct(conn)
        kept = conn.execute(
            "SELECT count(*) FROM pg_prepared_statements WHERE statement LIKE %s",
            ["%pg_backend_pid%"],
            prepare=False,
        ).fetchone()
    assert kept == (0,)
