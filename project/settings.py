"""Settings of the Taskhoster server, configured by environment (SPEC section 7)."""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from pathlib import Path

import dj_database_url

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(os.environ.get("TASKHOSTER_VAR", BASE_DIR / "var"))


def _env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    return value.strip().lower() not in {"0", "false", "no", "off"}


def _server_settings(given: str, **defaults: str) -> str:
    """PostgreSQL's startup ``options`` (``-c name=value ...``): ``given`` (DATABASE_URL's
    ``?options=``), with ``-c name=value`` added for each of ``defaults`` it does not set."""
    added = [
        f"-c {name}={value}"
        for name, value in defaults.items()
        if not re.search(rf"(-c\s*|--){name.replace('_', '[-_]')}\s*=", given)
    ]
    return " ".join([given.strip(), *added]).strip()


def _secret_key() -> str:
    key = os.environ.get("DJANGO_SECRET_KEY")
    if key:
        return key
    path = VAR_DIR / "secret_key"
    try:
        key = path.read_text().strip()
    except FileNotFoundError:
        key = ""
    except OSError:
        return secrets.token_urlsafe(50)
    if key:
        return key
    # The first start makes it (or replaces an empty one a power cut left). Several
    # processes may start at once (two test runs side by side, the processes of serve-many):
    # the key is written whole and flushed in a file of this process's own, then linked into
    # place, which only one of them does; the others read the one that won, never a file
    # half written.
    try:
        VAR_DIR.mkdir(parents=True, exist_ok=True)
        tmp = VAR_DIR / f".secret_key.{os.getpid()}.{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "w") as handle:
                handle.write(secrets.token_urlsafe(50))
                handle.flush()
                os.fsync(handle.fileno())
            try:
                os.link(tmp, path)
            except FileExistsError:
                if not path.read_text().strip():  # empty: a power cut's leftover
                    os.replace(tmp, path)
            except OSError:  # a filesystem without hard links
                os.replace(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        dir_fd = os.open(VAR_DIR, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        return path.read_text().strip()
    except OSError:
        return secrets.token_urlsafe(50)


SECRET_KEY = _secret_key()
DEBUG = _env_flag("DJANGO_DEBUG", False)
ALLOWED_HOSTS = [h for h in os.environ.get("DJANGO_ALLOWED_HOSTS", "*").split(",") if h]
CSRF_TRUSTED_ORIGINS = [
    o for o in os.environ.get("DJANGO_CSRF_TRUSTED_ORIGINS", "").split(",") if o
]

# Served over HTTPS (TLS ended by a proxy in front, which says so in X-Forwarded-Proto):
# TASKHOSTER_HTTPS=1 redirects plain HTTP (but /healthz and /metrics, which load balancers
# and Prometheus may ask over plain HTTP), sends HSTS and marks the cookies secure, so that
# `manage.py check --deploy` passes. HSTS is a promise browsers keep for its whole max-age:
# TASKHOSTER_HSTS_SECONDS (a year) and TASKHOSTER_HSTS_PRELOAD (on) change it.
if _env_flag("TASKHOSTER_HTTPS", False):
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    SECURE_SSL_REDIRECT = True
    SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^metrics$"]
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True
    SECURE_HSTS_SECONDS = int(os.environ.get("TASKHOSTER_HSTS_SECONDS", 365 * 24 * 3600))
    SECURE_HSTS_INCLUDE_SUBDOMAINS = True
    SECURE_HSTS_PRELOAD = _env_flag("TASKHOSTER_HSTS_PRELOAD", True)

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "channels",
    "taskhoster",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "project.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]
WSGI_APPLICATION = None
ASGI_APPLICATION = "project.asgi.application"


def _database() -> dict[str, object]:
    url = os.environ.get("DATABASE_URL") or f"sqlite:///{VAR_DIR / 'taskhoster.sqlite3'}"
    config: dict[str, object] = dict(dj_database_url.parse(url))
    engine = str(config["ENGINE"])
    options: dict[str, object] = dict(config.get("OPTIONS") or {})  # type: ignore[call-overload]
    if "sqlite" in engine:
        config["ENGINE"] = "taskhoster.db.sqlite"
        # WAL lets readers run beside the writer; IMMEDIATE makes every write transaction
        # take the lock at BEGIN, so two writers never deadlock upgrading a read lock.
        # synchronous=NORMAL is enough: durability comes from the item files, and the index
        # can be rebuilt from them.
        options.setdefault("transaction_mode", "IMMEDIATE")
        options.setdefault("timeout", 30)
        options.setdefault(
            "init_command",
            "PRAGMA journal_mode=WAL;PRAGMA synchronous=NORMAL;PRAGMA busy_timeout=30000;",
        )
        name = str(config.get("NAME") or "")
        if name and name != ":memory:":
            Path(name).parent.mkdir(parents=True, exist_ok=True)
        config["TEST"] = {
            "NAME": os.environ.get("TASKHOSTER_TEST_DB")
            or str(VAR_DIR / f"test-{os.getpid()}.sqlite3")
        }
    elif "postgresql" in engine:
        # Django's backend, with a pool that answers a request at once while the database is
        # away (taskhoster/db/postgresql/base.py), and attempts to connect that give up.
        config["ENGINE"] = "taskhoster.db.postgresql"
        options.setdefault("connect_timeout", 5)
        # A network that drops packets (a failover that moves an address, a firewall change)
        # answers nothing, not even a reset: an open connection is given up once data it
        # sent stays unacknowledged for 10 s (``tcp_user_timeout``; TCP's own retransmissions
        # take some 15 minutes), and an idle one once 3 probes 2 s apart, after 5 s idle, go
        # unanswered. A slow query is not cut: the server's kernel acknowledges it. Any of
        # these can be set in DATABASE_URL's query (``?tcp_user_timeout=30000``).
        options.setdefault("tcp_user_timeout", 10_000)
        options.setdefault("keepalives", 1)
        options.setdefault("keepalives_idle", 5)
        options.setdefault("keepalives_interval", 2)
        options.setdefault("keepalives_count", 3)
        # The index can be rebuilt from the durable item files, so a commit need not wait
        # for the database's own flush. A prepared statement is planned for its values at
        # each run (``plan_cache_mode``): a plan made once for any values (PostgreSQL's
        # "generic" plan, kept until the table is next analyzed) while the item table was
        # small reads the whole table, and after a burst of posts had grown it to 200,000
        # rows every claim and verdict read all of them until autovacuum's ANALYZE came
        # (a post's answer on another queue went from 6-9 ms to 104-188 ms). Planning again
        # costs some tens of microseconds a statement. Each is added to DATABASE_URL's
        # ``?options=`` unless that sets it.
        options["options"] = _server_settings(
            str(options.get("options") or ""),
            synchronous_commit="off",
            plan_cache_mode="force_custom_plan",
        )
        # The engine's statements (``taskhoster.engine.rows``, bound by the server) are
        # kept prepared on their connection once run a few times: parsed once, not once a
        # group. Django's own queries are never prepared. Behind a connection pooler in
        # transaction mode that does not carry prepared statements from one client to the
        # next: TASKHOSTER_DB_PREPARE=0 (a connection that finds itself behind a pooler keeps
        # nothing prepared anyway: ``taskhoster.db.postgresql``).
        if _env_flag("TASKHOSTER_DB_PREPARE", True):
            options.setdefault("prepare_threshold", 5)
        if os.environ.get("TASKHOSTER_TEST_DB"):
            config["TEST"] = {"NAME": os.environ["TASKHOSTER_TEST_DB"]}
        if _env_flag("TASKHOSTER_DB_POOL", True):
            options.setdefault("pool", {"min_size": 1, "max_size": 20, "timeout": 30})
    config["OPTIONS"] = options
    # SQLite: a request thread keeps its connection (see taskhoster/asgi.py); PostgreSQL:
    # connections come from the pool, which needs CONN_MAX_AGE 0.
    config["CONN_MAX_AGE"] = None if "sqlite" in engine else 0
    return config


DATABASES = {"default": _database()}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

if os.environ.get("REDIS_URL"):
    CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {"hosts": [os.environ["REDIS_URL"]]},
        }
    }
else:
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}

TASKHOSTER = {
    "ROOT": os.environ.get("TASKHOSTER_ROOT") or str(VAR_DIR / "state"),
    "FSYNC": _env_flag("TASKHOSTER_FSYNC", True),
    "COMMITTER": os.environ.get("TASKHOSTER_COMMITTER", "process"),
    "FLUSH": os.environ.get("TASKHOSTER_FLUSH", "auto"),
    "MAX_PAYLOAD_BYTES": int(os.environ.get("TASKHOSTER_MAX_PAYLOAD_BYTES", 1024 * 1024)),
    "REDIS_URL": os.environ.get("REDIS_URL", ""),
    "SOCKET_BACKSTOP_SECONDS": float(os.environ.get("TASKHOSTER_SOCKET_BACKSTOP_SECONDS", 5)),
    "BACKGROUND_SHARE": float(os.environ.get("TASKHOSTER_BACKGROUND_SHARE", 0.25)),
    "BACKGROUND_CHUNK_SECONDS": float(os.environ.get("TASKHOSTER_BACKGROUND_CHUNK_SECONDS", 0.02)),
    "ADMISSION_WAIT_SECONDS": float(os.environ.get("TASKHOSTER_ADMISSION_WAIT_SECONDS", 0.5)),
    "ADMISSION_MAX_ITEMS": int(os.environ.get("TASKHOSTER_ADMISSION_MAX_ITEMS", 10_000)),
    "MIN_FREE_BYTES": int(os.environ.get("TASKHOSTER_MIN_FREE_BYTES", 64 * 1024 * 1024)),
    "MIN_FREE_INODES": int(os.environ.get("TASKHOSTER_MIN_FREE_INODES", 4096)),
    "METRICS_PUBLIC": _env_flag("TASKHOSTER_METRICS_PUBLIC", False),
    "LONG_POLL_INTERVAL": float(os.environ.get("TASKHOSTER_LONG_POLL_INTERVAL", 1.0)),
    "MAX_WAITS_PER_KEY": int(os.environ.get("TASKHOSTER_MAX_WAITS_PER_KEY", 50)),
    "HEALTH_LISTEN": os.environ.get("TASKHOSTER_HEALTH_LISTEN", ""),
    "MAX_REQUEST_THREADS": int(os.environ.get("TASKHOSTER_MAX_REQUEST_THREADS", 64)),
    # Declared by scripts/serve-many; the system checks refuse SQLite for several processes.
    "PROCESSES": int(os.environ.get("TASKHOSTER_PROCESSES") or 1),
}

if os.environ.get("TASKHOSTER_MAX_WAIT_SECONDS"):
    TASKHOSTER["MAX_WAIT_SECONDS"] = float(os.environ["TASKHOSTER_MAX_WAIT_SECONDS"])

# A batch of up to 1,000 items rides in one body; the per-item limit is checked separately.
DATA_UPLOAD_MAX_MEMORY_SIZE = int(os.environ.get("TASKHOSTER_MAX_BODY_BYTES", 64 * 1024 * 1024))

# No REST_FRAMEWORK or SPECTACULAR_SETTINGS: Taskhoster's views carry their own DRF and
# drf-spectacular configuration (taskhoster/api/base.py, taskhoster/api/schema_view.py), as
# they must in any project that installs the app.

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True
STATIC_URL = "static/"
STATIC_ROOT = VAR_DIR / "static"
LOGIN_URL = "/admin/login/"

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {
        "taskhoster": {"handlers": ["console"], "level": os.environ.get("TASKHOSTER_LOG", "INFO")},
    },
}
APPEND_SLASH = False
