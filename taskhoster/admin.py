"""The Django admin (staff only): a view of state whose changes go through the engine.

The full operator dashboard is its own issue; this registers the index read-only so nothing
here can go around the engine's rules.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest

from .models import ApiKey, Item, Queue, Thread


class ReadOnlyAdmin(admin.ModelAdmin):
    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(Queue)
class QueueAdmin(ReadOnlyAdmin):
    list_display = (
        "name",
        "lease_seconds",
        "queue_seconds",
        "retain_seconds",
        "max_attempts",
        "dead_letter_queue",
    )


@admin.register(Item)
class ItemAdmin(ReadOnlyAdmin):
    list_display = ("id", "queue", "status", "thread_id", "attempts", "scheduled_at")
    list_filter = ("status",)
    show_full_result_count = False


@admin.register(Thread)
class ThreadAdmin(ReadOnlyAdmin):
    list_display = ("queue", "thread_id", "member_count", "processing_item", "head_item")


@admin.register(ApiKey)
class ApiKeyAdmin(ReadOnlyAdmin):
    list_display = ("name", "prefix", "scopes", "queues", "created_at", "revoked_at")
