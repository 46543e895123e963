"""The app's URLs: the REST API under ``api/``, plus health and metrics."""

from __future__ import annotations

from django.urls import path
from drf_spectacular.views import SpectacularAPIView
from rest_framework.permissions import AllowAny

from .api import threads, views
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
    path("api/items/<str:item_id>", views.ItemView.as_view()),
    path("api/items/<str:item_id>/restart", views.RestartView.as_view()),
    path("api/items/<str:item_id>/result", views.ResultView.as_view()),
    path("api/items/<str:item_id>/fail", views.FailView.as_view()),
    path("api/items/<str:item_id>/extend", views.ExtendView.as_view()),
    path(
        "api/schema",
        SpectacularAPIView.as_view(authentication_classes=[], permission_classes=[AllowAny]),
    ),
    path("api/asyncapi", asyncapi_view),  # the /work socket, AsyncAPI 3
    path("healthz", views.HealthView.as_view()),
    path("metrics", views.MetricsView.as_view()),
]
