"""Thread endpoints: ``GET /api/queues/{queue}/threads`` and ``.../threads/{threadId}``."""

from __future__ import annotations

from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response

from .. import engine
from ..conf import get_conf
from ..engine.threads import ThreadView, get_thread, list_threads, thread_members
from ..errors import InvalidInput
from ..models import Item
from .auth import require
from .base import ApiView
from .cursors import decode_cursor, encode_cursor
from .serializers import ItemSerializer
from .views import ERRORS, _queue_or_404


class ThreadSerializer(serializers.Serializer):
    threadId = serializers.CharField()
    memberCount = serializers.IntegerField()
    head = serializers.CharField(allow_null=True)
    processing = serializers.CharField(allow_null=True)


class ThreadPageSerializer(serializers.Serializer):
    threads = ThreadSerializer(many=True)
    next = serializers.CharField(allow_null=True)


class ThreadDetailSerializer(ThreadSerializer):
    members = ItemSerializer(many=True)
    next = serializers.CharField(allow_null=True)


def _wire(view: ThreadView) -> dict[str, object]:
    return {
        "threadId": view.thread_id,
        "memberCount": view.member_count,
        "head": view.head,
        "processing": view.processing,
    }


def _limit(request: Request) -> int:
    conf = get_conf()
    try:
        limit = int(request.query_params.get("limit") or conf.page_size)
    except ValueError:
        raise InvalidInput("limit must be an integer", code="invalid_limit") from None
    if not 1 <= limit <= conf.max_page_size:
        raise InvalidInput(f"limit must be 1..{conf.max_page_size}", code="invalid_limit")
    return limit


def _check_thread_id(thread_id: str) -> str:
    if not 1 <= len(thread_id) <= 200 or not thread_id.isprintable():
        raise InvalidInput("a threadId is 1-200 printable characters", code="invalid_thread_id")
    return thread_id


class ThreadListView(ApiView):
    @extend_schema(
        parameters=[OpenApiParameter("cursor", str), OpenApiParameter("limit", int)],
        responses={200: ThreadPageSerializer, **ERRORS},
        summary="List live threads: head, member count, processing member",
    )
    def get(self, request: Request, queue: str) -> Response:
        require(request, "produce", "manage", queue=queue)
        q = _queue_or_404(queue)
        after = decode_cursor(request.query_params.get("cursor"))
        if after is not None:
            _check_thread_id(after)
        views, last = list_threads(queue=q, after=after, limit=_limit(request))
        return Response({"threads": [_wire(v) for v in views], "next": encode_cursor(last)})


class ThreadDetailView(ApiView):
    @extend_schema(
        parameters=[OpenApiParameter("cursor", str), OpenApiParameter("limit", int)],
        responses={200: ThreadDetailSerializer, **ERRORS},
        summary="A thread and its live members in head order",
    )
    def get(self, request: Request, queue: str, thread_id: str) -> Response:
        require(request, "produce", "manage", queue=queue)
        q = _queue_or_404(queue)
        _check_thread_id(thread_id)
        view = get_thread(queue=q, thread_id=thread_id)
        after = None
        cursor = decode_cursor(request.query_params.get("cursor"))
        if cursor:
            after = Item.objects.filter(id=cursor, queue=q, thread_id=thread_id).first()
            if after is None:
                raise InvalidInput("invalid cursor", code="invalid_cursor")
        members, last = thread_members(
            queue=q, thread_id=thread_id, after=after, limit=_limit(request)
        )
        return Response(
            {
                **_wire(view),
                "members": [engine.item_json(m, queue_name=q.name) for m in members],
                "next": encode_cursor(last),
            }
        )
