"""Schedule endpoints (SPEC section 8.3): ``GET /api/queues/{queue}/schedules`` and ``PUT``,
``GET``, ``DELETE`` of ``/api/queues/{queue}/schedules/{name}``."""

from __future__ import annotations

from rest_framework import status
from rest_framework.request import Request
from rest_framework.response import Response

from .. import engine
from ..errors import InvalidInput
from . import params
from .auth import require
from .base import ApiView
from .cursors import decode_cursor, encode_cursor
from .schema import (
    QUEUE_ERRORS,
    SCHEDULE_ERRORS,
    STORE_ERRORS,
    cursor_param,
    documented,
    limit_param,
    merge_errors,
    queue_param,
    schedule_param,
)


class ScheduleListView(ApiView):
    @documented(
        "listSchedules",
        summary="List a queue's schedules, by name",
        scopes=("produce", "manage"),
        parameters=[queue_param(), cursor_param(), limit_param()],
        responses={200: "SchedulePage"},
        errors=merge_errors(QUEUE_ERRORS, {400: ["invalid_limit", "invalid_cursor"]}),
    )
    def get(self, request: Request, queue: str) -> Response:
        require(request, "produce", "manage", queue=queue)
        engine.validate_queue_name(queue)
        after = decode_cursor(request.query_params.get("cursor"))
        if after is not None:
            try:
                engine.validate_schedule_name(after)
            except InvalidInput:
                raise InvalidInput("invalid cursor", code="invalid_cursor") from None
        limit = params.limit(request.query_params)
        found = engine.list_schedules(queue, after=after, limit=limit)
        page = found[:limit]
        last = page[-1].name if len(found) > limit else None
        return Response(
            {
                "schedules": [engine.schedule_wire(s, queue) for s in page],
                "next": encode_cursor(last),
            }
        )


class ScheduleView(ApiView):
    @documented(
        "getSchedule",
        summary="Get a schedule, with its next and last slots",
        scopes=("produce", "manage"),
        parameters=[queue_param(), schedule_param()],
        responses={200: "Schedule"},
        errors=SCHEDULE_ERRORS,
    )
    def get(self, request: Request, queue: str, name: str) -> Response:
        require(request, "produce", "manage", queue=queue)
        engine.validate_queue_name(queue)
        return Response(engine.schedule_wire(engine.get_schedule(queue, name), queue))

    @documented(
        "putSchedule",
        summary="Create or change a schedule",
        scopes=("manage",),
        parameters=[queue_param(), schedule_param()],
        request="ScheduleSettings",
        responses={200: "Schedule", 201: "Schedule"},
        errors=merge_errors(
            SCHEDULE_ERRORS,
            {400: ["invalid_schedule", "invalid_thread_id", "invalid", "missing_field"]},
            STORE_ERRORS,  # (its definition is kept beside the queue's items too)
        ),
        body=True,
    )
    def put(self, request: Request, queue: str, name: str) -> Response:
        require(request, "manage", queue=queue)
        engine.validate_queue_name(queue)
        schedule, created = engine.put_schedule(queue, name, request.data)
        return Response(
            engine.schedule_wire(schedule, queue),
            status=status.HTTP_201_CREATED if created else status.HTTP_200_OK,
        )

    @documented(
        "deleteSchedule",
        summary="Delete a schedule: no slot of it is posted from now on",
        scopes=("manage",),
        parameters=[queue_param(), schedule_param()],
        responses={204: None},
        errors=merge_errors(SCHEDULE_ERRORS, STORE_ERRORS),
    )
    def delete(self, request: Request, queue: str, name: str) -> Response:
        require(request, "manage", queue=queue)
        engine.validate_queue_name(queue)
        engine.delete_schedule(queue, name)
        return Response(status=status.HTTP_204_NO_CONTENT)
