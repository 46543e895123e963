"""The ``/work`` consumer: translates frames into engine calls and back (SPEC section 6).

It authenticates by the ``Authorization: Token`` header (the work scope; queue limits apply),
keeps what the socket holds (item id -> lease), and leaves the pushing to the process's
dispatcher. A bad frame gets an ``error`` frame and changes nothing.

However a socket ends (a clean close, a dropped connection, the server closing it, an
exception in a frame handler, a send that fails), it is marked ``closed`` at once, so the
dispatcher deals it nothing more and nothing more is sent on it; the frames the worker sent
before it closed are still applied in order (its last results count); then ``_end`` runs
exactly once and re-queues everything the socket still holds. A send never raises out of
the consumer: a socket that cannot be written to is treated as gone.

Work in flight (SPEC section 8.2): each socket has an id and a ``name`` (from ``subscribe``),
which the dispatcher's reporter writes to the registry of workers (``work.registry``) and the
claims record as the holder of each item pushed here; a ``progress`` frame from the holder is
acked like an ``extend``; ``drain`` (an operator's, by news) sends the ``drain`` frame and
takes the socket out of the dispatcher's deals for good, leaving it what it holds.

Frames are answered in order, but not one at a time: each ``result``, ``fail`` or ``extend``
is handed to the engine at once (so one socket's frames share group commits), and its
answer goes into ``outbox``; one task sends the answers in the order the frames came.

Leases on frames. An item can come back to the socket that held it: its lease lapsed (the
sweep re-queued it), the socket's slot was freed (a refused extend), and the item was pushed
here again under a new lease while the first attempt's handler still runs. A ``fail`` or
``extend`` naming only the id would then be applied to the new attempt. So ``result``,
``fail`` and ``extend`` may carry the ``lease`` of the item frame they answer:

- no ``lease``: as ever, the frame answers whatever the socket holds for the item;
- ``fail`` or ``extend`` with another lease than the one held (or for an item not held):
  acked ``accepted: false``, and nothing changes: the held attempt keeps its lease, its slot
  and its item, and the engine is not asked;
- ``result`` with another lease than the one held: still submitted (rule 3: a result is
  accepted while the item is not terminal, whoever sends it; the first wins), but the held
  attempt keeps its slot while the result is applied (its handler still runs). Once the
  verdict is in and the item is terminal (this result won, or it was over already), the
  held attempt is over too: it is dropped, the socket is told ``cancel`` with
  ``reason: "finished"`` and the held ``lease`` (so the worker stops the later attempt, not
  the one that just answered), before the result's ``ack``, and its slot is freed, as for a
  delete. The held attempt's own frames later get ``accepted: false``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections import deque
from collections.abc import Awaitable
from typing import Any, NamedTuple

from channels.exceptions import StopConsumer
from channels.generic.websocket import AsyncWebsocketConsumer

from .. import contract, engine
from ..conf import get_conf
from ..errors import InvalidInput, ItemNotFound, StoreWriteFailed, TaskhosterError, TooLarge
from ..faults import fault, raise_if_armed
from ..ids import is_valid_id
from ..keys import Principal, authenticate, parse_authorization
from ..status import TERMINAL_STATUSES
from ..timeutil import now as utcnow
from ..timeutil import to_wire
from .dispatcher import Dispatcher, get_dispatcher, run_sync

log = logging.getLogger(__name__)

# A socket handles at most this many frames in a row before the event loop runs others.
FAIR_SHARE = 32

# 1011 is the protocol's own code for a server error, but the ASGI server may only send 1000 or
# 3000-4999; like 4401 and 4403 mirror HTTP statuses, 4500 mirrors 500.
CLOSE_SERVER_ERROR = 4500
# The database did not answer a connect's key or a subscribe's queues: try again later (as
# HTTP's 503; WebSocket's own 1013 is not a code this server's protocol library may send).
CLOSE_UNAVAILABLE = 4503
CLOSE_UNAUTHORIZED = 4401
CLOSE_FORBIDDEN = 4403
CLOSE_ABUSE = 4429
ABUSE_WINDOW_SECONDS = 10.0
ABUSE_ERRORS = 100
# A frame's error while the database is away or the state root takes no write
# (``engine.RETRYABLE``; not counted above):
# sent again, a verdict that did commit is refused harmlessly, one that did not is taken.
UNAVAILABLE = "unavailable"
# An answer's key (not sent) naming the code to close the socket with once it is sent.
CLOSES = "closes"


class Held(NamedTuple):
    """An item this socket holds: the lease it was pushed with, its queue, and the size of
    the frame that pushed it (what the socket may still have to read)."""

    lease: str
    queue: str
    queue_id: int
    size: int = 0


class HeldItems(dict[str, Held]):
    """The items a socket holds, by id, with the sum of their frames' sizes kept as they
    come and go (``size``): the dispatcher asks for it before every push, and summing it
    each time would cost a socket of large capacity its whole map per item. Every way of
    changing the map keeps it (copies too), and counts in ``version``: the dispatcher lists a
    socket for the registry again only when its version moved (``registry_entries``)."""

    size = 0
    version = 0

    def __init__(self, *args: Any, **kwargs: Held) -> None:
        super().__init__()
        self.update(*args, **kwargs)

    def __setitem__(self, key: str, value: Held) -> None:
        old = super().get(key)
        super().__setitem__(key, value)
        self.size += value.size - (old.size if old is not None else 0)
        self.version += 1

    def __delitem__(self, key: str) -> None:
        self.size -= self[key].size
        super().__delitem__(key)
        self.version += 1

    def pop(self, key: str, *default: Any) -> Any:
        if key in self:
            value = super().pop(key)
            self.size -= value.size
            self.version += 1
            return value
        return super().pop(key, *default)

    def popitem(self) -> tuple[str, Held]:
        key, value = super().popitem()
        self.size -= value.size
        self.version += 1
        return key, value

    def setdefault(self, key: str, default: Held) -> Held:
        if key not in self:
            self[key] = default
        return self[key]

    def update(self, *args: Any, **kwargs: Held) -> None:
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def __ior__(self, other: Any) -> HeldItems:  # type: ignore[override,misc]
        self.update(other)
        return self

    def copy(self) -> HeldItems:
        return HeldItems(self)

    __copy__ = copy

    def __deepcopy__(self, memo: dict[int, Any]) -> HeldItems:
        return HeldItems(self)  # Held values are immutable

    def __reduce__(self) -> tuple[Any, ...]:
        return (HeldItems, (dict(self),))

    def clear(self) -> None:
        super().clear()
        self.size = 0
        self.version += 1


Answer = Awaitable[dict[str, Any] | None]


def _header(scope: dict[str, Any], name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return None


class WorkConsumer(AsyncWebsocketConsumer):
    """One worker's socket."""

    # This consumer takes no channel-layer messages: news reaches it through the process's
    # dispatcher (``taskhoster.bus``). Not joining the layer also spares every socket a
    # blocking Redis read, which redis-py 8 times out under channels-redis, closing the socket.
    channel_layer_alias = "taskhoster-work-sockets-use-no-layer"

    def _reset(self) -> None:
        self.queues: list[str] = []
        self.capacity = 0
        self.batch = 1  # at most this many items per pushed frame (``subscribe``'s batch)
        self.held = HeldItems()
        self.reserved = 0
        self.last_served = 0.0
        self.closed = False
        self.principal: Principal | None = None
        self.dispatcher: Dispatcher | None = None
        self.errors: list[float] = []
        self.ending: asyncio.Future[None] | None = None
        self.outbox: asyncio.Queue[Answer] = asyncio.Queue()
        # Items this socket was told to cancel: a result for one of them is acked
        # accepted: false (rule 9), not answered with an error for an unknown id.
        self.cancelled: deque[str] = deque(maxlen=1000)
        # Section 8.2: the socket as ``GET /api/workers`` lists it.
        self.socket_id = secrets.token_hex(8)
        self.name = f"socket-{self.socket_id}"  # until ``subscribe`` names it
        self.connected_at = self.last_seen_at = utcnow()
        self.draining = False

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        """Run the consumer; whatever ends it, ``_end`` runs once before it returns.

        A reader task takes the server's messages as they come, so a disconnect is seen at
        once, even while a frame handler is still waiting for the engine; the consumer's
        own loop takes them from ``inbox`` in order.
        """
        self._reset()
        self.dispatcher = get_dispatcher()
        self.dispatcher.socket_opened(self)
        inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        reader = asyncio.ensure_future(self._read(receive, inbox))
        sender = asyncio.ensure_future(self._send_answers())
        try:
            await self._consume(scope, inbox, send)
        except Exception:
            log.exception("the /work consumer failed; closing its socket")
            await self._close(CLOSE_SERVER_ERROR)
        finally:
            reader.cancel()
            await asyncio.shield(self._end())
            sender.cancel()

    async def _consume(self, scope: Any, inbox: asyncio.Queue[dict[str, Any]], send: Any) -> None:
        """What channels' ``AsyncConsumer.__call__`` does for a consumer on no channel layer,
        in a plain loop: each message dispatched in order as it comes (channels waits for
        each one with a new task and an ``asyncio.wait``, which cost the event loop as much
        as the frame's own handling)."""
        self.scope = scope
        self.channel_layer = None  # it takes no channel-layer messages (above)
        self.base_send = send
        handled = 0
        try:
            while True:
                await self.dispatch(await inbox.get())
                handled += 1
                if handled % FAIR_SHARE == 0:
                    # ``inbox.get`` does not yield while frames wait: a socket with many
                    # lets the others' frames in between.
                    await asyncio.sleep(0)
        except StopConsumer:
            pass

    async def _read(self, receive: Any, inbox: asyncio.Queue[dict[str, Any]]) -> None:
        while True:
            message = await receive()
            if message.get("type") == "websocket.disconnect":
                # Gone now, not when the consumer's loop reaches the message: nothing more is
                # dealt to it. Its frames ahead in ``inbox`` are still applied, then ``_end``.
                self._gone()
                inbox.put_nowait(message)
                return
            inbox.put_nowait(message)

    async def dispatch(self, message: dict[str, Any]) -> None:
        # channels closes stale database connections before every message; the engine's
        # calls run on the dispatcher's threads, which look after their own.
        handler = getattr(self, message["type"].replace(".", "_"), None)
        if handler is None:
            raise ValueError(f"no handler for message type {message['type']}")
        await handler(message)

    async def connect(self) -> None:
        secret = parse_authorization(_header(self.scope, b"authorization"))
        try:
            principal = await run_sync(authenticate, secret) if secret else None
        except engine.RETRYABLE as exc:
            await self.accept()
            log.warning(
                "a /work socket's key could not be judged: the database did not answer: %s", exc
            )
            await self._refuse(
                CLOSE_UNAVAILABLE, UNAVAILABLE, "the database did not answer; connect again later"
            )
            return
        await self.accept()
        if principal is None:
            await self._refuse(
                CLOSE_UNAUTHORIZED,
                "unauthorized",
                "send 'Authorization: Token <key>' with a valid key",
            )
            return
        if not principal.has_scope("work"):
            await self._refuse(CLOSE_FORBIDDEN, "forbidden", "this key needs the work scope")
            return
        self.principal = principal

    @property
    def key_id(self) -> int | None:
        """The id of the key this socket authenticated with (None before it has)."""
        return self.principal.key_id if self.principal is not None else None

    async def revoked(self) -> None:
        """Its key was revoked: close the socket (4401); what it holds is re-queued."""
        if not self.closed:
            await self._refuse(CLOSE_UNAUTHORIZED, "unauthorized", "this key was revoked")

    async def _refuse(self, code: int, error: str, message: str) -> None:
        await self._error(error, message)
        await self._close(code)

    async def disconnect(self, code: int) -> None:
        await self._end()

    def _gone(self) -> None:
        """The socket cannot take more: deal it nothing more, send nothing more on it."""
        if not self.closed:
            self.closed = True
            if self.dispatcher is not None:
                self.dispatcher.socket_closed(self)

    def _end(self) -> asyncio.Future[None]:
        """End this socket, once: it is gone, and everything it still holds is re-queued.

        Safe to call any number of times; every call returns the same future.
        """
        if self.ending is None:
            self._gone()
            self.ending = asyncio.ensure_future(self._requeue_held())
        return self.ending

    async def _requeue_held(self) -> None:
        held, self.held = self.held, HeldItems()
        if held and self.dispatcher is not None:
            await self.dispatcher.requeue({i: holding.lease for i, holding in held.items()})

    # -- frames in -------------------------------------------------------------------------

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        if self.principal is None or self.ending is not None:
            return
        self.last_seen_at = utcnow()
        message: dict[str, Any] = {}
        try:
            message = self._parse(text_data, bytes_data)
            kind = message["type"]
            if kind == "subscribe":
                await self._on_subscribe(message)
                return
            answer: Answer = getattr(self, f"_on_{kind}")(message)
        except engine.RETRYABLE as exc:  # (before TaskhosterError: OutcomeUnknown is one)
            answer = _now(self._unavailable(message, exc))
        except TaskhosterError as exc:
            answer = _now(self._error_frame(exc, message.get("id")))
        except Exception:
            answer = _now(self._failed(message))
        self.outbox.put_nowait(self._guarded(answer, message))

    async def _guarded(self, answer: Answer, message: dict[str, Any]) -> dict[str, Any] | None:
        """A frame's answer; an error takes the ack's place (naming the item when it can)."""
        try:
            return await answer
        except engine.RETRYABLE as exc:  # (before TaskhosterError: OutcomeUnknown is one)
            return self._unavailable(message, exc)
        except TaskhosterError as exc:
            return self._error_frame(exc, message.get("id"))
        except Exception:
            return self._failed(message)

    def _error_frame(self, exc: TaskhosterError, item_id: Any) -> dict[str, Any]:
        return error_frame(exc.code, exc.message, item_id)

    def _unavailable(
        self, message: dict[str, Any], exc: Exception, then: str = "send this frame again"
    ) -> dict[str, Any]:
        """The database did not answer (a restart, an outage), or the state root took no
        write (full, read-only): the frame changed nothing, the socket stays open, and the
        worker sends the frame again later (as a REST call gets 503 ``unavailable`` or
        ``store_error``)."""
        what = (
            "the state root could not be written"
            if isinstance(exc, StoreWriteFailed)
            else "the database did not answer"
        )
        log.warning(
            "socket frame %r for item %s: %s: %s", message.get("type"), message.get("id"), what, exc
        )
        return error_frame(UNAVAILABLE, f"{what}; {then}", message.get("id"))

    def _failed(self, message: dict[str, Any]) -> dict[str, Any]:
        """An unexpected exception while handling a frame: log it with the item, and answer
        with an ``internal`` error, after which the sender closes the socket."""
        log.exception(
            "socket frame %r for item %s failed; closing the socket",
            message.get("type"),
            message.get("id"),
        )
        return error_frame("internal", "the server could not handle this frame", message.get("id"))

    async def _send_answers(self) -> None:
        """Send each frame's answer in the order the frames came."""
        while True:
            frame = await (await self.outbox.get())
            if frame is None:
                continue
            if frame["type"] != "error":
                await self._send(frame)
                if frame["type"] == "acks":
                    # An entry's error counts as the error frame a lone result would get.
                    await self._count_errors(
                        sum(
                            "error" in ack and ack["error"]["code"] != UNAVAILABLE
                            for ack in frame["acks"]
                        )
                    )
                continue
            await self._error(frame["code"], frame["message"], item_id=frame.get("id"))
            if frame["code"] == "internal":
                await self._close(CLOSE_SERVER_ERROR)
            elif CLOSES in frame:
                await self._close(frame[CLOSES])

    def _parse(self, text_data: str | None, bytes_data: bytes | None) -> dict[str, Any]:
        if text_data is None:
            raise InvalidInput("send JSON in text frames", code="text_frames_only")
        limit = contract.max_frame_bytes()
        if len(text_data) > limit or len(text_data.encode("utf-8", "surrogatepass")) > limit:
            raise TooLarge(f"a frame is at most {limit} bytes")
        try:
            message = json.loads(text_data)
        except ValueError:
            raise InvalidInput("a frame is one JSON object", code="bad_json") from None
        except RecursionError:
            most = get_conf().max_json_depth
            raise InvalidInput(
                f"the JSON is nested more than {most} levels deep", code="too_deep"
            ) from None
        if not isinstance(message, dict) or not isinstance(message.get("type"), str):
            raise InvalidInput("a frame is a JSON object with a 'type'", code="bad_frame")
        contract.check_depth(text_data, message)
        if contract.holds_lone_surrogate(text_data, message):
            # (Before the fields are checked: a result or progress holding one would fail
            # its size check with an encoding error, a fail's error its whole group.)
            raise InvalidInput(
                "the frame holds a lone surrogate escape (\\ud800-\\udfff without its pair), "
                "which is no Unicode text",
                code="bad_json",
            )
        kind = message["type"]
        if kind not in contract.FRAMES:
            raise InvalidInput(f"unknown frame type {kind!r}", code="unknown_type")
        return contract.validate(contract.FRAMES[kind], message, where=f"{kind}.")

    async def _on_subscribe(self, message: dict[str, Any]) -> None:
        try:
            await self._subscribe(message)
        except engine.RETRYABLE as exc:
            # Nothing to wait on: a subscription whose queues are unknown takes nothing. The
            # socket is closed once this is sent (4503); the worker connects again later.
            frame = self._unavailable(message, exc, "connect again later")
            self.outbox.put_nowait(_now({**frame, CLOSES: CLOSE_UNAVAILABLE}))
        except TaskhosterError as exc:
            self.outbox.put_nowait(_now(self._error_frame(exc, None)))
        except Exception:
            self.outbox.put_nowait(_now(self._failed(message)))

    async def _subscribe(self, message: dict[str, Any]) -> None:
        queues, capacity = message["queues"], message["capacity"]
        assert self.principal is not None
        refused = [q for q in queues if not self.principal.may_use(q)]
        if refused:
            raise InvalidInput(f"this key may not use {', '.join(refused)}", code="forbidden")
        unique = list(dict.fromkeys(queues))
        existing = set(await run_sync(_live_queue_names, unique))
        raise_if_armed("socket.subscribe")
        missing = [q for q in unique if q not in existing]
        if missing:
            raise InvalidInput(f"no such queue: {', '.join(missing)}", code="queue_not_found")
        if self.closed:
            return
        self.queues, self.capacity = unique, capacity
        self.batch = message.get("batch") or 1
        if message.get("name"):
            self.name = message["name"]
        assert self.dispatcher is not None
        self.dispatcher.register(self)

    def _stale(self, message: dict[str, Any], holding: Held | None) -> bool:
        """The frame names a lease, and it is not the one this socket holds for the item: it
        answers an earlier attempt (one whose lease lapsed before the item came back here)."""
        lease = message.get("lease")
        return lease is not None and holding is not None and lease != holding.lease

    def _on_result(self, message: dict[str, Any]) -> Answer:
        (answer,) = self._submit_results([message])
        return answer

    def _on_results(self, message: dict[str, Any]) -> Answer:
        """Several results in one frame (``results``), each handled as its own ``result``
        frame would be, in order, handed to the committer together; their slots are claimed
        for together, and one ``acks`` frame answers them all, in the same order."""
        entries = message["results"]
        return self._acks(entries, self._submit_results(entries))

    def _submit_results(self, entries: list[dict[str, Any]]) -> list[Answer]:
        """Hand these results to the committer at once, free the slots of the attempts they
        answer, and return each one's ack (to come)."""
        assert self.principal is not None
        held = [self.held.get(entry["id"]) for entry in entries]
        # The key's queue limits hold for every frame that names an item: a result for an
        # item of a queue it may not use is not found (checked by the group, with the row).
        verdicts = engine.submit_many_async(
            [
                engine.Result(
                    item_id=entry["id"],
                    result=entry["result"],
                    queues=self.principal.queues,
                    with_row=False,  # the ack says the verdict alone
                )
                for entry in entries
            ]
        )
        answers: list[Answer] = []
        freed = False
        for entry, holding, verdict in zip(entries, held, verdicts, strict=True):
            # Should the acks not be awaited to the end (an unexpected error closes the
            # socket), a verdict's error is not left unretrieved.
            verdict.add_done_callback(_retrieve)
            item_id = entry["id"]
            if self._stale(entry, holding):
                # An earlier attempt's result: still submitted (rule 3), but the attempt
                # this socket holds keeps its slot until the verdict says the item is over.
                answers.append(self._result_ack(item_id, verdict, still_held=holding))
                continue
            # Free the slot at once, so the verdict's own news is not taken for a cancel, and
            # so the claim for the freed slot can join the same group as this result.
            self.held.pop(item_id, None)
            freed = True
            if holding is not None:
                self._on_settled(item_id, holding, verdict)
            answers.append(self._result_ack(item_id, verdict))
        if freed:
            self._slot_freed()
        return answers

    async def _acks(self, entries: list[dict[str, Any]], answers: list[Answer]) -> dict[str, Any]:
        """The ``acks`` frame of a ``results`` frame: each entry's ack, or, where a lone
        ``result`` would have been answered with an ``error`` frame, ``accepted: false`` with
        that error."""
        acks: list[dict[str, Any]] = []
        try:
            for entry, answer in zip(entries, answers, strict=True):
                try:
                    ack = await answer
                except engine.RETRYABLE as exc:  # (first: OutcomeUnknown is a TaskhosterError)
                    # This entry's group met the database away; the others' may have
                    # committed: each says its own.
                    error = self._unavailable({"type": "result", "id": entry["id"]}, exc)
                    ack = {
                        "id": entry["id"],
                        "accepted": False,
                        "error": {"code": error["code"], "message": error["message"]},
                    }
                except TaskhosterError as exc:
                    ack = {
                        "id": entry["id"],
                        "accepted": False,
                        "error": {"code": exc.code, "message": exc.message},
                    }
                else:
                    assert ack is not None
                    del ack["type"]
                acks.append(ack)
        finally:
            for answer in answers[len(acks) + 1 :]:
                _forget(answer)
        return {"type": "acks", "acks": acks}

    async def _result_ack(
        self,
        item_id: str,
        verdict: Awaitable[engine.Verdict],
        *,
        still_held: Held | None = None,
    ) -> dict[str, Any]:
        """The ack of a result. ``still_held``: the later attempt this socket holds when the
        result came from an earlier one; if the item is over now (this result won, or it was
        already terminal), so is that attempt: it is cancelled (with its lease) before the
        ack, and its slot freed. (The attempt a result answers, let go of when it came, is
        held again if the verdict met the database away or a read-only state root:
        ``_on_settled``.)"""
        try:
            # Shielded: the socket's end cancels the task sending its answers, and the
            # verdict's outcome is still wanted (``_on_settled``).
            answer = await asyncio.shield(verdict)
        except ItemNotFound:
            if item_id not in self.cancelled:
                raise
            return {"type": "ack", "id": item_id, "accepted": False}
        if (
            still_held is not None
            and answer.status in TERMINAL_STATUSES
            and self.held.get(item_id) == still_held
        ):
            del self.held[item_id]
            await self.cancel(item_id, "finished", lease=still_held.lease)
            self._slot_freed()
        raise_if_armed("socket.result")
        return {"type": "ack", "id": item_id, "accepted": answer.accepted, "status": answer.status}

    def _on_settled(self, item_id: str, holding: Held, verdict: asyncio.Future[Any]) -> None:
        """Once a verdict this socket handed on (letting go of its item when it came) has
        settled: if it met the database away or the state root refusing writes, it changed
        nothing (or may have), and the attempt is this socket's again, for the worker's
        frame sent again ("unavailable"), which finds it held; or, the socket having ended
        meanwhile, the item is re-queued under its lease, again until that can be done
        (``engine.make_again_later``). Run when the verdict settles, not by its ack, which
        may wait behind earlier answers, or never be sent (the socket closed): an item
        re-held after its socket's end stayed ``processing`` until its lease ended."""

        def settled(future: asyncio.Future[Any]) -> None:
            if future.cancelled() or not isinstance(future.exception(), engine.RETRYABLE):
                return
            if self.ending is None:
                self.held.setdefault(item_id, holding)
                return
            engine.make_again_later(
                [
                    engine.Requeue(
                        item_id=item_id, lease=holding.lease, cause=engine.WORKER_DISCONNECTED
                    )
                ]
            )

        verdict.add_done_callback(settled)

    def _on_fail(self, message: dict[str, Any]) -> Answer:
        item_id = message["id"]
        error, retry = message.get("error"), message["retry"]
        holding = self.held.get(item_id)
        if holding is None or self._stale(message, holding):
            return _now({"type": "ack", "id": item_id, "accepted": False})
        verdict = engine.submit_async(
            engine.Fail(
                item_id=item_id, lease=holding.lease, error=error, retry=retry, with_row=False
            )
        )
        # Handed on (a committer that cannot take it raises above, and the item stays held):
        # its slot is free now, before the verdict's own news could come back on this loop.
        del self.held[item_id]
        self._slot_freed()
        self._on_settled(item_id, holding, verdict)
        return self._fail_ack(item_id, verdict)

    async def _fail_ack(self, item_id: str, verdict: Awaitable[engine.Verdict]) -> dict[str, Any]:
        answer = await asyncio.shield(verdict)  # (as a result's: ``_result_ack``)
        raise_if_armed("socket.fail")
        return {"type": "ack", "id": item_id, "accepted": answer.accepted, "status": answer.status}

    def _on_extend(self, message: dict[str, Any]) -> Answer:
        item_id, seconds = message["id"], message.get("seconds")
        holding = self.held.get(item_id)
        if holding is None or self._stale(message, holding):
            return _now({"type": "ack", "id": item_id, "accepted": False})
        extended = engine.submit_async(
            engine.Extend(item_id=item_id, lease=holding.lease, seconds=seconds)
        )
        return self._extend_ack(item_id, holding, extended)

    async def _extend_ack(
        self, item_id: str, holding: Held, extended: Awaitable[tuple[bool, engine.ItemRow]]
    ) -> dict[str, Any]:
        accepted, row = await extended
        if not accepted and self.held.get(item_id) == holding:
            del self.held[item_id]  # the lease lapsed and was re-queued: not ours now
            self._slot_freed()
        raise_if_armed("socket.extend")
        return {
            "type": "ack",
            "id": item_id,
            "accepted": accepted,
            "leaseExpiresAt": to_wire(row.lease_expires_at) if accepted else None,
        }

    def _on_progress(self, message: dict[str, Any]) -> Answer:
        item_id = message["id"]
        holding = self.held.get(item_id)
        if holding is None or self._stale(message, holding):
            return _now({"type": "ack", "id": item_id, "accepted": False})
        reported = engine.submit_async(
            engine.Progress(item_id=item_id, lease=holding.lease, progress=message["progress"])
        )
        return self._progress_ack(item_id, reported)

    async def _progress_ack(
        self, item_id: str, reported: Awaitable[tuple[bool, engine.ItemRow]]
    ) -> dict[str, Any]:
        try:
            accepted, _row = await reported
        except ItemNotFound:
            accepted = False  # deleted meanwhile
        return {"type": "ack", "id": item_id, "accepted": accepted}

    async def drain(self) -> None:
        """Section 8.2: nothing more is pushed to this socket; it is told so, and keeps what
        it holds until it answers (a worker then closes)."""
        if self.draining or self.closed:
            return
        self.draining = True
        await self._send({"type": "drain"})

    def _slot_freed(self) -> None:
        if self.dispatcher is not None and not self.closed:
            self.dispatcher.wake_worker(self)

    # -- frames out ------------------------------------------------------------------------

    async def deliver(self, claimed: engine.Claimed) -> bool:
        """Push a claimed item; False if it did not go out (the socket is gone): the caller
        then gives the item back without counting the attempt."""
        row = claimed.row
        if self.closed or row.lease is None:
            return False
        frame = {"type": "item", **engine.item_json(row, payload=claimed.payload, lease=row.lease)}
        text = json.dumps(frame, separators=(",", ":"))
        self.held[row.id] = Held(row.lease, row.queue_name, row.queue_id, len(text))
        if not await self._send(frame, text=text):
            self.held.pop(row.id, None)
            return False
        return True

    async def deliver_many(self, claimed: list[engine.Claimed]) -> list[engine.Claimed]:
        """Push several claimed items, in ``items`` frames of at most ``batch`` items and
        of at most a frame's bytes (a larger item goes alone), while the socket holds less
        than ``MAX_SOCKET_HELD_BYTES`` of frames (as ``Dispatcher._free`` asks before each
        lone push). The items that did not go out (the socket is gone, drained or full) are
        returned, for the caller to give back."""
        most = contract.max_frame_bytes() - len(_ITEMS_FRAME_WRAPPER)
        full = get_conf().max_socket_held_bytes
        runs: list[list[tuple[engine.Claimed, str]]] = []
        size = 0
        taken = self.held.size  # what it holds, and what the runs so far will add
        unsent: list[engine.Claimed] = []
        for n, item in enumerate(claimed):
            row = item.row
            if row.lease is None or (taken >= full and (self.held or runs)):
                unsent.extend(claimed[n:])
                break
            text = json.dumps(
                engine.item_json(row, payload=item.payload, lease=row.lease),
                separators=(",", ":"),
            )
            if not runs or len(runs[-1]) >= self.batch or size + len(text) > most:
                runs.append([])
                size = 0
            runs[-1].append((item, text))
            size += len(text) + 1
            taken += len(text)
        for n, run in enumerate(runs):
            if self.closed or self.draining:
                unsent[:0] = [item for later in runs[n:] for item, _text in later]
                break
            for item, text in run:
                row = item.row
                self.held[row.id] = Held(row.lease or "", row.queue_name, row.queue_id, len(text))
            if len(run) == 1:
                frame_text = '{"type":"item",' + run[0][1][1:]
                kind = "item"
            else:
                frame_text = _ITEMS_FRAME_WRAPPER.replace("]", ",".join(t for _i, t in run) + "]")
                kind = "items"
            if not await self._send({"type": kind}, text=frame_text):
                for item, _text in run:
                    self.held.pop(item.row.id, None)
                unsent[:0] = [item for later in runs[n:] for item, _text in later]
                break
        return unsent

    @property
    def held_bytes(self) -> int:
        """The frames of the items this socket holds, in bytes: what it may not have read
        yet. The dispatcher pushes nothing more past ``MAX_SOCKET_HELD_BYTES``, so a worker
        that never reads costs the server that much, not capacity x the largest payload."""
        return self.held.size

    async def cancel(self, item_id: str, reason: str, *, lease: str | None = None) -> None:
        self.cancelled.append(item_id)
        frame = {"type": "cancel", "id": item_id, "reason": reason}
        if lease is not None:
            frame["lease"] = lease
        await self._send(frame)

    async def _error(self, code: str, message: str, *, item_id: Any = None) -> None:
        await self._send(error_frame(code, message, item_id))
        if code != UNAVAILABLE:  # the server's database away is not the worker's doing
            await self._count_errors(1)

    async def _count_errors(self, count: int) -> None:
        """``count`` more errors told to this socket: past ABUSE_ERRORS within the window,
        it is closed (4429)."""
        if not count:
            return
        now = time.monotonic()
        self.errors = [t for t in self.errors if now - t < ABUSE_WINDOW_SECONDS] + [now] * count
        if len(self.errors) > ABUSE_ERRORS:
            await self._close(CLOSE_ABUSE)

    async def _send(self, frame: dict[str, Any], *, text: str | None = None) -> bool:
        """Send one frame; False (and the socket ended) if it could not be sent.

        A worker that closes while the server answers one of its frames makes the send fail
        inside the closing handshake; that must end the socket, never the consumer.
        """
        if self.closed:
            return False
        try:
            if fault(f"socket.send.{frame['type']}"):
                # Start the closing handshake first: the send below then fails as it does
                # when a worker closes while the server is answering it.
                await self.base_send({"type": "websocket.close", "code": 1000})
            await self.send(text_data=text or json.dumps(frame, separators=(",", ":")))
        except Exception as exc:
            # The closing handshake has begun (or the transport failed): its disconnect
            # follows and ends the socket; until then it takes nothing more.
            log.info("a %s frame could not be sent (%s); the socket is gone", frame["type"], exc)
            self._gone()
            return False
        return True

    async def _close(self, code: int) -> None:
        """Close the socket (if it is not closing already); its disconnect then ends it."""
        if not self.closed:
            self._gone()
            try:
                await self.close(code=code)
            except Exception as exc:
                log.warning("could not close a socket cleanly: %s", exc)


def _now(frame: dict[str, Any]) -> Answer:
    """An answer already known."""
    done: asyncio.Future[dict[str, Any] | None] = asyncio.get_running_loop().create_future()
    done.set_result(frame)
    return done


# An items frame around its entries (the entries go between the brackets).
_ITEMS_FRAME_WRAPPER = '{"type":"items","items":[]}'


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


def _forget(answer: Answer) -> None:
    """An answer no one will await: a coroutine is closed, a future's error retrieved."""
    if asyncio.iscoroutine(answer):
        answer.close()
    elif isinstance(answer, asyncio.Future):
        answer.add_done_callback(_retrieve)


def _live_queue_names(names: list[str]) -> list[str]:
    return engine.live_queue_names(names)


def error_frame(code: str, message: str, item_id: Any = None) -> dict[str, Any]:
    """The socket's one error frame (SPEC section 6): ``{"type": "error", "code", "message"}``,
    naming the item when the frame that caused it named a valid one."""
    frame = {"type": "error", "code": code, "message": message}
    if is_valid_id(item_id):
        frame["id"] = item_id
    return frame
