"""The ``/work`` consumer: translates frames into engine calls and back (SPEC section 6).

It authenticates by the ``Authorization: Token`` header (the work scope; queue limits apply),
keeps what the socket holds (item id -> lease), and leaves the pushing to the process's
dispatcher. A bad frame gets an ``error`` frame and changes nothing; closing the socket, in
any way, re-queues at once everything it still holds.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from typing import Any

from channels.generic.websocket import AsyncWebsocketConsumer

from .. import engine
from ..conf import get_conf
from ..errors import InvalidInput, ItemNotFound, TaskhosterError, TooLarge
from ..ids import is_valid_id
from ..keys import Principal, authenticate, parse_authorization
from ..models import Queue
from ..store import QUEUE_NAME_PATTERN
from ..timeutil import to_wire
from .dispatcher import Dispatcher, get_dispatcher, run_sync

log = logging.getLogger(__name__)

CLOSE_UNAUTHORIZED = 4401
CLOSE_FORBIDDEN = 4403
CLOSE_ABUSE = 4429
ABUSE_WINDOW_SECONDS = 10.0
ABUSE_ERRORS = 100
MAX_SUBSCRIBED_QUEUES = 100

FIELDS = {
    "subscribe": ({"type", "queues", "capacity"}, {"type", "queues", "capacity"}),
    "result": ({"type", "id", "result"}, {"type", "id", "result"}),
    "fail": ({"type", "id"}, {"type", "id", "error", "retry"}),
    "extend": ({"type", "id"}, {"type", "id", "seconds"}),
}


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

    async def connect(self) -> None:
        self.queues: list[str] = []
        self.capacity = 0
        self.held: dict[str, str] = {}
        self.reserved = 0
        self.last_served = 0.0
        self.closed = False
        self.principal: Principal | None = None
        self.dispatcher: Dispatcher | None = None
        self.errors: list[float] = []
        # Items this socket was told to cancel: a result for one of them is acked
        # accepted: false (rule 9), not answered with an error for an unknown id.
        self.cancelled: deque[str] = deque(maxlen=1000)
        secret = parse_authorization(_header(self.scope, b"authorization"))
        principal = await run_sync(authenticate, secret) if secret else None
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

    async def _refuse(self, code: int, error: str, message: str) -> None:
        self.closed = True
        await self._error(error, message)
        await self.close(code=code)

    async def disconnect(self, code: int) -> None:
        self.closed = True
        if self.dispatcher is not None:
            self.dispatcher.unregister(self)
        held, self.held = self.held, {}
        for item_id, lease in held.items():
            try:
                await run_sync(
                    engine.requeue_held,
                    item_id=item_id,
                    lease=lease,
                    cause=engine.WORKER_DISCONNECTED,
                )
            except Exception:
                log.exception("could not re-queue %s after its socket closed", item_id)

    # -- frames in -------------------------------------------------------------------------

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        if self.principal is None or self.closed:
            return
        message: dict[str, Any] = {}
        try:
            message = self._parse(text_data, bytes_data)
            kind = message["type"]
            await getattr(self, f"_on_{kind}")(message)
        except TaskhosterError as exc:
            # An error answers its frame in the ack's place; it names the item when it can.
            item_id = message.get("id") if isinstance(message, dict) else None
            await self._error(exc.code, exc.message, item_id=item_id)

    def _parse(self, text_data: str | None, bytes_data: bytes | None) -> dict[str, Any]:
        if text_data is None:
            raise InvalidInput("send JSON in text frames", code="text_frames_only")
        limit = get_conf().max_payload_bytes + 64 * 1024
        if len(text_data) > limit or len(text_data.encode("utf-8", "surrogatepass")) > limit:
            raise TooLarge(f"a frame is at most {limit} bytes")
        try:
            message = json.loads(text_data)
        except (ValueError, RecursionError):
            raise InvalidInput("a frame is one JSON object", code="bad_json") from None
        if not isinstance(message, dict) or not isinstance(message.get("type"), str):
            raise InvalidInput("a frame is a JSON object with a 'type'", code="bad_frame")
        kind = message["type"]
        if kind not in FIELDS:
            raise InvalidInput(f"unknown frame type {kind!r}", code="unknown_type")
        required, allowed = FIELDS[kind]
        missing = sorted(required - set(message))
        unknown = sorted(set(message) - allowed)
        if missing:
            raise InvalidInput(f"{kind} needs {', '.join(missing)}", code="missing_field")
        if unknown:
            raise InvalidInput(f"unknown field(s) {', '.join(unknown)}", code="unknown_field")
        if "id" in message and not is_valid_id(message["id"]):
            raise InvalidInput("id must be an item id", code="invalid_id")
        return message

    async def _on_subscribe(self, message: dict[str, Any]) -> None:
        queues, capacity = message["queues"], message["capacity"]
        if (
            not isinstance(queues, list)
            or not 1 <= len(queues) <= MAX_SUBSCRIBED_QUEUES
            or not all(isinstance(q, str) and QUEUE_NAME_PATTERN.fullmatch(q) for q in queues)
        ):
            raise InvalidInput(
                f"queues must be 1-{MAX_SUBSCRIBED_QUEUES} queue names", code="invalid_queues"
            )
        max_capacity = get_conf().max_capacity
        if (
            isinstance(capacity, bool)
            or not isinstance(capacity, int)
            or not 0 <= capacity <= max_capacity
        ):
            raise InvalidInput(
                f"capacity must be an integer 0..{max_capacity}", code="invalid_capacity"
            )
        assert self.principal is not None
        refused = [q for q in queues if not self.principal.may_use(q)]
        if refused:
            raise InvalidInput(f"this key may not use {', '.join(refused)}", code="forbidden")
        unique = list(dict.fromkeys(queues))
        existing = set(await run_sync(_live_queue_names, unique))
        missing = [q for q in unique if q not in existing]
        if missing:
            raise InvalidInput(f"no such queue: {', '.join(missing)}", code="queue_not_found")
        self.queues, self.capacity = unique, capacity
        if self.dispatcher is None:
            self.dispatcher = get_dispatcher()
            self.dispatcher.register(self)
        else:
            self.dispatcher.wake_worker(self)

    async def _on_result(self, message: dict[str, Any]) -> None:
        item_id = message["id"]
        _check_size(message["result"], "result")
        # Free the slot first, so the verdict's own news is not taken for a cancel.
        self.held.pop(item_id, None)
        try:
            verdict = await run_sync(
                engine.submit_result, item_id=item_id, result=message["result"]
            )
        except ItemNotFound:
            if item_id not in self.cancelled:
                raise
            await self._send({"type": "ack", "id": item_id, "accepted": False})
            return
        finally:
            self._slot_freed()
        await self._send(
            {"type": "ack", "id": item_id, "accepted": verdict.accepted, "status": verdict.status}
        )

    async def _on_fail(self, message: dict[str, Any]) -> None:
        item_id = message["id"]
        error, retry = message.get("error"), message.get("retry", True)
        if error is not None and (not isinstance(error, str) or len(error) > 10_000):
            raise InvalidInput(
                "error must be a string of at most 10000 characters", code="invalid_error"
            )
        if not isinstance(retry, bool):
            raise InvalidInput("retry must be true or false", code="invalid_retry")
        lease = self.held.get(item_id)
        if lease is None:
            await self._send({"type": "ack", "id": item_id, "accepted": False})
            return
        self.held.pop(item_id, None)
        try:
            verdict = await run_sync(
                engine.fail, item_id=item_id, lease=lease, error=error, retry=retry
            )
        except ItemNotFound:
            self._slot_freed()
            raise
        self._slot_freed()
        await self._send(
            {"type": "ack", "id": item_id, "accepted": verdict.accepted, "status": verdict.status}
        )

    async def _on_extend(self, message: dict[str, Any]) -> None:
        item_id, seconds = message["id"], message.get("seconds")
        if seconds is not None and (
            isinstance(seconds, bool) or not isinstance(seconds, int | float) or seconds <= 0
        ):
            raise InvalidInput("seconds must be a positive number", code="invalid_seconds")
        lease = self.held.get(item_id)
        if lease is None:
            await self._send({"type": "ack", "id": item_id, "accepted": False})
            return
        accepted, row = await run_sync(engine.extend, item_id=item_id, lease=lease, seconds=seconds)
        if not accepted:
            self.held.pop(item_id, None)  # the lease lapsed and was re-queued: not ours now
            self._slot_freed()
        await self._send(
            {
                "type": "ack",
                "id": item_id,
                "accepted": accepted,
                "leaseExpiresAt": to_wire(row.lease_expires_at) if accepted else None,
            }
        )

    def _slot_freed(self) -> None:
        if self.dispatcher is not None:
            self.dispatcher.wake_worker(self)

    # -- frames out ------------------------------------------------------------------------

    async def deliver(self, claimed: engine.Claimed) -> bool:
        """Push a claimed item; False if this socket can no longer take it."""
        row = claimed.row
        if self.closed or row.lease is None:
            return False
        self.held[row.id] = row.lease
        try:
            await self._send(
                {
                    "type": "item",
                    "id": row.id,
                    "queue": self.queue_name_of(claimed),
                    "payload": claimed.payload,
                    "attempts": row.attempts,
                    "threadId": row.thread_id,
                    "scheduledAt": to_wire(row.scheduled_at),
                    "leaseExpiresAt": to_wire(row.lease_expires_at),
                    "lease": row.lease,
                }
            )
        except Exception:
            self.held.pop(row.id, None)
            return False
        return True

    @staticmethod
    def queue_name_of(claimed: engine.Claimed) -> str:
        return claimed.row.queue.name

    async def cancel(self, item_id: str, reason: str) -> None:
        self.cancelled.append(item_id)
        if not self.closed:
            await self._send({"type": "cancel", "id": item_id, "reason": reason})

    async def _error(self, code: str, message: str, *, item_id: str | None = None) -> None:
        frame = {"type": "error", "code": code, "message": message}
        if item_id is not None and is_valid_id(item_id):
            frame["id"] = item_id
        await self._send(frame)
        now = time.monotonic()
        self.errors = [t for t in self.errors if now - t < ABUSE_WINDOW_SECONDS] + [now]
        if len(self.errors) > ABUSE_ERRORS and not self.closed:
            self.closed = True
            await self.close(code=CLOSE_ABUSE)

    async def _send(self, frame: dict[str, Any]) -> None:
        await self.send(text_data=json.dumps(frame, separators=(",", ":")))


def _live_queue_names(names: list[str]) -> list[str]:
    return list(Queue.objects.filter(name__in=names, deleting=False).values_list("name", flat=True))


def _check_size(value: Any, what: str) -> None:
    limit = get_conf().max_payload_bytes
    size = len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())
    if size > limit:
        raise TooLarge(f"{what} is {size} bytes of JSON; the limit is {limit}")
