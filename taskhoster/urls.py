"""The app's URLs: the REST API under ``api/``, plus health and metrics.

A project includes them under any prefix (``path("tasks/", include("taskhoster.urls"))``).
Every path under ``api/`` answers in the API's JSON envelope, an unknown one too (a 404
``not_found``), whatever the project's own ``handler404`` does with the rest of its paths.
"""

from __future__ import annotations

from django.urls import path, re_path
from django.views.decorators.csrf import csrf_exempt

from .api import schedules, threads, views
from .api.errors import json_404
from .api.schema_view import SchemaView
from .asyncapi import asyncapi_view

urlpatterns = [
    path("api/queues", views.QueueListView.as_view()),
    path("api/queues/<str:queue>", views.QueueView.as_view()),
    path("api/queues/<str:queue>/items", views.QueueItemsView.as_view()),
    path("api/queues/<str:queue>/items/delete", views.BulkDeleteView.as_view()),
    path("api/queues/<str:queue>/claim", views.ClaimView.as_view()),
    path("api/queues/<str:queue>/threads", threads.ThreadListView.as_view()),
    # A threadId may hold '/', so it takes the rest of the path.
    path("api/queues/<str:queue>/threads/<path:thread_id>", threads.ThreadDetailView.as_view()),
    path("api/queues/<str:queue>/schedules", schedules.ScheduleListView.as_view()),
    path("api/queues/<str:queue>/schedules/<str:name>", schedules.ScheduleView.as_view()),
    path("api/items/<str:item_id>", views.ItemView.as_view()),
    path("api/items/<str:item_id>/restart", views.RestartView.as_view()),
    path("api/items/<str:item_id>/result", views.ResultView.as_view()),
    path("api/items/<str:item_id>/fail", views.FailView.as_view()),
    path("api/items/<str:item_id>/extend", views.ExtendView.as_view()),
    path("api/items/<str:item_id>/progress", views.ProgressView.as_view()),
    path("api/items/<str:item_id>/cancel", views.CancelView.as_view()),
    path("api/items/<str:item_id>/attempts", views.AttemptsView.as_view()),
    path("api/workers", views.WorkerListView.as_view()),
    path("api/workers/drain", views.WorkersDrainView.as_view()),
    path("api/workers/<str:worker_id>/drain", views.WorkerDrainView.as_view()),
    path("api/schema", SchemaView.as_view()),
    path("api/asyncapi", asyncapi_view),  # the /work socket, AsyncAPI 3
    # Last: any other path under api/ (any method; a POST carries no CSRF token).
    re_path(r"^api/", csrf_exempt(json_404)),
    path("healthz", views.HealthView.as_view()),
    path("metrics", views.MetricsView.as_view()),
]
