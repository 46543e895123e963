"""Item rows as plain objects, and the set-based SQL that reads and writes them.

A group reads all the rows it needs in one query and writes them back with one statement
per shape of change (``executemany``), so the per-item cost is a few microseconds of
database work rather than a model instance and a query each. Everything here runs inside
the group's transaction; on PostgreSQL the rows are read ``FOR UPDATE`` (claims add ``SKIP
LOCKED``), on SQLite the IMMEDIATE write transaction already serialises writers.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from functools import lru_cache
from operator import attrgetter
from typing import Any

from django.core.signals import setting_changed
from django.db import connection, transaction
from django.dispatch import receiver

from ..errors import Conflict
from ..status import RetainFrom, Status
from .queues import QUEUE_SETTINGS
from .rules import ItemRow, Line, QueueInfo, RateLimit, ThreadState

ITEM = "taskhoster_item"
THREAD = "taskhoster_thread"
QUEUE = "taskhoster_queue"
COUNT = "taskhoster_queuecount"
CLAIM_START = "taskhoster_claimstart"

COLUMNS = (
    "id",
    "queue_id",
    "status",
    "eligible",
    "thread_id",
    "key",
    "seq",
    "scheduled_at",
    "posted_at",
    "attempts",
    "lease",
    "lease_expires_at",
    "claimed_at",
    "finished_at",
    "fetched_at",
    "error",
    "origin",
    "dead_letter",
    "rev",
    "updated_at",
    "priority",
    "claimed_by",
    "progress",
    "cancel_reason",
    "unflushed",
)
JSON_COLUMNS = frozenset({"origin", "progress"})
TIME_COLUMNS = frozenset(
    {
        "scheduled_at",
        "posted_at",
        "lease_expires_at",
        "claimed_at",
        "finished_at",
        "fetched_at",
        "updated_at",
    }
)
SELECT_COLUMNS = ", ".join(f'"{c}"' for c in COLUMNS)
# The same on SQLite, each time column under a unary "+" (SQLite's no-op): a column that is
# an expression has no declared type, so sqlite3 hands over its text as stored, without
# the converter Django registers for "datetime" columns, and ``read_time`` parses it as
# UTC in one step (the converter parsed it naive, and ``read_time`` then set its zone).
SQLITE_SELECT_COLUMNS = ", ".join(
    f'+"{c}" AS "{c}"' if c in TIME_COLUMNS else f'"{c}"' for c in COLUMNS
)


# -- values in and out -----------------------------------------------------------------------


@dataclass(frozen=True)
class Dialect:
    """What differs between the databases the engine runs on, declared once a database
    (``SQLITE``, ``POSTGRESQL``); ``dialect`` gives the connection's."""

    vendor: str
    # Rows read to change are locked (PostgreSQL); SQLite's IMMEDIATE write transaction
    # already serialises writers.
    lock: str
    # A claim passes rows that another claimer holds.
    skip_locked: str
    # How a JSON value is bound in an INSERT.
    json_mark: str
    # Times are stored as naive UTC text (SQLite).
    naive_times: bool
    # Many rows are updated in one ``UPDATE ... FROM (VALUES ...)`` (else ``executemany``).
    update_from_values: bool
    # Queue directories are guarded by advisory locks (PostgreSQL).
    advisory_locks: bool
    # A group's statements are sent without waiting for each one's answer (psycopg's
    # pipeline mode), and new rows go in by ``COPY`` or from one array per column.
    pipeline: bool
    # A list of ids is bound as one array (``= ANY(%s)``), not a placeholder each: a
    # statement's text does not change with their number, so the server can keep it
    # prepared (see ``_cursor``).
    arrays: bool
    # A transaction's outcome can be asked for by its id once its connection is lost
    # (``pg_xact_status``): ``transaction_id``, ``transaction_outcome``.
    outcome_by_id: bool


SQLITE = Dialect(
    vendor="sqlite",
    lock="",
    skip_locked="",
    json_mark="%s",
    naive_times=True,
    update_from_values=False,
    advisory_locks=False,
    pipeline=False,
    arrays=False,
    outcome_by_id=False,
)
POSTGRESQL = Dialect(
    vendor="postgresql",
    lock=" FOR UPDATE",
    skip_locked=" FOR UPDATE SKIP LOCKED",
    json_mark="%s::jsonb",
    naive_times=False,
    update_from_values=True,
    advisory_locks=True,
    pipeline=True,
    arrays=True,
    outcome_by_id=True,
)


# Any other database Django speaks: row locks and casts as PostgreSQL's, no advisory locks.
OTHER = replace(
    POSTGRESQL,
    vendor="other",
    advisory_locks=False,
    pipeline=False,
    arrays=False,
    outcome_by_id=False,
)
DIALECTS = {d.vendor: d for d in (SQLITE, POSTGRESQL)}


_dialect: Dialect | None = None


def dialect() -> Dialect:
    """The dialect of the database the engine's connection is on: every difference between
    the databases is one of its fields, and the SQL here reads it instead of asking which
    database it is. Found once (asking the connection costs a lookup through Django's
    connection proxy each time, and a group asks some times per row); forgotten when the
    ``DATABASES`` setting changes (``_forget_dialect``)."""
    global _dialect
    found = _dialect
    if found is None:
        found = _dialect = DIALECTS.get(connection.vendor, OTHER)
    return found


@receiver(setting_changed)
def _forget_dialect(*, setting: str, **_kwargs: Any) -> None:
    global _dialect
    if setting == "DATABASES":
        _dialect = None


# PostgreSQL advisory lock class for queues: groups hold it shared, deleting a queue
# exclusive, so no group writes into a queue's directory while it is being taken away.
QUEUE_LOCK_CLASS = 7331


def select_columns() -> str:
    """The item columns to select, as ``_row`` reads them, on this connection's database."""
    return SQLITE_SELECT_COLUMNS if dialect().vendor == "sqlite" else SELECT_COLUMNS


# A group making more new rows than this runs without a pipeline, so that they go in by
# one ``COPY`` (which a pipeline cannot carry; in one, a statement a row: ``insert_rows``).
PIPELINED_NEW_ROWS_MOST = 32


@contextmanager
def group_transaction(pipelined: bool = True) -> Iterator[None]:
    """A group's transaction (``transaction.atomic``: a savepoint inside the caller's own).

    On PostgreSQL (``Dialect.pipeline``) and when ``pipelined``, its statements are sent
    without waiting for each one's answer until one is read (psycopg's pipeline mode): a
    group's locks and writes go with the statement after them, its last ones with the
    pipeline's end. The server runs them in the order sent, so a lock is still held before
    the rows read after it. An error is raised where the answers are next read, as Django's
    error (a lost key race is still ``IntegrityError``), inside the transaction (or
    savepoint), which then fails whole, as it would without: the answers still owed are
    read first, so that the rollback is not dropped with them (a pipeline discards what
    follows an error until then).

    A transaction of its own is begun and ended outside the pipeline, its ``COMMIT`` after
    the pipeline's end: psycopg waits for a pipeline's answers (a round trip, even with
    nothing sent) whenever autocommit is set in one, and Django sets it as a transaction
    begins and after it ends. A savepoint in the caller's transaction sets no autocommit,
    and goes in the pipeline (its release after the last answers are read, so that an
    error of the last statements rolls the savepoint back and the caller's transaction
    goes on)."""
    if not (pipelined and dialect().pipeline):
        with transaction.atomic():
            yield
        return
    connection.ensure_connection()
    outermost = not connection.in_atomic_block
    with ExitStack() as stack:
        if outermost:
            stack.enter_context(transaction.atomic())
        stack.enter_context(connection.wrap_database_errors)
        pipeline = stack.enter_context(connection.connection.pipeline())
        if not outermost:
            stack.enter_context(transaction.atomic())
        try:
            yield
            if not outermost:
                pipeline.sync()  # (before the savepoint's release)
        except BaseException:
            with suppress(Exception):  # (the error being raised says what failed)
                pipeline.sync()
            raise


@dataclass(frozen=True)
class TransactionId:
    """A transaction's id, with when its server started and when the transaction began (the
    server's clocks): a server that crashed, whole or one session of it, gives again the ids
    of the transactions it lost (those whose records it had not written), so an id alone
    does not name one transaction (``transaction_outcome``)."""

    xid: int
    server_started: str
    began: str


def transaction_id() -> Callable[[], TransactionId]:
    """This transaction's id (``Dialect.outcome_by_id``), asked for now and read by calling
    what is returned: in a pipeline, the answer comes with the next statement that is read,
    so asking first costs no round trip of its own (outside one, a round trip). Asking gives
    the transaction an id (a write would have; a group whose operations are all refused
    then commits a transaction that changed nothing)."""
    cursor = _cursor()
    cursor.execute(
        "SELECT pg_current_xact_id()::text, pg_postmaster_start_time()::text, now()::text"
    )

    def read() -> TransactionId:
        xid, started, began = cursor.fetchone()
        return TransactionId(int(xid), started, began)

    return read


# Whether a transaction's id is still its own (the first column), and, where the server may
# have given it again, whether it can say anything of it. A crash of the whole server shows
# as a new start time; a crash of one session makes the server start over without one, but
# recovery ends in a checkpoint, whose next id is the first the server gives from then on:
# an id at or past that of a checkpoint begun since the transaction began may be given
# again (a checkpoint of its own in that second, rare, only makes the answer unknown).
_OUTCOME = (
    "WITH s AS (SELECT pg_postmaster_start_time() = %s::timestamptz AND NOT ("
    "c.checkpoint_time >= date_trunc('second', %s::timestamptz) "
    "AND %s::xid8 >= ((split_part(c.next_xid, ':', 1)::bigint << 32) "
    "| split_part(c.next_xid, ':', 2)::bigint)::text::xid8) AS own "
    "FROM pg_control_checkpoint() c) "
    "SELECT own, CASE WHEN own OR %s::xid8 < pg_snapshot_xmax(pg_current_snapshot()) "
    "THEN pg_xact_status(%s::xid8) END FROM s"
)


def transaction_outcome(asked: TransactionId) -> str | None:
    """What became of transaction ``asked``, asked on this thread's connection (a new one,
    once the transaction's own was lost): ``"committed"``, ``"aborted"``, ``"in progress"``
    (its session has not ended yet), or None (too old to say).

    Of a server that crashed since the transaction began: ``"aborted"`` where the id is not
    given again yet, or is another transaction's that is running or rolled back (the
    transaction's own session ended in the crash, and its commit, had it been written,
    would be the id's status); None where it says ``"committed"``: that may be the
    transaction's own commit, written before the crash, or another's, given the id after
    the crash lost the first, and nothing says which."""
    xid = str(asked.xid)
    with connection.cursor() as cursor:
        cursor.execute(_OUTCOME, [asked.server_started, asked.began, xid, xid, xid])
        row = cursor.fetchone()
    if row is None:
        return None
    own, status = row
    if own:
        return None if status is None else str(status)
    return None if status == "committed" else "aborted"


def end_session_of(xid: int) -> None:
    """End the session still running transaction ``xid`` (a lost client's, which the server
    has not noticed yet): it can then no longer commit, and its outcome is settled."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE backend_xid = xid(%s::xid8)",
            [str(xid)],
        )


def _in_pipeline() -> bool:
    raw = connection.connection
    return raw is not None and bool(raw.pgconn.pipeline_status)


def _cursor() -> Any:
    """A cursor for the engine's statements, under Django's wrappers (its errors, query
    logging, ``execute_wrapper``). On PostgreSQL, psycopg's own ``Cursor``: values bound by
    the server and made by psycopg's C code, where Django's cursor makes a statement's
    text of its values in Python; and times read by psycopg's C loader, where Django's
    reads them in Python (both give UTC times: Django sets the session's zone to UTC)."""
    if not dialect().pipeline:
        return connection.cursor()
    connection.ensure_connection()
    connection.validate_thread_sharing()  # as Django's own ``cursor()`` does
    raw = _psycopg().Cursor(connection.connection)
    raw.adapters.register_loader("timestamptz", _time_loader())
    if connection.queries_logged:
        return connection.make_debug_cursor(raw)
    return connection.make_cursor(raw)


def _psycopg() -> Any:
    import psycopg

    return psycopg


@lru_cache(maxsize=1)
def _time_loader() -> Any:
    """psycopg's own loader of ``timestamptz`` text (its C one where installed)."""
    psycopg = _psycopg()
    oid = psycopg.postgres.types["timestamptz"].oid
    return psycopg.adapters.get_loader(oid, psycopg.pq.Format.TEXT)


def lock_queues_shared(queue_ids: Iterable[int]) -> None:
    """A group's hold on the directories of the queues it writes into (in id order)."""
    if not dialect().advisory_locks:
        return
    with _cursor() as cursor:
        for queue_id in sorted(queue_ids):
            cursor.execute(
                "SELECT pg_advisory_xact_lock_shared(%s, %s)", [QUEUE_LOCK_CLASS, queue_id]
            )


def lock_queue_exclusive(queue_id: int) -> None:
    """A queue's deletion waits for the groups writing into its directory."""
    if not dialect().advisory_locks:
        return
    with _cursor() as cursor:
        cursor.execute("SELECT pg_advisory_xact_lock(%s, %s)", [QUEUE_LOCK_CLASS, queue_id])


# -- values in and out -----------------------------------------------------------------------


# The last time ``adapt_time`` made text of, and that text: a group writes its own time
# (``Group.at``, one object) into most rows it changes, several columns each.
_last_adapted: tuple[datetime | None, str] = (None, "")


def adapt_time(value: datetime | None) -> Any:
    """A time as the database stores it: what Django's own adapter gives (on SQLite, naive
    UTC text; the engine's times are always UTC, which takes the short way: the ISO text
    without its "+00:00", the same text as ``str`` of the naive time)."""
    global _last_adapted
    if value is None:
        return None
    if value.tzinfo is UTC and dialect().naive_times:
        last = _last_adapted
        if last[0] is value:
            return last[1]
        text = value.isoformat(" ")[:-6]
        _last_adapted = (value, text)
        return text
    return connection.ops.adapt_datetimefield_value(value)


# SQLite's time texts parsed lately: many rows share times (a batch's posts, a group's
# writes). Emptied when it grows past ``_PARSED_MOST``; datetimes are immutable, so one
# object may stand in many rows.
_parsed: dict[str, datetime] = {}
_PARSED_MOST = 4096


def read_time(value: object) -> datetime | None:
    if value is None:
        return None
    if isinstance(value, str):
        found = _parsed.get(value)
        if found is not None:
            return found
        if len(value) in (19, 26) and value[10] == " ":
            # SQLite's naive UTC text ("YYYY-MM-DD HH:MM:SS[.ffffff]"): parsed as UTC at
            # once (a seventh of the cost of parsing it naive and then setting its zone).
            found = datetime.fromisoformat(value + "+00:00")
            if len(_parsed) >= _PARSED_MOST:
                _parsed.clear()
            _parsed[value] = found
            return found
        value = datetime.fromisoformat(value)
    assert isinstance(value, datetime)
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def adapt_json(value: Any) -> Any:
    return None if value is None else json.dumps(value)


def read_json(value: Any) -> Any:
    if isinstance(value, str | bytes):
        return json.loads(value)
    return value


def _row(values: Sequence[Any], queue_name: str = "") -> ItemRow:
    (
        item_id,
        queue_id,
        status,
        eligible,
        thread_id,
        key,
        seq,
        scheduled_at,
        posted_at,
        attempts,
        lease,
        lease_expires_at,
        claimed_at,
        finished_at,
        fetched_at,
        error,
        origin,
        dead_letter,
        rev,
        updated_at,
        priority,
        claimed_by,
        progress,
        cancel_reason,
        unflushed,
    ) = values
    return ItemRow(
        id=item_id,
        queue_id=queue_id,
        status=Status(status),
        eligible=bool(eligible),
        thread_id=thread_id,
        key=key,
        seq=seq,
        scheduled_at=read_time(scheduled_at),  # type: ignore[arg-type]
        posted_at=read_time(posted_at),  # type: ignore[arg-type]
        attempts=attempts,
        lease=lease,
        lease_expires_at=read_time(lease_expires_at),
        claimed_at=read_time(claimed_at),
        finished_at=read_time(finished_at),
        fetched_at=read_time(fetched_at),
        error=error,
        origin=read_json(origin),
        dead_letter=dead_letter,
        rev=rev,
        updated_at=read_time(updated_at),  # type: ignore[arg-type]
        priority=priority,
        claimed_by=claimed_by,
        progress=read_json(progress),
        cancel_reason=cancel_reason,
        unflushed=bool(unflushed),
        queue_name=queue_name,
    )


def _values_of(columns: Sequence[str]) -> Callable[[ItemRow], list[Any]]:
    """A function giving a row's values of ``columns`` as the database stores them (times
    by ``adapt_time``, JSON as text): the columns' kinds looked at once for many rows, and
    a row's attributes read in one call."""
    getter = attrgetter(*columns)
    times = [i for i, c in enumerate(columns) if c in TIME_COLUMNS]
    jsons = [i for i, c in enumerate(columns) if c in JSON_COLUMNS]
    one = len(columns) == 1

    def values(row: ItemRow) -> list[Any]:
        found: list[Any] = [getter(row)] if one else list(getter(row))
        for i in times:
            found[i] = adapt_time(found[i])
        for i in jsons:
            found[i] = adapt_json(found[i])
        return found

    return values


def _placeholders(n: int) -> str:
    return ", ".join(["%s"] * n)


def _chunks(values: Sequence[Any], size: int = 500) -> Iterable[Sequence[Any]]:
    for start in range(0, len(values), size):
        yield values[start : start + size]


# -- reads ------------------------------------------------------------------------------------


def select_rows(ids: Iterable[str], *, lock: bool) -> dict[str, ItemRow]:
    """The rows of ``ids`` that exist, locked in id order when ``lock`` (PostgreSQL)."""
    suffix = f" ORDER BY id{dialect().lock}" if lock and dialect().lock else ""
    found: dict[str, ItemRow] = {}
    for values in _by_ids(f"SELECT {select_columns()} FROM {ITEM} WHERE id", ids, suffix):
        row = _row(values)
        found[row.id] = row
    return found


def _by_ids(head: str, ids: Iterable[str], suffix: str = "") -> Iterator[tuple[Any, ...]]:
    """The rows of ``head`` (a query ending in ``WHERE`` and its id column) ``suffix`` for
    the distinct ``ids``, 500 of them a statement (on PostgreSQL bound as one array, so the
    statement's text is the same whatever their number: ``Dialect.arrays``). Read to the
    end: the cursor is open until."""
    with _cursor() as cursor:
        for chunk in _chunks(sorted(set(ids))):
            condition, params = _among(chunk)
            cursor.execute(f"{head}{condition}{suffix}", params)
            yield from cursor.fetchall()


def _among(values: Sequence[Any]) -> tuple[str, list[Any]]:
    """The condition that a column is one of ``values`` (to follow the column's name), and
    its parameters: on PostgreSQL one array (``Dialect.arrays``), else a placeholder each."""
    if dialect().arrays:
        return " = ANY(%s)", [list(values)]
    return f" IN ({_placeholders(len(values))})", list(values)


def select_states(ids: Iterable[str]) -> dict[str, tuple[Status, str | None]]:
    """Each existing item's status and error, unlocked (a few columns, for many items); an
    item of a queue being deleted is not found."""
    head = (
        f"SELECT i.id, i.status, i.error FROM {ITEM} AS i "
        f"JOIN {QUEUE} AS q ON q.id = i.queue_id AND NOT q.deleting WHERE i.id"
    )
    return {item_id: (Status(status), error) for item_id, status, error in _by_ids(head, ids)}


def peek_threads(ids: Iterable[str]) -> dict[str, tuple[int, str | None]]:
    """Each existing item's queue id and thread id (unlocked: to know what to lock first)."""
    head = f"SELECT id, queue_id, thread_id FROM {ITEM} WHERE id"
    return {item_id: (queue_id, thread_id) for item_id, queue_id, thread_id in _by_ids(head, ids)}


# Priorities run 0-9 (section 8.1): a claim probes the claim index once per level, so it
# stays a few index descents however many items wait, and however many of them are delayed.
PRIORITIES = tuple(range(9, -1, -1))


def claim_query(
    queue_id: int, at: datetime, limit: int, skip: Sequence[str] = ()
) -> tuple[str, list[Any]]:
    """The claim's query: the claimable items of a queue in claim order (higher priority
    first, then earliest ``scheduled_at``, then arrival), through the partial index
    ``item_claimable_by_priority``, one probe per priority level: each level's earliest due
    rows, merged. On PostgreSQL each probe locks with SKIP LOCKED, so concurrent claimers
    pass each other by (a probe may lock up to ``limit`` rows that the merge leaves out:
    they are free again at the group's commit). The text is built once per database and
    number of rows to skip (``_claim_text``); only the values are bound per claim."""
    when = adapt_time(at)
    found = dialect()
    query = _claim_text(found, len(skip) if found.vendor == "sqlite" else 0)
    if found.vendor == "sqlite":
        # The rows to skip are left out after the merge (bound once, not once a level: a
        # group's claims may skip thousands), each level reaching that much further.
        reach = limit + len(skip)
        params: list[Any] = [v for _level in PRIORITIES for v in (queue_id, when, reach)]
        params += skip
        params.append(limit)
        return query, params
    return query, [queue_id, when, list(skip), limit, limit]


@lru_cache(maxsize=64)
def _claim_text(found: Dialect, skipping: int) -> str:
    """``claim_query``'s text on ``found``'s database, skipping ``skipping`` rows (SQLite:
    one placeholder each; PostgreSQL binds them as one array)."""
    lock = found.skip_locked
    # ``eligible`` bare, as in the partial index's condition, so the planner uses it.
    probe = (
        f"SELECT {SELECT_COLUMNS} FROM {ITEM} WHERE eligible AND queue_id = %s "
        f"AND priority = {{level}} AND scheduled_at <= %s{{skip}} "
        f"ORDER BY scheduled_at, seq LIMIT %s{lock}"
    )
    if found.vendor == "sqlite":
        parts = [f"SELECT * FROM ({probe.format(level=level, skip='')})" for level in PRIORITIES]
        where = f"WHERE id NOT IN ({_placeholders(skipping)}) " if skipping else ""
        return (
            f"SELECT {SQLITE_SELECT_COLUMNS} FROM ({' UNION ALL '.join(parts)}) {where}"
            "ORDER BY priority DESC, scheduled_at, seq LIMIT %s"
        )
    levels = ", ".join(f"({level})" for level in PRIORITIES)
    columns = ", ".join(f'c."{c}"' for c in COLUMNS)
    return (
        f"SELECT {columns} FROM (VALUES {levels}) AS lv(level) CROSS JOIN LATERAL "
        f"({probe.format(level='lv.level', skip=' AND id <> ALL(%s)')}) AS c "
        "ORDER BY c.priority DESC, c.scheduled_at, c.seq LIMIT %s"
    )


def claim_candidates(
    queue_id: int, at: datetime, limit: int, skip: Sequence[str] = ()
) -> list[ItemRow]:
    query, params = claim_query(queue_id, at, limit, skip)
    with _cursor() as cursor:
        cursor.execute(query, params)
        return [_row(values) for values in cursor.fetchall()]


# -- flow control (section 8.1) ---------------------------------------------------------------

# PostgreSQL advisory lock class for the claims of a queue with a cap or a rate limit: its
# claims count and take under it, one group at a time, so two processes never both see the
# last free slot. (SQLite's write transaction already makes them one at a time.)
CLAIM_LOCK_CLASS = 7332


def lock_claims(queue_id: int) -> None:
    if not dialect().advisory_locks:
        return
    with _cursor() as cursor:
        cursor.execute("SELECT pg_advisory_xact_lock(%s, %s)", [CLAIM_LOCK_CLASS, queue_id])


def count_processing(queue_id: int, cap: int) -> int:
    """How many of the queue's items are processing, counted from their rows (the leases
    themselves), up to ``cap``: a few index entries, never a tally a crash could leave off."""
    with _cursor() as cursor:
        cursor.execute(
            f"SELECT COUNT(*) FROM (SELECT 1 FROM {ITEM} WHERE queue_id = %s AND status = %s "
            "LIMIT %s) AS p",
            [queue_id, Status.PROCESSING.value, cap],
        )
        return int(cursor.fetchone()[0])


def claim_starts(
    queue_id: int, since: datetime, *, prune: bool = False
) -> list[tuple[datetime, int]]:
    """The claims that started in the queue after ``since`` (their times and counts);
    ``prune``: older ones are dropped on the way (a claim, under ``lock_claims``)."""
    with _cursor() as cursor:
        if prune:
            cursor.execute(
                f"DELETE FROM {CLAIM_START} WHERE queue_id = %s AND at <= %s",
                [queue_id, adapt_time(since)],
            )
        cursor.execute(
            f"SELECT at, n FROM {CLAIM_START} WHERE queue_id = %s AND at > %s ORDER BY at",
            [queue_id, adapt_time(since)],
        )
        return [(read_time(at), n) for at, n in cursor.fetchall()]  # type: ignore[misc]


def control_state(
    queue: QueueInfo, at: datetime, *, prune: bool = False
) -> tuple[int, list[tuple[datetime, int]]]:
    """What a queue's cap and rate limit are judged by at ``at``: its items processing
    (``count_processing``, 0 without a cap) and the claims started in its window
    (``claim_starts``, none without a rate limit)."""
    processing = 0
    if queue.max_processing is not None:
        processing = count_processing(queue.id, queue.max_processing)
    starts: list[tuple[datetime, int]] = []
    if queue.rate_limit is not None:
        since = at - timedelta(seconds=queue.rate_limit.seconds)
        starts = claim_starts(queue.id, since, prune=prune)
    return processing, starts


def count_due_eligible(queue_id: int, at: datetime, cap: int) -> int:
    """The queue's claimable items due at ``at``, up to ``cap``."""
    with _cursor() as cursor:
        cursor.execute(
            f"SELECT COUNT(*) FROM (SELECT 1 FROM {ITEM} WHERE eligible AND queue_id = %s "
            "AND scheduled_at <= %s LIMIT %s) AS e",
            [queue_id, adapt_time(at), cap],
        )
        return int(cursor.fetchone()[0])


def count_thread_waiting(queue_id: int, at: datetime, cap: int) -> int:
    """The queue's due pending thread members that are not eligible, up to ``cap``."""
    with _cursor() as cursor:
        cursor.execute(
            f"SELECT COUNT(*) FROM (SELECT 1 FROM {ITEM} WHERE queue_id = %s "
            "AND thread_id IS NOT NULL AND status = %s AND NOT eligible AND scheduled_at <= %s "
            "LIMIT %s) AS t",
            [queue_id, Status.PENDING.value, adapt_time(at), cap],
        )
        return int(cursor.fetchone()[0])


def record_claim_start(queue_id: int, at: datetime, n: int) -> None:
    with _cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {CLAIM_START} (queue_id, at, n) VALUES (%s, %s, %s)",
            [queue_id, adapt_time(at), n],
        )


def existing_keys(queue_id: int, keys: Iterable[str]) -> dict[str, ItemRow]:
    wanted = sorted(set(keys))
    found: dict[str, ItemRow] = {}
    with _cursor() as cursor:
        for chunk in _chunks(wanted):
            cursor.execute(
                f"SELECT {select_columns()} FROM {ITEM} "
                f"WHERE queue_id = %s AND key IN ({_placeholders(len(chunk))})",
                [queue_id, *chunk],
            )
            for values in cursor.fetchall():
                row = _row(values)
                if row.key is not None:
                    found[row.key] = row
    return found


# The queue's settings as the engine reads them (``rules.QueueInfo``, whose fields are these
# in this order): each declared once, in ``queues.QUEUE_SETTINGS``.
QUEUE_COLUMNS = ("id", "name", *(s.field for s in QUEUE_SETTINGS), "deleting")


def select_queues(*, names: Sequence[str] = (), ids: Sequence[int] = ()) -> list[QueueInfo]:
    """The settings of the live queues named, and of the queues of the ids given."""
    if not names and not ids:
        return []
    where = []
    params: list[Any] = []
    if names:
        where.append(f"(name IN ({_placeholders(len(names))}) AND NOT deleting)")
        params.extend(names)
    if ids:
        where.append(f"id IN ({_placeholders(len(ids))})")
        params.extend(ids)
    columns = ", ".join(f'"{c}"' for c in QUEUE_COLUMNS)
    with _cursor() as cursor:
        cursor.execute(f"SELECT {columns} FROM {QUEUE} WHERE {' OR '.join(where)}", params)
        return [_queue(row) for row in cursor.fetchall()]


def _queue(values: Sequence[Any]) -> QueueInfo:
    found = dict(zip(QUEUE_COLUMNS, values, strict=True))
    found["retain_from"] = RetainFrom(found["retain_from"])
    found["deleting"] = bool(found["deleting"])
    found["paused"] = bool(found["paused"])
    rate = read_json(found["rate_limit"])
    found["rate_limit"] = None if rate is None else RateLimit(rate["count"], rate["seconds"])
    return QueueInfo(**found)


def earliest_claimable(queue_names: Sequence[str]) -> dict[str, tuple[datetime, bool]]:
    """For each live queue named that has a claimable item (due or delayed), the earliest
    ``scheduledAt`` among them, and whether the queue has a control set (paused, a cap, a
    rate limit): one query, one probe of the claim index per queue and priority level (a
    queue with nothing claimable is left out). An item marked ``unflushed`` is not
    claimable until its file is written again, whose news wakes the claims: counted here,
    every waiting worker's claim looked again at it 20 times a second meanwhile."""
    found: dict[str, tuple[datetime, bool]] = {}
    levels = ", ".join(f"({level})" for level in PRIORITIES)
    with _cursor() as cursor:
        for chunk in _chunks(list(queue_names)):
            # ``eligible`` bare, as in the partial index's condition, so the planner uses it.
            cursor.execute(
                f"WITH lv(level) AS (VALUES {levels}) "
                "SELECT name, MIN(at), MAX(controlled) FROM ("
                f"SELECT q.name AS name, (SELECT i.scheduled_at FROM {ITEM} i WHERE i.eligible "
                "AND i.queue_id = q.id AND i.priority = lv.level "
                "AND (i.unflushed IS NULL OR NOT i.unflushed) "
                "ORDER BY i.scheduled_at, i.seq LIMIT 1) AS at, "
                "CASE WHEN q.paused OR q.max_processing IS NOT NULL "
                "OR q.rate_limit IS NOT NULL THEN 1 ELSE 0 END AS controlled "
                f"FROM {QUEUE} q CROSS JOIN lv WHERE q.name IN ({_placeholders(len(chunk))}) "
                "AND NOT q.deleting) AS d GROUP BY name",
                list(chunk),
            )
            for name, at, controlled in cursor.fetchall():
                if at is not None:
                    found[name] = (read_time(at), bool(controlled))  # type: ignore[assignment]
    return found


def thread_line(queue_id: int, thread_id: str, limit: int) -> Line:
    """A thread's members as ``rules.settle`` reads them: up to ``limit`` processing, and
    the first ``limit`` pending in line order (``rules.line_order``: earliest
    ``scheduled_at``, then arrival; the real-engine model test holds the two to each
    other). Two probes of ``item_thread_order``, in one statement."""
    member = f"SELECT id, status FROM {ITEM} WHERE queue_id = %s AND thread_id = %s AND status = %s"
    with _cursor() as cursor:
        cursor.execute(
            f"SELECT * FROM ({member} LIMIT %s) AS p UNION ALL "
            f"SELECT * FROM ({member} ORDER BY scheduled_at, seq LIMIT %s) AS w",
            [
                queue_id,
                thread_id,
                Status.PROCESSING.value,
                limit,
                queue_id,
                thread_id,
                Status.PENDING.value,
                limit,
            ],
        )
        found = cursor.fetchall()
    return Line(
        processing=[i for i, status in found if status == Status.PROCESSING.value],
        pending=[i for i, status in found if status == Status.PENDING.value],
    )


def first_pending_member(queue_id: int, thread_id: str) -> str | None:
    """A thread's head as the index orders the line (``rules.thread_head``: earliest
    ``scheduled_at``, then arrival, ``rules.line_order``; the real-engine model test holds
    the two to each other)."""
    with _cursor() as cursor:
        cursor.execute(
            f"SELECT id FROM {ITEM} WHERE queue_id = %s AND thread_id = %s AND status = %s "
            "ORDER BY scheduled_at, seq LIMIT 1",
            [queue_id, thread_id, Status.PENDING.value],
        )
        found = cursor.fetchone()
    return found[0] if found else None


# -- writes ------------------------------------------------------------------------------------


def insert_rows(rows: Sequence[ItemRow]) -> None:
    """New rows: on PostgreSQL outside a pipeline by one ``COPY`` (``_copy_rows``); else a
    statement a row (``executemany``: in a pipeline they go together, and psycopg prepares
    a statement the server has seen a few times)."""
    if not rows:
        return
    columns = ", ".join(f'"{c}"' for c in COLUMNS)
    if dialect().pipeline and not _in_pipeline():
        _copy_rows(columns, rows)
        return
    json_mark = dialect().json_mark
    marks = ", ".join(json_mark if c in JSON_COLUMNS else "%s" for c in COLUMNS)
    with _cursor() as cursor:
        cursor.executemany(
            f"INSERT INTO {ITEM} ({columns}) VALUES ({marks})",
            list(map(_values_of(COLUMNS), rows)),
        )


def _copy_rows(columns: str, rows: Sequence[ItemRow]) -> None:
    """PostgreSQL, outside a pipeline: new rows by ``COPY ... FROM STDIN``, made by
    psycopg's C code: one statement for the server, where a statement a row cost a batch
    of 500 posts twice as much here (``bench/committer_cost.py``). ``COPY`` is not a
    statement Django's cursor runs, so ``execute_wrapper`` and query logging do not see it;
    its errors are Django's all the same."""
    values = _values_of(COLUMNS)
    with (
        _cursor() as cursor,
        connection.wrap_database_errors,
        cursor.cursor.copy(f"COPY {ITEM} ({columns}) FROM STDIN") as copy,
    ):
        for row in rows:
            copy.write_row(values(row))


def update_rows(rows: Iterable[ItemRow]) -> None:
    """Write back each row's changed columns, per set of columns: on PostgreSQL one
    ``UPDATE ... FROM unnest(...)`` for all the rows (one statement for the server to run,
    where each row's own took most of a group's time there); on SQLite, in the same process,
    an ``executemany``."""
    shapes: dict[tuple[str, ...], list[ItemRow]] = defaultdict(list)
    for row in rows:
        if row.dirty:
            shapes[tuple(sorted(row.dirty))].append(row)
            row.dirty = set()
    with _cursor() as cursor:
        for columns, members in shapes.items():
            if dialect().update_from_values:
                for chunk in _chunks(members):
                    _update_from_arrays(cursor, columns, chunk)
                continue
            assignments = ", ".join(f'"{c}" = %s' for c in columns)
            values = _values_of((*columns, "id"))
            cursor.executemany(
                f"UPDATE {ITEM} SET {assignments} WHERE id = %s", list(map(values, members))
            )


def _update_from_arrays(cursor: Any, columns: tuple[str, ...], rows: Sequence[ItemRow]) -> None:
    """PostgreSQL: set ``columns`` of ``rows`` from one array per column, each cast to its
    column's type (an array of NULLs alone would be text): the statement's text depends on
    the columns only, not on the number of rows, so the server keeps it prepared."""
    names = ("id", *columns)
    # The base type ("varchar", not "varchar(64)"): a cast to a length cuts a longer text
    # short, where the assignment to the column refuses it.
    arrays = ", ".join(f"%s::{_column_type(c).split('(')[0]}[]" for c in names)
    assignments = ", ".join(f'"{c}" = v."{c}"' for c in columns)
    quoted = ", ".join(f'"{c}"' for c in names)
    values = _values_of(names)
    cursor.execute(
        f"UPDATE {ITEM} AS t SET {assignments} FROM unnest({arrays}) AS v({quoted}) "
        'WHERE t.id = v."id"',
        [list(column) for column in zip(*map(values, rows), strict=True)],
    )


_COLUMN_TYPES: dict[str, str] = {}


def _column_type(column: str) -> str:
    """The item table's type of ``column`` on this database (``timestamp with time zone``)."""
    if not _COLUMN_TYPES:
        from ..models import Item

        for f in Item._meta.concrete_fields:
            _COLUMN_TYPES[str(f.column)] = str(f.db_type(connection))
    return _COLUMN_TYPES[column]


def delete_rows(ids: Sequence[str]) -> None:
    with _cursor() as cursor:
        for chunk in _chunks(list(ids)):
            condition, params = _among(chunk)
            cursor.execute(f"DELETE FROM {ITEM} WHERE id{condition}", params)


def mark_unflushed(ids: Collection[str]) -> None:
    """Mark the rows of ``ids`` ``unflushed`` (``Item.unflushed``): statements of their own,
    outside any group's transaction (``clear_unflushed`` clears them). A row already marked
    is not written again (a mark set once a second while a disk fails leaves no dead row
    versions)."""
    with _cursor() as cursor:
        for chunk in _chunks(sorted(ids)):
            condition, params = _among(chunk)
            cursor.execute(
                f"UPDATE {ITEM} SET unflushed = %s "
                f"WHERE (unflushed IS NULL OR NOT unflushed) AND id{condition}",
                [True, *params],
            )


def clear_unflushed(revs: dict[str, int]) -> None:
    """Clear the marks of the rows of ``revs`` (``Item.unflushed``) that are still at the
    ``rev`` given: one statement a chunk, outside any group's transaction."""
    with _cursor() as cursor:
        for chunk in _chunks(sorted(revs), 250):  # (two parameters a row)
            pairs = " OR ".join(["(id = %s AND rev = %s)"] * len(chunk))
            cursor.execute(
                f"UPDATE {ITEM} SET unflushed = %s WHERE unflushed AND ({pairs})",
                [False, *(value for item_id in chunk for value in (item_id, revs[item_id]))],
            )


def unflushed_rows(limit: int, after: str = "") -> list[str]:
    """Up to ``limit`` ids, past ``after``, of the rows marked ``unflushed`` (by their partial
    index), in order."""
    with _cursor() as cursor:
        cursor.execute(
            f"SELECT id FROM {ITEM} WHERE unflushed AND id > %s ORDER BY id LIMIT %s",
            [after, limit],
        )
        return [item_id for (item_id,) in cursor.fetchall()]


def delete_rows_of_queue(queue_id: int, ids: Sequence[str]) -> list[Status]:
    """Delete the rows ``ids`` of one queue; the status of each row that went."""
    gone: list[Status] = []
    with _cursor() as cursor:
        for chunk in _chunks(list(ids)):
            cursor.execute(
                f"DELETE FROM {ITEM} WHERE queue_id = %s "
                f"AND id IN ({_placeholders(len(chunk))}) RETURNING status",
                [queue_id, *chunk],
            )
            gone += [Status(status) for (status,) in cursor.fetchall()]
    return gone


# -- threads -----------------------------------------------------------------------------------

THREAD_COLUMNS = "id, queue_id, thread_id, member_count, processing, processing_item, heads"


def _thread(values: Sequence[Any], queue_names: dict[int, str]) -> ThreadState:
    pk, queue_id, thread_id, count, processing, processing_item, heads = values
    return ThreadState(
        queue_id=queue_id,
        thread_id=thread_id,
        queue_name=queue_names.get(queue_id, ""),
        pk=pk,
        member_count=count,
        processing=processing,
        processing_item=processing_item,
        heads=list(read_json(heads) or []),
    )


def lock_threads(
    keys: Sequence[tuple[int, str]], *, create: set[tuple[int, str]], queue_names: dict[int, str]
) -> dict[tuple[int, str], ThreadState]:
    """The thread rows of ``keys`` (queue id, thread id), locked in that order, making those
    in ``create`` that do not exist. A row its last member's verdict deleted while we waited
    is made again; one that keeps being deleted is a ``Conflict``."""
    found: dict[tuple[int, str], ThreadState] = {}
    missing = sorted(keys)
    with _cursor() as cursor:
        for _round in range(5):
            to_create = [k for k in missing if k in create]
            if to_create:
                cursor.executemany(
                    f"INSERT INTO {THREAD} (queue_id, thread_id, member_count, processing, heads) "
                    "VALUES (%s, %s, 0, 0, '[]') ON CONFLICT (queue_id, thread_id) DO NOTHING",
                    to_create,
                )
            marks = ", ".join(["(%s, %s)"] * len(missing))
            cursor.execute(
                f"SELECT {THREAD_COLUMNS} FROM {THREAD} WHERE (queue_id, thread_id) IN ({marks}) "
                f"ORDER BY queue_id, thread_id{dialect().lock}",
                [v for k in missing for v in k],
            )
            for values in cursor.fetchall():
                thread = _thread(values, queue_names)
                found[(thread.queue_id, thread.thread_id)] = thread
            missing = [k for k in missing if k not in found and k in create]
            if not missing:
                return found
    raise Conflict("could not lock a thread: it kept being deleted", code="busy")


def claim_thread(queue_id: int, thread_id: str, queue_name: str) -> ThreadState | None:
    """A claimed candidate's thread row, unless another group holds it (``SKIP LOCKED``)."""
    with _cursor() as cursor:
        cursor.execute(
            f"SELECT {THREAD_COLUMNS} FROM {THREAD} "
            f"WHERE queue_id = %s AND thread_id = %s{dialect().skip_locked}",
            [queue_id, thread_id],
        )
        found = cursor.fetchone()
    return None if found is None else _thread(found, {queue_id: queue_name})


def thread_exists(queue_id: int, thread_id: str) -> bool:
    """Whether the thread's row exists (unlocked: a claim that could not lock it asks)."""
    with _cursor() as cursor:
        cursor.execute(
            f"SELECT 1 FROM {THREAD} WHERE queue_id = %s AND thread_id = %s",
            [queue_id, thread_id],
        )
        return cursor.fetchone() is not None


def save_thread(thread: ThreadState) -> None:
    mark = dialect().json_mark
    values = [
        thread.member_count,
        thread.processing,
        thread.processing_item,
        adapt_json(thread.heads),
    ]
    with _cursor() as cursor:
        if thread.pk is None:
            cursor.execute(
                f"INSERT INTO {THREAD} (queue_id, thread_id, member_count, processing, "
                f"processing_item, heads) VALUES (%s, %s, %s, %s, %s, {mark})",
                [thread.queue_id, thread.thread_id, *values],
            )
            cursor.execute(
                f"SELECT id FROM {THREAD} WHERE queue_id = %s AND thread_id = %s",
                [thread.queue_id, thread.thread_id],
            )
            thread.pk = cursor.fetchone()[0]
        else:
            cursor.execute(
                f"UPDATE {THREAD} SET member_count = %s, processing = %s, "
                f"processing_item = %s, heads = {mark} WHERE id = %s",
                [*values, thread.pk],
            )


def delete_thread(pk: int) -> None:
    with _cursor() as cursor:
        cursor.execute(f"DELETE FROM {THREAD} WHERE id = %s", [pk])


def set_eligible(ids: Sequence[str], eligible: bool, *, only_pending: bool = False) -> None:
    if not ids:
        return
    condition = " AND status = %s" if only_pending else ""
    params: list[Any] = [eligible, *ids]
    if only_pending:
        params.append(Status.PENDING.value)
    with _cursor() as cursor:
        cursor.execute(
            f"UPDATE {ITEM} SET eligible = %s WHERE id IN ({_placeholders(len(ids))}){condition}",
            params,
        )


# -- queue counts ------------------------------------------------------------------------------


def add_counts(deltas: dict[tuple[int, str], int], shard: int) -> None:
    """Add each group's change to the per-queue counts (``QueueCount``), on this process's
    shard, so processes do not queue behind one row."""
    changes = [(q, s, shard, n) for (q, s), n in sorted(deltas.items()) if n]
    if not changes:
        return
    with _cursor() as cursor:
        cursor.executemany(
            f"INSERT INTO {COUNT} (queue_id, status, shard, n) VALUES (%s, %s, %s, %s) "
            "ON CONFLICT (queue_id, status, shard) DO UPDATE SET n = "
            f"{COUNT}.n + excluded.n",
            changes,
        )


# -- schedules (section 8.3) -----------------------------------------------------------------

SCHEDULE = "taskhoster_schedule"


@dataclass
class ScheduleState:
    """What a firing checks and changes of a schedule's row, read under its lock."""

    id: int
    queue_id: int
    rev: int
    paused: bool
    next_at: datetime | None
    overlap: str
    last_item: str | None


def lock_schedule(schedule_id: int) -> ScheduleState | None:
    """A schedule's row, locked for the rest of the group on PostgreSQL (SQLite's write
    transaction holds every row already); None if it is gone."""
    with _cursor() as cursor:
        cursor.execute(
            "SELECT id, queue_id, rev, paused, next_at, overlap, last_item "
            f"FROM {SCHEDULE} WHERE id = %s{dialect().lock}",
            [schedule_id],
        )
        values = cursor.fetchone()
    if values is None:
        return None
    return ScheduleState(
        id=int(values[0]),
        queue_id=int(values[1]),
        rev=int(values[2]),
        paused=bool(values[3]),
        next_at=read_time(values[4]),
        overlap=str(values[5]),
        last_item=values[6],
    )


def advance_schedule(
    state: ScheduleState, *, next_at: datetime | None, slot: datetime | None, at: datetime
) -> None:
    """Move a schedule on to ``next_at``; with ``slot``, that slot's item is ``last_item``."""
    state.next_at = next_at
    with _cursor() as cursor:
        if slot is None:
            cursor.execute(
                f"UPDATE {SCHEDULE} SET next_at = %s, updated_at = %s WHERE id = %s",
                [adapt_time(next_at), adapt_time(at), state.id],
            )
        else:
            cursor.execute(
                f"UPDATE {SCHEDULE} SET next_at = %s, last_slot = %s, last_item = %s, "
                "updated_at = %s WHERE id = %s",
                [adapt_time(next_at), adapt_time(slot), state.last_item, adapt_time(at), state.id],
            )
