"""The claims of one group (rule 2), run after its other operations so they see this group's
posts and freed threads: per queue, the earliest due eligible rows (``rows.claim_candidates``)
that the rules let it take (``rules.may_take``), renamed into ``processing/`` under new leases
(``rules.claim``)."""

from __future__ import annotations

import logging
import secrets
from collections import defaultdict
from collections.abc import Callable
from datetime import datetime
from typing import Any

from ..errors import QueueNotFound, TaskhosterError
from ..faults import crash_point
from ..status import State, Status
from ..store import FileBatch, StateStore
from . import rows as sql
from . import rules
from .ops import Claim, Claimed
from .rules import ItemRow, QueueInfo, RowStamp, ThreadState
from .tally import Tally

log = logging.getLogger(__name__)

CLAIM_ROUNDS = 4


class ClaimedTwice(RuntimeError):
    """A claim met an item it had already taken: a bug, never an answer."""


class Claims:
    """The claims of one group; ``vanished`` finishes the delete of a row whose file is gone,
    ``settle`` settles the group's threads."""

    def __init__(
        self,
        *,
        at: datetime,
        store: StateStore,
        files: FileBatch,
        found: dict[str, RowStamp],
        threads: dict[tuple[int, str], ThreadState],
        tally: Tally,
        vanished: Callable[[ItemRow], None],
        settle: Callable[[], None],
    ) -> None:
        self.at = at
        self.store = store
        self.files = files
        self.found = found  # each row whose file it changes, as found
        self.threads = threads
        self.tally = tally
        self.vanished = vanished
        self.settle = settle
        self.looked_at: set[str] = set()  # every row a claim of this group looked at
        self.to_write: list[ItemRow] = []  # taken, to write in one statement
        self.vanished_rows: list[ItemRow] = []
        self.put_back: set[str] = set()  # queues to look at again (a file put back, a thread busy)
        self.stale_threads = False

    def run(self, claims: list[Claim], live: dict[str, QueueInfo]) -> dict[int, tuple[bool, Any]]:
        """Each claim's answer (by ``id``): its share of what its queue's claims took."""
        answers: dict[int, tuple[bool, Any]] = {}
        by_queue: dict[str, list[Claim]] = defaultdict(list)
        for op in claims:
            by_queue[op.queue_name].append(op)
        # In queue id order: a controlled queue's claims hold its claim lock to the commit.
        for name, ops in sorted(
            by_queue.items(), key=lambda e: live[e[0]].id if e[0] in live else 0
        ):
            queue = live.get(name)
            if queue is None:
                for op in ops:
                    answers[id(op)] = (False, QueueNotFound(f"queue {name!r} does not exist"))
                continue
            wanted = sum(op.max_items for op in ops)
            taken = self._claim_controlled(queue, wanted)
            if len(taken) < wanted and name not in self.put_back:
                self.tally.exhausted.add(name)
            for op in ops:
                share, taken = taken[: op.max_items], taken[op.max_items :]
                for claimed, holder in zip(share, op.holders, strict=False):
                    # Written with the claims, below (a row written already is written
                    # again for this column alone; one in ``to_write`` twice, once).
                    claimed.row.set(claimed_by=holder)
                    self.to_write.append(claimed.row)
                answers[id(op)] = (True, share)
                self.tally.count(name, "claim_attempts")
        sql.update_rows(self.to_write)
        self.to_write = []
        return answers

    def _claim_controlled(self, queue: QueueInfo, want: int) -> list[Claimed]:
        """Section 8.1: a paused queue hands out nothing; a cap or a rate limit bounds the
        claim by what its rows say (the items processing; the claims started in the window),
        counted under the queue's claim lock, so processes claiming at once see each other's
        claims. Nothing held back costs an item an attempt: it is simply not taken."""
        if not queue.controlled:
            return self._claim_queue(queue, want)
        if queue.paused:
            return []
        sql.lock_claims(queue.id)
        processing, starts = sql.control_state(queue, self.at, prune=True)
        started = sum(n for _t, n in starts)
        budget, held = rules.claim_budget(queue, want, processing=processing, started=started)
        taken = self._claim_queue(queue, budget) if budget > 0 else []
        if queue.rate_limit is not None and taken:
            sql.record_claim_start(queue.id, self.at, len(taken))
            starts.append((self.at, len(taken)))
        if held == "rateLimit":
            # The window is full: every process's waiting workers look again when it opens
            # (no item waits for the socket backstop).
            opens = rules.rate_window_opens(queue, starts, self.at)
            if opens is not None:
                self.tally.opens(queue.name, opens)
        return taken

    def _claim_queue(self, queue: QueueInfo, want: int) -> list[Claimed]:
        taken: list[Claimed] = []
        # A second member of a thread waits until the other threads' heads among the
        # candidates of its priority have been taken (section 8.1: many threads' heads
        # before a second member of one).
        seconds: list[ItemRow] = []
        taken_from: set[str] = set()
        # Every row this claim has looked at, taken or not. A later round's query must not
        # see them again: the rows it took are written only after the loop, so the index
        # still calls them eligible (on PostgreSQL SKIP LOCKED does not skip our own locks).
        seen: list[str] = []
        for _round in range(CLAIM_ROUNDS):
            need = want - len(taken)
            if need <= 0:
                break
            candidates = sql.claim_candidates(queue.id, self.at, need, seen)
            for row in candidates:
                if row.id in self.looked_at:
                    # Never two leases for one item: the group fails, loudly, and nothing
                    # of it is written.
                    raise ClaimedTwice(f"claim: item {row.id} was found twice in one group")
                self.looked_at.add(row.id)
                seen.append(row.id)
                if row.unflushed:
                    # Its file is not yet durable (``Item.unflushed``): not handed out; this
                    # process takes it up, to write it again before anything else.
                    self.store.take_up([row.id])
                    continue
                row.queue_name = queue.name
                if seconds and seconds[0].priority > row.priority:
                    self._take_all(queue, seconds, taken, want)  # before a lower priority
                if len(taken) >= want:
                    break
                if row.thread_id is not None and row.thread_id in taken_from:
                    seconds.append(row)
                    continue
                claimed = self._take(queue, row)
                if claimed is not None:
                    taken.append(claimed)
                    if row.thread_id is not None:
                        taken_from.add(row.thread_id)
            if len(candidates) < need:
                break
        self._take_all(queue, seconds, taken, want)
        # Written with the other queues' claims of this group, in one statement (``run``);
        # at once only when a vanished row makes its threads settle now.
        if self.vanished_rows or self.stale_threads:
            sql.update_rows(self.to_write)
            self.to_write = []
            sql.delete_rows([row.id for row in self.vanished_rows])
            self.vanished_rows.clear()
            self.stale_threads = False
            self.settle()
        self.tally.count(queue.name, "claims", len(taken))
        return taken

    def _take_all(
        self, queue: QueueInfo, rows: list[ItemRow], taken: list[Claimed], want: int
    ) -> None:
        while rows and len(taken) < want:
            claimed = self._take(queue, rows.pop(0))
            if claimed is not None:
                taken.append(claimed)
        rows.clear()  # not taken by this claim: they stay eligible for the next

    def _take(self, queue: QueueInfo, row: ItemRow) -> Claimed | None:
        thread = None
        if row.thread_id is not None:
            thread = self._thread(queue, row.thread_id)
        if not rules.may_take(row, thread, queue.thread_limit):
            if thread is None:
                if row.thread_id is not None and sql.thread_exists(queue.id, row.thread_id):
                    # Another group holds its thread (it is changing): look again after
                    # this group's commit, in every process, rather than wait for a backstop.
                    self.put_back.add(queue.name)
                    self.tally.claimable(queue.name)
            else:
                # Eligible, yet not one of its thread's heads under the queue's threadLimit
                # (a limit lowered while a group settled it with the old one): the thread is
                # settled again at the end of this claim, so the row stops being offered.
                thread.touched = True
                self.stale_threads = True
            return None
        self.found.setdefault(row.id, row.stamp)
        if not self.files.take(queue.name, row.id, State.PENDING, State.PROCESSING):
            self._lost(queue, row)
            return None
        crash_point("claim.after_rename")
        move = rules.claim(row, queue, lease=secrets.token_urlsafe(16), at=self.at)
        self.tally.status(row, move.status)
        row.set(**move.changes)
        if thread is not None:
            rules.take_head(thread, row.id)
            sql.save_thread(thread)
        try:
            payload = self.store.read(queue.name, State.PROCESSING, row.id).get("payload")
        except TaskhosterError as exc:
            log.error("claim: item %s has an unreadable file: %s", row.id, exc)
            payload = None
        self.to_write.append(row)
        if row.attempts == 1:
            due = max(row.posted_at, row.scheduled_at)
            self.tally.latencies.append((queue.name, max(0.0, (self.at - due).total_seconds())))
        return Claimed(row=row, payload=payload)

    def _lost(self, queue: QueueInfo, row: ItemRow) -> None:
        """A claim found the file of a claimable row gone from ``pending/``: it has lost,
        and takes nothing. What is left is a crash's, or a group's whose commit failed (the
        database let go of its locks before it could undo its files; it spares the rows
        changed meanwhile when it does: ``Group.put_back_files``), never a live group's
        (this group holds the row, and a group that fails otherwise undoes its files before
        it lets go):

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
            self.vanished(row)
            self.vanished_rows.append(row)
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
                    self.tally.claimable(queue.name)
                return
        log.error(
            "claim: item %s is claimable in the index, but its file is in %s/; passed over "
            "(sweep --repair reconciles the index with the files)",
            row.id,
            where.value,
        )

    def _thread(self, queue: QueueInfo, thread_id: str) -> ThreadState | None:
        key = (queue.id, thread_id)
        if key not in self.threads:
            found = sql.claim_thread(queue.id, thread_id, queue.name)
            if found is None:
                return None
            self.threads[key] = found
        return self.threads[key]
