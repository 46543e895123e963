"""REST endpoints (SPEC section 5). Each view checks scope, validates, calls the engine."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

from django.http import HttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiResponse
from rest_framework import exceptions, status
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response

from .. import contract, engine, events, health, metrics
from ..conf import get_conf
from ..errors import InvalidInput, ItemNotFound, WorkerNotFound
from ..keys import authenticate, parse_authorization
from ..models import Queue
from ..status import Status
from ..timeutil import now as utcnow
from ..timeutil import to_wire
from ..work import registry
from . import loop_posts
from . import params as params_
from .auth import principal_of, require
from .base import ApiView
from .cursors import decode_cursor, encode_cursor
from .schema import (
    AUTH_ERRORS,
    ITEM_ERRORS,
    QUEUE_ERRORS,
    STORE_ERRORS,
    WORKER_ERRORS,
    annotate,
    cursor_param,
    documented,
    error_responses,
    item_param,
    limit_param,
    merge_errors,
    queue_param,
    status_param,
    thread_filter_param,
    wait_param,
    worker_param,
)


class Waits:
    """The long-polls each key has waiting in this process, capped at MAX_WAITS_PER_KEY: a
    key's requests beyond it are answered at once, as with no ``wait`` (each waiting
    long-poll holds a request thread)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_key: dict[int, int] = {}

    @contextlib.contextmanager
    def hold(self, key_id: int) -> Iterator[bool]:
        """Yields whether this key may wait now."""
        with self.lock:
            allowed = self.by_key.get(key_id, 0) < get_conf().max_waits_per_key
            if allowed:
                self.by_key[key_id] = self.by_key.get(key_id, 0) + 1
        try:
            yield allowed
        finally:
            if allowed:
                with self.lock:
                    left = self.by_key[key_id] - 1
                    if left:
                        self.by_key[key_id] = left
                    else:
                        del self.by_key[key_id]


waits = Waits()


def _queue_or_404(name: str) -> Queue:
    engine.validate_queue_name(name)
    return engine.get_live_queue(name)


def _queue_wire(queue: Queue, counts: dict[str, int]) -> dict[str, Any]:
    return {"name": queue.name, **engine.queue_settings(queue), "counts": counts}


def _item_queue_name(item_id: str) -> str:
    name = engine.item_queue(item_id)
    if name is None:
        raise ItemNotFound(f"item {item_id!r} does not exist")
    return name


def require_item(request: Request, item_id: str, *scopes: str) -> str:
    """The item's queue, if the caller has one of ``scopes`` (else 403) and its key may use
    that queue. An item of a queue the key may not use is not found (404, as a missing one):
    a 403 would tell a key limited to some queues which ids exist elsewhere."""
    principal = require(request, *scopes)
    name = _item_queue_name(item_id)
    if not principal.may_use(name):
        raise ItemNotFound(f"item {item_id!r} does not exist")
    return name


class QueueListView(ApiView):
    @documented("listQueues", summary="List queues", scopes=(), responses={200: "QueueList"})
    def get(self, request: Request) -> Response:
        principal = require(request)
        queues = [q for q in engine.live_queues() if principal.may_use(q.name)]
        counts = engine.counts_by_queue([q.id for q in queues])
        return Response([_queue_wire(q, counts[q.id]) for q in queues])


class QueueView(ApiView):
    @documented(
        "getQueue",
        summary="Get a queue",
        parameters=[queue_param()],
        responses={200: "Queue"},
        errors=QUEUE_ERRORS,
    )
    def get(self, request: Request, queue: str) -> Response:
        require(request, queue=queue)
        q = _queue_or_404(queue)
        wire = _queue_wire(q, engine.counts_by_queue([q.id])[q.id])
        wire["held"] = engine.held_for(q.name).wire()
        return Response(wire)

    @documented(
        "putQueue",
        summary="Create or update a queue",
        scopes=("manage",),
        parameters=[queue_param()],
        request="QueueSettings",
        responses={200: "Queue", 201: "Queue"},
        errors=merge_errors({400: ["invalid_queue_name", "invalid_setting"]}, STORE_ERRORS),
        body=True,
    )
    def put(self, request: Request, queue: str) -> Response:
        principal = require(request, "manage", queue=queue)
        body = request.data
        if not isinstance(body, dict):
            raise InvalidInput("the body must be a JSON object of settings", code="invalid_body")
        target = body.get("deadLetterQueue")
        if isinstance(target, str) and not principal.may_use(target):
            # Dead letters are posts into that queue: setting it needs the right to use it.
            raise exceptions.PermissionDenied(
                f"this key may not use queue {target!r}, so it may not make it the dead-letter "
                "queue"
            )
        q, created = engine.upsert_queue(name=queue, body=body)
        wire = _queue_wire(q, engine.counts_by_queue([q.id])[q.id])
        return Response(wire, status=status.HTTP_201_CREATED if created else status.HTTP_200_OK)

    @documented(
        "deleteQueue",
        summary="Delete a queue and all its items",
        scopes=("manage",),
        parameters=[queue_param()],
        responses={204: None},
        errors=merge_errors(QUEUE_ERRORS, STORE_ERRORS),
    )
    def delete(self, request: Request, queue: str) -> Response:
        require(request, "manage", queue=queue)
        engine.validate_queue_name(queue)
        engine.delete_queue(queue_name=queue)
        return Response(status=status.HTTP_204_NO_CONTENT)


def _item_cursor(cursor: str | None) -> str | None:
    position = decode_cursor(cursor)
    return None if position is None else params_.item_id(position)


class QueueItemsView(ApiView):
    # A post may be answered on the handler's event loop (taskhoster.asgi reads this), the
    # engine's group checking the key with the rest of its work: api/loop_posts.py.
    loop_methods = frozenset({"post"})

    @documented(
        "listItems",
        summary="List items (no payloads)",
        scopes=("produce", "manage"),
        parameters=[
            queue_param(),
            status_param(),
            thread_filter_param(),
            cursor_param(),
            limit_param(),
        ],
        responses={200: "ItemPage"},
        errors=merge_errors(
            QUEUE_ERRORS,
            {400: ["invalid_status", "invalid_limit", "invalid_thread_id", "invalid_cursor"]},
        ),
    )
    def get(self, request: Request, queue: str) -> Response:
        require(request, "produce", "manage", queue=queue)
        q = _queue_or_404(queue)
        params = request.query_params
        status_filter = params_.choice(params, "status", {s.value for s in Status})
        limit = params_.limit(params)
        thread_id = params_.thread_id(params.get("threadId"))
        rows, last = engine.list_items(
            queue=q,
            status=Status(status_filter) if status_filter else None,
            thread_id=thread_id,
            after=_item_cursor(params.get("cursor")),
            limit=limit,
        )
        return Response(
            {
                "items": [engine.item_json(r, queue_name=q.name) for r in rows],
                "next": encode_cursor(last),
            }
        )

    @documented(
        "postItems",
        summary="Post one item, or {items: [...]} (all or none)",
        scopes=("produce",),
        parameters=[queue_param()],
        request="PostItems",
        responses={201: "Posted", 200: "Item"},
        errors=merge_errors(
            QUEUE_ERRORS,
            {
                400: ["invalid"],
                409: ["busy", "scheduled_beyond_timeout"],
                413: ["batch_too_large"],
                503: ["overloaded", "store_error"],
            },
        ),
        body=True,
    )
    def post(self, request: Request, queue: str) -> HttpResponse:
        def new_items() -> list[engine.NewItem]:
            engine.validate_queue_name(queue)  # the group answers 404 for a missing one
            return engine.new_items(request.data)

        def answer(posted: list[engine.Posted]) -> Response:
            # A repeated key answers its item as GET shows it, result included.
            wires = [engine.item_json(p.row, payload=p.payload, result=p.result) for p in posted]
            body = request.data  # parsed by new_items
            if isinstance(body, dict) and "items" in body:
                return Response({"items": wires}, status=status.HTTP_201_CREATED)
            code = status.HTTP_201_CREATED if posted[0].created else status.HTTP_200_OK
            return Response(wires[0], status=code)

        if loop_posts.on_the_loop(request):  # the key is left to the engine's group
            return loop_posts.post_later(self, request, queue, new_items, answer)
        engine.admit_post()  # overloaded: 503 at once, before any other work
        require(request, "produce", queue=queue)
        return answer(engine.post_items(queue_name=queue, items=new_items()))


class BulkDeleteView(ApiView):
    @documented(
        "deleteItems",
        summary="Delete items by id or by status",
        scopes=("manage",),
        parameters=[queue_param()],
        request="BulkDelete",
        responses={200: "Deleted"},
        errors=merge_errors(QUEUE_ERRORS, {400: ["invalid_id", "invalid"]}, STORE_ERRORS),
        body=True,
    )
    def post(self, request: Request, queue: str) -> Response:
        require(request, "manage", queue=queue)
        q = _queue_or_404(queue)
        body = contract.validate(contract.BULK_DELETE, request.data)
        if "ids" in body:
            ids = [params_.item_id(i) for i in body["ids"]]
            deleted = engine.delete_items(item_ids=ids, queue_name=q.name)
        else:
            deleted = engine.delete_by_status(queue_name=q.name, status=Status(body["status"]))
        return Response({"deleted": deleted})


class ClaimView(ApiView):
    @documented(
        "claimItems",
        summary="Claim items (long-poll with wait)",
        scopes=("work",),
        parameters=[queue_param()],
        request="Claim",
        responses={200: "Claimed"},
        errors=merge_errors(QUEUE_ERRORS, {400: ["invalid"]}, STORE_ERRORS),
        body=True,
    )
    def post(self, request: Request, queue: str) -> Response:
        principal = require(request, "work", queue=queue)
        q = _queue_or_404(queue)
        body = contract.validate(contract.CLAIM, request.data)
        with waits.hold(principal.key_id) as may_wait:
            return self._claim(q, body, float(body["wait"]) if may_wait else 0.0)

    def _claim(self, q: Queue, body: dict[str, Any], wait: float) -> Response:
        deadline = time.monotonic() + wait
        interval = get_conf().long_poll_interval
        names = [f"c:{q.name}", f"d:{q.name}"]
        while True:
            seen = events.generation()
            claimed = engine.claim(queue_name=q.name, max_items=int(body["max"]))
            remaining = deadline - time.monotonic()
            if claimed or remaining <= 0:
                break
            # Claims again when this queue has news (claimable, deleted), when its next
            # delayed item comes due, else every LONG_POLL_INTERVAL: never a claim per news
            # of any queue, nor ten a second for nothing.
            due = engine.next_due([q.name]).get(q.name)
            until = interval if due is None else max(0.01, (due - utcnow()).total_seconds())
            engine.wait_for_news(names, seen, min(remaining, interval, until))
        return Response(
            {
                "items": [
                    engine.item_json(c.row, payload=c.payload, result=None, lease=c.row.lease)
                    for c in claimed
                ]
            }
        )


class ItemView(ApiView):
    @documented(
        "getItem",
        summary="Get an item (long-poll for its verdict with wait)",
        scopes=("produce",),
        parameters=[item_param(), wait_param()],
        responses={200: "Item"},
        errors=merge_errors(ITEM_ERRORS, {400: ["invalid_wait"]}, STORE_ERRORS),
    )
    def get(self, request: Request, item_id: str) -> Response:
        params_.item_id(item_id)
        require_item(request, item_id, "produce")
        wait = params_.wait(request.query_params)
        if wait is not None:
            with waits.hold(principal_of(request).key_id) as may_wait:
                if may_wait:
                    engine.wait_for_verdict(item_id=item_id, wait=wait)
        row, record = engine.get_item(item_id=item_id, producer_read=True)
        return Response(
            engine.item_json(row, payload=record.get("payload"), result=record.get("result"))
        )

    @documented(
        "deleteItem",
        summary="Delete an item",
        scopes=("produce", "manage"),
        parameters=[item_param()],
        responses={204: None},
        errors=merge_errors(ITEM_ERRORS, STORE_ERRORS),
    )
    def delete(self, request: Request, item_id: str) -> Response:
        params_.item_id(item_id)
        require_item(request, item_id, "produce", "manage")
        if not engine.delete_item(item_id=item_id):
            raise ItemNotFound(f"item {item_id!r} does not exist")
        return Response(status=status.HTTP_204_NO_CONTENT)


class RestartView(ApiView):
    @documented(
        "restartItem",
        summary="Restart a failed item",
        scopes=("manage",),
        parameters=[item_param()],
        responses={200: "Item"},
        errors=merge_errors(ITEM_ERRORS, {409: ["not_failed"]}, STORE_ERRORS),
    )
    def post(self, request: Request, item_id: str) -> Response:
        params_.item_id(item_id)
        require_item(request, item_id, "manage")
        engine.restart(item_id=item_id)
        row, record = engine.get_item(item_id=item_id)
        return Response(
            engine.item_json(row, payload=record.get("payload"), result=record.get("result"))
        )


class CancelView(ApiView):
    @documented(
        "cancelItem",
        summary="Cancel a pending or processing item",
        scopes=("produce", "manage"),
        parameters=[item_param()],
        request="Cancel",
        responses={200: "Item"},
        errors=merge_errors(
            ITEM_ERRORS, {400: ["invalid_reason"], 409: ["terminal"]}, STORE_ERRORS
        ),
        body=True,
    )
    def post(self, request: Request, item_id: str) -> Response:
        """Section 8.2: it fails now with ``cancelled``; a socket holding it, in any server
        process, is told to stop; its later result, fail, extend or progress is refused."""
        params_.item_id(item_id)
        require_item(request, item_id, "produce", "manage")
        body = contract.validate(contract.CANCEL, request.data)
        engine.cancel(item_id=item_id, reason=body.get("reason"))
        row, record = engine.get_item(item_id=item_id)
        return Response(
            engine.item_json(row, payload=record.get("payload"), result=record.get("result"))
        )


class AttemptsView(ApiView):
    @documented(
        "getAttempts",
        summary="An item's attempts, oldest first",
        scopes=("produce", "manage"),
        parameters=[item_param()],
        responses={200: "Attempts"},
        errors=merge_errors(ITEM_ERRORS, STORE_ERRORS),
    )
    def get(self, request: Request, item_id: str) -> Response:
        params_.item_id(item_id)
        require_item(request, item_id, "produce", "manage")
        story, omitted = engine.attempts(item_id=item_id, producer_read=True)
        return Response({"attempts": story, "omitted": omitted})


class ProgressView(ApiView):
    @documented(
        "reportProgress",
        summary="Report progress (needs the lease; does not extend it)",
        scopes=("work",),
        parameters=[item_param()],
        request="Progress",
        responses={200: "Progressed"},
        errors=merge_errors(ITEM_ERRORS, {400: ["invalid_lease"]}, STORE_ERRORS),
        body=True,
    )
    def post(self, request: Request, item_id: str) -> Response:
        params_.item_id(item_id)
        require_item(request, item_id, "work")
        body = contract.validate(contract.PROGRESS, request.data)
        accepted, _row = engine.report_progress(
            item_id=item_id, lease=body["lease"], progress=body["progress"]
        )
        return Response({"accepted": accepted})


def _worker_id(worker_id: str) -> str:
    if not registry.is_socket_id(worker_id):
        raise InvalidInput("a worker id is 16 hexadecimal digits", code="invalid_worker_id")
    return worker_id


class WorkerListView(ApiView):
    @documented(
        "listWorkers",
        summary="Every connected worker socket, of every server process",
        scopes=("manage",),
        responses={200: "WorkerList"},
    )
    def get(self, request: Request) -> Response:
        principal = require(request, "manage")
        return Response({"workers": [registry.wire(w) for w in registry.workers(principal.queues)]})


class WorkerDrainView(ApiView):
    @documented(
        "drainWorker",
        summary="Drain a worker: nothing more is pushed to it",
        scopes=("manage",),
        parameters=[worker_param()],
        responses={200: "Worker"},
        errors=WORKER_ERRORS,
    )
    def post(self, request: Request, worker_id: str) -> Response:
        principal = require(request, "manage")
        found = registry.worker(_worker_id(worker_id), principal.queues)
        if found is None:
            raise WorkerNotFound(f"no connected worker {worker_id!r}")
        (drained,) = registry.drain([found])
        return Response(registry.wire(drained))


class WorkersDrainView(ApiView):
    @documented(
        "drainWorkers",
        summary="Drain every worker whose name starts with a prefix (a deploy)",
        scopes=("manage",),
        request="DrainWorkers",
        responses={200: "WorkerList"},
        errors={400: ["invalid_name_prefix"]},
        body=True,
    )
    def post(self, request: Request) -> Response:
        principal = require(request, "manage")
        body = contract.validate(contract.DRAIN_WORKERS, request.data)
        prefix = body["namePrefix"]
        chosen = [w for w in registry.workers(principal.queues) if w.name.startswith(prefix)]
        return Response({"workers": [registry.wire(w) for w in registry.drain(chosen)]})


class ResultView(ApiView):
    @documented(
        "submitResult",
        summary="Hand in a result (first one wins)",
        scopes=("work",),
        parameters=[item_param()],
        request="Result",
        responses={200: "Verdict"},
        errors=merge_errors({400: ["invalid_id"]}, STORE_ERRORS),
        body=True,
    )
    def post(self, request: Request, item_id: str) -> Response:
        params_.item_id(item_id)
        principal = require(request, "work")
        body = contract.validate(contract.RESULT, request.data)
        gone = Response({"accepted": False, "status": None})
        try:
            # The group judges the item's queue against the key's (queues=): one read less.
            verdict = engine.submit_result(
                item_id=item_id, result=body["result"], queues=principal.queues
            )
        except ItemNotFound:
            return gone  # rule 9: a result for a deleted item is refused, not an error
        return Response({"accepted": verdict.accepted, "status": verdict.status})


class FailView(ApiView):
    @documented(
        "failItem",
        summary="Report a failure (needs the lease)",
        scopes=("work",),
        parameters=[item_param()],
        request="Fail",
        responses={200: "Verdict"},
        errors=merge_errors(
            ITEM_ERRORS,
            {400: ["invalid_lease", "invalid_error", "invalid_retry"]},
            STORE_ERRORS,
        ),
        body=True,
    )
    def post(self, request: Request, item_id: str) -> Response:
        params_.item_id(item_id)
        require_item(request, item_id, "work")
        body = contract.validate(contract.FAIL, request.data)
        verdict = engine.fail(
            item_id=item_id, lease=body["lease"], error=body.get("error"), retry=body["retry"]
        )
        return Response({"accepted": verdict.accepted, "status": verdict.status})


class ExtendView(ApiView):
    @documented(
        "extendLease",
        summary="Extend a lease",
        scopes=("work",),
        parameters=[item_param()],
        request="Extend",
        responses={200: "Extended"},
        errors=merge_errors(ITEM_ERRORS, {400: ["invalid_lease", "invalid_seconds"]}, STORE_ERRORS),
        body=True,
    )
    def post(self, request: Request, item_id: str) -> Response:
        params_.item_id(item_id)
        require_item(request, item_id, "work")
        body = contract.validate(contract.EXTEND, request.data)
        accepted, row = engine.extend(
            item_id=item_id, lease=body["lease"], seconds=body.get("seconds")
        )
        expires = row.lease_expires_at if row.status == Status.PROCESSING else None
        return Response({"accepted": accepted, "leaseExpiresAt": to_wire(expires)})


class HealthView(ApiView):
    authentication_classes: list[type] = []
    permission_classes = [AllowAny]
    # Under taskhoster.asgi's handler, answered at once from the health monitor's latest
    # report (taskhoster.health), never behind other requests.
    health_check = True

    @documented(
        "health",
        summary="Health check",
        responses={200: "Health", 503: "Health"},
        public=True,
    )
    def get(self, request: Request) -> Response:
        """200 when the database, the news bus and the state root all answer and the
        process's committer is ready (a committer process is starting: not yet), else 503;
        the body says whether each answered, and to a caller with a valid key (any scope)
        also names each, with its errors (see ``taskhoster.health``)."""
        healthy, body = health.report()
        secret = parse_authorization(request.META.get("HTTP_AUTHORIZATION"))
        if secret is None or authenticate(secret) is None:
            body = health.public(body)
        return Response(body, status=200 if healthy else 503)


class MetricsView(ApiView):
    """Prometheus metrics. A key is needed, any scope, as for ``GET /api/queues`` (queue names
    and counts are the operator's business); a key limited to some queues sees those. With
    ``METRICS_PUBLIC`` no key is asked."""

    permission_classes = [AllowAny]

    @annotate(
        operation_id="metrics",
        tags=["service"],
        summary="Prometheus metrics",
        description="Needs a valid key (of any scope); a key limited to some queues sees "
        "those. A server with METRICS_PUBLIC serves it without one.",
        responses={
            (200, "text/plain"): OpenApiResponse(
                OpenApiTypes.STR, description="Prometheus text format 0.0.4"
            ),
            **error_responses(AUTH_ERRORS),
        },
        auth=[{"tokenAuth": []}],
        extensions={"x-scopes": []},
    )
    def get(self, request: Request) -> HttpResponse:
        may_see = None
        if not get_conf().metrics_public:
            may_see = require(request).may_use
        return HttpResponse(
            metrics.render(may_see, held=engine.held_by_queue),
            content_type="text/plain; version=0.0.4",
        )
