"""One dispatcher per server process: hands claimable items to this process's ``/work``
sockets.

When a queue may have claimable items (news from the engine, from another process, a freed
slot, a new subscription, or a delayed item coming due), the dispatcher makes ONE claim for
that queue of up to the free capacity of all its sockets serving the queue that no claim in
flight has reserved yet, and deals the items out round the sockets, least recently served
first, one each before any gets two. So 50 idle sockets and one new item cost one claim,
not fifty; and a slot freed while a claim is in flight is claimed for at once, so it can
join the next group commit. News arriving while every free slot is reserved marks the
queue to be looked at once more afterwards.

A claim that finds nothing arms a timer for the queue's next delayed item. In case a piece
of news was lost, a backstop runs every ``SOCKET_BACKSTOP_SECONDS``: ONE query for all the
queues that have a socket with a free slot, which says which of them have a due item now
(those are claimed for) and when the others' next delayed item is due (timers). Idle costs
that query and nothing else: no claim is made for a queue with nothing to take, so a
thousand idle queues cost one indexed lookup each per backstop, not a claim each. The
backstop also looks at what the sockets hold (``_recheck_holds``): an item removed while its
news was lost is cancelled on its socket there. When the process's bus listener knows it may
have missed news (its subscription confirmed again after Redis was away: ``bus.LOOK_AGAIN``),
the same re-check runs at once.

Sockets are kept per queue (``serving``), so news for one queue looks at that queue's
sockets only, however many queues and sockets the process serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any, Protocol, TypeVar

from django.db import DatabaseError, close_old_connections

from .. import bus, engine, events, metrics
from ..conf import get_conf
from ..errors import QueueNotFound, StoreWriteFailed
from ..faults import fault
from ..keys import KEY_REVOKED, live_key_ids
from ..osthread import name_os_thread
from ..timeutil import parse_wire
from . import registry

log = logging.getLogger(__name__)
T = TypeVar("T")
W = TypeVar("W")

GAUGE_INTERVAL = 1.0
# A claim that failed (the database away, most often) is made again after this long, with
# whatever is free then: not left to the next news or the backstop.
CLAIM_RETRY_SECONDS = 1.0
GAUGE_HEARTBEAT = 5.0

_executor = ThreadPoolExecutor(
    max_workers=4, thread_name_prefix="taskhoster-db", initializer=name_os_thread
)


async def run_sync(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """Run blocking database or file work on the dispatcher's threads."""

    def call() -> T:
        try:
            return fn(*args, **kwargs)
        except Exception:
            close_old_connections()
            raise

    return await asyncio.get_running_loop().run_in_executor(_executor, call)


class Worker(Protocol):
    """What the dispatcher needs of a socket."""

    queues: list[str]
    capacity: int
    name: str
    draining: bool
    held: dict[str, Any]
    held_bytes: int
    reserved: int
    last_served: float
    closed: bool

    async def deliver(self, claimed: engine.Claimed) -> bool: ...

    # A socket that takes several items per frame (``batch`` over 1) has this too.
    async def deliver_many(self, claimed: list[engine.Claimed]) -> list[engine.Claimed]: ...

    async def cancel(self, item_id: str, reason: str) -> None: ...


class Dispatcher:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        # Every open socket of the process (for /metrics); ``workers`` are those subscribed.
        self.sockets: weakref.WeakSet[Any] = weakref.WeakSet()
        # Each socket's last registry entry, with what it was made from (``registry_entries``).
        self.listed: dict[str, tuple[Any, tuple[Any, ...], registry.Entry]] = {}
        self.workers: set[Worker] = set()
        # The subscribed sockets of each queue, and the queues each socket was filed under.
        self.serving: dict[str, set[Worker]] = {}
        self.filed: dict[Worker, tuple[str, ...]] = {}
        self.claiming: dict[str, int] = {}  # claims in flight, per queue
        self.starting: set[str] = set()  # queues with a claim made that has not yet begun
        self.dirty: set[str] = set()  # queues to look at again when a claim ends
        # The same, for local news only: the latest news generation that marked each.
        self.dirty_local: dict[str, int] = {}
        self.timers: dict[str, tuple[float, asyncio.TimerHandle]] = {}
        self.retrying: dict[str, asyncio.TimerHandle] = {}  # a failed claim's look again
        self.backstop: asyncio.Task[None] | None = None
        self.looking: asyncio.Task[None] | None = None  # a re-check for missed news
        self.look_again_after = False
        self.reporter: asyncio.Task[None] | None = None
        self.tick = 0.0
        self.publisher = registry.Publisher()

    def start(self) -> None:
        events.subscribe(self._local_news)
        bus.listen_in_background()  # other processes' news reaches _local_news too
        self.backstop = self.loop.create_task(self._backstop())
        self.reporter = self.loop.create_task(self._report())

    # -- news ------------------------------------------------------------------------------

    def _local_news(self, news: Sequence[events.News], remote: bool = False) -> None:
        """Called once per batch of news, in the thread that delivers it: this process's
        committer's (once per group), or the bus listener's (``remote``)."""
        wanted = [n for n in news if n[0] != "verdict"]  # verdicts are for long-polls only
        if wanted:
            seen = None if remote else events.generation()  # this batch's, or later
            with contextlib.suppress(RuntimeError):  # the loop has closed
                self.loop.call_soon_threadsafe(self._news, wanted, seen)

    def _news(self, news: Sequence[events.News], seen: int | None = None) -> None:
        """``seen``: for news of this process's own committer, the news generation it came
        with (None: another process's, by the bus)."""
        for kind, queue, item_id in news:
            self._one_piece(kind, queue, item_id, seen)

    def _one_piece(self, kind: str, queue: str, item_id: str, seen: int | None = None) -> None:
        if kind in ("claimable", events.POSTING):
            self.wake(queue, seen=seen)
        elif kind == bus.LOOK_AGAIN:
            # This process's bus listener was not subscribed for a while (Redis restarted,
            # its connection was made again): look now for what the news it missed said.
            self._look_again()
        elif kind == engine.OPENS:
            # ``item_id`` carries when the queue's rate window opens: look again then.
            self._timer_for(queue, parse_wire(item_id))
        elif kind == KEY_REVOKED:
            # ``item_id`` carries the key's id: its sockets close (4401), in every process.
            for socket in list(self.sockets):
                if socket.key_id == int(item_id):
                    self.loop.create_task(socket.revoked())
        elif kind == engine.QUEUE_DELETED:
            if fault("dispatch.lose_stop_news"):
                return  # as for "removed:" below
            # ``item_id`` carries the deleted queue's id: a queue of the same name made since
            # is another queue, whose items stay. (Every socket: one may hold items of a
            # queue it has since subscribed away from.)
            for worker in list(self.workers):
                for held_id, holding in list(worker.held.items()):
                    if str(holding.queue_id) == item_id:
                        self._stop_held(worker, held_id, "deleted")
                self.wake_worker(worker)
        elif kind == registry.DRAIN:
            # ``item_id`` carries the socket's id (section 8.2): it takes nothing more.
            for socket in list(self.sockets):
                if socket.socket_id == item_id:
                    self.loop.create_task(socket.drain())
        elif kind.startswith("removed:"):
            if fault("dispatch.lose_stop_news"):
                return  # a test's stand-in for news a Redis reconnect dropped
            reason = kind.split(":", 1)[1]
            for worker in list(self.workers):
                if item_id in worker.held:
                    self._stop_held(worker, item_id, reason)
                    self.wake_worker(worker)

    def _stop_held(self, worker: Worker, item_id: str, reason: str) -> None:
        """Tell ``worker`` to stop on the item it holds (a ``cancel`` frame with ``reason``);
        its slot is free at once (the caller wakes it)."""
        worker.held.pop(item_id, None)
        self.loop.create_task(worker.cancel(item_id, reason))

    # -- registration ----------------------------------------------------------------------

    def socket_opened(self, socket: Any) -> None:
        self.sockets.add(socket)

    def socket_closed(self, socket: Any) -> None:
        self.sockets.discard(socket)
        self.unregister(socket)

    def register(self, worker: Worker) -> None:
        """File a subscribed socket under its queues (again after a new ``subscribe``)."""
        if worker.closed:
            return
        self._unfile(worker)
        self.workers.add(worker)
        self.filed[worker] = tuple(worker.queues)
        for queue in worker.queues:
            self.serving.setdefault(queue, set()).add(worker)
        self.wake_worker(worker)

    def unregister(self, worker: Worker) -> None:
        self.workers.discard(worker)
        self._unfile(worker)

    def _unfile(self, worker: Worker) -> None:
        for queue in self.filed.pop(worker, ()):
            serving = self.serving.get(queue)
            if serving is not None:
                serving.discard(worker)
                if not serving:
                    del self.serving[queue]

    def wake_worker(self, worker: Worker) -> None:
        for queue in worker.queues:
            self.wake(queue)

    def wake(self, queue: str, *, seen: int | None = None) -> None:
        """Claim for the free slots of this process's sockets on ``queue`` (not already
        reserved by a claim in flight). Claims do not wait for each other: each freed slot
        can join the very next group commit. ``seen``: woken by this process's own news, of
        that news generation."""
        serving = self.serving.get(queue, ())
        if not any(self._free(w) > 0 for w in serving):
            if self.claiming.get(queue) or any(w.reserved for w in serving):
                # News while a claim is in flight (for this queue, or for another queue of
                # these sockets, holding their free slots): look once more when one ends.
                # Not for local news that a claim of this queue answered after, with less
                # than it asked: one committer answers in order, so that claim's group came
                # no earlier than the news's, and took all there was (``_claim``).
                if seen is None:
                    self.dirty.add(queue)
                else:
                    self.dirty_local[queue] = max(seen, self.dirty_local.get(queue, 0))
            return
        if queue in self.starting:
            # A claim of this queue is made and has not begun: it reserves every slot free
            # when it begins, and reaches the committer after this news, so it takes what
            # the news announces (a post's hint and its commit's news, one right after the
            # other, make one claim, not a second that finds nothing).
            return
        self.starting.add(queue)
        self.claiming[queue] = self.claiming.get(queue, 0) + 1
        self.loop.create_task(self._claim(queue))

    # -- claims ------------------------------------------------------------------------------

    @staticmethod
    def _free(worker: Worker) -> int:
        if worker.closed or worker.draining:
            return 0
        if worker.held and worker.held_bytes >= get_conf().max_socket_held_bytes:
            return 0  # it has that much left to read: nothing more until it answers
        return max(0, worker.capacity - len(worker.held) - worker.reserved)

    async def _claim(self, queue: str) -> None:
        again = False
        failed = False
        try:
            self.starting.discard(queue)
            self.dirty.discard(queue)
            self.dirty_local.pop(queue, None)
            wanting = sorted(
                (w for w in self.serving.get(queue, ()) if self._free(w) > 0),
                key=lambda w: w.last_served,
            )
            # One claim takes at most MAX_CLAIM items, as a REST claim does; slots left over
            # are claimed for again at once (``again`` below).
            slots = deal_order(wanting, self._free, get_conf().max_claim)
            shares = Counter(slots)
            for worker, share in shares.items():
                worker.reserved += share
            total = len(slots)
            if not shares:
                # Every free slot was reserved, since this claim was asked for, by a claim of
                # another queue of these sockets (a subscribe to several queues wakes them
                # all at once): look again when that one ends, with what it leaves free.
                if any(w.reserved for w in self.serving.get(queue, ())):
                    self.dirty.add(queue)
                return
            if fault("dispatch.slow_claim"):
                await asyncio.sleep(1.0)
            # Each item is for one slot, in order: its holder's name goes into the attempt's
            # story with the claim (``_deal`` hands each to the socket it was claimed for).
            try:
                op = engine.Claim(
                    queue_name=queue, max_items=total, holders=tuple(w.name for w in slots)
                )
                claimed = await engine.execute_async(op)
                # This process's news delivered up to the claim's answer came from groups no
                # later than the claim's (``Op.generation``).
                seen = op.generation
                if len(claimed) < total and self.dirty_local.get(queue, seen + 1) <= seen:
                    del self.dirty_local[queue]  # that news was this claim's to see: it did
            except QueueNotFound:
                claimed = []
            except Exception as exc:
                failed = True
                if isinstance(exc, DatabaseError | StoreWriteFailed):
                    log.warning("claim for queue %s failed (%s); again soon", queue, exc)
                else:
                    log.exception("claim for queue %s failed", queue)
                claimed = []
            finally:
                for worker, share in shares.items():
                    worker.reserved -= share
            await self._deal(claimed, slots)
            if not claimed and self.claiming.get(queue) == 1:
                if failed:
                    self._retry_soon(queue)
                else:
                    await self._arm_timer(queue)
            again = len(claimed) == total  # there may be more for other free slots
        finally:
            self.claiming[queue] -= 1
        # The slots this claim reserved and did not fill are free again: look at the queues
        # that had news meanwhile (each marks itself again if its slots are still taken).
        if again:
            self.dirty.add(queue)
        looked_at = self.dirty | set(self.dirty_local)
        self.dirty, self.dirty_local = set(), {}
        for name in sorted(looked_at):
            self.wake(name)

    async def _deal(self, claimed: list[engine.Claimed], slots: list[Worker]) -> None:
        """Hand each item to the socket it was claimed for (``slots``, in ``deal_order``), if
        that socket is still open, subscribed to the item's queue (it may have subscribed
        anew while the claim was in flight) and not drained. A socket that takes several
        items per frame (``batch``) gets its share in as few frames as it allows."""
        unplaced: list[engine.Claimed] = []
        shares: dict[Worker, list[engine.Claimed]] = {}
        for item, worker in zip(claimed, slots, strict=False):
            shares.setdefault(worker, []).append(item)
        for worker, share in shares.items():
            if worker not in self.workers:
                unplaced.extend(share)
                continue
            wanted = [item for item in share if item.row.queue_name in worker.queues]
            unplaced.extend(item for item in share if item.row.queue_name not in worker.queues)
            free = self._free(worker)
            wanted, over = wanted[:free], wanted[free:]
            unplaced.extend(over)
            if not wanted:
                continue
            worker.last_served = self.loop.time()
            if getattr(worker, "batch", 1) > 1 and len(wanted) > 1:
                unplaced.extend(await worker.deliver_many(wanted))
                continue
            for item in wanted:
                if self._free(worker) <= 0 or not await worker.deliver(item):
                    unplaced.append(item)
        for item in unplaced:
            # Its socket did not take it (it closed meanwhile): it never reached a worker,
            # so it goes back without costing it an attempt, and is claimed again for
            # whichever socket is free (news of the release).
            release = engine.Release(item_id=item.row.id, lease=item.row.lease or "")
            try:
                await engine.execute_async(release)
            except engine.RETRYABLE as exc:
                # The database away, the state root refusing writes: made again until it
                # can be, not left ``processing`` until its lease ends.
                log.warning("could not give back %s, which no socket took: %s", item.row.id, exc)
                engine.make_again_later([release])
            except Exception:
                log.exception("could not give back %s, which no socket took", item.row.id)

    # -- what closed sockets held ---------------------------------------------------------

    async def requeue(self, held: dict[str, str]) -> None:
        """Re-queue the items a closed socket held (id: lease), each under its lease (one
        that lapsed or was answered meanwhile is left as it is). Those that meet the
        database away are made again until it answers (``engine.make_again_later``), so an
        outage does not leave them ``processing`` until their leases end."""
        ops = [
            engine.Requeue(item_id=item_id, lease=lease, cause=engine.WORKER_DISCONNECTED)
            for item_id, lease in held.items()
        ]
        answers = await asyncio.gather(
            *(engine.execute_async(op) for op in ops), return_exceptions=True
        )
        away = []
        for op, answer in zip(ops, answers, strict=True):
            if isinstance(answer, engine.RETRYABLE):
                log.warning("could not re-queue %s after its socket closed: %s", op.item_id, answer)
                away.append(op)
            elif isinstance(answer, BaseException):
                log.error("could not re-queue %s after its socket closed: %s", op.item_id, answer)
        if away:
            engine.make_again_later(away)

    # -- delayed items and the backstop ----------------------------------------------------

    async def _arm_timer(self, queue: str) -> None:
        try:
            due = (await run_sync(engine.next_due, [queue])).get(queue)
        except DatabaseError as exc:
            log.warning("queue %s's next delayed item not found (%s); again soon", queue, exc)
            self._retry_soon(queue)
            return
        if due is not None:
            self._timer_for(queue, due)

    def _retry_soon(self, queue: str) -> None:
        """Look at ``queue`` again shortly, beside (not in place of) its delayed item's timer,
        whose time is not known while the database is away; once per queue at a time, however
        many claims fail meanwhile (each wake may start a claim that fails too)."""
        if queue not in self.retrying:
            self.retrying[queue] = self.loop.call_later(
                CLAIM_RETRY_SECONDS, self._retry_fired, queue
            )

    def _retry_fired(self, queue: str) -> None:
        self.retrying.pop(queue, None)
        self.wake(queue)

    def _timer_for(self, queue: str, due: datetime) -> None:
        # An item already due that the claim passed over (its thread was busy changing) is
        # looked at again shortly, not in a tight loop.
        delay = max(0.05, (due - datetime.now(UTC)).total_seconds() + 0.001)
        at = self.loop.time() + delay
        current = self.timers.get(queue)
        if current is not None and current[0] <= at:
            return
        if current is not None:
            current[1].cancel()
        self.timers[queue] = (at, self.loop.call_at(at, self._timer_fired, queue))

    def _timer_fired(self, queue: str) -> None:
        self.timers.pop(queue, None)
        self.wake(queue)

    async def _backstop(self) -> None:
        while True:
            await asyncio.sleep(get_conf().socket_backstop_seconds)
            try:
                await self.recheck()
            except Exception as exc:
                log.warning("the socket backstop could not look for work: %s", exc)

    def _look_again(self) -> None:
        """A backstop's re-check now, beside the backstop's own (one at a time: asked again
        while one runs, it runs once more after)."""
        if self.looking is not None:
            self.look_again_after = True
            return

        async def look() -> None:
            try:
                await self.recheck()
            except asyncio.CancelledError:
                self.looking = None  # (``stop``: nothing more)
                raise
            except Exception as exc:
                log.warning("could not look for work after news was missed: %s", exc)
            self.looking = None
            if self.look_again_after:
                self.look_again_after = False
                self._look_again()

        self.looking = self.loop.create_task(look())

    async def recheck(self) -> None:
        """Look again, in one query, at every queue a socket has a free slot for: claim for
        those with a due item, arm a timer for the others' next delayed item. And, in one
        more, whether every open socket's key is still live (a revocation whose news was
        lost closes its sockets here). And whether the items they hold still are theirs to
        work on (``_recheck_holds``)."""
        keys = {s.key_id for s in list(self.sockets) if s.key_id is not None}
        if keys:
            live = await run_sync(live_key_ids, keys)
            for socket in list(self.sockets):
                if socket.key_id is not None and socket.key_id not in live:
                    self.loop.create_task(socket.revoked())
        await self._recheck_holds()
        queues = sorted(
            q for q, serving in self.serving.items() if any(self._free(w) > 0 for w in serving)
        )
        if not queues:
            return
        due = await run_sync(engine.next_due, queues)
        now = datetime.now(UTC)
        for queue, at in due.items():
            if at <= now:
                self.wake(queue)
            else:
                self._timer_for(queue, at)

    async def _recheck_holds(self) -> None:
        """Whether what the sockets hold is still theirs to work on: an item deleted, timed
        out or cancelled while its news was lost (a Redis reconnect drops what was published
        meanwhile) is cancelled on its socket here, as the news would have done, so its
        worker stops and its slot is free. One query per 500 items held; none when the
        sockets hold nothing."""
        holds = [
            (worker, item_id, holding)
            for worker in list(self.workers)
            for item_id, holding in list(worker.held.items())
        ]
        if not holds:
            return
        stopped = await run_sync(engine.stopped_holds, [item_id for _w, item_id, _h in holds])
        for worker, item_id, holding in holds:
            reason = stopped.get(item_id)
            # Still held as it was when looked up (not answered, not cancelled by news since).
            if reason is None or worker.held.get(item_id) is not holding:
                continue
            log.info("%s was %s and its news lost: cancelled on its socket", item_id, reason)
            self._stop_held(worker, item_id, reason)
            self.wake_worker(worker)

    # -- gauges for /metrics -------------------------------------------------------------

    def gauges(self) -> dict[tuple[str, str], float]:
        """This process's open sockets, and per queue the items it believes they hold."""
        values: dict[tuple[str, str], float] = {("", "sockets_open"): float(len(self.sockets))}
        for socket in list(self.sockets):
            for holding in list(socket.held.values()):
                key = (holding.queue, "socket_held_items")
                values[key] = values.get(key, 0.0) + 1
        return values

    def registry_entries(self) -> list[registry.Entry]:
        """This process's authenticated open sockets, as the registry lists them. A socket's
        entry is made again only when something it lists moved (its held map's ``version``
        among them); otherwise the last one is given again, which the publisher, once it has
        written that very entry, knows for unchanged at a glance. The reporter asks every
        second: with a thousand idle sockets, making every entry afresh was the largest part
        of the Python daphne ran while idle, in a profile (``docs/performance.md``)."""
        listed: dict[str, tuple[Any, tuple[Any, ...], registry.Entry]] = {}
        entries: list[registry.Entry] = []
        for s in list(self.sockets):
            if s.key_id is None or s.closed:
                continue
            held = s.held
            looks = (
                held.version,
                s.name,
                s.key_id,
                tuple(s.queues),
                s.capacity,
                s.draining,
                s.last_seen_at,
            )
            before = self.listed.get(s.socket_id)
            if before is not None and before[0] is held and before[1] == looks:
                entry = before[2]
            else:
                entry = registry.Entry(
                    id=s.socket_id,
                    name=s.name,
                    key_id=s.key_id,
                    queues=looks[3],
                    capacity=s.capacity,
                    held=tuple(sorted(held)),
                    draining=s.draining,
                    connected_at=s.connected_at,
                    last_seen_at=s.last_seen_at,
                )
            listed[s.socket_id] = (held, looks, entry)
            entries.append(entry)
        self.listed = listed
        return entries

    async def _publish_registry(self) -> None:
        entries = self.registry_entries()
        if entries:
            registry.forget_at_exit()
        try:
            draining = await run_sync(self.publisher.publish, entries, time.monotonic())
        except Exception as exc:
            log.warning("could not publish this process's workers: %s", exc)
            return
        # A drain whose news was lost reaches its socket here.
        for socket in list(self.sockets):
            if socket.socket_id in draining and not socket.draining:
                self.loop.create_task(socket.drain())

    async def _report(self) -> None:
        last: dict[tuple[str, str], float] | None = None
        published = 0.0
        while True:
            await asyncio.sleep(GAUGE_INTERVAL)
            await self._publish_registry()
            values = self.gauges()
            if values == last and time.monotonic() - published < GAUGE_HEARTBEAT:
                continue
            try:
                await run_sync(metrics.publish_gauges, values)
            except Exception as exc:
                log.warning("could not publish socket gauges: %s", exc)
                continue
            last, published = values, time.monotonic()

    def stop(self) -> None:
        events.unsubscribe(self._local_news)
        if self.reporter is not None:
            self.reporter.cancel()
        if self.backstop is not None:
            self.backstop.cancel()
        if self.looking is not None:
            self.looking.cancel()
        for _at, handle in self.timers.values():
            handle.cancel()


def deal_order(wanting: Sequence[W], free: Callable[[W], int], most: int) -> list[W]:
    """The slots one claim is made for, one entry per slot, at most ``most``: round the
    sockets (``wanting``, least recently served first), one free slot of each per round. The
    claim's items fill them in this order, so the items it finds, however few, go one to each
    socket before any socket gets two (three idle sockets and three items: one each, not all
    three to the first while two wait)."""
    left = [(worker, free(worker)) for worker in wanting]
    left = [(worker, n) for worker, n in left if n > 0]
    slots: list[W] = []
    while left and len(slots) < most:
        slots.extend(worker for worker, _n in left[: most - len(slots)])
        left = [(worker, n - 1) for worker, n in left if n > 1]
    return slots


_dispatcher: Dispatcher | None = None


def get_dispatcher() -> Dispatcher:
    """The dispatcher of this process, started on the running loop at first use."""
    global _dispatcher
    loop = asyncio.get_running_loop()
    if _dispatcher is None or _dispatcher.loop is not loop:
        if _dispatcher is not None:
            _dispatcher.stop()
        _dispatcher = Dispatcher(loop)
        _dispatcher.start()
    return _dispatcher
