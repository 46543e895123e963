"""Group commit: the committer thread that gathers operations into groups, and runs them.

Callers from any thread (HTTP requests, the ``/work`` sockets' event loop, the sweep) hand
an operation to ``committer.execute`` or ``committer.execute_async``. The committer thread
(here, in the server process or in a committer process of its own) takes everything
queued, runs it as one group (``group.Group``: one transaction), makes the group's files
durable with one barrier after the commit (so the database's write lock is not held across
it), and answers each caller. Whatever arrives while a group runs joins the next one.
Nothing waits on a timer: a lone operation is committed at once (latency); under load, a
crowd shares one transaction and one flush (throughput), and the flush overlaps the next
group: with operations already waiting, a group's barrier runs on the flusher's thread,
which answers the group once it is done, while the next group commits; the next barrier
waits for it (``Committer._run``; a failed barrier fails the group that committed meanwhile
too).

Nothing is acknowledged before its files are durable (with fsync on): a claim or an extend
(which need nothing durable) is answered at the commit, everything else after the barrier.
What another reader may see between a commit and its barrier (a result, a new item) is at
most what a power cut in that instant could take back; no acknowledgement that depends on
it has gone out.

A caller inside a database transaction of its own (``transaction.atomic``) runs its operation
right there, as a group of one, so it commits (and announces) with the caller's transaction.

If a group fails as a whole (a database error, a lost race on an idempotency key), it is
run again, and then each operation alone, so one bad member only fails itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.db import DatabaseError, IntegrityError, OperationalError, connection

from .. import events, identity, metrics
from ..conf import get_conf
from ..errors import (
    NotYetDurable,
    OutcomeUnknown,
    StoreError,
    StoreWriteFailed,
    TaskhosterError,
)
from ..faults import GATHER, fault, slow_seconds
from ..osthread import name_os_thread
from . import giveback, pacing, reclaim
from . import rows as sql
from .common import store
from .group import PASS_THE_GATE, Group
from .ops import (
    Claim,
    Extend,
    MarkFetched,
    Op,
    Post,
    Progress,
    Reclaim,
    Release,
    Resettle,
    Rewrite,
)

log = logging.getLogger(__name__)

MAX_GROUP_ITEMS = 2000
IDLE_SECONDS = 0.5  # idle this long: write out the metrics counted so far
IDLE_CLOSE_ROUNDS = 4  # idle this many times over: give the database connection back
COUNT_SHARDS = 16
# While files a failed flush left are not written again, they are tried again at most this
# often (at the next group, or while idle); every other group is refused meanwhile.
REWRITE_EVERY_SECONDS = 1.0
REWRITE_CHUNK = 256  # items written again in one group
ADOPT_MOST = 10_000  # rows marked ``unflushed`` a committer takes up at a time
ADOPT_EVERY_SECONDS = 30.0  # ... and looks for them this often, busy or idle


# Operations answered at the commit: they need nothing durable (a claim may be repeated
# after a crash: at-least-once; a lease extension or a first fetch only shortens a clock, and
# progress is kept only while the attempt lasts; the
# rows of a deleted queue are reclaimed again if a crash brings them back).
ANSWERED_AT_COMMIT = (Claim, Extend, MarkFetched, Progress, Release, Reclaim, Resettle)


_bound: set[Path] = set()  # state roots whose identity this process has checked


def _refused_root() -> TaskhosterError | None:
    """Before this process writes into a state root: is it this database's (``identity``)?
    Checked once per process and root; a database that is away is checked again later."""
    root = get_conf().root
    if root in _bound or not root.is_dir():
        return None
    try:
        identity.check()
    except identity.StateRootTaken as exc:
        return StoreError(str(exc))
    except DatabaseError:
        return None  # the group meets the same error, and says so
    _bound.add(root)
    return None


def run_group(ops: list[Op[Any]], shard: int) -> None:
    """Run ``ops`` as one group, flush its files and answer them; never raises."""
    committed = commit_group(ops, shard)
    if isinstance(committed, Split):
        _one_by_one(committed.ops, shard)
    elif committed is not None:
        flushed(committed, flush(committed))


@dataclass
class Split:
    """A group that failed as a whole: its members are to be run one by one (by whoever
    ran it, once nothing it flushes on another thread is pending: ``Committer._run``)."""

    ops: list[Op[Any]]


@dataclass
class Committed:
    """A group that committed and whose files are still to be made durable: the answers
    that wait for that (``after_flush``)."""

    group: Group
    after_flush: list[tuple[Op[Any], bool, Any]]

    def may_overlap(self) -> bool:
        """Whether the next group may commit while this one's files are flushed: it has
        files to flush, and it is not a rewrite of files a failed flush left (its marks and
        its bookkeeping wait for its own flush, in order)."""
        g = self.group
        return g.needs_flush and not (g.rewritten or g.set_aside or g.let_go)


def commit_group(ops: list[Op[Any]], shard: int) -> Committed | Split | None:
    """Run ``ops`` as one group, answer those answered at the commit, and return what waits
    for the group's flush (the rest, even when it wrote no file: a post sent again with its
    key, found, waits for a flush of the group before it that may still run); ``Split``
    when its members are to be run one by one; None when it is over (it failed, answered).
    Never raises."""
    if not all(op.background for op in ops):
        pacing.mark_foreground()
    taken = _refused_root()
    if taken is not None:
        log.error("%s", taken.message)
        _fail_all(ops, taken)
        return None
    if (
        store().unflushed  # (nearly always empty: one look)
        and not all(isinstance(op, PASS_THE_GATE) for op in ops)
        and not _unflushed_written_again(shard)
    ):
        _fail_all(ops, NotYetDurable())
        return None
    for attempt in range(3):
        group = Group(ops, store(), shard)
        try:
            group.run()
        except StoreWriteFailed as exc:
            # The state root refused a write (full, read-only): the group undid its files
            # and rolled back. Its members one by one, so that those the refusal was not
            # about (another queue's, a verdict with no file to write) are not refused too.
            if len(ops) > 1:
                return Split(ops)
            refused = group.refused_keys()
            answer([(op, False, refused.get(id(op), exc)) for op in ops])
            return None
        except TaskhosterError as exc:
            if isinstance(exc, OutcomeUnknown):
                # Settled once the database answers: its files put back if it rolled back,
                # what its claims took (no one heard of it) given back if it committed.
                giveback.unsettled(group.unsettled())
            # A post whose key the group refused keeps that answer (what the caller would
            # have heard first), the rest hear why the group failed.
            refused = group.refused_keys()
            answer([(op, False, refused.get(id(op), exc)) for op in ops])
            return None
        except IntegrityError as exc:
            # A concurrent post (another process) took one of our keys: run it again, and
            # it finds that item; a second failure is not a lost race, so isolate it.
            if len(ops) > 1:
                return Split(ops)
            if attempt == 2:
                _fail_all(ops, exc)
                return None
            continue
        except OperationalError as exc:
            # A dropped connection or a lock that timed out: a fresh connection, once more.
            log.warning("group of %d failed (%s); trying again", len(ops), exc)
            if not connection.in_atomic_block:
                connection.close()
            if attempt == 2:
                _fail_all(ops, exc)
                return None
            continue
        except Exception as exc:
            if len(ops) > 1:
                log.exception("group of %d failed; running its members one by one", len(ops))
                return Split(ops)
            log.exception("operation %r failed", ops[0])
            _fail_all(ops, exc)
            return None
        outcomes = group.outcomes()
        now = [isinstance(op, ANSWERED_AT_COMMIT) or not ok for op, ok, _value in outcomes]
        answer([o for o, at_commit in zip(outcomes, now, strict=True) if at_commit])
        after_flush = [o for o, at_commit in zip(outcomes, now, strict=True) if not at_commit]
        if any(isinstance(op, Post) for op in ops) and fault("post.slow_flush"):
            time.sleep(slow_seconds())  # tests: another process's claim comes in between
        if group.rewritten and fault("rewrite.slow_flush"):
            time.sleep(slow_seconds())  # tests: the marks stand until the flush
        return Committed(group, after_flush)
    return None  # (not reached: each attempt returns or goes on)


def flush(committed: Committed) -> TaskhosterError | None:
    """Make a committed group's files durable: None, or why they could not be. Any thread
    (the flusher's, while the committer's next group runs): the store's calls alone."""
    if not committed.group.needs_flush:
        return None  # (a rewrite that wrote nothing, a group that only read)
    if fault("flush.slow"):
        time.sleep(slow_seconds())  # tests: the next group commits meanwhile
    try:
        committed.group.files.flush()
    except TaskhosterError as exc:
        return exc
    return None


def _flush_overlapped(committed: Committed) -> TaskhosterError | None:
    """The flusher's thread: flush a group that may overlap the next one, and answer it at
    once if that succeeded (for such a group ``flushed`` touches nothing the committer's
    thread does: no marks, no rewrite's bookkeeping; ``answer`` takes any thread); a
    failure is left to the committer's thread (``Committer._settle``)."""
    error = flush(committed)
    if error is None:
        flushed(committed, None)
    return error


def flushed(committed: Committed, error: TaskhosterError | None) -> None:
    """After a committed group's flush (``error``: why it failed): the bookkeeping of files
    written again or left unflushed, then the answers that waited. In the committer's
    thread; a successful flush of a group that ``may_overlap`` in the flusher's too."""
    group, after_flush = committed.group, committed.after_flush
    if error is not None:
        quiet = bool(group.ops) and isinstance(group.ops[0], Rewrite)
        after_flush = _flush_failed(after_flush, error, quiet=quiet)
        group.files.remember_unflushed()
        _forget_unflushed(group, flushed=False)
        if group.rewritten:
            # Still marked: this process's own now (it holds back until they are
            # written again), taken up or not.
            group.store.add_unflushed(group.rewritten)
            log.error(
                "%d items' files written again could not be flushed: nothing else is "
                "changed until they are",
                len(group.rewritten),
            )
        _mark_unflushed()  # before the answers: another process refuses them too
    else:
        _forget_unflushed(group, flushed=_clear_marks(group.rewritten))
        if group.files.deferred:
            reclaim.later(group.files.deferred)
    answer(after_flush)


def _flush_failed(
    outcomes: list[tuple[Op[Any], bool, Any]], exc: TaskhosterError, *, quiet: bool = False
) -> list[tuple[Op[Any], bool, Any]]:
    """The files could not be made durable: nothing that needed them is acknowledged.
    ``quiet``: a rewrite's (tried every second while the disk fails: said once, above)."""
    (log.debug if quiet else log.error)("could not flush a group's files: %s", exc.message)
    return [
        o if isinstance(o[0], ANSWERED_AT_COMMIT) or not o[1] else (o[0], False, exc)
        for o in outcomes
    ]


# A flush that fails after its group committed (an I/O error: a thin pool or a network
# filesystem out of room, a failing disk) leaves rows whose files may never reach the disk:
# Linux may mark the pages whose write failed as written, so the next flush of the same
# file succeeds without writing them, and a filesystem without a journal may drop the
# inode's and the directory's changes likewise. PostgreSQL stops in this place. Here the
# process changes nothing more (every group answered 503 ``store_error``, at once: nothing
# acknowledged, not even a post sent again with its key, whose row the failed group left)
# until those items' files are written again as new files and flushed
# (``FileBatch.rewrite``), tried at the next group and while idle, at most every
# ``REWRITE_EVERY_SECONDS``. Their rows are marked ``unflushed`` meanwhile (``Item``), so
# that every other process sharing the root refuses to change or acknowledge them too
# (``Group._refuse_unflushed``), takes them up and writes them again itself: the process
# that failed may be gone (a committer found them when it starts, too).
_rewrite_tried = 0.0  # (time.monotonic) of the last try
_adopted_up_to = ""  # the last id of the last look's full page: the next look goes on past it


def _mark_unflushed() -> None:
    """Mark the rows of the files this process's own failed flushes left ``unflushed``, for
    the other processes to see: at once after a failed flush, and again at each try (a
    mark the database did not take then; a row already marked is not written again)."""
    st = store()
    with st.unflushed_lock:
        ids = sorted(st.unflushed)
    if not ids or connection.in_atomic_block:  # (in a caller's transaction: not its to add)
        return
    try:
        sql.mark_unflushed(ids)
    except Exception as exc:  # (the database away too: tried again in a second)
        log.warning("could not mark %d items as waiting for their files: %s", len(ids), exc)


def _clear_marks(rewritten: dict[str, tuple[int, str | None]]) -> bool:
    """The files a rewrite wrote again are durable: their rows' marks cleared (of those
    still at the ``rev`` written: a row changed since keeps its mark for a later look), and
    the claims of the queues of those claimable woken, in every process (a claim passed
    them by; nothing else looks again). Only now: a mark cleared at the rewrite's commit
    let a claim hand the item out while its flush, perhaps failing, went on. Whether the
    marks are cleared (the database away, they are tried again)."""
    if not rewritten:
        return True
    try:
        sql.clear_unflushed({item_id: rev for item_id, (rev, _queue) in rewritten.items()})
    except Exception as exc:
        log.warning("could not clear the marks of %d items written again: %s", len(rewritten), exc)
        return False
    queues = sorted({queue for _rev, queue in rewritten.values() if queue is not None})
    if queues:
        events.announce_many([("claimable", queue, "") for queue in queues])
    return True


def _forget_unflushed(group: Group, *, flushed: bool) -> None:
    """After a rewrite: the items it has nothing more to do for, and (``flushed``) those it
    wrote again, wait no more; those it set aside wait for a later look."""
    st = group.store
    if group.set_aside:
        st.set_aside(group.set_aside)
    done = (group.let_go | group.rewritten.keys()) if flushed else group.let_go
    if done and not st.forget_unflushed(done) and not st.taken_up and flushed:
        log.warning("the files a failed flush left are written again and durable (or gone)")


def adopt_unflushed() -> None:
    """Take up the rows marked ``unflushed`` (their files left by a failed flush in another
    process, perhaps one gone since, or in this one before a restart), to write their files
    again: when a committer starts, and every ``ADOPT_EVERY_SECONDS`` (a row met marked is
    taken up where it is met). ``ADOPT_MOST`` a look, each look going on past the last one's
    page, from the first again after a short page: rows that cannot be written again (set
    aside, still marked) never hide those behind them. Never raises."""
    global _adopted_up_to
    try:
        ids = sql.unflushed_rows(ADOPT_MOST, after=_adopted_up_to)
        if _adopted_up_to and len(ids) < ADOPT_MOST:  # the end: on from the first
            ids = list(dict.fromkeys(ids + sql.unflushed_rows(ADOPT_MOST - len(ids))))
    except Exception as exc:
        log.debug("could not look for items waiting for their files: %s", exc)
        return
    _adopted_up_to = ids[-1] if len(ids) >= ADOPT_MOST else ""
    st = store()
    new = [i for i in ids if i not in st.unflushed and i not in st.taken_up]
    told = [i for i in new if i not in st.unflushed_said]
    if told:
        log.warning(
            "%d items' files, left by a flush that failed, are to be written again here",
            len(told),
        )
    if new:
        st.take_up(new)


def _unflushed_written_again(shard: int) -> bool:
    """Whether none of this process's own files wait to be written again: when some do, or
    some were taken up, one try (at most every ``REWRITE_EVERY_SECONDS``) first. Its own,
    all of them, chunk by chunk until the disk refuses one; of those taken up, one chunk a
    try (a process whose flushes did not fail serves meanwhile). Not inside a caller's
    transaction (an embedding's): its locks and its commit are not the rewrite's."""
    global _rewrite_tried
    st = store()
    if not st.unflushed and not st.taken_up:
        return True
    if connection.in_atomic_block or time.monotonic() - _rewrite_tried < REWRITE_EVERY_SECONDS:
        return not st.unflushed
    _rewrite_tried = time.monotonic()
    _mark_unflushed()
    with st.unflushed_lock:
        own = sorted(st.unflushed)
        theirs = sorted(st.taken_up - st.unflushed)[:REWRITE_CHUNK]
    for at in range(0, len(own), REWRITE_CHUNK):  # (each chunk's rows locked for its own)
        chunk = own[at : at + REWRITE_CHUNK]
        _rewrite(chunk, shard)
        if any(i in st.unflushed for i in chunk if i not in st.unflushed_said):
            break  # the disk still refuses: the rest at the next try
    if theirs:
        _rewrite(theirs, shard)
    return not st.unflushed


def _rewrite(ids: list[str], shard: int) -> None:
    rewrite = Rewrite(tuple(ids))
    rewrite.background = True
    run_group([rewrite], shard)


def _one_by_one(ops: list[Op[Any]], shard: int) -> None:
    for op in ops:
        run_group([op], shard)


def measure_flush_ahead() -> None:
    """With ``FLUSH = "auto"``, measure now how this state root's filesystem makes one file
    durable sooner (``StateStore.one_file_flush``: some 20 ms, once), so that the first lone
    post after a start does not wait for it. Only into a state root this process may write
    to (``_refused_root``); otherwise (a database away, a root not yet made) the first group
    that needs it measures, as it would have. Not where the store flushes file by file
    whatever the setting (no ``syncfs``, or a FUSE filesystem that drops it): no group asks
    there."""
    try:
        st = store()
        if not st.fsync or st.flush_mode != "auto":
            return
        if _refused_root() is None and get_conf().root in _bound:  # as the setting says it
            st.one_file_flush()
    except Exception as exc:  # never in the way of a start: the first group measures then
        log.warning("could not measure the flush of one file ahead: %s", exc)


def _fail_all(ops: list[Op[Any]], exc: BaseException) -> None:
    answer([(op, False, exc) for op in ops])


# In a committer process, answers go back to the server process instead (engine.process).
answer_hook: Callable[[list[tuple[Op[Any], bool, Any]]], None] | None = None


def answer(outcomes: list[tuple[Op[Any], bool, Any]]) -> None:
    """Hand each operation its answer: threads through their futures; event loops in one
    callback per loop for the whole group."""
    if answer_hook is not None:
        answer_hook(outcomes)
        return
    answer_here(outcomes)


def answer_here(outcomes: list[tuple[Op[Any], bool, Any]]) -> None:
    """``answer`` in this process (in a committer process: for the operations its own
    threads handed in)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Op[Any], bool, Any]]] = {}
    seen = events.generation()
    for op, ok, value in outcomes:
        op.generation = seen
        if op.loop is not None:
            by_loop.setdefault(op.loop, []).append((op, ok, value))
        elif op.future is not None and not op.future.done():
            if ok:
                op.future.set_result(value)
            else:
                op.future.set_exception(value)
    for loop, batch in by_loop.items():
        with contextlib.suppress(RuntimeError):  # the loop has closed
            loop.call_soon_threadsafe(_settle_waiters, batch)


def _settle_waiters(batch: list[tuple[Op[Any], bool, Any]]) -> None:
    for op, ok, value in batch:
        waiter = op.waiter
        if waiter is None or waiter.done():
            continue
        if ok:
            waiter.set_result(value)
        else:
            waiter.set_exception(value)


class Committer:
    """The committer thread of this process."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.queue: deque[Op[Any]] = deque()
        self.queued_items = 0
        self.thread: threading.Thread | None = None
        self.pid = os.getpid()
        self.shard = random.randrange(COUNT_SHARDS)
        self.busy = False  # a group taken from the queue and not yet answered
        # The group before, committed, its files flushed on the flusher's thread meanwhile.
        self.flushing: tuple[Committed, Future[TaskhosterError | None]] | None = None
        self.flusher: Flusher | None = None

    def submit(self, op: Op[Any]) -> None:
        self.submit_many([op])

    def submit_many(self, ops: list[Op[Any]]) -> None:
        with self.cond:
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(
                    target=self._loop, name="taskhoster-committer", daemon=True
                )
                self.thread.start()
            self._enqueue(ops)
            self.cond.notify()

    def _enqueue(self, ops: Iterable[Op[Any]]) -> None:
        """Queue ``ops`` for the next groups, in order, stamped with the time they came in
        (``cond`` held)."""
        now = time.monotonic()
        for op in ops:
            op.submitted = now
            self.queue.append(op)
            self.queued_items += op.size

    def start(self) -> None:
        """Its thread starts at the first operation: nothing to do ahead."""

    def starting(self) -> bool:
        """A thread is ready as soon as it is made."""
        return False

    def unflushed(self) -> int:
        return len(store().unflushed)

    def waiting(self) -> int:
        """Operations handed in and not yet taken into a group."""
        return len(self.queue)

    def backlog(self) -> tuple[int, float]:
        """(items waiting, seconds the oldest of them has waited) for a group to take them."""
        with self.cond:
            oldest = self.queue[0].submitted if self.queue else None
            items = self.queued_items
        return items, (time.monotonic() - oldest) if oldest is not None else 0.0

    def _wait(self, seconds: float) -> None:
        """Wait up to ``seconds`` for an operation to be handed in (``cond`` held)."""
        self.cond.wait(seconds)

    def _ended(self) -> bool:
        """Whether nothing more can be handed in and the loop may end (a thread: never)."""
        return False

    def _more_waiting(self) -> bool:
        """Whether an operation waits for the next group already."""
        return bool(self.queue)

    def _take(self) -> list[Op[Any]] | None:
        """The next group; None when nothing came for ``IDLE_SECONDS``, or once the flush on
        the flusher's thread is done (its group to settle)."""
        with self.cond:
            if not self.queue and not self._flush_done():
                self._wait(IDLE_SECONDS)
            if not self.queue:
                return None
            if GATHER:  # a test's crowd: wait for it
                deadline = time.monotonic() + 10
                while len(self.queue) < GATHER and (left := deadline - time.monotonic()) > 0:
                    if self._ended():
                        break
                    self._wait(left)
            group: list[Op[Any]] = []
            size = 0
            while self.queue and (not group or size + self.queue[0].size <= MAX_GROUP_ITEMS):
                op = self.queue.popleft()
                group.append(op)
                size += op.size
            self.queued_items -= size
            self.busy = True  # under the lock that took it: never idle to an onlooker between
            return group

    def _loop(self) -> None:
        name_os_thread()
        adopt_unflushed()
        adopted = time.monotonic()
        idle = 0
        try:
            while True:
                if time.monotonic() - adopted >= ADOPT_EVERY_SECONDS:
                    self._settled()
                    adopt_unflushed()  # (never raises)
                    adopted = time.monotonic()
                if store().taken_up or store().unflushed:  # (at most once a second)
                    # Its own too, not only at the gate and when idle: groups that pass the
                    # gate (a producer's reads, which leave them to this) could keep it
                    # from both.
                    self._settled()
                    _unflushed_written_again(self.shard)
                group = self._take()
                if group is None:
                    if self.flushing is not None:
                        self._settled()  # its flush is done (if it failed: answered here)
                        continue
                    if self._ended():
                        return
                    idle += 1
                    self._idle(idle)
                    continue
                idle = 0
                self._run(group)
        finally:
            self._settle()

    def _idle(self, rounds: int) -> None:
        try:
            if store().unflushed:
                _unflushed_written_again(self.shard)
            metrics.maybe_flush(force=True)
            if rounds >= IDLE_CLOSE_ROUNDS:
                # Give the connection back (a pool, or a test database to drop), again
                # after any later flush of metrics counted while idle: a closed
                # connection costs nothing to close.
                connection.close()
        except Exception as exc:  # the database is away: nothing to do while idle
            log.debug("idle committer: %s", exc)

    def _run(self, group: list[Op[Any]]) -> None:
        """Commit ``group``; then settle the group before it, whose files were flushed
        meanwhile (``_settle``); then flush this one's: with operations already waiting
        for the next group (under load), on the flusher's thread, which answers the group as
        soon as its flush succeeded, while the committer commits that next group; otherwise
        here, answered without a hop between threads (a lone operation's latency)."""
        started = time.perf_counter()
        if fault("committer.slow_group"):
            time.sleep(slow_seconds())  # a test's stand-in for a disk that stalls
        committed: Committed | Split | None = None
        try:
            committed = commit_group(group, self.shard)
        except BaseException:  # commit_group never raises; keep the committer alive anyway
            log.exception("the committer failed on a group")
            _fail_all(group, RuntimeError("the committer failed"))
        failed = self._settle()
        try:
            if isinstance(committed, Split):
                # Only now: each member is answered after its own flush, and so after the
                # flush before (if that failed, the gate refuses them).
                _one_by_one(committed.ops, self.shard)
            elif committed is not None and failed is not None:
                # The group before failed its flush, and this one committed on top of
                # files that may never reach the disk: its own are not acknowledged either,
                # and are written again with the rest.
                flushed(committed, failed)
            elif committed is not None and committed.may_overlap() and self._more_waiting():
                future = self._flusher().submit(committed)
                self.flushing = (committed, future)
                future.add_done_callback(self._flush_ended)
            elif committed is not None:
                flushed(committed, flush(committed))
        except BaseException:  # (as above)
            log.exception("the committer failed on a group's flush")
            _fail_all(group, RuntimeError("the committer failed"))
        finally:
            self.busy = self.flushing is not None
        # After the answers, outside the try: a group is answered once, whatever happens
        # to its count (which does not raise; should it, the committer goes on).
        try:
            metrics.count_group(len(group), time.perf_counter() - started)
        except Exception:
            log.exception("could not count a group")

    def _settle(self) -> TaskhosterError | None:
        """Wait for the flush on the flusher's thread, if one runs (its group answered
        there if it succeeded); if it failed, answer its group here: None, or why."""
        if self.flushing is None:
            return None
        committed, future = self.flushing
        self.flushing = None
        try:
            error = future.result()  # (answered already if it succeeded)
            if error is not None:
                flushed(committed, error)
        except BaseException:
            log.exception("the committer failed on a group's flush")
            _fail_all(
                [op for op, _ok, _value in committed.after_flush],
                RuntimeError("the committer failed"),
            )
            error = None
        return error

    def _settled(self) -> None:
        """``_settle`` between groups: nothing is left unanswered then."""
        self._settle()
        self.busy = False

    def _flush_done(self) -> bool:
        """Whether a flush runs on the flusher's thread and is done (to settle)."""
        return self.flushing is not None and self.flushing[1].done()

    def _flush_ended(self, _future: Future[TaskhosterError | None]) -> None:
        """(The flusher's thread, its flush done.) Wake the committer if it waits for
        operations: the flush is to be settled now, a failed one's group answered
        (``_take`` looks, under ``cond``, whether it is done before it waits, so this never
        comes between)."""
        with self.cond:
            self.cond.notify_all()

    def _flusher(self) -> Flusher:
        if self.flusher is None:
            self.flusher = Flusher()
        return self.flusher


class Flusher:
    """The committer's flusher: one thread (a daemon, as the committer's own is: a flush
    that hangs on a dying disk does not keep the process from exiting) that flushes the
    groups handed to it in turn, and answers each (``_flush_overlapped``)."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[tuple[Committed, Future[TaskhosterError | None]]]
        self.jobs = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name="taskhoster-flusher", daemon=True)
        self.thread.start()

    def submit(self, committed: Committed) -> Future[TaskhosterError | None]:
        future: Future[TaskhosterError | None] = Future()
        self.jobs.put((committed, future))
        return future

    def _loop(self) -> None:
        name_os_thread()
        while True:
            committed, future = self.jobs.get()
            future.set_running_or_notify_cancel()
            try:
                future.set_result(_flush_overlapped(committed))
            except BaseException as exc:  # (the committer's thread logs it, and answers)
                future.set_exception(exc)
