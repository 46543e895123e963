"""``Authorization: Token <key>`` for DRF, and the scope and queue checks of the views."""

from __future__ import annotations

from typing import Any

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import exceptions
from rest_framework.authentication import BaseAuthentication
from rest_framework.permissions import BasePermission
from rest_framework.request import Request

from ..keys import Principal, authenticate, known_keys, parse_authorization, refusal, secret_hash


class KeyAuthentication(BaseAuthentication):
    def authenticate(self, request: Request) -> tuple[Principal, str] | None:
        header = request.META.get("HTTP_AUTHORIZATION")
        if not header:
            return None
        secret = parse_authorization(header)
        if secret is None:
            raise exceptions.AuthenticationFailed("expected 'Authorization: Token <key>'")
        principal = authenticate(secret)
        if principal is None:
            raise exceptions.AuthenticationFailed("invalid or revoked key")
        found = secret_hash(secret)
        if found is not None:
            known_keys.add(found)  # it may post on the event loop now (``api.loop_posts``)
        return principal, secret

    def authenticate_header(self, request: Request) -> str:
        return "Token"


class KeyAuthenticationScheme(OpenApiAuthenticationExtension):
    """Describes ``KeyAuthentication`` in ``/api/schema``."""

    target_class = KeyAuthentication
    name = "tokenAuth"

    def get_security_definition(self, auto_schema: Any) -> dict[str, str]:
        return {
            "type": "apiKey",
            "in": "header",
            "name": "Authorization",
            "description": "`Token <key>`",
        }


class HasKey(BasePermission):
    """A caller with a key: a ``Principal``, or the unchecked key of a post on the event loop
    (``api.loop_posts.UncheckedKey``, which the engine's group checks)."""

    def has_permission(self, request: Request, view: Any) -> bool:
        return bool(getattr(request.user, "is_authenticated", False))


def principal_of(request: Request) -> Principal:
    user = request.user
    if not isinstance(user, Principal):
        raise exceptions.NotAuthenticated()
    return user


def require(request: Request, *scopes: str, queue: str | None = None) -> Principal:
    """The caller, if it has one of ``scopes`` and may use ``queue``; else 403
    (``keys.refusal``)."""
    principal = principal_of(request)
    refused = refusal(principal, scopes, queue)
    if refused is not None:
        raise refused
    return principal
