"""``Authorization: Token <key>`` for DRF, and the scope and queue checks of the views."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import exceptions
from rest_framework.authentication import BaseAuthentication
from rest_framework.permissions import BasePermission
from rest_framework.request import Request

from ..asgi import RunInThreadError, is_on_loop
from ..keys import Principal, authenticate, parse_authorization, secret_hash


@dataclass(frozen=True)
class UncheckedKey:
    """A key not looked up yet. On the event loop (``taskhoster.asgi.ON_LOOP``) nothing may
    wait for the database: a view there leaves the lookup to the engine's group
    (``key_for_post``), and any other use of the caller answers in a thread."""

    key_hash: str
    is_authenticated = True


class KnownKeys:
    """Hashes of keys this process saw accepted lately (``KNOWN_FOR`` seconds).

    A post answered on the event loop does not look its key up (the engine's group does,
    with the rest of its work); but its body is read there before the group runs. So only a
    key seen accepted lately is let on the loop: any other request goes to a thread, where
    the key is judged before the body is read, and a made-up key costs a lookup, not a
    parse. A hint, never an authority: the group checks every key again, revoked ones
    included."""

    KNOWN_FOR = 60.0
    MOST = 10_000

    def __init__(self) -> None:
        self.seen: dict[str, float] = {}
        self.lock = threading.Lock()

    def add(self, key_hash: str) -> None:
        with self.lock:
            if len(self.seen) >= self.MOST and key_hash not in self.seen:
                self.seen.pop(next(iter(self.seen)))  # the oldest
            self.seen.pop(key_hash, None)
            self.seen[key_hash] = time.monotonic() + self.KNOWN_FOR

    def __contains__(self, key_hash: object) -> bool:
        until = self.seen.get(key_hash) if isinstance(key_hash, str) else None
        return until is not None and until > time.monotonic()


known_keys = KnownKeys()


class KeyAuthentication(BaseAuthentication):
    def authenticate(self, request: Request) -> tuple[Principal | UncheckedKey, str] | None:
        header = request.META.get("HTTP_AUTHORIZATION")
        if not header:
            return None
        secret = parse_authorization(header)
        if secret is None:
            raise exceptions.AuthenticationFailed("expected 'Authorization: Token <key>'")
        if is_on_loop(request):
            found = secret_hash(secret)
            if found is None or found not in known_keys:
                # Judged in a thread, before its body is read (``KnownKeys``).
                raise RunInThreadError
            return UncheckedKey(found), secret
        principal = authenticate(secret)
        if principal is None:
            raise exceptions.AuthenticationFailed("invalid or revoked key")
        found = secret_hash(secret)
        if found is not None:
            known_keys.add(found)
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
    def has_permission(self, request: Request, view: Any) -> bool:
        return isinstance(request.user, Principal | UncheckedKey)


def principal_of(request: Request) -> Principal:
    user = request.user
    if not isinstance(user, Principal):
        raise exceptions.NotAuthenticated()
    return user


def key_for_post(request: Request, *, queue: str) -> str | None:
    """A post's key: on the event loop its hash, for the engine's group to check as
    ``require(request, "produce", queue=queue)`` would (``ops.Post.key_hash``); in a thread,
    None once that ``require`` has passed."""
    user = request.user
    if isinstance(user, UncheckedKey):
        return user.key_hash
    require(request, "produce", queue=queue)
    return None


def require(request: Request, *scopes: str, queue: str | None = None) -> Principal:
    """The caller, if it has one of ``scopes`` and may use ``queue``; else 403."""
    principal = principal_of(request)
    if scopes and not principal.has_scope(*scopes):
        raise exceptions.PermissionDenied(f"this key needs the {' or '.join(scopes)} scope")
    if queue is not None and not principal.may_use(queue):
        raise exceptions.PermissionDenied(f"this key may not use queue {queue!r}")
    return principal
