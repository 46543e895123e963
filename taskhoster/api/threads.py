"""Thread endpoints: ``GET /api/queues/{queue}/threads`` and ``.../threads/{threadId}``."""

from __future__ import annotations

from rest_framework.request import Request
from rest_framework.response import Response

from .. import engine
from . import params
from .auth import require
from .base import ApiView
from .cursors import decode_cursor, encode_cursor
from .schema import (
    QUEUE_ERRORS,
    cursor_param,
    documented,
    limit_param,
    merge_errors,
    queue_param,
    thread_param,
)
from .views import _queue_or_404


def _wire(view: engine.ThreadView) -> dict[str, object]:
    return {
        "threadId": view.thread_id,
        "memberCount": view.member_count,
        "head": view.head,
        "processing": view.processing,
    }


class ThreadListView(ApiView):
    @documented(
        "listThreads",
        summary="List live threads: head, member count, processing member",
        scopes=("produce", "manage"),
        parameters=[queue_param(), cursor_param(), limit_param()],
        responses={200: "ThreadPage"},
        errors=merge_errors(QUEUE_ERRORS, {400: ["invalid_limit", "invalid_cursor"]}),
    )
    def get(self, request: Request, queue: str) -> Response:
        require(request, "produce", "manage", queue=queue)
        q = _queue_or_404(queue)
        after = decode_cursor(request.query_params.get("cursor"))
        if after is not None:
            params.thread_id(after)
        views, last = engine.list_threads(
            queue=q, after=after, limit=params.limit(request.query_params)
        )
        return Response({"threads": [_wire(v) for v in views], "next": encode_cursor(last)})


class ThreadDetailView(ApiView):
    @documented(
        "getThread",
        summary="A thread and its live members in head order",
        scopes=("produce", "manage"),
        parameters=[queue_param(), thread_param(), cursor_param(), limit_param()],
        responses={200: "ThreadDetail"},
        errors=merge_errors(
            QUEUE_ERRORS,
            {
                400: ["invalid_thread_id", "invalid_limit", "invalid_cursor"],
                404: ["thread_not_found"],
            },
        ),
    )
    def get(self, request: Request, queue: str, thread_id: str) -> Response:
        require(request, "produce", "manage", queue=queue)
        q = _queue_or_404(queue)
        params.thread_id(thread_id)
        view = engine.get_thread(queue=q, thread_id=thread_id)
        cursor = decode_cursor(request.query_params.get("cursor"))
        after = (
            engine.thread_position(queue=q, thread_id=thread_id, after=cursor) if cursor else None
        )
        members, last = engine.thread_members(
            queue=q, thread_id=thread_id, after=after, limit=params.limit(request.query_params)
        )
        return Response(
            {
                **_wire(view),
                "members": [engine.item_json(m, queue_name=q.name) for m in members],
                "next": encode_cursor(last),
            }
        )
