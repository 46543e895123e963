"""API keys: created with ``manage.py createkey``, stored as SHA-256 hashes, checked per request.

A key is 32 random bytes, so a plain SHA-256 is enough to store it (no password stretching is
needed for a secret that cannot be guessed).
"""

from __future__ import annotations

import hashlib
import json
import secrets
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from django.db import connection

from .errors import InvalidInput, KeyForbidden, KeyRefused
from .models import ApiKey
from .store import QUEUE_NAME_PATTERN

SCOPES = ("produce", "work", "manage")
KEY_PREFIX = "th_"


@dataclass(frozen=True)
class Principal:
    """Who is calling: a key's name, scopes and optional queue limits."""

    key_id: int
    name: str
    scopes: frozenset[str]
    queues: frozenset[str] | None

    is_authenticated = True

    def has_scope(self, *scopes: str) -> bool:
        return any(s in self.scopes for s in scopes)

    def may_use(self, queue: str) -> bool:
        return self.queues is None or queue in self.queues


def refusal(
    principal: Principal | None, scope: str | tuple[str, ...], queue: str | None
) -> KeyRefused | None:
    """Why a key may not do this, or None if it may: the one rule for the API's views
    (``api.auth.require``) and the engine's group (a post whose key it checks).

    ``principal``: the key's holder, None for a key that is invalid or revoked (401).
    ``scope``: the scope the key needs, or scopes of which it needs one (none: any will do);
    ``queue``: the queue it must be allowed to use, if any. Either refused is 403.
    """
    if principal is None:
        return KeyRefused("invalid or revoked key")
    scopes = (scope,) if isinstance(scope, str) else scope
    if scopes and not principal.has_scope(*scopes):
        return KeyForbidden(f"this key needs the {' or '.join(scopes)} scope")
    if queue is not None and not principal.may_use(queue):
        return KeyForbidden(f"this key may not use queue {queue!r}")
    return None


def hash_key(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).hexdigest()


def create_key(
    *, name: str, scopes: Iterable[str], queues: Iterable[str] | None = None
) -> tuple[ApiKey, str]:
    """Create a key; the secret is returned once and never stored."""
    scope_list = sorted({s.strip() for s in scopes if s.strip()})
    bad = [s for s in scope_list if s not in SCOPES]
    if bad or not scope_list:
        raise InvalidInput(f"scopes must be some of {', '.join(SCOPES)}", code="invalid_scope")
    queue_list = None
    if queues is not None:
        queue_list = sorted({q.strip() for q in queues if q.strip()}) or None
        for q in queue_list or []:
            if QUEUE_NAME_PATTERN.fullmatch(q) is None:
                raise InvalidInput(f"invalid queue name {q!r}", code="invalid_queue_name")
    if not name or len(name) > 100:
        raise InvalidInput("a key needs a name of 1-100 characters", code="invalid_name")
    secret = KEY_PREFIX + secrets.token_urlsafe(32)
    key = ApiKey.objects.create(
        name=name,
        prefix=secret[:10],
        key_hash=hash_key(secret),
        scopes=scope_list,
        queues=queue_list,
    )
    return key, secret


def secret_hash(secret: str) -> str | None:
    """The hash to look a secret up by, or None for a secret no key can have."""
    if not secret or len(secret) > 200:
        return None
    return hash_key(secret)


class KnownKeys:
    """Hashes of keys this process saw accepted lately (``KNOWN_FOR`` seconds).

    A post answered on the event loop (``api.loop_posts``) does not look its key up (the
    engine's group does, with the rest of its work); but its body is read there before the
    group runs. So only a key seen accepted lately is let on the loop: any other request goes
    to a thread, where the key is judged before the body is read, and a made-up key costs a
    lookup, not a parse. A hint, never an authority: the group checks every key again,
    revoked ones included."""

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


KEY_REVOKED = "key-revoked"  # news: (KEY_REVOKED, "", key id); sockets of the key close


def revoke(key_ids: Iterable[int]) -> int:
    """Revoke keys: REST refuses them at once (every request looks its key up), and every
    server process closes their open ``/work`` sockets (4401) when it hears the news (a
    lost piece of news is caught by the dispatcher's backstop, which checks its sockets'
    keys). Returns how many were live."""
    from django.db import transaction

    from . import events
    from .timeutil import now as utcnow

    wanted = sorted(set(key_ids))
    with transaction.atomic():
        live = list(
            ApiKey.objects.filter(id__in=wanted, revoked_at__isnull=True).values_list(
                "id", flat=True
            )
        )
        ApiKey.objects.filter(id__in=live).update(revoked_at=utcnow())
        transaction.on_commit(
            lambda: events.announce_many([(KEY_REVOKED, "", str(k)) for k in live])
        )
    return len(live)


def live_key_ids(key_ids: Iterable[int]) -> set[int]:
    """Those of ``key_ids`` that are not revoked (one query)."""
    wanted = sorted(set(key_ids))
    if not wanted:
        return set()
    return set(
        ApiKey.objects.filter(id__in=wanted, revoked_at__isnull=True).values_list("id", flat=True)
    )


def authenticate(secret: str) -> Principal | None:
    """The key's holder, or None. One indexed lookup by the key's hash on every call (no
    cache: a revoked key stops working at once, in every process)."""
    found = secret_hash(secret)
    return None if found is None else principals_by_hash([found]).get(found)


def principals_by_hash(hashes: Iterable[str]) -> dict[str, Principal]:
    """The holders of the live (unrevoked) keys among ``hashes``, in one query."""
    wanted = sorted(set(hashes))
    if not wanted:
        return {}
    table = ApiKey._meta.db_table
    marks = ", ".join(["%s"] * len(wanted))
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT key_hash, id, name, scopes, queues FROM {table} "
            f"WHERE key_hash IN ({marks}) AND revoked_at IS NULL",
            wanted,
        )
        rows = cursor.fetchall()
    found = {}
    for key_hash, key_id, name, scopes, queues in rows:
        scopes, queues = _json(scopes), _json(queues)
        found[key_hash] = Principal(
            key_id=key_id,
            name=name,
            scopes=frozenset(scopes or ()),
            queues=frozenset(queues) if queues else None,
        )
    return found


def _json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str | bytes) else value


def parse_authorization(header: str | None) -> str | None:
    """The secret of ``Authorization: Token <secret>``, or None if the header is not that."""
    if not header:
        return None
    parts = header.split()
    if len(parts) != 2 or parts[0].lower() != "token":
        return None
    return parts[1]
