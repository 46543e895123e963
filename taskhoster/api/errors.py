"""One mapping from every error to ``{"error": {"code", "message"}}``."""

from __future__ import annotations

import logging
from typing import Any

from django.core.exceptions import PermissionDenied, RequestDataTooBig, SuspiciousOperation
from django.db import InterfaceError, OperationalError
from django.http import Http404, HttpRequest, JsonResponse
from rest_framework import exceptions
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from ..errors import TaskhosterError

log = logging.getLogger(__name__)


def error_body(code: str, message: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message}}


def _message(detail: Any) -> str:
    if isinstance(detail, dict):
        parts = [f"{key}: {_message(value)}" for key, value in detail.items()]
        return "; ".join(parts)
    if isinstance(detail, list):
        return "; ".join(_message(value) for value in detail)
    return str(detail)


def _code(exc: exceptions.APIException) -> str:
    codes = exc.get_codes()
    while isinstance(codes, dict | list) and codes:
        codes = next(iter(codes.values())) if isinstance(codes, dict) else codes[0]
    if isinstance(codes, str) and isinstance(exc, exceptions.ValidationError):
        return "invalid" if codes in {"invalid", "required", "null", "blank"} else codes
    return exc.default_code if isinstance(exc.default_code, str) else "error"


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    if isinstance(exc, TaskhosterError):
        return Response(error_body(exc.code, exc.message), status=exc.http_status)
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
            error_body("unavailable", "the database did not answer; try again"), status=503
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
    response.data = error_body(code, _message(exc.detail))
    return response


def json_404(request: HttpRequest, exception: Exception | None = None) -> JsonResponse:
    return JsonResponse(error_body("not_found", "no such endpoint"), status=404)


def json_400(request: HttpRequest, exception: Exception | None = None) -> JsonResponse:
    return JsonResponse(error_body("bad_request", "bad request"), status=400)


def json_403(request: HttpRequest, exception: Exception | None = None) -> JsonResponse:
    return JsonResponse(error_body("forbidden", "forbidden"), status=403)


def json_500(request: HttpRequest) -> JsonResponse:
    return JsonResponse(error_body("internal", "internal error"), status=500)
