"""One group commit: many operations, one transaction, one flush of the item files.

Every transition has the same shape here:

1. **read rows**: every item the group's operations name, in one query (locked in id order on
   PostgreSQL, after their thread rows in (queue, thread) order: the one locking order);
2. **decide by the rules**: each operation, in arrival order, against the rows in memory
   (``Group.result``, ``Group.requeue`` ...), so two operations on one item in one group see
   each other; a bad or losing operation gets its own answer and changes nothing;
3. **write files**: append the transition's line to the item's file and rename it into its
   new state's directory (``store.FileBatch``): undoable until the commit;
4. **write rows**: one statement per shape of change, new rows in one ``executemany``;
5. **settle threads**: each touched thread once, with its next head made eligible;
6. **claims** run last, so they see this group's posts and freed threads;
7. **commit** (removals are applied just before it), and announce what changed;
8. **flush, then answer** (``committer.run_group``): one barrier for the group
   (``store.FileBatch.flush``) makes its files durable before any answer that needs them
   goes out; a claim, an extend or a release, which need no durability, is answered at the
   commit.
"""

from __future__ import annotations

import logging
import math
import secrets
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db import connection, transaction

from .. import events, metrics
from ..errors import (
    Conflict,
    ItemNotFound,
    KeyForbidden,
    KeyRefused,
    QueueNotFound,
    TaskhosterError,
)
from ..faults import crash_point
from ..ids import new_id, new_ids
from ..keys import principals_by_hash
from ..status import State, Status
from ..store import Record, StateStore, encode_line
from ..timeutil import now as utcnow
from ..timeutil import to_wire
from . import rows as sql
from .ops import (
    Claim,
    Claimed,
    Delete,
    Extend,
    Fail,
    ItemOp,
    MarkFetched,
    Op,
    Post,
    Posted,
    Reclaim,
    Release,
    Requeue,
    Restart,
    Result,
    Sweep,
    Verdict,
)
from .rows import ItemRow

log = logging.getLogger(__name__)

LEASE_EXPIRED = "lease expired"
WORKER_DISCONNECTED = "worker disconnected"
TIMEOUT = "timeout"
CLAIM_ROUNDS = 4
# PostgreSQL advisory lock class for queues: groups hold it shared, deleting a queue
# exclusive, so no group writes into a queue's directory while it is being taken away.
QUEUE_LOCK_CLASS = 7331


class ClaimedTwice(RuntimeError):
    """A claim met an item it had already taken: a bug, never an answer."""


@dataclass(frozen=True, slots=True)
class QueueInfo:
    """A queue's settings, in the order of ``rows.QUEUE_COLUMNS``."""

    id: int
    name: str
    lease_seconds: float
    queue_seconds: float
    retain_seconds: float
    retain_from: str
    max_attempts: int | None
    backoff_seconds: float
    backoff_max_seconds: float
    dead_letter_queue: str | None
    deleting: bool


@dataclass(slots=True)
class ThreadState:
    queue_id: int
    thread_id: str
    queue_name: str
    pk: int | None = None
    member_count: int = 0
    processing_item: str | None = None
    head_item: str | None = None
    delta: int = 0
    touched: bool = False


def backoff_delay(queue: QueueInfo, attempts: int) -> float:
    exponent = max(0, attempts - 1)
    if exponent > 60:
        return float(queue.backoff_max_seconds)
    return float(min(queue.backoff_max_seconds, queue.backoff_seconds * math.pow(2, exponent)))


def attempts_exhausted(queue: QueueInfo, attempts: int) -> bool:
    return queue.max_attempts is not None and attempts >= queue.max_attempts


def record_of(row: ItemRow, queue_name: str, payload: Any) -> Record:
    """The first line of a new item's file: everything needed to rebuild it."""
    return {
        "id": row.id,
        "queue": queue_name,
        "status": row.status,
        "payload": payload,
        "threadId": row.thread_id,
        "key": row.key,
        "seq": row.seq,
        "scheduledAt": to_wire(row.scheduled_at),
        "postedAt": to_wire(row.posted_at),
        "attempts": row.attempts,
        "finishedAt": None,
        "fetchedAt": None,
        "result": None,
        "error": None,
        "origin": row.origin,
        "deadLetter": None,
        "rev": row.rev,
    }


def new_row(
    item_id: str,
    *,
    at: datetime,
    scheduled_at: datetime,
    thread_id: str | None,
    key: str | None,
    origin: Any,
) -> ItemRow:
    return ItemRow(
        id=item_id,
        queue_id=0,
        status=Status.PENDING.value,
        eligible=False,
        thread_id=thread_id,
        key=key,
        seq=item_id,
        scheduled_at=scheduled_at,
        posted_at=at,
        attempts=0,
        lease=None,
        lease_expires_at=None,
        claimed_at=None,
        finished_at=None,
        fetched_at=None,
        error=None,
        origin=origin,
        dead_letter=None,
        rev=1,
        updated_at=at,
    )


class Group:
    """The state of one group commit while it runs (see the module docstring)."""

    def __init__(self, ops: list[Op], store: StateStore, shard: int) -> None:
        self.ops = ops
        self.store = store
        self.shard = shard
        self.at = utcnow()
        self.files = store.batch()
        self.queues: dict[int, QueueInfo] = {}
        self.live: dict[str, QueueInfo] = {}
        self.rows: dict[str, ItemRow] = {}
        self.threads: dict[tuple[int, str], ThreadState] = {}
        self.created: list[ItemRow] = []
        self.removed: dict[str, ItemRow] = {}
        self.counts: Counter[tuple[int, str]] = Counter()
        self.news: list[tuple[str, str, str]] = []
        self.counters: Counter[tuple[str, str]] = Counter()
        self.latencies: list[tuple[str, float]] = []
        self.answers: dict[int, tuple[bool, Any]] = {}
        self.keys_seen: dict[tuple[int, str], ItemRow] = {}
        self.copies: list[tuple[ItemRow, Any]] = []
        self.vanished_in_claims: list[ItemRow] = []
        self.claimed: set[str] = set()  # every row a claim of this group looked at
        self.claimed_rows: list[ItemRow] = []  # taken by this group's claims, to write
        self.exhausted: set[str] = set()  # queues whose claims here took all there was
        self.put_back: set[str] = set()  # queues with a dead claim's file put back here
        self.payloads: dict[str, Any] = {}  # of the keyed items made in this group

    # -- running ------------------------------------------------------------------------

    def run(self) -> None:
        """Run every operation in one transaction; the caller answers afterwards."""
        try:
            with transaction.atomic():
                try:
                    self._run_in_transaction()
                except BaseException:
                    # Undo the files while the transaction still holds its locks: once they
                    # are released another group may change these items, and a rename undone
                    # after that would undo its change instead.
                    self.files.rollback()
                    raise
        except BaseException:
            self.files.rollback()  # the commit itself failed (nothing left to undo otherwise)
            raise
        crash_point("group.after_commit", group_size=len(self.ops))
        if any(isinstance(op, Post) for op in self.ops):
            crash_point("post.after_index")
        if any(isinstance(op, Claim) for op in self.ops):
            crash_point("claim.after_commit")
        if any(isinstance(op, Result) for op in self.ops):
            crash_point("result.after_commit")

    def _run_in_transaction(self) -> None:
        self._check_keys()
        self._load()
        for op in self.ops:
            if isinstance(op, ItemOp):
                self._answer(op, self._item_op, op)
        self._dead_letters()
        for op in self.ops:
            if isinstance(op, Post) and id(op) not in self.answers:
                self._answer(op, self._post, op)
            elif isinstance(op, Reclaim):
                self._answer(op, self._reclaim, op)
        crash_point("group.after_files", group_size=len(self.ops))
        sql.update_rows(r for r in self.rows.values() if r.id not in self.removed)
        sql.delete_rows(list(self.removed))  # before the inserts: a key may be taken again
        sql.insert_rows(self.created)
        self._settle_threads()
        claims = [op for op in self.ops if isinstance(op, Claim)]
        if claims:
            self._claims(claims)
        sql.add_counts(dict(self.counts), self.shard)
        self.files.apply_unlinks()
        crash_point("group.before_commit", group_size=len(self.ops))
        transaction.on_commit(self._announce)

    def _answer(self, op: Op, fn: Any, *args: Any) -> None:
        try:
            self.answers[id(op)] = (True, _as_of_now(fn(*args)))
        except TaskhosterError as exc:
            self.answers[id(op)] = (False, exc)

    @property
    def needs_flush(self) -> bool:
        return bool(self.files.written or self.files.directories)

    def outcomes(self) -> list[tuple[Op, bool, Any]]:
        """Each operation with its answer (True, value) or its error (False, exception)."""
        return [
            (op, *self.answers.get(id(op), (False, RuntimeError("no answer")))) for op in self.ops
        ]

    # -- reading ------------------------------------------------------------------------

    def refused_keys(self) -> dict[int, KeyRefused]:
        """The posts whose key ``_check_keys`` refused (by ``id``), with their errors."""
        return {
            key: value
            for key, (ok, value) in self.answers.items()
            if not ok and isinstance(value, KeyRefused)
        }

    def _check_keys(self) -> None:
        """Refuse each post whose key, left to the group (``Post.key_hash``), is not live,
        lacks the ``produce`` scope or may not use its queue: all keys in one query, in the
        group's transaction (a key revoked before it commits refuses the post)."""
        posts = [op for op in self.ops if isinstance(op, Post) and op.key_hash is not None]
        if not posts:
            return
        holders = principals_by_hash(op.key_hash for op in posts if op.key_hash)
        for op in posts:
            holder = holders.get(op.key_hash or "")
            refused: KeyRefused
            if holder is None:
                refused = KeyRefused("invalid or revoked key")
            elif not holder.has_scope("produce"):
                refused = KeyForbidden("this key needs the produce scope")
            elif not holder.may_use(op.queue_name):
                refused = KeyForbidden(f"this key may not use queue {op.queue_name!r}")
            else:
                continue
            self.answers[id(op)] = (False, refused)

    def _load(self) -> None:
        names = {op.queue_name for op in self.ops if isinstance(op, Post | Claim)}
        ids = {i for op in self.ops if isinstance(op, ItemOp) for i in op.item_ids()}
        self._load_queues(names=names)
        lock = connection.vendor != "sqlite"
        keys: set[tuple[int, str]] = set()
        joining: set[tuple[int, str]] = set()
        if lock and ids:
            peek = sql.peek_threads(ids)
            self._load_queues(ids={q for q, _t in peek.values()})
            keys = {(q, t) for q, t in peek.values() if t is not None}
            restarts = {op.item_id for op in self.ops if isinstance(op, Restart)}
            joining = {(q, t) for i, (q, t) in peek.items() if t is not None and i in restarts}
        for op in self.ops:
            if isinstance(op, Post) and op.queue_name in self.live and id(op) not in self.answers:
                q = self.live[op.queue_name]
                joining |= {(q.id, item.thread_id) for item in op.items if item.thread_id}
        self._lock_queues()
        self._lock_threads(keys | joining, create=joining)
        if ids:
            self.rows = sql.select_rows(ids, lock=lock)
            self._load_queues(ids={row.queue_id for row in self.rows.values()})
            for row in self.rows.values():
                queue = self.queues.get(row.queue_id)
                row.queue_name = queue.name if queue else ""
            if not lock:
                restarts = {op.item_id for op in self.ops if isinstance(op, Restart)}
                keys = {(r.queue_id, r.thread_id) for r in self.rows.values() if r.thread_id}
                joining = {
                    (r.queue_id, r.thread_id)
                    for r in self.rows.values()
                    if r.thread_id and r.id in restarts
                }
                self._lock_threads(keys | joining, create=joining)

    def _load_queues(self, *, names: Iterable[str] = (), ids: Iterable[int] = ()) -> None:
        names = [n for n in names if n not in self.live]
        ids = [i for i in ids if i not in self.queues]
        for values in sql.select_queues(names=names, ids=ids):
            queue = QueueInfo(*values)
            self.queues[queue.id] = queue
            if not queue.deleting:
                self.live[queue.name] = queue

    def _lock_queues(self) -> None:
        if connection.vendor != "postgresql" or not self.queues:
            return
        with connection.cursor() as cursor:
            for queue_id in sorted(self.queues):
                cursor.execute(
                    "SELECT pg_advisory_xact_lock_shared(%s, %s)", [QUEUE_LOCK_CLASS, queue_id]
                )

    def _lock_threads(self, keys: set[tuple[int, str]], *, create: set[tuple[int, str]]) -> None:
        """Lock the thread rows of ``keys`` (making those in ``create``), in one order."""
        wanted = sorted(k for k in keys if k not in self.threads)
        if not wanted:
            return
        lock = " FOR UPDATE" if connection.vendor != "sqlite" else ""
        missing = list(wanted)
        with connection.cursor() as cursor:
            for _round in range(5):
                to_create = [k for k in missing if k in create]
                if to_create:
                    cursor.executemany(
                        f"INSERT INTO {sql.THREAD} (queue_id, thread_id, member_count) "
                        "VALUES (%s, %s, 0) ON CONFLICT (queue_id, thread_id) DO NOTHING",
                        to_create,
                    )
                marks = ", ".join(["(%s, %s)"] * len(missing))
                cursor.execute(
                    f"SELECT id, queue_id, thread_id, member_count, processing_item, head_item "
                    f"FROM {sql.THREAD} WHERE (queue_id, thread_id) IN ({marks}) "
                    f"ORDER BY queue_id, thread_id{lock}",
                    [v for k in missing for v in k],
                )
                for pk, queue_id, thread_id, count, processing, head in cursor.fetchall():
                    queue = self.queues.get(queue_id)
                    self.threads[(queue_id, thread_id)] = ThreadState(
                        queue_id=queue_id,
                        thread_id=thread_id,
                        queue_name=queue.name if queue else "",
                        pk=pk,
                        member_count=count,
                        processing_item=processing,
                        head_item=head,
                    )
                # A row its last member's verdict deleted while we waited is made again.
                missing = [k for k in missing if k not in self.threads and k in create]
                if not missing:
                    return
        raise Conflict("could not lock a thread: it kept being deleted", code="busy")

    # -- item operations ------------------------------------------------------------------

    def _item_op(self, op: ItemOp) -> Any:
        if isinstance(op, Result):
            return self.result(op)
        if isinstance(op, Fail):
            return self.fail(op)
        if isinstance(op, Extend):
            return self.extend(op)
        if isinstance(op, Requeue):
            return self.requeue_held(op)
        if isinstance(op, Release):
            return self.release(op)
        if isinstance(op, Sweep):
            return self.sweep(op)
        if isinstance(op, Delete):
            return sum(self.delete(i, op.queue_id) for i in op.ids)
        if isinstance(op, Restart):
            return self.restart(op)
        if isinstance(op, MarkFetched):
            return self.mark_fetched(op)
        raise TypeError(f"unknown operation {op!r}")

    def _row(self, item_id: str) -> ItemRow | None:
        row = self.rows.get(item_id)
        if row is None or item_id in self.removed:
            return None
        queue = self.queues.get(row.queue_id)
        if queue is None or queue.deleting:
            return None
        return row

    def _queue(self, row: ItemRow) -> QueueInfo:
        return self.queues[row.queue_id]

    def result(self, op: Result) -> Verdict:
        row = self._row(op.item_id)
        if row is None or (op.queues is not None and row.queue_name not in op.queues):
            # (An item of a queue the caller's key may not use is not found: the same answer
            # as a missing one, so the key learns nothing of other queues' items.)
            raise ItemNotFound(f"item {op.item_id!r} does not exist")
        if row.is_terminal:
            return Verdict(False, row.status, row)
        self._finish(row, Status.FINISHED, error=None, result=op.result)
        return Verdict(True, row.status, row)

    def fail(self, op: Fail) -> Verdict:
        row = self._row(op.item_id)
        if row is None:
            raise ItemNotFound(f"item {op.item_id!r} does not exist")
        if row.status != Status.PROCESSING or not op.lease or row.lease != op.lease:
            return Verdict(False, row.status, row)
        queue = self._queue(row)
        cause = op.error or "failed"
        if op.retry and not attempts_exhausted(queue, row.attempts):
            delay = backoff_delay(queue, row.attempts)
            self._requeue(row, scheduled_at=self.at + timedelta(seconds=delay), error=cause)
        else:
            self._die(row, error=cause)
        return Verdict(True, row.status, row)

    def extend(self, op: Extend) -> tuple[bool, ItemRow]:
        row = self._row(op.item_id)
        if row is None:
            raise ItemNotFound(f"item {op.item_id!r} does not exist")
        limit = self._queue(row).lease_seconds
        wanted = limit if op.seconds is None else min(float(op.seconds), limit)
        if op.lease and row.status == Status.PROCESSING and row.lease == op.lease:
            row.set(lease_expires_at=self.at + timedelta(seconds=wanted), updated_at=self.at)
            return True, row
        return False, row

    def requeue_held(self, op: Requeue) -> Verdict:
        row = self._row(op.item_id)
        if row is None:
            return Verdict(False, None)
        if row.status != Status.PROCESSING or row.lease != op.lease:
            return Verdict(False, row.status, row)
        if attempts_exhausted(self._queue(row), row.attempts):
            self._die(row, error=op.cause)
        else:
            self._requeue(row, scheduled_at=row.scheduled_at, error=op.cause)
        return Verdict(True, row.status, row)

    def release(self, op: Release) -> Verdict:
        row = self._row(op.item_id)
        if row is None:
            return Verdict(False, None)
        if row.status != Status.PROCESSING or row.lease != op.lease:
            return Verdict(False, row.status, row)
        if not self.files.change(row.queue_name, row.id, State.PROCESSING, State.PENDING, None):
            self._vanished(row)
            return Verdict(False, None)
        self._status(row, Status.PENDING)
        row.set(
            eligible=row.thread_id is None,
            attempts=max(0, row.attempts - 1),
            lease=None,
            lease_expires_at=None,
            claimed_at=None,
            updated_at=self.at,
        )
        self._free_thread(row)
        return Verdict(True, row.status, row)

    def sweep(self, op: Sweep) -> int:
        changed = 0
        for item_id in op.ids:
            row = self._row(item_id)
            if row is None:
                continue
            queue = self._queue(row)
            try:
                if op.clock == "lapse":
                    if (
                        row.status != Status.PROCESSING
                        or row.lease_expires_at is None
                        or row.lease_expires_at > op.at
                    ):
                        continue
                    if attempts_exhausted(queue, row.attempts):
                        self._die(row, error=LEASE_EXPIRED, at=op.at)
                    else:
                        self._requeue(
                            row, scheduled_at=row.scheduled_at, error=LEASE_EXPIRED, at=op.at
                        )
                elif op.clock == "timeout":
                    if row.is_terminal or row.posted_at + _secs(queue.queue_seconds) > op.at:
                        continue
                    was_processing = row.status == Status.PROCESSING
                    self._finish(row, Status.FAILED, error=TIMEOUT, at=op.at)
                    self.counters[(queue.name, "timeouts")] += 1
                    if was_processing:
                        self.news.append(("removed:" + TIMEOUT, queue.name, row.id))
                elif op.clock == "retain":
                    start = row.finished_at if queue.retain_from == "finished" else row.fetched_at
                    if not row.is_terminal or start is None:
                        continue
                    if start + _secs(queue.retain_seconds) > op.at:
                        continue
                    self._remove(row, reason=None)
                else:
                    raise ValueError(f"unknown clock {op.clock}")
            except ItemNotFound:
                continue  # its file had vanished: the half-done delete is finished now
            changed += 1
        return changed

    def delete(self, item_id: str, queue_id: int | None) -> bool:
        row = self._row(item_id)
        if row is None or (queue_id is not None and row.queue_id != queue_id):
            return False
        self._remove(row, reason="deleted")
        return True

    def restart(self, op: Restart) -> ItemRow:
        row = self._row(op.item_id)
        if row is None:
            raise ItemNotFound(f"item {op.item_id!r} does not exist")
        if row.status != Status.FAILED:
            raise Conflict(
                f"only a failed item can be restarted; this one is {row.status}", code="not_failed"
            )
        seq = new_id()
        patch = {
            "rev": row.rev + 1,
            "status": Status.PENDING.value,
            "attempts": 0,
            "postedAt": to_wire(self.at),
            "scheduledAt": to_wire(self.at),
            "seq": seq,
            "finishedAt": None,
            "fetchedAt": None,
            "result": None,
            "error": None,
            "deadLetter": None,
        }
        if not self.files.change(row.queue_name, row.id, State.DONE, State.PENDING, patch):
            self._vanished(row)
            raise ItemNotFound(f"item {op.item_id!r} does not exist")
        self._status(row, Status.PENDING)
        row.set(
            eligible=row.thread_id is None,
            attempts=0,
            posted_at=self.at,
            scheduled_at=self.at,
            seq=seq,
            finished_at=None,
            fetched_at=None,
            error=None,
            dead_letter=None,
            lease=None,
            lease_expires_at=None,
            claimed_at=None,
            rev=row.rev + 1,
            updated_at=self.at,
        )
        if row.thread_id is not None:
            thread = self._thread(row)
            thread.delta += 1
            thread.touched = True
        else:
            self.news.append(("claimable", row.queue_name, ""))
        return row

    def mark_fetched(self, op: MarkFetched) -> datetime | None:
        row = self._row(op.item_id)
        if row is None or not row.is_terminal:
            return None
        if row.fetched_at is None:
            row.set(fetched_at=op.at)
        return row.fetched_at

    # -- the transitions ------------------------------------------------------------------

    def _status(self, row: ItemRow, status: Status) -> None:
        if row.status != status:
            self.counts[(row.queue_id, row.status)] -= 1
            self.counts[(row.queue_id, status.value)] += 1
            row.set(status=status.value)

    def _thread(self, row: ItemRow) -> ThreadState:
        assert row.thread_id is not None
        key = (row.queue_id, row.thread_id)
        thread = self.threads.get(key)
        if thread is None:  # SQLite: not locked ahead (its writer lock covers it)
            self._lock_threads({key}, create={key})
            thread = self.threads[key]
        return thread

    def _free_thread(self, row: ItemRow) -> None:
        """The row stopped processing but stays a member: its thread may advance."""
        if row.thread_id is None:
            self.news.append(("claimable", row.queue_name, ""))
            return
        thread = self._thread(row)
        if thread.processing_item == row.id:
            thread.processing_item = None
        thread.touched = True

    def _leave_thread(self, row: ItemRow) -> None:
        """A member leaves for good (verdict, delete): free the thread and advance it."""
        if row.thread_id is None:
            return
        thread = self._thread(row)
        if thread.processing_item == row.id:
            thread.processing_item = None
        if thread.head_item == row.id:
            thread.head_item = None
        thread.delta -= 1
        thread.touched = True

    def _requeue(
        self, row: ItemRow, *, scheduled_at: datetime, error: str, at: datetime | None = None
    ) -> None:
        """Back to pending; ``error`` keeps the cause, so a producer can see why."""
        at = at or self.at
        patch = {
            "rev": row.rev + 1,
            "status": Status.PENDING.value,
            "scheduledAt": to_wire(scheduled_at),
            "error": error,
            "attempts": row.attempts,
        }
        old = Status(row.status).state
        if not self.files.change(row.queue_name, row.id, old, State.PENDING, patch):
            self._vanished(row)
            raise ItemNotFound(f"item {row.id!r} does not exist")
        crash_point("requeue.after_pending_file")
        self._status(row, Status.PENDING)
        row.set(
            eligible=row.thread_id is None,
            scheduled_at=scheduled_at,
            error=error,
            lease=None,
            lease_expires_at=None,
            rev=row.rev + 1,
            updated_at=at,
        )
        self._free_thread(row)
        self.counters[(row.queue_name, "requeues")] += 1

    def _finish(
        self,
        row: ItemRow,
        status: Status,
        *,
        error: str | None,
        result: Any = None,
        dead_letter: str | None = None,
        at: datetime | None = None,
    ) -> None:
        """A verdict: ``done``, out of its thread, announced."""
        at = at or self.at
        patch: dict[str, Any] = {
            "rev": row.rev + 1,
            "status": status.value,
            "finishedAt": to_wire(at),
            "error": error,
            "attempts": row.attempts,
        }
        if status == Status.FINISHED:
            patch["result"] = result
        if dead_letter is not None:
            patch["deadLetter"] = dead_letter
        old = Status(row.status).state
        if not self.files.change(row.queue_name, row.id, old, State.DONE, patch):
            self._vanished(row)
            raise ItemNotFound(f"item {row.id!r} does not exist")
        crash_point("result.after_done_file")
        self._status(row, status)
        row.set(
            eligible=False,
            finished_at=at,
            error=error,
            lease=None,
            lease_expires_at=None,
            dead_letter=dead_letter if dead_letter is not None else row.dead_letter,
            rev=row.rev + 1,
            updated_at=at,
        )
        self._leave_thread(row)
        self.news.append(("verdict", row.queue_name, row.id))
        metric = "results" if status == Status.FINISHED else "failures"
        self.counters[(row.queue_name, metric)] += 1

    def _die(self, row: ItemRow, *, error: str, at: datetime | None = None) -> None:
        """Rule 7: failed, out of its thread, copied to the dead-letter queue if any. The
        copy itself is posted by ``_dead_letters`` once every operation has run."""
        queue = self._queue(row)
        copy_id = None
        target = queue.dead_letter_queue
        if target and target != queue.name:
            self._load_queues(names=[target])
            if target in self.live:
                copy_id = self._dead_letter_copy(row, queue, target, error)
        self._finish(row, Status.FAILED, error=error, dead_letter=copy_id, at=at)

    def _dead_letter_copy(self, row: ItemRow, queue: QueueInfo, target: str, error: str) -> str:
        dlq = self.live[target]
        # The key makes the copy once per death: a death repeated after a crash (whose first
        # copy was already written) finds that copy instead of making a second.
        key = f"dead-letter:{row.id}:{row.seq}"
        known = self.keys_seen.get((dlq.id, key)) or sql.existing_keys(dlq.id, [key]).get(key)
        if known is not None:
            return known.id
        _state, record = self.store.read_any(queue.name, row.id, Status(row.status).state)
        copy = new_row(
            new_id(),
            at=self.at,
            scheduled_at=self.at,
            thread_id=None,
            key=key,
            origin={"queue": queue.name, "id": row.id, "error": error, "attempts": row.attempts},
        )
        copy.queue_id = dlq.id
        copy.queue_name = dlq.name
        copy.eligible = True
        self.keys_seen[(dlq.id, key)] = copy
        self.payloads[copy.id] = record.get("payload")
        self.copies.append((copy, record.get("payload")))
        return copy.id

    def _dead_letters(self) -> None:
        for copy, payload in self.copies:
            self.files.create(
                copy.queue_name, copy.id, encode_line(record_of(copy, copy.queue_name, payload))
            )
            self.created.append(copy)
            self.counts[(copy.queue_id, Status.PENDING.value)] += 1
            self.news.append(("claimable", copy.queue_name, ""))
            self.counters[(copy.queue_name, "posts")] += 1

    def _remove(self, row: ItemRow, *, reason: str | None) -> None:
        """Rule 9 (and 11): the file goes (at the end of the group), then the row."""
        self.files.remove(row.queue_name, row.id, Status(row.status).state)
        self.removed[row.id] = row
        self.counts[(row.queue_id, row.status)] -= 1
        if not row.is_terminal:
            self._leave_thread(row)
        if reason and row.status == Status.PROCESSING:
            self.news.append(("removed:" + reason, row.queue_name, row.id))

    def _vanished(self, row: ItemRow) -> None:
        """The row's file is gone (a delete that crashed half-way): finish the delete."""
        self.removed[row.id] = row
        self.counts[(row.queue_id, row.status)] -= 1
        if not row.is_terminal:
            self._leave_thread(row)

    # -- posts ----------------------------------------------------------------------------

    def _post(self, op: Post) -> list[Posted]:
        queue = self.live.get(op.queue_name)
        if queue is None:
            raise QueueNotFound(f"queue {op.queue_name!r} does not exist")
        for row in op.rows:
            check_schedule(row.scheduled_at, row.posted_at, queue.queue_seconds)
        keys = [item.key for item in op.items if item.key is not None]
        existing = sql.existing_keys(
            queue.id, [k for k in keys if (queue.id, k) not in self.keys_seen]
        )
        answers: list[Posted] = []
        made_here: dict[str, Posted] = {}
        for item, row, line in zip(op.items, op.rows, op.lines, strict=True):
            key = item.key
            if key is not None:
                twin = made_here.get(key)
                if twin is not None:  # two members of one batch with one key are one item
                    answers.append(twin)
                    continue
                known = self.keys_seen.get((queue.id, key)) or existing.get(key)
                if known is not None:
                    # As this group left it: an earlier operation of the group may have
                    # finished it, or deleted it (then the key is free again).
                    known = None if known.id in self.removed else self.rows.get(known.id, known)
                if known is not None:
                    known.queue_name = queue.name
                    payload, result = self._payload_and_result(queue, known)
                    answers.append(Posted(row=known, payload=payload, created=False, result=result))
                    continue
            row.queue_id = queue.id
            row.queue_name = queue.name
            row.eligible = row.thread_id is None
            self.files.create(queue.name, row.id, line)
            self.created.append(row)
            self.counts[(queue.id, Status.PENDING.value)] += 1
            posted = Posted(row=row, payload=item.payload, created=True)
            if key is not None:
                made_here[key] = posted
                self.payloads[row.id] = item.payload
                self.keys_seen[(queue.id, key)] = row
            if row.thread_id is None:
                self.news.append(("claimable", queue.name, ""))
            else:
                thread = self._thread(row)
                thread.delta += 1
                thread.touched = True
            answers.append(posted)
        self.counters[(queue.name, "posts")] += sum(1 for a in answers if a.created)
        crash_point("post.after_files")
        return answers

    def _payload_and_result(self, queue: QueueInfo, row: ItemRow) -> tuple[Any, Any]:
        """A repeated key's item as a read shows it: both live in its file, read once (an
        item made earlier in this group has no result yet, and its payload is at hand)."""
        if row.id in self.payloads:
            return self.payloads[row.id], None
        try:
            record = self.store.read_any(queue.name, row.id, Status(row.status).state)[1]
        except TaskhosterError:
            return None, None
        return record.get("payload"), record.get("result")

    def _reclaim(self, op: Reclaim) -> int:
        """Rows of a deleted queue (its files went with its directory): gone, and counted."""
        self._load_queues(ids=[op.queue_id])
        queue = self.queues.get(op.queue_id)
        if queue is None or not queue.deleting:
            raise Conflict("only the items of a deleted queue are reclaimed", code="not_deleted")
        gone = sql.delete_rows_of_queue(op.queue_id, op.ids)
        for status in gone:
            self.counts[(op.queue_id, status)] -= 1
        return len(gone)

    # -- threads --------------------------------------------------------------------------

    def _settle_threads(self) -> None:
        """Bring each touched thread back to its rule: at most one eligible member, the head
        (earliest ``scheduledAt``, then arrival), and only while none is processing; a thread
        with no live member is deleted."""
        with connection.cursor() as cursor:
            for thread in self.threads.values():
                if not thread.touched and thread.member_count + thread.delta > 0:
                    continue  # (a row with no member was made for a join that was refused)
                thread.touched = False
                thread.member_count = max(0, thread.member_count + thread.delta)
                thread.delta = 0
                if thread.member_count == 0:
                    if thread.head_item:
                        sql.set_eligible(thread.head_item, False)
                    if thread.pk is not None:
                        cursor.execute(f"DELETE FROM {sql.THREAD} WHERE id = %s", [thread.pk])
                    thread.pk = None
                    thread.head_item = None
                    continue
                head = None
                if thread.processing_item is None:
                    head = sql.first_pending_member(thread.queue_id, thread.thread_id)
                if thread.head_item and thread.head_item != head:
                    sql.set_eligible(thread.head_item, False)
                if head is not None:
                    sql.set_eligible(head, True, only_pending=True)
                    self.news.append(("claimable", thread.queue_name, ""))
                thread.head_item = head
                self._save_thread(thread)

    def _save_thread(self, thread: ThreadState) -> None:
        with connection.cursor() as cursor:
            if thread.pk is None:
                cursor.execute(
                    f"INSERT INTO {sql.THREAD} (queue_id, thread_id, member_count, "
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
                    f"SELECT id FROM {sql.THREAD} WHERE queue_id = %s AND thread_id = %s",
                    [thread.queue_id, thread.thread_id],
                )
                thread.pk = cursor.fetchone()[0]
            else:
                cursor.execute(
                    f"UPDATE {sql.THREAD} SET member_count = %s, processing_item = %s, "
                    "head_item = %s WHERE id = %s",
                    [thread.member_count, thread.processing_item, thread.head_item, thread.pk],
                )

    # -- claims ---------------------------------------------------------------------------

    def _claims(self, claims: list[Claim]) -> None:
        by_queue: dict[str, list[Claim]] = defaultdict(list)
        for op in claims:
            by_queue[op.queue_name].append(op)
        for name, ops in by_queue.items():
            queue = self.live.get(name)
            if queue is None:
                for op in ops:
                    self.answers[id(op)] = (False, QueueNotFound(f"queue {name!r} does not exist"))
                continue
            wanted = sum(op.max_items for op in ops)
            taken = self._claim_queue(queue, wanted)
            if len(taken) < wanted and name not in self.put_back:
                self.exhausted.add(name)
            for op in ops:
                share, taken = taken[: op.max_items], taken[op.max_items :]
                self.answers[id(op)] = (True, share)
                self.counters[(name, "claim_attempts")] += 1
        sql.update_rows(self.claimed_rows)
        self.claimed_rows = []

    def _claim_queue(self, queue: QueueInfo, want: int) -> list[Claimed]:
        expires = self.at + _secs(queue.lease_seconds)
        taken: list[Claimed] = []
        # Every row this claim has looked at, taken or not. A later round's query must not
        # see them again: the rows it took are written only after the loop, so the index
        # still calls them eligible (on PostgreSQL SKIP LOCKED does not skip our own locks).
        seen: list[str] = []
        changed: list[ItemRow] = []
        for _round in range(CLAIM_ROUNDS):
            need = want - len(taken)
            if need <= 0:
                break
            candidates = sql.claim_candidates(queue.id, self.at, need, seen)
            for row in candidates:
                if row.id in self.claimed:
                    # Never two leases for one item: the group fails, loudly, and nothing
                    # of it is written.
                    raise ClaimedTwice(f"claim: item {row.id} was found twice in one group")
                self.claimed.add(row.id)
                seen.append(row.id)
                row.queue_name = queue.name
                thread = None
                if row.thread_id is not None:
                    thread = self._claim_thread(queue, row.thread_id)
                    if (
                        thread is None
                        or thread.processing_item is not None
                        or thread.head_item != row.id
                    ):
                        continue  # its thread is busy changing: not now
                if not self.files.take(queue.name, row.id, State.PENDING, State.PROCESSING):
                    self._lost_claim(queue, row)
                    continue
                crash_point("claim.after_rename")
                self._status(row, Status.PROCESSING)
                row.set(
                    eligible=False,
                    attempts=row.attempts + 1,
                    lease=secrets.token_urlsafe(16),
                    lease_expires_at=expires,
                    claimed_at=self.at,
                    updated_at=self.at,
                )
                if thread is not None:
                    thread.processing_item = row.id
                    thread.head_item = None
                    self._save_thread(thread)
                try:
                    payload = self.store.read(queue.name, State.PROCESSING, row.id).get("payload")
                except TaskhosterError as exc:
                    log.error("claim: item %s has an unreadable file: %s", row.id, exc)
                    payload = None
                changed.append(row)
                taken.append(Claimed(row=row, payload=payload))
                if row.attempts == 1:
                    due = max(row.posted_at, row.scheduled_at)
                    self.latencies.append((queue.name, max(0.0, (self.at - due).total_seconds())))
            if len(candidates) < need:
                break
        # Written with the other queues' claims of this group, in one statement
        # (``_claims``); at once only when a vanished row makes its threads settle now.
        self.claimed_rows += changed
        if self.vanished_in_claims:
            sql.update_rows(self.claimed_rows)
            self.claimed_rows = []
            sql.delete_rows([row.id for row in self.vanished_in_claims])
            self.vanished_in_claims.clear()
            self._settle_threads()
        self.counters[(queue.name, "claims")] += len(taken)
        return taken

    def _lost_claim(self, queue: QueueInfo, row: ItemRow) -> None:
        """A claim found the file of a claimable row gone from ``pending/``: it has lost,
        and takes nothing. What is left is a crash's, never a live group's (this group holds
        the row, and a group that fails undoes its files before it lets go):

        - no file anywhere: a delete that crashed between its unlink and its commit; the
          delete is finished here;
        - in ``processing/`` at the row's ``rev``: a claim that renamed and died before its
          commit (repair's row of the crash table); the file goes back to ``pending/`` and
          the queue is announced, so the next claim takes it;
        - anything else: the index is behind its files in a way only repair may judge
          (``sweep --repair``); the row is passed over, and said so in the log.
        """
        where = self.store.locate(queue.name, row.id, State.PENDING)
        if where is None:
            self._vanished(row)
            self.vanished_in_claims.append(row)
            return
        if where is State.PROCESSING:
            try:
                record = self.store.read(queue.name, State.PROCESSING, row.id)
            except TaskhosterError:
                record = {}
            if record.get("rev") == row.rev and record.get("status") == Status.PENDING.value:
                if self.files.take(queue.name, row.id, State.PROCESSING, State.PENDING):
                    self.put_back.add(queue.name)
                    log.warning(
                        "claim: item %s was left in processing/ by a claim that died "
                        "before its commit; put back in pending/",
                        row.id,
                    )
                    self.news.append(("claimable", queue.name, ""))
                return
        log.error(
            "claim: item %s is claimable in the index, but its file is in %s/; passed over "
            "(sweep --repair reconciles the index with the files)",
            row.id,
            where.value,
        )

    def _claim_thread(self, queue: QueueInfo, thread_id: str) -> ThreadState | None:
        key = (queue.id, thread_id)
        if key in self.threads:
            return self.threads[key]
        lock = " FOR UPDATE SKIP LOCKED" if connection.vendor != "sqlite" else ""
        with connection.cursor() as cursor:
            cursor.execute(
                f"SELECT id, member_count, processing_item, head_item FROM {sql.THREAD} "
                f"WHERE queue_id = %s AND thread_id = %s{lock}",
                [queue.id, thread_id],
            )
            found = cursor.fetchone()
        if found is None:
            return None
        thread = ThreadState(
            queue_id=queue.id,
            thread_id=thread_id,
            queue_name=queue.name,
            pk=found[0],
            member_count=found[1],
            processing_item=found[2],
            head_item=found[3],
        )
        self.threads[key] = thread
        return thread

    # -- after the commit -----------------------------------------------------------------

    def _announce(self) -> None:
        news = list(dict.fromkeys(self.news))
        # This process's claims in this group took everything claimable of these queues:
        # its sockets need not look again (other processes' still do).
        here = [n for n in news if not (n[0] == "claimable" and n[1] in self.exhausted)]
        events.announce_many(news, here=here if len(here) < len(news) else None)
        for (queue, name), amount in self.counters.items():
            metrics.count(queue, name, amount)
        for queue, seconds in self.latencies:
            metrics.observe_latency(queue, seconds)


def _as_of_now(value: Any) -> Any:
    """An operation's answer as the state stood right after it: the later operations of the
    group change the same row objects (an extend followed by a result of the same item must
    still answer with the lease it extended)."""
    if isinstance(value, ItemRow):
        return value.snapshot()
    if isinstance(value, Verdict) and value.row is not None:
        return Verdict(value.accepted, value.status, value.row.snapshot())
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], ItemRow):
        return value[0], value[1].snapshot()
    return value


def _secs(value: float) -> timedelta:
    return timedelta(seconds=value)


def check_schedule(scheduled_at: datetime, posted_at: datetime, queue_seconds: float) -> None:
    """An item may not be scheduled past its queue's timeout: it would time out before it
    could be claimed. A 409: the body is well formed; it conflicts with ``queueSeconds``."""
    if scheduled_at > posted_at + _secs(queue_seconds):
        raise Conflict(
            "scheduledAt is beyond the queue timeout: the item would time out before it "
            "could be claimed",
            code="scheduled_beyond_timeout",
        )


def prepare_post(queue_name: str, items: list[Any], key_hash: str | None = None) -> Post:
    """Build a post in the caller's thread: ids, times, rows and each file's first line
    (``key_hash``: see ``ops.Post``)."""
    at = utcnow()
    ids = new_ids(len(items))
    rows: list[ItemRow] = []
    lines: list[bytes] = []
    for item_id, item in zip(ids, items, strict=True):
        scheduled = item.scheduled_at or at
        if item.delay_seconds is not None:
            scheduled = at + _secs(item.delay_seconds)
        row = new_row(
            item_id,
            at=at,
            scheduled_at=scheduled,
            thread_id=item.thread_id,
            key=item.key,
            origin=item.origin,
        )
        rows.append(row)
        lines.append(encode_line(record_of(row, queue_name, item.payload)))
    return Post(queue_name=queue_name, items=items, rows=rows, lines=lines, key_hash=key_hash)
