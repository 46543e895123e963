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
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from django.db import connection

from ..status import Status

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


@dataclass(slots=True, eq=False)
class ItemRow:
    """An item's index row, as the engine reads and changes it (field names as the model's).

    ``dirty`` names the columns changed since it was read, so only they are written back.
    """

    id: str
    queue_id: int
    status: str
    eligible: bool
    thread_id: str | None
    key: str | None
    seq: str
    scheduled_at: datetime
    posted_at: datetime
    attempts: int
    lease: str | None
    lease_expires_at: datetime | None
    claimed_at: datetime | None
    finished_at: datetime | None
    fetched_at: datetime | None
    error: str | None
    origin: Any
    dead_letter: str | None
    rev: int
    updated_at: datetime
    queue_name: str = ""
    dirty: set[str] = field(default_factory=set)

    def set(self, **values: Any) -> None:
        for name, value in values.items():
            if getattr(self, name) != value:
                setattr(self, name, value)
                self.dirty.add(name)

    @property
    def is_terminal(self) -> bool:
        return Status(self.status).is_terminal

    def snapshot(self) -> ItemRow:
        """A copy as the row is now, for an answer that later changes must not reach."""
        return replace(self, dirty=set())


# -- values in and out -----------------------------------------------------------------------


def _is_sqlite() -> bool:
    return connection.vendor == "sqlite"


def adapt_time(value: datetime | None) -> Any:
    """A time as the database stores it: what Django's own adapter gives (on SQLite, naive
    UTC text; the engine's times are always UTC, which takes the short way)."""
    if value is None:
        return None
    if value.tzinfo is UTC and _is_sqlite():
        return str(value.replace(tzinfo=None))
    return connection.ops.adapt_datetimefield_value(value)


def read_time(value: Any) -> datetime | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    if value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    return value


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
        status=status,
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
    suffix = " ORDER BY id FOR UPDATE" if lock and not _is_sqlite() else ""
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
    lock = "" if _is_sqlite() else " FOR UPDATE SKIP LOCKED"
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


QUEUE_COLUMNS = (
    "id",
    "name",
    "lease_seconds",
    "queue_seconds",
    "retain_seconds",
    "retain_from",
    "max_attempts",
    "backoff_seconds",
    "backoff_max_seconds",
    "dead_letter_queue",
    "deleting",
)


def select_queues(*, names: Sequence[str] = (), ids: Sequence[int] = ()) -> list[tuple[Any, ...]]:
    """Queue settings (``QUEUE_COLUMNS``) of the live queues named, and of the ids given."""
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
        return [(*row[:-1], bool(row[-1])) for row in cursor.fetchall()]


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
    marks = ", ".join("%s::jsonb" if c == "origin" and not _is_sqlite() else "%s" for c in COLUMNS)
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
            if not _is_sqlite():
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


def delete_rows_of_queue(queue_id: int, ids: Sequence[str]) -> list[str]:
    """Delete the rows ``ids`` of one queue; the status of each row that went."""
    gone: list[str] = []
    with connection.cursor() as cursor:
        for chunk in _chunks(list(ids)):
            cursor.execute(
                f"DELETE FROM {ITEM} WHERE queue_id = %s "
                f"AND id IN ({_placeholders(len(chunk))}) RETURNING status",
                [queue_id, *chunk],
            )
            gone += [status for (status,) in cursor.fetchall()]
    return gone


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
