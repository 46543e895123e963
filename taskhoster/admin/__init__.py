"""The Django admin (staff only): a view of state whose changes go through the engine.

Items, queues, threads and keys each have a module; ``overview`` is the one-page dashboard,
linked from the app's own index page (``admin/taskhoster/app_index.html``). The admin site
itself (its header, title and index page) belongs to the project: nothing here changes it.
"""

from __future__ import annotations

from . import items, keys, overview, queues, threads

__all__ = ["items", "keys", "overview", "queues", "threads"]
