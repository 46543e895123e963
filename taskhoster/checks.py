"""Django system checks of Taskhoster's configuration (``manage.py check``).

Registered in ``TaskhosterConfig.ready`` under the tag ``taskhoster``. Every check reads the
project's settings as they are and changes nothing. Three look further:

- the state root's is judged by a probe that makes and removes one empty directory there (or
  in the folder it would be made in): permission bits do not tell, since root ignores them
  and a read-only mount or sysfs refuses even root;
- the route check imports ``ASGI_APPLICATION``, as Django's URL checks import
  ``ROOT_URLCONF``, holding back the committer a server module may start at import
  (``engine.hold_start``), so checking starts no process;
- the one that asks Redis to answer talks to a server, so it runs only with ``--deploy``,
  and waits at most ``REDIS_TIMEOUT_SECONDS``.

Ids (each described in docs/configuration.md, each with a test in tests/unit/test_checks.py
or, where it needs a fresh process, tests/integration/test_checks_command.py):

- E001 ``TASKHOSTER`` is not a dict; E002 an unknown key; E003 a value of the wrong type;
  E004 a value out of range or not one of its choices; E005 ``MAX_PAGE_SIZE`` below
  ``PAGE_SIZE``; E006 ``DATA_UPLOAD_MAX_MEMORY_SIZE`` too small for one payload at its limit;
- E007 the state root is not a directory; E008 it is missing and cannot be created; E009 it
  cannot be written to;
- E010 SQLite served by several processes; E011 ``REDIS_URL`` not a Redis URL; E012 (deploy)
  Redis does not answer;
- E013 ``ASGI_APPLICATION`` cannot be imported; E014 it has no websocket route to the
  ``/work`` consumer;
- W001 fsync off; W002 several processes and no Redis; W003 a relative state root; W004 a
  limit below the contract's figure; W005 SQLite without IMMEDIATE transactions; W006 no
  ``ASGI_APPLICATION`` to look at; W007 an ASGI wrapper the check cannot see through; W008
  PostgreSQL's prepared statements without ``plan_cache_mode=force_custom_plan``.
"""

from __future__ import annotations

import difflib
import os
import re
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from django.apps import AppConfig
from django.conf import settings
from django.core import checks
from django.db import connections
from django.utils.module_loading import import_string

from . import conf
from .contract import ENVELOPE_BYTES

TAG = "taskhoster"
DOCS = "see docs/configuration.md"
REDIS_SCHEMES = ("redis", "rediss", "unix")
REDIS_TIMEOUT_SECONDS = 1.0

Messages = list[checks.CheckMessage]


def register() -> None:
    """Register every check (``TaskhosterConfig.ready``; registering twice is harmless)."""
    checks.register(check_settings, TAG)
    checks.register(check_state_root, TAG)
    checks.register(check_durability, TAG)
    checks.register(check_time_zone, TAG)
    checks.register(check_processes, TAG)
    checks.register(check_redis_url, TAG)
    checks.register(check_redis_answers, TAG, deploy=True)
    checks.register(check_work_route, TAG, checks.Tags.urls)


def _id(number: str) -> str:
    return f"{TAG}.{number}"


def _setting(name: str) -> str:
    return f"TASKHOSTER[{name!r}]"


def _conf() -> conf.Conf | None:
    """The settings as the server would read them, or None while E001, E003 or E004 stands
    (the other checks then wait: they would judge values the project did not mean)."""
    user = conf.user_settings()
    if user is None:
        user = {}
    if not isinstance(user, dict):
        return None
    if any(s.problem(user[s.name]) for s in conf.SETTINGS if s.name in user):
        return None
    try:
        return conf.get_conf()
    except (TypeError, ValueError, OverflowError):
        return None


# -- the TASKHOSTER settings ----------------------------------------------------------------


def check_settings(app_configs: Sequence[AppConfig] | None = None, **kwargs: Any) -> Messages:
    user = conf.user_settings()
    if user is None:
        user = {}
    if not isinstance(user, dict):
        return [
            checks.Error(
                f"TASKHOSTER must be a dict of settings, not {type(user).__name__}.",
                hint=f"TASKHOSTER = {{'ROOT': '/srv/taskhoster/state', ...}}; {DOCS}.",
                id=_id("E001"),
            )
        ]
    found: Messages = []
    for name in sorted(set(user) - set(conf.BY_NAME), key=str):
        close = difflib.get_close_matches(str(name), list(conf.BY_NAME), n=1)
        found.append(
            checks.Error(
                f"TASKHOSTER has an unknown key {name!r}.",
                hint=f"Did you mean {close[0]!r}?" if close else f"The keys are listed in {DOCS}.",
                id=_id("E002"),
            )
        )
    for setting in conf.SETTINGS:
        if setting.name not in user:
            continue
        problem = setting.problem(user[setting.name])
        if problem is None:
            continue
        what, why = problem
        found.append(
            checks.Error(
                f"{_setting(setting.name)} {why}; it is {user[setting.name]!r}.",
                hint=setting.doc,
                id=_id("E003" if what == "type" else "E004"),
            )
        )
    raw = getattr(settings, "DATA_UPLOAD_MAX_MEMORY_SIZE", None)
    if raw is not None and (isinstance(raw, bool) or not isinstance(raw, int) or raw < 0):
        found.append(
            checks.Error(
                f"DATA_UPLOAD_MAX_MEMORY_SIZE must be a number of bytes or None; it is {raw!r}.",
                hint="It is the largest REST request body Taskhoster reads (a batch rides in one).",
                id=_id("E006"),
            )
        )
        return found
    current = _conf()
    if current is None:
        return found
    if current.max_page_size < current.page_size:
        found.append(
            checks.Error(
                f"{_setting('MAX_PAGE_SIZE')} ({current.max_page_size}) is below "
                f"{_setting('PAGE_SIZE')} ({current.page_size}): a listing without a limit "
                "would be served a page larger than any it may ask for.",
                hint="Make MAX_PAGE_SIZE at least PAGE_SIZE.",
                id=_id("E005"),
            )
        )
    found += _body_limit(current)
    found += _below_contract(user)
    return found


def _body_limit(current: conf.Conf) -> Messages:
    needed = current.max_payload_bytes + ENVELOPE_BYTES
    if current.max_body_bytes >= needed:
        return []
    return [
        checks.Error(
            f"DATA_UPLOAD_MAX_MEMORY_SIZE ({current.max_body_bytes} bytes) cannot hold one item "
            f"with a payload at {_setting('MAX_PAYLOAD_BYTES')} ({current.max_payload_bytes}): "
            "such a post, or a result, would be refused as too large although its payload is "
            "within the limit.",
            hint=f"Make DATA_UPLOAD_MAX_MEMORY_SIZE at least {needed} (the payload limit and "
            f"{ENVELOPE_BYTES} bytes for the rest of the body), or lower MAX_PAYLOAD_BYTES. "
            "A batch's body holds many items; size it for the batches you post.",
            id=_id("E006"),
        )
    ]


def _below_contract(user: dict[str, Any]) -> Messages:
    found: Messages = []
    for setting in conf.SETTINGS:
        if setting.contract and setting.name in user and user[setting.name] < setting.default:
            found.append(
                checks.Warning(
                    f"{_setting(setting.name)} is {user[setting.name]!r}, below the contract's "
                    f"{setting.default}: requests that clients written to the contract may send "
                    "(taskhoster.client's among them) are refused.",
                    hint=f"{setting.doc} Lower it only for clients that keep to the new limit.",
                    id=_id("W004"),
                )
            )
    return found


# -- the state root --------------------------------------------------------------------------


def _probe(directory: Path) -> OSError | None:
    """Why no entry can be made in ``directory`` (by making one and removing it), or None."""
    try:
        made = tempfile.mkdtemp(prefix=".taskhoster-check-", dir=directory)
    except OSError as exc:
        return exc
    os.rmdir(made)
    return None


def _nearest_existing(path: Path) -> Path:
    for candidate in (path, *path.parents):
        if candidate.exists() or candidate.is_symlink():
            return candidate
    return Path(path.anchor or ".")


def check_state_root(app_configs: Sequence[AppConfig] | None = None, **kwargs: Any) -> Messages:
    current = _conf()
    if current is None:
        return []
    root = current.root
    found: Messages = []
    if not root.is_absolute():
        found.append(
            checks.Warning(
                f"{_setting('ROOT')} is a relative path ({str(root)!r}): each process resolves "
                "it against its own working directory, so a server and a sweep started from "
                "different directories would keep two different sets of items.",
                hint="Give an absolute path.",
                id=_id("W003"),
            )
        )
    if root.exists() and not root.is_dir():
        found.append(
            checks.Error(
                f"The state root {str(root)!r} ({_setting('ROOT')}) exists and is not a directory.",
                hint="Point ROOT at a directory, or at a path where one can be made.",
                id=_id("E007"),
            )
        )
        return found
    if not root.exists():
        parent = _nearest_existing(root.parent)
        why = ""
        if not parent.is_dir():
            why = f"{str(parent)!r} is not a directory"
        elif (problem := _probe(parent)) is not None:
            why = f"nothing can be made in {str(parent)!r}: {problem}"
        if why:
            found.append(
                checks.Error(
                    f"The state root {str(root)!r} ({_setting('ROOT')}) does not exist and "
                    f"cannot be created: {why}.",
                    hint="Create it (writable by the server's user), or point ROOT elsewhere.",
                    id=_id("E008"),
                )
            )
        return found
    problem = _probe(root)
    if problem is not None:
        found.append(
            checks.Error(
                f"The state root {str(root)!r} ({_setting('ROOT')}) cannot be written to: "
                f"{problem}.",
                hint="Every post, claim and result writes there: make it writable by the "
                "server's user (and not a read-only mount).",
                id=_id("E009"),
            )
        )
    return found


def check_durability(app_configs: Sequence[AppConfig] | None = None, **kwargs: Any) -> Messages:
    current = _conf()
    if current is None or current.fsync:
        return []
    return [
        checks.Warning(
            f"{_setting('FSYNC')} is off: a power cut (or a crash of the machine) can lose "
            "items, results and changes the server has already acknowledged.",
            hint="Leave FSYNC on (TASKHOSTER_FSYNC=1) unless losing acknowledged work is "
            "acceptable, as in tests or benchmarks.",
            id=_id("W001"),
        )
    ]


def check_time_zone(app_configs: Sequence[AppConfig] | None = None, **kwargs: Any) -> Messages:
    """The engine's times are aware UTC (``timeutil.now``) and compared with what the index
    holds: with ``USE_TZ`` off, Django would hand it naive times to compare them with."""
    if getattr(settings, "USE_TZ", False):
        return []
    return [
        checks.Error(
            "USE_TZ is False: Taskhoster keeps every time in UTC, aware, and the database "
            "would give it naive times to compare them with.",
            hint="Set USE_TZ = True (Django's default since 5.0).",
            id=_id("E015"),
        )
    ]


# -- several processes, the database and Redis -----------------------------------------------


def check_processes(
    app_configs: Sequence[AppConfig] | None = None,
    databases: Sequence[str] | None = None,
    **kwargs: Any,
) -> Messages:
    current = _conf()
    if current is None:
        return []
    found: Messages = []
    sqlite = connections["default"].vendor == "sqlite"
    if sqlite and current.processes > 1:
        found.append(
            checks.Error(
                f"{current.processes} server processes ({_setting('PROCESSES')}, "
                "TASKHOSTER_PROCESSES) would share one SQLite database: SQLite serialises "
                "every writer of every process on one file lock, and cannot be shared across "
                "hosts (scripts/serve-many refuses it for the same reason).",
                hint="Use PostgreSQL (DATABASE_URL=postgres://...) for several processes, or "
                "serve from one process (PROCESSES = 1).",
                id=_id("E010"),
            )
        )
    if current.processes > 1 and not current.redis_url:
        found.append(
            checks.Warning(
                f"{current.processes} server processes and no {_setting('REDIS_URL')}: news "
                "between them (new work for their sockets, cancels) goes by a doorbell that "
                "reaches the processes of this host only.",
                hint="Set REDIS_URL to a Redis all processes share, certainly before adding a "
                "second host.",
                id=_id("W002"),
            )
        )
    options = connections["default"].settings_dict.get("OPTIONS") or {}
    if sqlite and str(options.get("transaction_mode", "")).upper() != "IMMEDIATE":
        found.append(
            checks.Warning(
                "The SQLite database does not begin write transactions IMMEDIATE: two "
                "writers (the server's committer and a sweep) can then fail with 'database "
                "is locked' instead of waiting for each other.",
                hint="DATABASES['default']['OPTIONS']['transaction_mode'] = 'IMMEDIATE'.",
                id=_id("W005"),
            )
        )
    if connections["default"].vendor == "postgresql" and _plans_kept(options):
        found.append(
            checks.Warning(
                "PostgreSQL with prepared statements (OPTIONS['prepare_threshold']) and "
                "without plan_cache_mode=force_custom_plan: a statement's plan made while the "
                "item table was small, which reads the whole table, can be kept until its next "
                "ANALYZE; after a burst of posts every claim and verdict then reads all of it.",
                hint="Add '-c plan_cache_mode=force_custom_plan' to OPTIONS['options'] (as "
                "project/settings.py does), or leave prepare_threshold out. If the database "
                "or role sets it (ALTER ROLE ... SET), silence this warning.",
                id=_id("W008"),
            )
        )
    return found


def _plans_kept(options: dict[str, Any]) -> bool:
    """Whether a PostgreSQL connection with these OPTIONS prepares statements (psycopg's
    ``prepare_threshold``; Django leaves it None: nothing prepared) without asking the
    server to plan each run for its values."""
    if options.get("prepare_threshold") is None:
        return False
    startup = str(options.get("options") or "")
    return not re.search(r"(-c\s*|--)plan[-_]cache[-_]mode\s*=\s*force_custom_plan\b", startup)


def check_redis_url(app_configs: Sequence[AppConfig] | None = None, **kwargs: Any) -> Messages:
    current = _conf()
    if current is None or not current.redis_url:
        return []
    scheme = urlsplit(current.redis_url).scheme
    if scheme in REDIS_SCHEMES:
        return []
    return [
        checks.Error(
            f"{_setting('REDIS_URL')} is not a Redis URL: {current.redis_url!r}.",
            hint="redis://host:6379/0, rediss:// for TLS, unix:///path/to/redis.sock; or "
            "empty for no Redis.",
            id=_id("E011"),
        )
    ]


def check_redis_answers(app_configs: Sequence[AppConfig] | None = None, **kwargs: Any) -> Messages:
    """With ``--deploy`` only: it talks to Redis (waiting at most REDIS_TIMEOUT_SECONDS)."""
    current = _conf()
    if current is None or not current.redis_url:
        return []
    if urlsplit(current.redis_url).scheme not in REDIS_SCHEMES:
        return []  # E011
    import redis

    client = redis.Redis.from_url(
        current.redis_url,
        socket_connect_timeout=REDIS_TIMEOUT_SECONDS,
        socket_timeout=REDIS_TIMEOUT_SECONDS,
    )
    try:
        client.ping()
    except (redis.RedisError, OSError) as exc:
        return [
            checks.Error(
                f"Redis at {_redacted(current.redis_url)} ({_setting('REDIS_URL')}) does not "
                f"answer: {exc}.",
                hint="Start it, or correct REDIS_URL: without it, sockets in other processes "
                "hear of new work only at their backstop re-check, and cancels come late.",
                id=_id("E012"),
            )
        ]
    finally:
        client.close()
    return []


def _redacted(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return parts._replace(netloc=netloc).geturl()


# -- the /work route ---------------------------------------------------------------------------


def check_work_route(app_configs: Sequence[AppConfig] | None = None, **kwargs: Any) -> Messages:
    path = getattr(settings, "ASGI_APPLICATION", None)
    if not path:
        return [
            checks.Warning(
                "ASGI_APPLICATION is not set, so the checks cannot look for the /work route "
                "that workers connect to.",
                hint="Set ASGI_APPLICATION to the application your ASGI server runs (for "
                "daphne's runserver it is required anyway).",
                id=_id("W006"),
            )
        ]
    from .engine import hold_start

    try:
        with hold_start():
            application = import_string(str(path))
    except Exception as exc:
        return [
            checks.Error(
                f"ASGI_APPLICATION {path!r} cannot be imported: {type(exc).__name__}: {exc}.",
                hint="It must name the module attribute your ASGI server runs.",
                id=_id("E013"),
            )
        ]
    routed, opaque = _find_work_route(application)
    if routed:
        return []
    if opaque:
        return [
            checks.Warning(
                f"ASGI_APPLICATION {path!r} routes websockets through {opaque}, which the "
                "check cannot look into; it found no route to the /work consumer elsewhere.",
                hint="Make sure its websocket routes include "
                "path('work', WorkConsumer.as_asgi()) (taskhoster.routing."
                "websocket_urlpatterns); if they do, silence taskhoster.W007 "
                "(SILENCED_SYSTEM_CHECKS).",
                id=_id("W007"),
            )
        ]
    return [
        checks.Error(
            f"ASGI_APPLICATION {path!r} has no websocket route to Taskhoster's /work "
            "consumer: workers cannot connect.",
            hint="Route websockets to it, e.g. ProtocolTypeRouter({'http': ..., 'websocket': "
            "URLRouter(taskhoster.routing.websocket_urlpatterns)}).",
            id=_id("E014"),
        )
    ]


def _find_work_route(application: Any) -> tuple[bool, str]:
    """(whether a websocket route leads to ``WorkConsumer``, the first wrapper the walk could
    not look into, or "")."""
    from channels.routing import ProtocolTypeRouter, URLRouter
    from django.core.handlers.asgi import ASGIHandler

    from .work.consumer import WorkConsumer

    opaque = ""
    seen: set[int] = set()

    def children(node: Any) -> Iterator[Any] | None:
        """What a router or wrapper hands websockets to; None if it is no router or
        wrapper this walk knows."""
        if isinstance(node, ProtocolTypeRouter):
            return iter([node.application_mapping.get("websocket")])
        if isinstance(node, URLRouter):
            return (route.callback for route in node.routes)
        if isinstance(node, ASGIHandler):
            return iter([])  # Django's own handler serves HTTP only
        # channels' middleware (AuthMiddlewareStack, ...) keeps ``inner``; OriginValidator
        # and Django's static files handler keep ``application``.
        inner = [getattr(node, name, None) for name in ("inner", "application", "app")]
        wrapped = [child for child in inner if child is not None and child is not node]
        return iter(wrapped) if wrapped else None

    def walk(node: Any) -> bool:
        nonlocal opaque
        if node is None or id(node) in seen:
            return False
        seen.add(id(node))
        consumer = getattr(node, "consumer_class", None)
        if isinstance(consumer, type) and issubclass(consumer, WorkConsumer):
            return True
        if consumer is not None:
            return False  # another consumer
        found = children(node)
        if found is None:
            opaque = opaque or _describe(node)
            return False
        return any(walk(child) for child in found)

    return walk(application), opaque


def _describe(node: Any) -> str:
    """A function or class by its name, anything else by its type's."""
    named = node if hasattr(node, "__qualname__") else type(node)
    return f"{named.__module__}.{named.__qualname__}"
