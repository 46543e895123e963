"""The Django admin (staff only): a view of state whose changes go through the engine.

Items, queues, schedules, threads, keys and workers each have a module (``inflight`` holds
the item pages' part of SPEC section 8.2: attempts, progress, cancel); ``overview`` is the
one-page dashboard, linked from the app's own index page (``admin/taskhoster/app_index.html``),
as the workers page is. The admin site itself (its header, title and index page) belongs to the
project: nothing here changes it.
"""

from __future__ import annotations

from . import items, keys, overview, queues, schedules, threads, workers

__all__ = ["items", "keys", "overview", "queues", "schedules", "threads", "workers"]
