"""What ``/healthz`` reports: which database, news bus, channel layer and state root this
process uses, and whether each answers.

With several server processes behind one address (or several hosts), a load balancer or an
operator asks each process in turn; every part is named (a URL without its password, a
path), so two processes that disagree about what they share show it at once.
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from django.conf import settings
from django.db import connection

from . import bus as news_bus
from . import metrics
from .conf import get_conf
from .engine.common import store


def _redacted(url: str) -> str:
    """``url`` without its password."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}{port}"))


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".strip()[:300]


def database() -> dict[str, Any]:
    db = settings.DATABASES["default"]
    answer: dict[str, Any] = {"vendor": connection.vendor, "name": str(db.get("NAME") or "")}
    if connection.vendor != "sqlite":
        answer["host"] = f"{db.get('HOST') or 'localhost'}:{db.get('PORT') or 5432}"
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        answer["reachable"] = True
    except Exception as exc:
        answer["reachable"] = False
        answer["error"] = _error(exc)
    return answer


def bus() -> dict[str, Any]:
    """The news bus that wakes sockets in other processes (``taskhoster.bus``)."""
    url = get_conf().redis_url
    answer: dict[str, Any] = (
        {"kind": "redis", "url": _redacted(url)}
        if url
        # The doorbell: abstract unix sockets, so only processes of this host hear it.
        else {"kind": "doorbell", "scope": "this host"}
    )
    try:
        news_bus.ping()
        answer["reachable"] = True
    except Exception as exc:
        answer["reachable"] = False
        answer["error"] = _error(exc)
    return answer


def channel_layer() -> dict[str, Any]:
    """The project's channel layer, for the operator's information: in-process, shared, or
    none. Taskhoster's own sockets use none (their news comes by ``taskhoster.bus``), so a
    project need not configure one."""
    layers = getattr(settings, "CHANNEL_LAYERS", None) or {}
    backend = str(layers.get("default", {}).get("BACKEND", ""))
    if not backend:
        return {"backend": "", "scope": "none"}
    shared = "InMemory" not in backend
    return {"backend": backend, "scope": "all processes" if shared else "this process"}


def state_root() -> dict[str, Any]:
    root = store().root  # resolved once, when the store was made
    answer: dict[str, Any] = {"path": str(root)}
    if not root.is_dir():
        answer["reachable"] = False
        answer["error"] = "missing: run manage.py bootstrap, or create it"
        return answer
    # access(2) also answers "no" on a read-only mount (EROFS).
    answer["reachable"] = os.access(root, os.W_OK | os.X_OK)
    if not answer["reachable"]:
        answer["error"] = "not writable by this process"
    return answer


def report() -> tuple[bool, dict[str, Any]]:
    """(healthy, the body of ``/healthz``)."""
    parts = {
        "database": database(),
        "bus": bus(),
        "stateRoot": state_root(),
    }
    healthy = all(part["reachable"] for part in parts.values())
    body: dict[str, Any] = {
        "status": "ok" if healthy else "unavailable",
        "process": metrics.PROCESS,
        "pid": os.getpid(),
        **parts,
        "channelLayer": channel_layer(),
    }
    return healthy, body
