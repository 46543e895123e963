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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

from django.db import connection

from ..errors import Conflict
from ..status import RetainFrom, Status
from .queues import QUEUE_SETTINGS
from .rules import ItemRow, QueueInfo, ThreadState

ITEM = "taskhoster_item"
THREAD = "taskhoster_thread"
QUEUE = "taskhoster_queue"
COUNT = "taskhoster_queuecount"

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
)
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


SQLITE = Dialect(
    vendor="sqlite",
    lock="",
    skip_locked="",
    json_mark="%s",
    naive_times=True,
    update_from_values=False,
    advisory_locks=False,
)
POSTGRESQL = Dialect(
    vendor="postgresql",
    lock=" FOR UPDATE",
    skip_locked=" FOR UPDATE SKIP LOCKED",
    json_mark="%s::jsonb",
    naive_times=False,
    update_from_values=True,
    advisory_locks=True,
)


# Any other database Django speaks: row locks and casts as PostgreSQL's, no advisory locks.
OTHER = replace(POSTGRESQL, vendor="other", advisory_locks=False)
DIALECTS = {d.vendor: d for d in (SQLITE, POSTGRESQL)}


def dialect() -> Dialect:
    """The dialect of the database the engine's connection is on: every difference between
    the databases is one of its fields, and the SQL here reads it instead of asking which
    database it is."""
    return DIALECTS.get(connection.vendor, OTHER)


# PostgreSQL advisory lock class for queues: groups hold it shared, deleting a queue
# exclusive, so no group writes into a queue's directory while it is being taken away.
QUEUE_LOCK_CLASS = 7331


def lock_queues_shared(queue_ids: Iterable[int]) -> None:
    """A group's hold on the directories of the queues it writes into (in id order)."""
    if not dialect().advisory_locks:
        return
    with connection.cursor() as cursor:
        for queue_id in sorted(queue_ids):
            cursor.execute(
                "SELECT pg_advisory_xact_lock_shared(%s, %s)", [QUEUE_LOCK_CLASS, queue_id]
            )


def lock_queue_exclusive(queue_id: int) -> None:
    """A queue's deletion waits for the groups writing into its directory."""
    if not dialect().advisory_locks:
        return
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_xact_lock(%s, %s)", [QUEUE_LOCK_CLASS, queue_id])


# -- values in and out -----------------------------------------------------------------------


def adapt_time(value: datetime | None) -> Any:
    """A time as the database stores it: what Django's own adapter gives (on SQLite, naive
    UTC text; the engine's times are always UTC, which takes the short way)."""
    if value is None:
        return None
    if value.tzinfo is UTC and dialect().naive_times:
        return str(value.replace(tzinfo=None))
    return connection.ops.adapt_datetimefield_value(value)


def read_time(value: object) -> datetime | None:
    if value is None:
        return None
    found = datetime.fromisoformat(value) if isinstance(value, str) else value
    assert isinstance(found, datetime)
    return found if found.tzinfo is not None else found.replace(tzinfo=UTC)


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
        queue_name=queue_name,
    )


def _value(row: ItemRow, column: str) -> Any:
    value = getattr(row, column)
    if column in TIME_COLUMNS:
        return adapt_time(value)
    if column == "origin":
        return adapt_json(value)
    return value


def _placeholders(n: int) -> str:
    return ", ".join(["%s"] * n)


def _chunks(values: Sequence[Any], size: int = 500) -> Iterable[Sequence[Any]]:
    for start in range(0, len(values), size):
        yield values[start : start + size]


# -- reads ------------------------------------------------------------------------------------


def select_rows(ids: Iterable[str], *, lock: bool) -> dict[str, ItemRow]:
    """The rows of ``ids`` that exist, locked in id order when ``lock`` (PostgreSQL)."""
    wanted = sorted(set(ids))
    found: dict[str, ItemRow] = {}
    suffix = f" ORDER BY id{dialect().lock}" if lock and dialect().lock else ""
    with connection.cursor() as cursor:
        for chunk in _chunks(wanted):
            cursor.execute(
                f"SELECT {SELECT_COLUMNS} FROM {ITEM} WHERE id IN ({_placeholders(len(chunk))})"
                + suffix,
                list(chunk),
            )
            for values in cursor.fetchall():
                row = _row(values)
                found[row.id] = row
    return found


def peek_threads(ids: Iterable[str]) -> dict[str, tuple[int, str | None]]:
    """Each existing item's queue id and thread id (unlocked: to know what to lock first)."""
    wanted = sorted(set(ids))
    out: dict[str, tuple[int, str | None]] = {}
    with connection.cursor() as cursor:
        for chunk in _chunks(wanted):
            cursor.execute(
                f"SELECT id, queue_id, thread_id FROM {ITEM} "
                f"WHERE id IN ({_placeholders(len(chunk))})",
                list(chunk),
            )
            for item_id, queue_id, thread_id in cursor.fetchall():
                out[item_id] = (queue_id, thread_id)
    return out


def claim_query(
    queue_id: int, at: datetime, limit: int, skip: Sequence[str] = ()
) -> tuple[str, list[Any]]:
    """The claim's query: the earliest due eligible items of a queue, through the partial
    index ``item_claimable``, locked with SKIP LOCKED on PostgreSQL so that concurrent
    claimers pass each other by."""
    where = ""
    params: list[Any] = [queue_id, adapt_time(at)]
    if skip:
        where = f" AND id NOT IN ({_placeholders(len(skip))})"
        params.extend(skip)
    params.append(limit)
    lock = dialect().skip_locked
    # ``eligible`` bare, as in the partial index's condition, so the planner uses it.
    query = (
        f"SELECT {SELECT_COLUMNS} FROM {ITEM} WHERE eligible AND queue_id = %s "
        f"AND scheduled_at <= %s{where} ORDER BY scheduled_at, seq LIMIT %s{lock}"
    )
    return query, params


def claim_candidates(
    queue_id: int, at: datetime, limit: int, skip: Sequence[str] = ()
) -> list[ItemRow]:
    query, params = claim_query(queue_id, at, limit, skip)
    with connection.cursor() as cursor:
        cursor.execute(query, params)
        return [_row(values) for values in cursor.fetchall()]


def existing_keys(queue_id: int, keys: Iterable[str]) -> dict[str, ItemRow]:
    wanted = sorted(set(keys))
    found: dict[str, ItemRow] = {}
    with connection.cursor() as cursor:
        for chunk in _chunks(wanted):
            cursor.execute(
                f"SELECT {SELECT_COLUMNS} FROM {ITEM} "
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
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {columns} FROM {QUEUE} WHERE {' OR '.join(where)}", params)
        return [_queue(row) for row in cursor.fetchall()]


def _queue(values: Sequence[Any]) -> QueueInfo:
    found = dict(zip(QUEUE_COLUMNS, values, strict=True))
    found["retain_from"] = RetainFrom(found["retain_from"])
    found["deleting"] = bool(found["deleting"])
    return QueueInfo(**found)


def next_due(queue_names: Sequence[str]) -> dict[str, datetime]:
    """For each live queue named that has a claimable item (due or delayed), the earliest
    ``scheduledAt`` among them: one query, one probe of the claim index per queue (a queue
    with nothing claimable is left out)."""
    found: dict[str, datetime] = {}
    with connection.cursor() as cursor:
        for chunk in _chunks(list(queue_names)):
            # ``eligible`` bare, as in the partial index's condition, so the planner uses it.
            cursor.execute(
                f"SELECT q.name, (SELECT i.scheduled_at FROM {ITEM} i WHERE i.eligible "
                "AND i.queue_id = q.id ORDER BY i.scheduled_at, i.seq LIMIT 1) "
                f"FROM {QUEUE} q WHERE q.name IN ({_placeholders(len(chunk))}) "
                "AND NOT q.deleting",
                list(chunk),
            )
            for name, at in cursor.fetchall():
                if at is not None:
                    found[name] = read_time(at)  # type: ignore[assignment]
    return found


def first_pending_member(queue_id: int, thread_id: str) -> str | None:
    """A thread's head as the index orders the line (``rules.thread_head``: earliest
    ``scheduled_at``, then arrival, ``rules.line_order``; the real-engine model test holds
    the two to each other)."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT id FROM {ITEM} WHERE queue_id = %s AND thread_id = %s AND status = %s "
            "ORDER BY scheduled_at, seq LIMIT 1",
            [queue_id, thread_id, Status.PENDING.value],
        )
        found = cursor.fetchone()
    return found[0] if found else None


# -- writes ------------------------------------------------------------------------------------


def insert_rows(rows: Sequence[ItemRow]) -> None:
    if not rows:
        return
    columns = ", ".join(f'"{c}"' for c in COLUMNS)
    json_mark = dialect().json_mark
    marks = ", ".join(json_mark if c == "origin" else "%s" for c in COLUMNS)
    with connection.cursor() as cursor:
        cursor.executemany(
            f"INSERT INTO {ITEM} ({columns}) VALUES ({marks})",
            [[_value(row, c) for c in COLUMNS] for row in rows],
        )


def update_rows(rows: Iterable[ItemRow]) -> None:
    """Write back each row's changed columns, per set of columns: on PostgreSQL one
    ``UPDATE ... FROM (VALUES ...)`` for all the rows (one statement for the server to run,
    where each row's own took most of a group's time there); on SQLite, in the same process,
    an ``executemany``."""
    shapes: dict[tuple[str, ...], list[ItemRow]] = defaultdict(list)
    for row in rows:
        if row.dirty:
            shapes[tuple(sorted(row.dirty))].append(row)
            row.dirty = set()
    with connection.cursor() as cursor:
        for columns, members in shapes.items():
            if dialect().update_from_values:
                for chunk in _chunks(members):
                    _update_from_values(cursor, columns, chunk)
                continue
            assignments = ", ".join(f'"{c}" = %s' for c in columns)
            cursor.executemany(
                f"UPDATE {ITEM} SET {assignments} WHERE id = %s",
                [[*(_value(row, c) for c in columns), row.id] for row in members],
            )


def _update_from_values(cursor: Any, columns: tuple[str, ...], rows: Sequence[ItemRow]) -> None:
    """PostgreSQL: set ``columns`` of ``rows`` from one VALUES list (each value cast to its
    column's type: a VALUES column of NULLs alone would be text)."""
    names = ", ".join(f'"{c}"' for c in ("id", *columns))
    row_marks = "(" + ", ".join(["%s"] * (len(columns) + 1)) + ")"
    assignments = ", ".join(f'"{c}" = v."{c}"::{_column_type(c)}' for c in columns)
    cursor.execute(
        f"UPDATE {ITEM} AS t SET {assignments} "
        f"FROM (VALUES {', '.join([row_marks] * len(rows))}) AS v({names}) "
        'WHERE t.id = v."id"',
        [value for row in rows for value in (row.id, *(_value(row, c) for c in columns))],
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
    with connection.cursor() as cursor:
        for chunk in _chunks(list(ids)):
            cursor.execute(
                f"DELETE FROM {ITEM} WHERE id IN ({_placeholders(len(chunk))})", list(chunk)
            )


def delete_rows_of_queue(queue_id: int, ids: Sequence[str]) -> list[Status]:
    """Delete the rows ``ids`` of one queue; the status of each row that went."""
    gone: list[Status] = []
    with connection.cursor() as cursor:
        for chunk in _chunks(list(ids)):
            cursor.execute(
                f"DELETE FROM {ITEM} WHERE queue_id = %s "
                f"AND id IN ({_placeholders(len(chunk))}) RETURNING status",
                [queue_id, *chunk],
            )
            gone += [Status(status) for (status,) in cursor.fetchall()]
    return gone


# -- threads -----------------------------------------------------------------------------------

THREAD_COLUMNS = "id, queue_id, thread_id, member_count, processing_item, head_item"


def _thread(values: Sequence[Any], queue_names: dict[int, str]) -> ThreadState:
    pk, queue_id, thread_id, count, processing, head = values
    return ThreadState(
        queue_id=queue_id,
        thread_id=thread_id,
        queue_name=queue_names.get(queue_id, ""),
        pk=pk,
        member_count=count,
        processing_item=processing,
        head_item=head,
    )


def lock_threads(
    keys: Sequence[tuple[int, str]], *, create: set[tuple[int, str]], queue_names: dict[int, str]
) -> dict[tuple[int, str], ThreadState]:
    """The thread rows of ``keys`` (queue id, thread id), locked in that order, making those
    in ``create`` that do not exist. A row its last member's verdict deleted while we waited
    is made again; one that keeps being deleted is a ``Conflict``."""
    found: dict[tuple[int, str], ThreadState] = {}
    missing = sorted(keys)
    with connection.cursor() as cursor:
        for _round in range(5):
            to_create = [k for k in missing if k in create]
            if to_create:
                cursor.executemany(
                    f"INSERT INTO {THREAD} (queue_id, thread_id, member_count) "
                    "VALUES (%s, %s, 0) ON CONFLICT (queue_id, thread_id) DO NOTHING",
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
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT {THREAD_COLUMNS} FROM {THREAD} "
            f"WHERE queue_id = %s AND thread_id = %s{dialect().skip_locked}",
            [queue_id, thread_id],
        )
        found = cursor.fetchone()
    return None if found is None else _thread(found, {queue_id: queue_name})


def save_thread(thread: ThreadState) -> None:
    with connection.cursor() as cursor:
        if thread.pk is None:
            cursor.execute(
                f"INSERT INTO {THREAD} (queue_id, thread_id, member_count, "
                "processing_item, head_item) VALUES (%s, %s, %s, %s, %s)",
                [
                    thread.queue_id,
                    thread.thread_id,
                    thread.member_count,
                    thread.processing_item,
                    thread.head_item,
                ],
            )
            cursor.execute(
                f"SELECT id FROM {THREAD} WHERE queue_id = %s AND thread_id = %s",
                [thread.queue_id, thread.thread_id],
            )
            thread.pk = cursor.fetchone()[0]
        else:
            cursor.execute(
                f"UPDATE {THREAD} SET member_count = %s, processing_item = %s, "
                "head_item = %s WHERE id = %s",
                [thread.member_count, thread.processing_item, thread.head_item, thread.pk],
            )


def delete_thread(pk: int) -> None:
    with connection.cursor() as cursor:
        cursor.execute(f"DELETE FROM {THREAD} WHERE id = %s", [pk])


def set_eligible(item_id: str, eligible: bool, *, only_pending: bool = False) -> None:
    condition = " AND status = %s" if only_pending else ""
    params: list[Any] = [eligible, item_id]
    if only_pending:
        params.append(Status.PENDING.value)
    with connection.cursor() as cursor:
        cursor.execute(f"UPDATE {ITEM} SET eligible = %s WHERE id = %s{condition}", params)


# -- queue counts ------------------------------------------------------------------------------


def add_counts(deltas: dict[tuple[int, str], int], shard: int) -> None:
    """Add each group's change to the per-queue counts (``QueueCount``), on this process's
    shard, so processes do not queue behind one row."""
    changes = [(q, s, shard, n) for (q, s), n in sorted(deltas.items()) if n]
    if not changes:
        return
    with connection.cursor() as cursor:
        cursor.executemany(
            f"INSERT INTO {COUNT} (queue_id, status, shard, n) VALUES (%s, %s, %s, %s) "
            "ON CONFLICT (queue_id, status, shard) DO UPDATE SET n = "
            f"{COUNT}.n + excluded.n",
            changes,
        )
