"""REST endpoints (SPEC section 5). Each view checks scope, validates, calls the engine."""

from __future__ import annotations

import time
from typing import Any

from django.http import HttpResponse
from drf_spectacular.utils import (
    OpenApiParameter,
    OpenApiResponse,
    PolymorphicProxySerializer,
    extend_schema,
)
from rest_framework import status
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response

from .. import contract, engine, events, health, metrics
from ..conf import get_conf
from ..errors import InvalidInput, ItemNotFound
from ..models import Item, Queue
from ..status import Status
from ..timeutil import to_wire
from .auth import require
from .base import ApiView
from .cursors import decode_cursor, encode_cursor
from .serializers import (
    BulkDeleteSerializer,
    ClaimAnswerSerializer,
    ClaimSerializer,
    DeletedSerializer,
    ErrorSerializer,
    ExtendAnswerSerializer,
    ExtendSerializer,
    FailSerializer,
    ItemPageSerializer,
    ItemSerializer,
    PostBatchSerializer,
    PostItemSerializer,
    QueueSerializer,
    QueueSettingsSerializer,
    ResultSerializer,
    VerdictSerializer,
    check_item_id,
)

ERRORS = {
    code: OpenApiResponse(ErrorSerializer, description=text)
    for code, text in {
        400: "Invalid request",
        401: "Missing or wrong key",
        403: "Wrong scope or queue",
        404: "Not found",
        409: "Conflict",
        413: "Too large",
    }.items()
}


def _queue_or_404(name: str) -> Queue:
    engine.queues.validate_queue_name(name)
    return engine.get_live_queue(name)


def _queue_wire(queue: Queue, counts: dict[str, int]) -> dict[str, Any]:
    return {"name": queue.name, **engine.queue_settings(queue), "counts": counts}


def _item_queue_name(item_id: str) -> str:
    name = (
        Item.objects.filter(id=item_id, queue__deleting=False)
        .values_list("queue__name", flat=True)
        .first()
    )
    if name is None:
        raise ItemNotFound(f"item {item_id!r} does not exist")
    return name


class QueueListView(ApiView):
    @extend_schema(responses={200: QueueSerializer(many=True), **ERRORS}, summary="List queues")
    def get(self, request: Request) -> Response:
        principal = require(request)
        queues = [q for q in Queue.objects.filter(deleting=False) if principal.may_use(q.name)]
        counts = engine.counts_by_queue([q.id for q in queues])
        return Response([_queue_wire(q, counts[q.id]) for q in queues])


class QueueView(ApiView):
    @extend_schema(responses={200: QueueSerializer, **ERRORS}, summary="Get a queue")
    def get(self, request: Request, queue: str) -> Response:
        require(request, queue=queue)
        q = _queue_or_404(queue)
        return Response(_queue_wire(q, engine.counts_by_queue([q.id])[q.id]))

    @extend_schema(
        request=QueueSettingsSerializer,
        responses={200: QueueSerializer, 201: QueueSerializer, **ERRORS},
        summary="Create or update a queue",
    )
    def put(self, request: Request, queue: str) -> Response:
        require(request, "manage", queue=queue)
        body = request.data
        if not isinstance(body, dict):
            raise InvalidInput("expected a JSON object of settings", code="invalid_body")
        q, created = engine.upsert_queue(name=queue, body=body)
        wire = _queue_wire(q, engine.counts_by_queue([q.id])[q.id])
        return Response(wire, status=status.HTTP_201_CREATED if created else status.HTTP_200_OK)

    @extend_schema(responses={204: None, **ERRORS}, summary="Delete a queue and all its items")
    def delete(self, request: Request, queue: str) -> Response:
        require(request, "manage", queue=queue)
        engine.queues.validate_queue_name(queue)
        engine.delete_queue(queue_name=queue)
        return Response(status=status.HTTP_204_NO_CONTENT)


def _item_cursor(cursor: str | None) -> str | None:
    position = decode_cursor(cursor)
    return None if position is None else check_item_id(position)


class QueueItemsView(ApiView):
    @extend_schema(
        parameters=[
            OpenApiParameter("status", str, enum=[s.value for s in Status]),
            OpenApiParameter("threadId", str),
            OpenApiParameter("cursor", str),
            OpenApiParameter("limit", int),
        ],
        responses={200: ItemPageSerializer, **ERRORS},
        summary="List items (no payloads)",
    )
    def get(self, request: Request, queue: str) -> Response:
        require(request, "produce", "manage", queue=queue)
        q = _queue_or_404(queue)
        params = request.query_params
        status_filter = params.get("status") or None
        if status_filter is not None and status_filter not in {s.value for s in Status}:
            raise InvalidInput(
                "status must be pending, processing, finished or failed", code="invalid_status"
            )
        conf = get_conf()
        try:
            limit = int(params.get("limit") or conf.page_size)
        except ValueError:
            raise InvalidInput("limit must be an integer", code="invalid_limit") from None
        if not 1 <= limit <= conf.max_page_size:
            raise InvalidInput(f"limit must be 1..{conf.max_page_size}", code="invalid_limit")
        thread_id = params.get("threadId") or None
        if thread_id is not None and (len(thread_id) > 200 or not thread_id.isprintable()):
            raise InvalidInput("invalid threadId", code="invalid_thread_id")
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

    @extend_schema(
        request=PolymorphicProxySerializer(
            component_name="PostItems",
            resource_type_field_name=None,
            serializers=[PostItemSerializer, PostBatchSerializer],
        ),
        responses={201: ItemSerializer, 200: ItemSerializer, **ERRORS},
        summary="Post one item, or {items: [...]} (all or none)",
    )
    def post(self, request: Request, queue: str) -> Response:
        require(request, "produce", queue=queue)
        engine.queues.validate_queue_name(queue)  # the group answers 404 for a missing one
        body = request.data
        batch = isinstance(body, dict) and "items" in body
        if batch:
            specs = contract.validate(contract.POST_BATCH, body)["items"]
        else:
            specs = [contract.validate(contract.POST_ITEM, body)]
        new = [
            engine.NewItem(
                payload=s.get("payload"),
                thread_id=s.get("threadId"),
                scheduled_at=s.get("scheduledAt"),
                delay_seconds=s.get("delaySeconds"),
                key=s.get("key"),
            )
            for s in specs
        ]
        posted = engine.post_items(queue_name=queue, items=new)
        wires = [engine.item_json(p.row, payload=p.payload, result=None) for p in posted]
        if batch:
            return Response({"items": wires}, status=status.HTTP_201_CREATED)
        code = status.HTTP_201_CREATED if posted[0].created else status.HTTP_200_OK
        return Response(wires[0], status=code)


class BulkDeleteView(ApiView):
    @extend_schema(
        request=BulkDeleteSerializer,
        responses={200: DeletedSerializer, **ERRORS},
        summary="Delete items by id or by status",
    )
    def post(self, request: Request, queue: str) -> Response:
        require(request, "manage", queue=queue)
        q = _queue_or_404(queue)
        body = contract.validate(contract.BULK_DELETE, request.data)
        if "ids" in body:
            ids = [check_item_id(i) for i in body["ids"]]
            deleted = engine.delete_items(item_ids=ids, queue_name=q.name)
        else:
            deleted = engine.delete_by_status(queue_name=q.name, status=Status(body["status"]))
        return Response({"deleted": deleted})


class ClaimView(ApiView):
    @extend_schema(
        request=ClaimSerializer,
        responses={200: ClaimAnswerSerializer, **ERRORS},
        summary="Claim items (long-poll with wait)",
    )
    def post(self, request: Request, queue: str) -> Response:
        require(request, "work", queue=queue)
        q = _queue_or_404(queue)
        body = contract.validate(contract.CLAIM, request.data)
        deadline = time.monotonic() + float(body["wait"])
        interval = get_conf().long_poll_interval
        while True:
            seen = events.generation()
            claimed = engine.claim(queue_name=q.name, max_items=int(body["max"]))
            remaining = deadline - time.monotonic()
            if claimed or remaining <= 0:
                break
            events.wait_for_news(seen, min(remaining, interval))
        return Response(
            {
                "items": [
                    engine.item_json(c.row, payload=c.payload, result=None, lease=c.row.lease)
                    for c in claimed
                ]
            }
        )


class ItemView(ApiView):
    @extend_schema(
        parameters=[OpenApiParameter("wait", float)],
        responses={200: ItemSerializer, **ERRORS},
        summary="Get an item (long-poll for its verdict with wait)",
    )
    def get(self, request: Request, item_id: str) -> Response:
        check_item_id(item_id)
        require(request, "produce", queue=_item_queue_name(item_id))
        wait_text = request.query_params.get("wait")
        if wait_text:
            try:
                wait = float(wait_text)
            except ValueError:
                raise InvalidInput(
                    "wait must be a number of seconds", code="invalid_wait"
                ) from None
            if not 0 <= wait <= get_conf().max_wait_seconds:
                raise InvalidInput(
                    f"wait must be 0..{get_conf().max_wait_seconds:g}", code="invalid_wait"
                )
            engine.wait_for_verdict(item_id=item_id, wait=wait)
        row, record = engine.get_item(item_id=item_id, producer_read=True)
        return Response(
            engine.item_json(row, payload=record.get("payload"), result=record.get("result"))
        )

    @extend_schema(responses={204: None, **ERRORS}, summary="Delete an item")
    def delete(self, request: Request, item_id: str) -> Response:
        check_item_id(item_id)
        require(request, "produce", "manage", queue=_item_queue_name(item_id))
        if not engine.delete_item(item_id=item_id):
            raise ItemNotFound(f"item {item_id!r} does not exist")
        return Response(status=status.HTTP_204_NO_CONTENT)


class RestartView(ApiView):
    @extend_schema(
        request=None, responses={200: ItemSerializer, **ERRORS}, summary="Restart a failed item"
    )
    def post(self, request: Request, item_id: str) -> Response:
        check_item_id(item_id)
        require(request, "manage", queue=_item_queue_name(item_id))
        engine.restart(item_id=item_id)
        row, record = engine.get_item(item_id=item_id)
        return Response(
            engine.item_json(row, payload=record.get("payload"), result=record.get("result"))
        )


class ResultView(ApiView):
    @extend_schema(
        request=ResultSerializer,
        responses={200: VerdictSerializer, **ERRORS},
        summary="Hand in a result (first one wins)",
    )
    def post(self, request: Request, item_id: str) -> Response:
        check_item_id(item_id)
        require(request, "work")
        body = contract.validate(contract.RESULT, request.data)
        gone = Response({"accepted": False, "status": None})
        try:
            require(request, "work", queue=_item_queue_name(item_id))
            verdict = engine.submit_result(item_id=item_id, result=body["result"])
        except ItemNotFound:
            return gone  # rule 9: a result for a deleted item is refused, not an error
        return Response({"accepted": verdict.accepted, "status": verdict.status})


class FailView(ApiView):
    @extend_schema(
        request=FailSerializer,
        responses={200: VerdictSerializer, **ERRORS},
        summary="Report a failure (needs the lease)",
    )
    def post(self, request: Request, item_id: str) -> Response:
        check_item_id(item_id)
        require(request, "work", queue=_item_queue_name(item_id))
        body = contract.validate(contract.FAIL, request.data)
        verdict = engine.fail(
            item_id=item_id, lease=body["lease"], error=body.get("error"), retry=body["retry"]
        )
        return Response({"accepted": verdict.accepted, "status": verdict.status})


class ExtendView(ApiView):
    @extend_schema(
        request=ExtendSerializer,
        responses={200: ExtendAnswerSerializer, **ERRORS},
        summary="Extend a lease",
    )
    def post(self, request: Request, item_id: str) -> Response:
        check_item_id(item_id)
        require(request, "work", queue=_item_queue_name(item_id))
        body = contract.validate(contract.EXTEND, request.data)
        accepted, row = engine.extend(
            item_id=item_id, lease=body["lease"], seconds=body.get("seconds")
        )
        expires = row.lease_expires_at if row.status == Status.PROCESSING else None
        return Response({"accepted": accepted, "leaseExpiresAt": to_wire(expires)})


class HealthView(ApiView):
    authentication_classes: list[type] = []
    permission_classes = [AllowAny]

    @extend_schema(responses={200: None, 503: None}, summary="Health check")
    def get(self, request: Request) -> Response:
        """200 when the database, the news bus and the state root all answer, else 503; the
        body names each and says whether it answered (see ``taskhoster.health``)."""
        healthy, body = health.report()
        return Response(body, status=200 if healthy else 503)


class MetricsView(ApiView):
    authentication_classes: list[type] = []
    permission_classes = [AllowAny]

    @extend_schema(responses={200: str}, summary="Prometheus metrics")
    def get(self, request: Request) -> HttpResponse:
        return HttpResponse(metrics.render(), content_type="text/plain; version=0.0.4")
