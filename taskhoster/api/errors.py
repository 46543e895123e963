"""One mapping from every error to ``{"error": {"code", "message"}}``.

Messages are for the people who read them: they say what to send instead, in the API's own
terms, never a framework's field names or phrasing (DRF's own words for a missing key, a wrong
content type or method are replaced here); the codes stay the ones the schema lists.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from django.core.exceptions import (
    DisallowedHost,
    PermissionDenied,
    RequestDataTooBig,
    SuspiciousOperation,
)
from django.db import InterfaceError, OperationalError
from django.http import Http404, HttpRequest, JsonResponse
from rest_framework import exceptions
from rest_framework.response import Response
from rest_framework.settings import api_settings
from rest_framework.views import exception_handler as drf_exception_handler

from ..errors import Overloaded, TaskhosterError
from .parsers import BadJSON

log = logging.getLogger(__name__)


def error_body(code: str, message: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message}}


def _message(detail: Any) -> str:
    if isinstance(detail, dict):
        # DRF files errors about the body as a whole under "non_field_errors": no field of ours.
        parts = [
            _message(value)
            if key == api_settings.NON_FIELD_ERRORS_KEY
            else f"{key}: {_message(value)}"
            for key, value in detail.items()
        ]
        return "; ".join(parts)
    if isinstance(detail, list):
        return "; ".join(_message(value) for value in detail)
    return str(detail)


def _content_type(request: Any) -> str:
    media = (getattr(request, "content_type", None) or "").split(";", 1)[0].strip()
    return f"this request's Content-Type is {media}" if media else "this request has none"


def _plain_message(exc: exceptions.APIException, context: dict[str, Any]) -> str | None:
    """Our words for DRF's own exceptions, which speak of DRF (None: the detail is ours)."""
    request = context.get("request")
    if isinstance(exc, exceptions.UnsupportedMediaType):
        return (
            "send the body as JSON with the header Content-Type: application/json "
            f"({_content_type(request)})"
        )
    if isinstance(exc, exceptions.NotAuthenticated):
        return "this needs an API key: send the header Authorization: Token <key>"
    if isinstance(exc, exceptions.MethodNotAllowed):
        view = context.get("view")
        allowed = [m for m in getattr(view, "allowed_methods", []) if m not in {"HEAD", "OPTIONS"}]
        method = getattr(request, "method", "this method")
        use = " or ".join(filter(None, [", ".join(allowed[:-1]), *allowed[-1:]]))
        return f"{method} is not allowed here; use {use or 'another method'}"
    if isinstance(exc, exceptions.ParseError) and not isinstance(exc, BadJSON):
        return "the body is not valid JSON"
    if type(exc) is exceptions.PermissionDenied and exc.detail == exc.default_detail:
        return "this key may not do this"
    return None


def _code(exc: exceptions.APIException) -> str:
    codes = exc.get_codes()
    while isinstance(codes, dict | list) and codes:
        codes = next(iter(codes.values())) if isinstance(codes, dict) else codes[0]
    if isinstance(codes, str) and isinstance(exc, exceptions.ValidationError):
        return "invalid" if codes in {"invalid", "required", "null", "blank"} else codes
    return exc.default_code if isinstance(exc.default_code, str) else "error"


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    if isinstance(exc, Overloaded):
        return Response(
            error_body(exc.code, exc.message),
            status=exc.http_status,
            headers={"Retry-After": f"{math.ceil(exc.retry_after)}"},
        )
    if isinstance(exc, TaskhosterError):
        # Every 503 says when to try again (a store away, an outcome unknown).
        again = {"Retry-After": "1"} if exc.http_status == 503 else None
        return Response(error_body(exc.code, exc.message), status=exc.http_status, headers=again)
    if isinstance(exc, RequestDataTooBig):
        return Response(error_body("too_large", "the request body is too large"), status=413)
    if isinstance(exc, Http404):
        return Response(error_body("not_found", "not found"), status=404)
    if isinstance(exc, SuspiciousOperation):
        return Response(error_body("bad_request", str(exc) or "bad request"), status=400)
    if isinstance(exc, PermissionDenied):
        return Response(error_body("permission_denied", "permission denied"), status=403)
    if isinstance(exc, OperationalError | InterfaceError):
        # The database did not answer (down, unreachable, a pool timeout, a lock held too
        # long): a condition to retry (a post with its key), not a bug.
        log.warning("the database did not answer in %s: %s", context.get("view"), exc)
        return Response(
            error_body("unavailable", "the database did not answer; try again"),
            status=503,
            headers={"Retry-After": "1"},
        )
    response = drf_exception_handler(exc, context)
    if response is None or not isinstance(exc, exceptions.APIException):
        log.exception("unhandled error in %s", context.get("view"))
        return Response(error_body("internal", "internal error"), status=500)
    code = _code(exc)
    if isinstance(exc, exceptions.NotAuthenticated | exceptions.AuthenticationFailed):
        code = "unauthorized"
        response.status_code = 401
        response["WWW-Authenticate"] = "Token"
    elif isinstance(exc, exceptions.PermissionDenied):
        code = "forbidden"
    if isinstance(exc, exceptions.ParseError):
        code = "bad_json"
    response.data = error_body(code, _plain_message(exc, context) or _message(exc.detail))
    return response


def json_404(request: HttpRequest, exception: Exception | None = None) -> JsonResponse:
    return JsonResponse(error_body("not_found", f"no endpoint at {request.path}"), status=404)


def json_400(request: HttpRequest, exception: Exception | None = None) -> JsonResponse:
    message = "bad request"
    if isinstance(exception, DisallowedHost):
        message = "the Host header names a host this server does not answer for"
    return JsonResponse(error_body("bad_request", message), status=400)


def json_403(request: HttpRequest, exception: Exception | None = None) -> JsonResponse:
    return JsonResponse(error_body("forbidden", "forbidden"), status=403)


def json_500(request: HttpRequest) -> JsonResponse:
    return JsonResponse(error_body("internal", "internal error"), status=500)
