"""The base of every API view (its own module: the authentication module is imported by
DRF's settings, before DRF's views can be)."""

from __future__ import annotations

from typing import Any

from rest_framework.renderers import JSONRenderer
from rest_framework.request import Request
from rest_framework.views import APIView


class ApiView(APIView):
    """JSON in and out, without negotiating per request: there is one renderer, so there is
    nothing to choose."""

    renderer_classes = [JSONRenderer]
    _renderer = JSONRenderer()

    def perform_content_negotiation(self, request: Request, force: bool = False) -> Any:
        return self._renderer, self._renderer.media_type
