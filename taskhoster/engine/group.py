"""One group commit: many operations, one transaction, one flush of the item files.

The group is the orchestrator; the rules are ``rules``' pure functions. Every transition has
the same shape here:

1. **read rows**: every item the group's operations name, in one query (locked in id order on
   PostgreSQL, after their thread rows in (queue, thread) order: the one locking order);
2. **decide by the rules**: each operation, in arrival order, asks its rule (``rules``) about
   the rows in memory, so two operations on one item in one group see each other; a bad or
   losing operation gets its own answer and changes nothing;
3. **write files** (``_apply``): append the decision's line to the item's file and rename it
   into its new state's directory (``store.FileBatch``): undoable until the commit;
4. **write rows** (``rows``): one statement per shape of change, new rows in one
   ``executemany``;
5. **settle threads**: each touched thread once (``rules.settle``), with its next head made
   eligible;
6. **claims** run last, so they see this group's posts and freed threads;
7. **commit** (removals are applied just before it), and announce what changed;
8. **flush, then answer** (``runner.run_group``): one barrier for the group
   (``store.FileBatch.flush``) makes its files durable before any answer that needs them
   goes out; a claim, an extend or a release, which need no durability, is answered at the
   commit.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from contextlib import suppress
from datetime import datetime
from functools import partial
from typing import Any

from django.db import Error as DbError
from django.db import connection, transaction

from ..errors import (
    Conflict,
    ItemNotFound,
    KeyRefused,
    NotYetDurable,
    OutcomeUnknown,
    QueueNotFound,
    StoreWriteFailed,
    TaskhosterError,
)
from ..faults import crash_point, fault, slow_seconds
from ..ids import new_id
from ..keys import principals_by_hash, refusal
from ..status import Status
from ..store import StateStore, encode_line
from ..timeutil import now as utcnow
from . import rows as sql
from . import rules
from .claims import Claims
from .giveback import Unsettled
from .ops import (
    Cancel,
    Claim,
    Delete,
    Extend,
    Fail,
    Fire,
    Fired,
    ItemOp,
    MarkFetched,
    Op,
    Post,
    Posted,
    Progress,
    Reclaim,
    Release,
    Requeue,
    Resettle,
    Restart,
    Result,
    Rewrite,
    Sweep,
    Verdict,
)
from .posts import new_row, record_of
from .rules import (
    Decision,
    ItemRow,
    Keep,
    Kind,
    Move,
    QueueInfo,
    Refuse,
    Remove,
    RowStamp,
    ThreadEffect,
    ThreadState,
)
from .tally import Tally

# Not refused while an item's file waits to be written again (``Item.unflushed``): the
# rewrite itself, and a producer's first read of a finished item (a clock started in its
# row: no file).
PASS_THE_GATE = (Rewrite, MarkFetched)

log = logging.getLogger(__name__)

# A group whose connection was lost during its COMMIT asks the database what became of its
# transaction for this long (reconnecting) before it answers "outcome unknown": a database
# that does not answer in this time is away (a restart), and the committer must not hold
# every other operation back while it is. A session that still runs the transaction this
# long after (its lost client not yet noticed by the server) is ended, which settles it
# (ending it even mid-commit is safe: the status read afterwards is the outcome).
OUTCOME_WAIT_SECONDS = 2.0
LOST_SESSION_SECONDS = 0.5
OUTCOME_ASK_EVERY = 0.1
# A group's files put back later (``put_back_files``) wait at most this long for a row's lock.
PUT_BACK_LOCK_TIMEOUT = "2s"


def _connection_lost(exc: DbError) -> bool:
    """Whether ``exc`` says the connection was lost (no answer of the database's, or one that
    ends the session: SQLSTATE class 08, or 57P, an operator's or a crash's shutdown). An
    error the database answered otherwise (a key race's, a statement's) says the
    transaction did not commit."""
    state = getattr(exc.__cause__, "sqlstate", None)
    return state is None or state.startswith(("08", "57P"))


class Group:
    """The state of one group commit while it runs (see the module docstring)."""

    def __init__(self, ops: list[Op[Any]], store: StateStore, shard: int) -> None:
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
        self.tally = Tally()
        self.answers: dict[int, tuple[bool, Any]] = {}
        self.keys_seen: dict[tuple[int, str], ItemRow] = {}
        self.copies: list[tuple[ItemRow, Any]] = []
        self.payloads: dict[str, Any] = {}  # of the keyed items made in this group
        self.committed = False  # set by the first of the commit's hooks
        self.announced = False
        self.outermost = False  # its own transaction, not a savepoint in its caller's
        # Its transaction's id, where a lost commit can be asked about.
        self.xid: sql.TransactionId | None = None
        self.committing = False  # its statements sent: what fails now may have committed
        # Each existing row whose file this group changes, as it found it
        # (``put_back_files``).
        self.found: dict[str, RowStamp] = {}
        # The items it made under an id every attempt makes the same (a schedule's slot's).
        self.reused: set[str] = set()
        # The items of its ``Rewrite``: their files written again, with the ``rev`` and,
        # claimable, the queue of each (their marks cleared once the files are durable:
        # ``runner``); those it has nothing more to do for (gone, or written again by
        # another process since); those taken up whose files do not read as their rows
        # say, set aside until a later look (``runner.adopt_unflushed``).
        self.rewritten: dict[str, tuple[int, str | None]] = {}
        self.let_go: set[str] = set()
        self.set_aside: set[str] = set()
        # Whether a row it loaded for its item operations is marked ``unflushed`` (nearly
        # never: their operations look no further otherwise).
        self.any_marked = False

    # -- running ------------------------------------------------------------------------

    def run(self) -> None:
        """Run every operation in one transaction; the caller answers afterwards."""
        outermost = self.outermost = not connection.in_atomic_block
        if outermost:
            # Django sets this once its COMMIT succeeded, before it runs the commit's hooks
            # (and turning autocommit back on, which can fail first): with
            # ``committed`` it says the group stands. A stale one, from a connection that
            # failed there before, must not.
            connection.run_commit_hooks_on_set_autocommit_on = False
        try:
            # (A group posting many items goes without the pipeline: see ``insert_rows``.)
            new_rows = sum(len(op.items) for op in self._posts())
            with sql.group_transaction(new_rows <= sql.PIPELINED_NEW_ROWS_MOST):
                try:
                    self._run_in_transaction()
                except BaseException:
                    # Undo the files while the transaction still holds its locks: once they
                    # are released another group may change these items, and a rename undone
                    # after that would undo its change instead.
                    self.files.rollback()
                    raise
        except BaseException as exc:
            committed = self.committed or (
                outermost and connection.run_commit_hooks_on_set_autocommit_on
            )
            askable = self.committing and self.xid is not None
            if not committed and askable and isinstance(exc, DbError) and _connection_lost(exc):
                committed = self._commit_outcome(exc)
            if not committed:
                # The commit itself failed (nothing left to undo otherwise): the database
                # rolled the transaction back and let go of its locks first.
                self.put_back_files()
                raise
            if not isinstance(exc, Exception):
                raise
            # Committed, then the connection failed: during the COMMIT (its answer lost), or
            # on the way out (autocommit turned back on meeting the database gone). The
            # group stands, and is answered, flushed and announced as committed; undoing
            # its files, or running it again, would contradict its rows.
            # The connection is given up (and the hooks Django still holds with it).
            log.warning("a group of %d committed, then: %s", len(self.ops), exc)
            self.committed = True
            with suppress(Exception):  # (a broken connection may fail to close, too)
                connection.close()
            if not self.announced:
                self._announce()
        crash_point("group.after_commit", group_size=len(self.ops))
        if any(isinstance(op, Post) for op in self.ops):
            crash_point("post.after_index")
        if any(isinstance(op, Claim) for op in self.ops):
            crash_point("claim.after_commit")
        if any(isinstance(op, Result) for op in self.ops):
            crash_point("result.after_commit")
        if any(isinstance(op, Fire) for op in self.ops):
            crash_point("schedule.after_commit")

    def _run_in_transaction(self) -> None:
        # Where a commit whose connection is lost can be asked about afterwards, a group that
        # will change files asks its transaction's id first (answered with its first read).
        # Not a group of claims alone, which may find nothing and change nothing: an id
        # would make its commit a write to wait for; it asks at the end if it took items.
        asked = None
        claims_alone = all(isinstance(op, Claim) for op in self.ops)
        if self.outermost and sql.dialect().outcome_by_id and not claims_alone:
            asked = sql.transaction_id()
        self._check_keys()
        self._load()
        for op in self.ops:
            if isinstance(op, ItemOp):
                self._answer(op, self._item_op, op)
        self._dead_letters()
        for op in self.ops:
            if isinstance(op, Post) and id(op) not in self.answers:
                self._answer(op, self._post, op)
            elif isinstance(op, Fire):
                self._answer(op, self._fire, op)
            elif isinstance(op, Reclaim):
                self._answer(op, self._reclaim, op)
            elif isinstance(op, Resettle):
                self._answer(op, self._resettle, op)
        crash_point("group.after_files", group_size=len(self.ops))
        sql.update_rows(r for r in self.rows.values() if r.id not in self.removed)
        sql.delete_rows(list(self.removed))  # before the inserts: a key may be taken again
        sql.insert_rows(self.created)
        self._settle_threads()
        claims = [op for op in self.ops if isinstance(op, Claim)]
        if claims:
            self.answers.update(self._claims().run(claims, self.live))
        sql.add_counts(dict(self.tally.counts), self.shard)
        self.files.apply_unlinks()
        crash_point("group.before_commit", group_size=len(self.ops))
        if asked is not None:
            self.xid = asked()
        elif self.outermost and self.files.undo and sql.dialect().outcome_by_id:
            self.xid = sql.transaction_id()()  # a claim's group that took items: one round trip
        self.committing = True
        transaction.on_commit(self._mark_committed)
        # Robust: an error of the announcement (logged) must not reach ``run``, which would
        # undo the files of a group already committed.
        transaction.on_commit(self._announce, robust=True)

    def put_back_files(self, *, or_unlocked: bool = True, spare: Collection[str] = ()) -> None:
        """Undo the files of a group whose ``COMMIT`` failed (a lost one found not to have
        committed, or one the database refused). Its transaction's locks went with it, so
        another group may have changed these items since: finding this group's files ahead
        of their rows, as a crash leaves them, and dealing with them (a claim puts a file
        back in ``pending/`` and takes it; a verdict finds it where it is). Undone then,
        this group's renames and truncations would undo that group's changes instead. So
        the rows are locked again first, and only the files of the items whose rows are as
        this group found them (its ``rev``, status, lease and attempts; made by it: no row)
        are put back; the others' are theirs now. Should the database not answer, they are
        put back without the locks (``or_unlocked``), or the error is raised.

        Also run later, for a group whose outcome was unknown and is found to have rolled
        back (``unsettled``), from another thread: then (``or_unlocked`` false) a row lock
        not given within ``PUT_BACK_LOCK_TIMEOUT`` raises too (a lingering session may hold
        it), and the files of ``spare`` are left as they are."""
        if not (self.outermost and self.committing and self.files.undo and sql.dialect().lock):
            self.files.rollback()
            return
        found: dict[str, RowStamp | None] = {
            **self.found,
            **{row.id: None for row in self.created},
        }
        if fault("group.slow_put_back"):
            time.sleep(slow_seconds())  # tests: another group changes these items meanwhile
        try:
            if or_unlocked:
                with suppress(Exception):
                    connection.close()  # (the one the commit failed on)
            with transaction.atomic():
                if not or_unlocked:
                    with connection.cursor() as cursor:
                        cursor.execute(f"SET LOCAL lock_timeout = '{PUT_BACK_LOCK_TIMEOUT}'")
                now = sql.select_rows(found, lock=True)
                changed = {
                    i for i, was in found.items() if (now[i].stamp if i in now else None) != was
                }
                spare = changed | set(spare)
                if changed:
                    log.warning(
                        "the files of %s, which another group changed since this group's "
                        "commit failed, are left as they are",
                        ", ".join(
                            f"{i} ({found[i]} -> {now[i].stamp if i in now else None})"
                            for i in sorted(changed)[:20]
                        ),
                    )
                self.files.rollback(spare=spare)
        except DbError as error:
            if not or_unlocked:
                raise
            log.warning("could not lock the rows again to put their files back (%s)", error)
            self.files.rollback()

    def _mark_committed(self) -> None:
        self.committed = True

    def _announce(self) -> None:
        self.announced = True
        try:
            self.tally.announce()
        except Exception:
            log.exception("could not announce a group's changes")

    def _commit_outcome(self, exc: DbError) -> bool:
        """Whether this group's transaction committed, its connection lost during its COMMIT
        (``exc``): asked of the database by the transaction's id, on a new connection, for up
        to ``OUTCOME_WAIT_SECONDS``; a session still running the transaction after
        ``LOST_SESSION_SECONDS`` is ended first. If no answer comes, the files are left as
        the group wrote them (the files are the truth: ``sweep --repair`` makes the rows
        follow, should this process end before it learns the outcome: ``unsettled``) and
        ``OutcomeUnknown`` is raised: nothing is answered as done, nor done again."""
        asked = self.xid
        assert asked is not None
        xid = asked.xid
        log.warning(
            "the connection was lost during a group's commit (%s); asking whether "
            "transaction %d committed",
            exc,
            xid,
        )
        started = time.monotonic()
        ended = False
        with suppress(Exception):  # (a broken connection may fail to close, too)
            connection.close()
        while True:
            try:
                status = sql.transaction_outcome(asked)
                lingering = time.monotonic() - started >= LOST_SESSION_SECONDS
                if status == "in progress" and lingering and not ended:
                    sql.end_session_of(xid)
                    ended = True
            except DbError as error:
                status = f"not asked: {error}"
                with suppress(Exception):
                    connection.close()
            if status in ("committed", "aborted"):
                log.warning("transaction %d was %s", xid, status)
                return status == "committed"
            if status is None or time.monotonic() - started >= OUTCOME_WAIT_SECONDS:
                break
            time.sleep(OUTCOME_ASK_EVERY)
        # The files stay as the group left them (not flushed, nothing acknowledged): if the
        # transaction committed they agree with its rows; if not, they are ahead of them, as
        # a crash between a group's files and its commit leaves them, which every transition
        # and repair already handles. The outcome is asked again once the database answers
        # (``unsettled``): the runner hands the group on.
        items = self.changed_items()
        log.error(
            "could not learn whether transaction %d committed (%s); its group's files are "
            "left as it wrote them: this process asks again once the database answers, and "
            "puts them back if it rolled back; should it end first, run `manage.py sweep "
            "--repair` to bring the index in line with them (items: %s)",
            xid,
            status,
            ", ".join(items[:20]) + (" ..." if len(items) > 20 else ""),
        )
        raise OutcomeUnknown(
            "the database connection was lost during the commit, and whether it committed "
            "is unknown: nothing is acknowledged"
        ) from exc

    def unsettled(self) -> Unsettled:
        """What settles this group once the database answers, its ``COMMIT``'s outcome
        unknown (``OutcomeUnknown``): its transaction, what its claims took (the ``(item id,
        lease)`` they would have answered had it committed), and how to put its files
        back."""
        assert self.xid is not None
        taken: list[tuple[str, str]] = []
        for op in self.ops:
            ok, value = self.answers.get(id(op), (False, None))
            if isinstance(op, Claim) and ok:
                taken.extend((c.row.id, c.row.lease or "") for c in value)
        return Unsettled(
            asked=self.xid,
            taken=taken,
            items=self.changed_items(),
            # A schedule's slot made again meanwhile has a file of that name of its own: left
            # (the next one quarantines a leftover; repair finds it).
            put_back=partial(self.put_back_files, or_unlocked=False, spare=self.reused),
            flush=self.files.flush,
            unflushed=self.files.remember_unflushed,
            announce=self._announce,
        )

    def changed_items(self) -> list[str]:
        """Every item whose file this group made or changed."""
        return sorted({r.id for r in self.created} | set(self.rows))

    def _answer(self, op: Op[Any], fn: Callable[..., Any], *args: Any) -> None:
        """Run one operation: its answer, or the error that refuses it alone. Not a write the
        state root refused (``StoreWriteFailed``), which may come part-way (a batch post's
        third file, after two were written; a line appended, then the rename refused): the
        whole group fails and undoes its files, or what was written of the operation would
        commit without it."""
        try:
            self.answers[id(op)] = (True, _as_of_now(fn(*args)))
        except NotYetDurable as exc:  # (refused before it changed anything)
            self.answers[id(op)] = (False, exc)
        except StoreWriteFailed:
            raise
        except TaskhosterError as exc:
            self.answers[id(op)] = (False, exc)

    @property
    def needs_flush(self) -> bool:
        return bool(self.files.written or self.files.directories)

    def outcomes(self) -> list[tuple[Op[Any], bool, Any]]:
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
        lacks the ``produce`` scope or may not use its queue (``keys.refusal``): all keys in
        one query, in the group's transaction (a key revoked before it commits refuses the
        post)."""
        posts = [op for op in self.ops if isinstance(op, Post) and op.key_hash is not None]
        if not posts:
            return
        holders = principals_by_hash(op.key_hash for op in posts if op.key_hash)
        for op in posts:
            refused = refusal(holders.get(op.key_hash or ""), "produce", op.queue_name)
            if refused is not None:
                self.answers[id(op)] = (False, refused)

    def _posts(self) -> Iterable[Post]:
        """The group's posts: its own, and those its schedules' firings carry."""
        for op in self.ops:
            if isinstance(op, Post):
                yield op
            elif isinstance(op, Fire):
                yield from (f.post for f in op.firings if f.post is not None)

    def _load(self) -> None:
        names = {op.queue_name for op in self.ops if isinstance(op, Claim)}
        names |= {op.queue_name for op in self._posts()}
        ids = {i for op in self.ops if isinstance(op, ItemOp) for i in op.item_ids()}
        self._load_queues(names=names)
        # Where rows are locked (PostgreSQL), their threads are locked first: peek at them.
        ahead = bool(sql.dialect().lock)
        restarts = {op.item_id for op in self.ops if isinstance(op, Restart)}
        keys: set[tuple[int, str]] = set()
        joining: set[tuple[int, str]] = set()
        if ahead and ids:
            peek = sql.peek_threads(ids)
            self._load_queues(ids={q for q, _t in peek.values()})
            keys = {(q, t) for q, t in peek.values() if t is not None}
            joining = {(q, t) for i, (q, t) in peek.items() if t is not None and i in restarts}
        for op in self._posts():
            if op.queue_name in self.live and id(op) not in self.answers:
                q = self.live[op.queue_name]
                joining |= {(q.id, item.thread_id) for item in op.items if item.thread_id}
        resettle = {
            (op.queue_id, t) for op in self.ops if isinstance(op, Resettle) for t in op.thread_ids
        }
        if resettle:
            self._load_queues(ids={q for q, _t in resettle})
            keys |= resettle
        sql.lock_queues_shared(self.queues)
        self._lock_threads(keys | joining, create=joining)
        if ids:
            self.rows = sql.select_rows(ids, lock=ahead)
            self.any_marked = any(row.unflushed for row in self.rows.values())
            self._load_queues(ids={row.queue_id for row in self.rows.values()})
            for row in self.rows.values():
                queue = self.queues.get(row.queue_id)
                row.queue_name = queue.name if queue else ""
            if not ahead:
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
        for queue in sql.select_queues(names=names, ids=ids):
            self.queues[queue.id] = queue
            if not queue.deleting:
                self.live[queue.name] = queue

    def _lock_threads(self, keys: set[tuple[int, str]], *, create: set[tuple[int, str]]) -> None:
        """Lock the thread rows of ``keys`` (making those in ``create``), in one order."""
        wanted = [k for k in keys if k not in self.threads]
        if wanted:
            names = {queue.id: queue.name for queue in self.queues.values()}
            self.threads.update(sql.lock_threads(wanted, create=create, queue_names=names))

    # -- item operations ------------------------------------------------------------------

    def _item_op(self, op: ItemOp[Any]) -> Any:
        if self.any_marked and not isinstance(op, (*PASS_THE_GATE, Sweep, Delete)):
            self._refuse_unflushed(self._visible(op))  # (Sweep and Delete: ``_marked``)
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
            marked = self._marked(op.ids, op.queue_id)
            if marked and op.refuse_marked:
                raise NotYetDurable()
            return sum(self.delete(i, op.queue_id) for i in op.ids if i not in marked)
        if isinstance(op, Restart):
            return self.restart(op)
        if isinstance(op, MarkFetched):
            return self.mark_fetched(op)
        if isinstance(op, Cancel):
            return self.cancel(op)
        if isinstance(op, Rewrite):
            return self.rewrite(op)
        if isinstance(op, Progress):
            return self.progress(op)
        raise TypeError(f"unknown operation {op!r}")

    def _take_up_marked(self, rows: Iterable[ItemRow]) -> set[str]:
        """The ids of those of ``rows`` marked ``unflushed`` (by this process or another):
        this process takes them up, to write their files again too (``StateStore.take_up``)."""
        met = {row.id for row in rows if row.unflushed}
        if met:
            self.store.take_up(met)
        return met

    def _refuse_unflushed(self, rows: Iterable[ItemRow]) -> None:
        """Refuse the operation (``NotYetDurable``) if one of its ``rows`` is marked."""
        if self._take_up_marked(rows):
            raise NotYetDurable()

    def _marked(self, ids: Iterable[str], queue_id: int | None = None) -> set[str]:
        """Those of ``ids`` (of ``queue_id`` only, when given) whose rows are marked, taken
        up; an operation on many items (a sweep's clocks, a status's deletes) passes them
        by, and a later one finds them written again."""
        if not self.any_marked:
            return set()
        return self._take_up_marked(
            row
            for i in ids
            if (row := self._row(i)) is not None and (queue_id is None or row.queue_id == queue_id)
        )

    def _visible(self, op: ItemOp[Any]) -> Iterator[ItemRow]:
        """The rows of ``op``'s items as it may see them: not those it would not find (an
        item of a queue being deleted, or of one the caller's key may not use), which it
        answers 404 as before, revealing nothing."""
        for item_id in op.item_ids():
            row = self._row(item_id)
            if row is None:
                continue
            if isinstance(op, Result) and op.queues is not None and row.queue_name not in op.queues:
                continue
            yield row

    def _row(self, item_id: str) -> ItemRow | None:
        row = self.rows.get(item_id)
        if row is None or item_id in self.removed:
            return None
        queue = self.queues.get(row.queue_id)
        if queue is None or queue.deleting:
            return None
        return row

    def _found(self, item_id: str) -> ItemRow:
        row = self._row(item_id)
        if row is None:
            raise ItemNotFound(f"item {item_id!r} does not exist")
        return row

    def _queue(self, row: ItemRow) -> QueueInfo:
        return self.queues[row.queue_id]

    def _verdict(self, row: ItemRow, decision: Decision) -> Verdict:
        self._apply(row, decision)
        return Verdict(isinstance(decision, Move), row.status, row)

    def result(self, op: Result) -> Verdict:
        row = self._row(op.item_id)
        if row is None or (op.queues is not None and row.queue_name not in op.queues):
            # (An item of a queue the caller's key may not use is not found: the same answer
            # as a missing one, so the key learns nothing of other queues' items.)
            raise ItemNotFound(f"item {op.item_id!r} does not exist")
        verdict = self._verdict(row, rules.result(row, value=op.result, at=self.at))
        return verdict if op.with_row else Verdict(verdict.accepted, verdict.status)

    def fail(self, op: Fail) -> Verdict:
        row = self._found(op.item_id)
        decision = rules.fail(
            row, self._queue(row), lease=op.lease, error=op.error, retry=op.retry, at=self.at
        )
        verdict = self._verdict(row, decision)
        return verdict if op.with_row else Verdict(verdict.accepted, verdict.status)

    def extend(self, op: Extend) -> tuple[bool, ItemRow]:
        row = self._found(op.item_id)
        decision = rules.extend(
            row, self._queue(row), lease=op.lease, seconds=op.seconds, at=self.at
        )
        self._apply(row, decision)
        return isinstance(decision, Move), row

    def progress(self, op: Progress) -> tuple[bool, ItemRow]:
        row = self._found(op.item_id)
        decision = rules.progress(row, lease=op.lease, value=op.progress, at=self.at)
        self._apply(row, decision)
        return isinstance(decision, Move), row

    def cancel(self, op: Cancel) -> ItemRow:
        row = self._found(op.item_id)
        self._apply(row, rules.cancel(row, reason=op.reason, at=self.at))
        return row

    def rewrite(self, op: Rewrite) -> int:
        """Write the files of ``op.ids`` again (``FileBatch.rewrite``), each on its own: a
        file the disk refuses is tried again later, the others go on. A file written again
        keeps its row's mark until the group's flush has made it durable: ``runner`` clears
        the marks then (of the rows still at the ``rev`` written), and wakes the claims."""
        written = 0
        for item_id in op.ids:
            if op.asked and (item_id in self.rewritten or self._left_to_its_pace(item_id)):
                continue  # (one file write for many reads: see ``Rewrite.asked``)
            row = self._row(item_id)
            if row is None:
                self.let_go.add(item_id)  # (its row gone, its mark with it)
                continue
            own = item_id in self.store.unflushed
            if not row.unflushed and not own:
                self.let_go.add(item_id)  # taken up, and written again elsewhere since
                continue
            try:
                done = self.files.rewrite(row.queue_name, item_id, row.status.state, row.rev)
            except StoreWriteFailed as exc:
                log.debug("item %s: its file could not be written again: %s", item_id, exc)
                if op.asked:
                    self.store.take_up([item_id])  # tried again at the committer's pace
                continue
            if done is False and own:
                # This process wrote it, on this root: gone for every process (a delete
                # finished half-way), nothing left to write.
                log.error(
                    "item %s: its file, which a failed flush left, is gone (a delete that "
                    "stopped half-way): its row goes when next met, or by `manage.py sweep "
                    "--repair`",
                    item_id,
                )
                row.set(unflushed=False)
                self.let_go.add(item_id)
                continue
            if not done:
                # Not to be made durable as it reads now: refused until it reads as its row
                # says, or repair has dealt with it. So too a file taken up from another
                # process and not found here, which proves nothing of the disk (a root this
                # process sees otherwise, a network filesystem's stale lookup): were its
                # mark cleared, the next claim would meet no file and drop the row.
                if item_id not in self.store.unflushed_said:
                    self.store.unflushed_said.add(item_id)
                    log.error(
                        "item %s: its file, which a failed flush left, does not read as its "
                        "row says (%s); it is refused until it does, or `manage.py sweep "
                        "--repair` has dealt with it",
                        item_id,
                        "it is not found here"
                        if done is False
                        else self.files.not_rewritten.get(item_id, "?"),
                    )
                if not own:
                    self.set_aside.add(item_id)
                continue
            written += 1
            self.rewritten[item_id] = (row.rev, row.queue_name if row.eligible else None)
        return written

    def _left_to_its_pace(self, item_id: str) -> bool:
        """Whether this process already writes the item's file again (its own, or taken
        up: at most once a second) or has set it aside (it does not read as its row says),
        so that a producer's read leaves it to that."""
        st = self.store
        with st.unflushed_lock:
            return item_id in st.unflushed or item_id in st.taken_up or item_id in st.unflushed_said

    def requeue_held(self, op: Requeue) -> Verdict:
        row = self._row(op.item_id)
        if row is None:
            return Verdict(False, None)
        decision = rules.drop(row, self._queue(row), lease=op.lease, cause=op.cause, at=self.at)
        return self._verdict(row, decision)

    def release(self, op: Release) -> Verdict:
        row = self._row(op.item_id)
        if row is None:
            return Verdict(False, None)
        try:
            return self._verdict(row, rules.release(row, lease=op.lease, at=self.at))
        except ItemNotFound:
            return Verdict(False, None)

    def sweep(self, op: Sweep) -> int:
        changed = 0
        marked = self._marked(op.ids)
        for item_id in op.ids:
            row = self._row(item_id)
            if row is None or item_id in marked:
                continue
            decision = rules.clock(op.clock, row, self._queue(row), at=op.at)
            if isinstance(decision, Keep):
                continue
            try:
                self._apply(row, decision)
            except ItemNotFound:
                continue  # its file had vanished: the half-done delete is finished now
            changed += 1
        return changed

    def delete(self, item_id: str, queue_id: int | None) -> bool:
        row = self._row(item_id)
        if row is None:
            return False
        decision = rules.delete(row, queue_id=queue_id)
        self._apply(row, decision)
        return isinstance(decision, Remove)

    def restart(self, op: Restart) -> ItemRow:
        row = self._found(op.item_id)
        self._apply(row, rules.restart(row, seq=new_id(), at=self.at))
        return row

    def mark_fetched(self, op: MarkFetched) -> datetime | None:
        row = self._row(op.item_id)
        if row is None or not row.is_terminal:
            return None
        self._apply(row, rules.fetched(row, at=op.at))
        return row.fetched_at

    # -- writing what the rules decide ------------------------------------------------------

    def _apply(self, row: ItemRow, decision: Decision) -> None:
        """Make a rule's decision: the item's file, its row, its thread, what is counted and
        announced. A file found gone is a delete that crashed half-way: it is finished here,
        and the item is not found."""
        if isinstance(decision, Keep):
            return
        if isinstance(decision, Refuse):
            raise decision.error
        # As found, before any change of it (the tally's included: it sets the status).
        self.found.setdefault(row.id, row.stamp)
        if isinstance(decision, Remove):
            self._remove(row, reason=decision.reason)
            return
        changes, patch = decision.changes, decision.patch
        if decision.dead_letter:
            copy_id = self._dead_letter(row, changes["error"])
            if copy_id is not None:
                changes = {**changes, "dead_letter": copy_id}
                patch = {**(patch or {}), "deadLetter": copy_id}
        old, new = row.status.state, decision.status.state
        if old is not new or patch is not None:
            if not self.files.change(row.queue_name, row.id, old, new, patch):
                self._vanished(row)
                raise ItemNotFound(f"item {row.id!r} does not exist")
            if decision.kind is Kind.REQUEUE:
                crash_point("requeue.after_pending_file")
            elif decision.kind is Kind.VERDICT:
                crash_point("result.after_done_file")
        if row.status is Status.PROCESSING and decision.status is not Status.PROCESSING:
            self._slot_freed(row)
        self.tally.status(row, decision.status)
        row.set(**changes)
        self._thread_effect(row, decision.thread)
        for counter in decision.counters:
            self.tally.count(row.queue_name, counter)
        for news in decision.news:
            self.tally.news.append((news, row.queue_name, row.id))

    def _slot_freed(self, row: ItemRow) -> None:
        """An item left ``processing``: under a cap, a slot is free, and waiting workers of
        every process are woken for it (I6). (A thread's freed slot is announced when its
        next head becomes eligible.)"""
        queue = self.queues.get(row.queue_id)
        if queue is not None and queue.max_processing is not None:
            self.tally.claimable(row.queue_name)

    def _thread(self, row: ItemRow) -> ThreadState:
        assert row.thread_id is not None
        key = (row.queue_id, row.thread_id)
        if key not in self.threads:  # SQLite: not locked ahead (its writer lock covers it)
            self._lock_threads({key}, create={key})
        return self.threads[key]

    def _thread_effect(self, row: ItemRow, effect: ThreadEffect) -> None:
        if effect is ThreadEffect.NONE:
            return
        if row.thread_id is None:
            if effect is not ThreadEffect.LEAVE:
                self.tally.claimable(row.queue_name)
            return
        rules.apply_to_thread(self._thread(row), row.id, effect)

    def _dead_letter(self, row: ItemRow, error: str) -> str | None:
        """Rule 7's copy, if the queue has a live dead-letter queue: its id. The copy itself is
        posted by ``_dead_letters`` once every operation has run."""
        queue = self._queue(row)
        target = queue.dead_letter_queue
        if not target or target == queue.name:
            return None
        self._load_queues(names=[target])
        if target not in self.live:
            return None
        return self._dead_letter_copy(row, queue, target, error)

    def _dead_letter_copy(self, row: ItemRow, queue: QueueInfo, target: str, error: str) -> str:
        dlq = self.live[target]
        # The key makes the copy once per death: a death repeated after a crash (whose first
        # copy was already written) finds that copy instead of making a second.
        key = f"dead-letter:{row.id}:{row.seq}"
        known = self.keys_seen.get((dlq.id, key)) or sql.existing_keys(dlq.id, [key]).get(key)
        if known is not None:
            return known.id
        _state, record = self.store.read_any(queue.name, row.id, row.status.state)
        copy = new_row(
            new_id(),
            at=self.at,
            scheduled_at=self.at,
            thread_id=None,
            key=key,
            origin={"queue": queue.name, "id": row.id, "error": error, "attempts": row.attempts},
            priority=row.priority,
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
            self.tally.created(copy.queue_id, copy.queue_name, claimable=True)
            self.tally.count(copy.queue_name, "posts")

    def _remove(self, row: ItemRow, *, reason: str | None) -> None:
        """Rule 9 (and 11): the file goes (at the end of the group), then the row."""
        self.files.remove(row.queue_name, row.id, row.status.state)
        self.removed[row.id] = row
        if row.status is Status.PROCESSING:
            self._slot_freed(row)
        self.tally.gone(row)
        if not row.is_terminal:
            self._thread_effect(row, ThreadEffect.LEAVE)
        if reason and row.status is Status.PROCESSING:
            self.tally.news.append(("removed:" + reason, row.queue_name, row.id))

    def _vanished(self, row: ItemRow) -> None:
        """The row's file is gone (a delete that crashed half-way): finish the delete."""
        self.removed[row.id] = row
        self.tally.gone(row)
        if not row.is_terminal:
            self._thread_effect(row, ThreadEffect.LEAVE)

    # -- posts ----------------------------------------------------------------------------

    def _post(self, op: Post) -> list[Posted]:
        queue = self.live.get(op.queue_name)
        if queue is None:
            raise QueueNotFound(f"queue {op.queue_name!r} does not exist")
        for row in op.rows:
            refused = rules.schedule_refusal(row.scheduled_at, row.posted_at, queue.queue_seconds)
            if refused is not None:
                raise refused
        keys = [item.key for item in op.items if item.key is not None]
        existing = sql.existing_keys(
            queue.id, [k for k in keys if (queue.id, k) not in self.keys_seen]
        )
        # A post sent again whose item's file is not yet durable is not acknowledged.
        self._refuse_unflushed(existing.values())
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
            self.files.create(queue.name, row.id, line, replace=op.replace_leftover)
            if op.replace_leftover:
                self.reused.add(row.id)
            self.created.append(row)
            self.tally.created(queue.id, queue.name, claimable=row.thread_id is None)
            posted = Posted(row=row, payload=item.payload, created=True)
            if key is not None:
                made_here[key] = posted
                self.payloads[row.id] = item.payload
                self.keys_seen[(queue.id, key)] = row
            if row.thread_id is not None:
                rules.apply_to_thread(self._thread(row), row.id, ThreadEffect.JOIN)
            answers.append(posted)
        self.tally.count(queue.name, "posts", sum(1 for a in answers if a.created))
        crash_point("post.after_files")
        return answers

    # -- schedules (section 8.3) ----------------------------------------------------------

    def _fire(self, op: Fire) -> list[Fired]:
        """Each firing, if its schedule is still as the sweep read it: the slot's item posted
        under its key (or found there: an attempt that committed before a crash, or another
        sweep's), or nothing while ``overlap: skip`` finds the previous item not terminal,
        and the schedule moved on, in this transaction. So a slot makes one item whatever
        the number of sweeps, and a crash anywhere leaves either both or neither."""
        states: dict[int, sql.ScheduleState | None] = {}
        for schedule_id in sorted({f.schedule_id for f in op.firings}):  # one locking order
            states[schedule_id] = sql.lock_schedule(schedule_id)
        answers: list[Fired] = []
        for firing in op.firings:
            state = states[firing.schedule_id]
            if (
                state is None
                or state.paused
                or state.rev != firing.rev
                or state.next_at != firing.expect
            ):
                answers.append(Fired(done=False))
                continue
            if firing.post is None or firing.slot is None:
                sql.advance_schedule(state, next_at=firing.after, slot=None, at=self.at)
                answers.append(Fired(done=True))
                continue
            if state.overlap == "skip" and self._running(state.last_item):
                sql.advance_schedule(state, next_at=firing.after, slot=None, at=self.at)
                answers.append(Fired(done=True, overlap=True))
                continue
            try:
                posted = self._post(firing.post)[0]
            except TaskhosterError as exc:  # refused before it changed anything
                answers.append(Fired(done=False, error=exc.message))
                continue
            crash_point("schedule.after_post")
            state.last_item = posted.row.id
            sql.advance_schedule(state, next_at=firing.after, slot=firing.slot, at=self.at)
            answers.append(Fired(done=True, item=posted.row.id, created=posted.created))
        return answers

    def _running(self, item_id: str | None) -> bool:
        """Whether a schedule's previous item is still there and not terminal."""
        if item_id is None:
            return False
        if item_id in self.removed:
            return False
        row = (
            next((r for r in self.created if r.id == item_id), None)
            or self.rows.get(item_id)
            or sql.select_rows([item_id], lock=False).get(item_id)
        )
        return row is not None and not row.is_terminal

    def _payload_and_result(self, queue: QueueInfo, row: ItemRow) -> tuple[Any, Any]:
        """A repeated key's item as a read shows it: both live in its file, read once (an
        item made earlier in this group has no result yet, and its payload is at hand)."""
        if row.id in self.payloads:
            return self.payloads[row.id], None
        try:
            record = self.store.read_any(queue.name, row.id, row.status.state)[1]
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
            self.tally.counts[(op.queue_id, status.value)] -= 1
        return len(gone)

    def _resettle(self, op: Resettle) -> int:
        found = [
            self.threads[k] for k in ((op.queue_id, t) for t in op.thread_ids) if k in self.threads
        ]
        for thread in found:
            thread.touched = True
        return len(found)

    # -- threads --------------------------------------------------------------------------

    def _settle_threads(self) -> None:
        """Bring each touched thread back to its rule (``rules.settle``): its heads (as the
        index orders the line, up to the queue's ``threadLimit``) eligible, old heads not; a
        thread with no member left deleted."""
        for thread in self.threads.values():
            queue = self.queues.get(thread.queue_id)
            limit = queue.thread_limit if queue is not None else 1
            settled = rules.settle(
                thread, partial(sql.thread_line, *thread.key, max(1, limit)), limit
            )
            if settled is None:
                continue
            sql.set_eligible(settled.unmark, False)
            if settled.delete:
                if thread.pk is not None:
                    sql.delete_thread(thread.pk)
                thread.pk = None
                continue
            if settled.mark:
                sql.set_eligible(settled.mark, True, only_pending=True)
            if settled.heads:
                # (Also for heads that were eligible already: a claim in another process may
                # have passed one over while this group held the thread.)
                self.tally.claimable(thread.queue_name)
            sql.save_thread(thread)

    # -- claims ---------------------------------------------------------------------------

    def _claims(self) -> Claims:
        return Claims(
            at=self.at,
            store=self.store,
            files=self.files,
            found=self.found,
            threads=self.threads,
            tally=self.tally,
            vanished=self._vanished,
            settle=self._settle_threads,
        )


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
