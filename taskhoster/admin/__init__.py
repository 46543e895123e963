"""The Django admin (staff only): a view of state whose changes go through the engine.

Items, queues, threads and keys each have a module; ``overview`` is the one-page dashboard
linked from the admin index.
"""

from __future__ import annotations

from django.contrib import admin

from . import items, keys, overview, queues, threads

admin.site.site_header = "Taskhoster"
admin.site.site_title = "Taskhoster admin"
admin.site.index_template = "admin/taskhoster/index.html"

__all__ = ["items", "keys", "overview", "queues", "threads"]
