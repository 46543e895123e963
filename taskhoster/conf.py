"""Taskhoster's settings, read lazily from ``settings.TASKHOSTER`` so ``override_settings`` works.

Every setting, its default, its type and its bounds are declared once, in ``SETTINGS``:
``get_conf`` reads them, the system checks (``taskhoster.checks``) hold a project's values
against them, and ``docs/configuration.md`` lists them. Every limit a request can meet is
either one of these or fixed by the wire format (``taskhoster.contract``).

``project/settings.py`` fills ``TASKHOSTER`` from the environment (``TASKHOSTER_ROOT``,
``TASKHOSTER_FSYNC``, ...); nothing here is read at import time.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.signals import setting_changed

# The request body limit when DATA_UPLOAD_MAX_MEMORY_SIZE is None (Django's "no limit"): a
# body is read into memory whole, so there is always one.
DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class Setting:
    """One key of ``TASKHOSTER``.

    ``kind``: bool, int, float (an int will do), path, choice or url. ``minimum`` (with
    ``above``: the value must be greater) bounds a number. ``contract``: the default is the
    figure SPEC gives clients (a batch of 1000, a claim of 100, a wait of 60 s); a lower value
    refuses requests that clients written to the contract, ``taskhoster.client`` among them,
    may send.
    """

    name: str
    default: Any
    kind: str
    doc: str
    minimum: float | None = None
    above: bool = False
    maximum: float | None = None
    choices: tuple[str, ...] = ()
    contract: bool = False

    def problem(self, value: Any) -> tuple[str, str] | None:
        """``(what, why)`` for a value of this setting, or None if it is fine: ``what`` is
        ``"type"`` for a value of the wrong type, ``"value"`` for one out of range."""
        kind = self.kind
        if kind == "bool" and not isinstance(value, bool):
            return "type", "must be True or False"
        if kind in ("int", "float"):
            number = (int, float) if kind == "float" else (int,)
            if isinstance(value, bool) or not isinstance(value, number):
                return "type", "must be an integer" if kind == "int" else "must be a number"
            if value != value or value in (float("inf"), float("-inf")):
                return "value", "must be finite"
            if self.minimum is not None and (
                value <= self.minimum if self.above else value < self.minimum
            ):
                bound = "greater than" if self.above else "at least"
                return "value", f"must be {bound} {self.minimum:g}"
            if self.maximum is not None and value > self.maximum:
                return "value", f"must be at most {self.maximum:g}"
        if kind == "path":
            if not isinstance(value, str | Path):
                return "type", "must be a path (a string or a pathlib.Path)"
            if not str(value):
                return "value", "must not be empty"
        if kind == "choice":
            if not isinstance(value, str):
                return "type", f"must be a string, one of {', '.join(self.choices)}"
            if value not in self.choices:
                return "value", f"must be one of {', '.join(self.choices)}"
        if kind == "url" and not isinstance(value, str):
            return "type", "must be a string (empty for none)"
        if kind == "address":
            if not isinstance(value, str):
                return "type", 'must be a string, "host:port" (empty for none)'
            _host, sep, port = value.rpartition(":")
            if value and (not sep or not port.isdigit() or not 0 < int(port) < 65536):
                return "value", 'must be "host:port" (or ":port" for every interface)'
        return None


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "ROOT",
        "var/state",
        "path",
        "The state directories: one folder per queue, an item's file in the folder of its "
        "state. Give an absolute path: a relative one is resolved against each process's "
        "working directory.",
    ),
    Setting(
        "FSYNC",
        True,
        "bool",
        "Make each acknowledged change durable before answering. False is faster, but a "
        "power cut may lose acknowledged items.",
    ),
    Setting(
        "FLUSH",
        "syncfs",
        "choice",
        "How a group's files are made durable: syncfs (one call for the whole filesystem; "
        "Linux, else fsync is used) or fsync (each written file and each touched directory).",
        choices=("syncfs", "fsync"),
    ),
    Setting(
        "COMMITTER",
        "thread",
        "choice",
        "Where group commits run: thread (a thread of this process) or process (a process of "
        "its own beside it, off its GIL: a server's choice).",
        choices=("thread", "process"),
    ),
    Setting(
        "MAX_PAYLOAD_BYTES",
        1024 * 1024,
        "int",
        "The largest payload or result, as compact JSON (413 above it).",
        minimum=1,
    ),
    Setting(
        "MAX_JSON_DEPTH",
        100,
        "int",
        "The deepest nesting of JSON a request body or a /work frame may have (400 too_deep "
        "above it).",
        minimum=1,
    ),
    Setting(
        "MAX_BATCH",
        1000,
        "int",
        "The most items one post may carry (413 above it).",
        minimum=1,
        contract=True,
    ),
    Setting(
        "MAX_WAIT_SECONDS",
        60,
        "float",
        "The longest long-poll: GET /api/items/{id}?wait= and a claim's wait.",
        minimum=0,
        contract=True,
    ),
    Setting(
        "MAX_CLAIM",
        100,
        "int",
        "The most items one claim takes: a REST claim's max, and each claim the socket "
        "dispatcher makes for its sockets' free slots on a queue (it claims again for the "
        "rest).",
        minimum=1,
        contract=True,
    ),
    Setting(
        "MAX_CAPACITY",
        1000,
        "int",
        "The largest capacity a /work socket may subscribe with.",
        minimum=1,
    ),
    Setting(
        "MAX_SOCKET_HELD_BYTES",
        16 * 1024 * 1024,
        "int",
        "A /work socket gets no more items while the frames of those it holds add up to "
        "this many bytes (a worker that does not read costs the server this much, not its "
        "capacity times the largest payload); it always may hold one.",
        minimum=1,
    ),
    Setting(
        "MAX_SUBSCRIBE_QUEUES",
        100,
        "int",
        "The most queues one /work subscription may name.",
        minimum=1,
    ),
    Setting(
        "MAX_DELETE_IDS",
        10_000,
        "int",
        "The most ids one POST /api/queues/{queue}/items/delete may name.",
        minimum=1,
    ),
    Setting(
        "PAGE_SIZE",
        100,
        "int",
        "Items or threads per page when a listing gives no limit.",
        minimum=1,
    ),
    Setting(
        "MAX_PAGE_SIZE",
        1000,
        "int",
        "The largest limit a listing may ask for (at least PAGE_SIZE).",
        minimum=1,
    ),
    Setting(
        "SWEEP_CHUNK",
        500,
        "int",
        "Items the sweep handles per transaction.",
        minimum=1,
    ),
    Setting(
        "REPAIR_GRACE_SECONDS",
        60,
        "float",
        "sweep --repair leaves files younger than this to a server that may be writing them.",
        minimum=0,
    ),
    Setting(
        "LONG_POLL_INTERVAL",
        1.0,
        "float",
        "How often a long-poll looks again when no news woke it (news of its item or queue "
        "wakes it at once, from any process).",
        minimum=0,
        above=True,
    ),
    Setting(
        "SOCKET_BACKSTOP_SECONDS",
        5.0,
        "float",
        "How often a server re-checks for work its idle sockets could take, in case news was lost.",
        minimum=0,
        above=True,
    ),
    Setting(
        "BACKGROUND_SHARE",
        0.25,
        "float",
        "The largest share of the time background work (reclaiming a deleted queue, deletes "
        "by status, retention of many items, unlinking behind them, repair beside a live "
        "server) may take while foreground work runs on the host: after each chunk it rests in "
        "proportion; alone it never rests. 1 runs it flat out always.",
        minimum=0,
        above=True,
        maximum=1,
    ),
    Setting(
        "BACKGROUND_CHUNK_SECONDS",
        0.02,
        "float",
        "About how long one chunk of background work may run while foreground work runs: "
        "chunks are sized to it, so that work waits at most about this long behind one "
        "(alone, chunks grow to five times this).",
        minimum=0,
        above=True,
    ),
    Setting(
        "ADMISSION_WAIT_SECONDS",
        0.5,
        "float",
        "Overload: while the oldest operation waiting for this process's committer has waited "
        "longer than this, new posts are refused at once (503 overloaded, with Retry-After) "
        "rather than queued behind it.",
        minimum=0,
        above=True,
    ),
    Setting(
        "ADMISSION_MAX_ITEMS",
        10_000,
        "int",
        "Overload: while this many items or more (of posts, claims, results...) wait for "
        "this process's committer, new posts are refused at once (503 overloaded).",
        minimum=1,
    ),
    Setting(
        "MAX_REQUEST_THREADS",
        64,
        "int",
        "Under taskhoster.asgi's handler, the most threads that answer requests at once "
        "(16 kept, the rest made for the moment); beyond, a request is refused at once with "
        "503 overloaded.",
        minimum=16,
    ),
    Setting(
        "MAX_WAITS_PER_KEY",
        50,
        "int",
        "The most long-polls (a GET of an item with wait, a claim with wait) one key may have "
        "waiting in one server process; more are answered at once, without waiting.",
        minimum=1,
    ),
    Setting(
        "HEALTH_LISTEN",
        "",
        "address",
        'Where a server process also answers GET /healthz in a thread of its own, "host:port" '
        '(":port": every interface; empty: nowhere). Under a flood of requests the event '
        "loop serves every connection in turn, and a /healthz on the main port waits its "
        "turn; on this port it does not. Only the public body (no key is read here).",
    ),
    Setting(
        "HEALTH_INTERVAL",
        1.0,
        "float",
        "How often a server process makes its /healthz report (in a thread of its own; "
        "/healthz answers at once with the latest).",
        minimum=0,
        above=True,
    ),
    Setting(
        "MIN_FREE_BYTES",
        64 * 1024 * 1024,
        "int",
        "Readiness: /healthz answers 503 while the state root's filesystem has less free "
        "space than this (as an unprivileged process sees it).",
        minimum=0,
    ),
    Setting(
        "MIN_FREE_INODES",
        4096,
        "int",
        "Readiness: /healthz answers 503 while the state root's filesystem has fewer free "
        "inodes than this (each item is a file).",
        minimum=0,
    ),
    Setting(
        "METRICS_PUBLIC",
        False,
        "bool",
        "Serve /metrics without a key. By default it needs a key of any scope (as GET "
        "/api/queues), and shows only the queues a key limited to some may use.",
    ),
    Setting(
        "REDIS_URL",
        "",
        "url",
        "Redis for news between server processes on any host (redis://, rediss:// or "
        "unix://). Empty: a doorbell under the state root, which reaches the processes of "
        "this host only.",
    ),
    Setting(
        "PROCESSES",
        1,
        "int",
        "How many server processes serve this database and state root (declared; "
        "scripts/serve-many sets it from TASKHOSTER_PROCESSES). Read by the system checks: "
        "several need PostgreSQL, and Redis across hosts.",
        minimum=1,
    ),
)
BY_NAME = {s.name: s for s in SETTINGS}
DEFAULTS: dict[str, Any] = {s.name: s.default for s in SETTINGS}


@dataclass(frozen=True)
class Conf:
    root: Path
    fsync: bool
    flush: str
    committer: str
    max_payload_bytes: int
    max_json_depth: int
    max_batch: int
    max_wait_seconds: float
    max_claim: int
    max_capacity: int
    max_socket_held_bytes: int
    max_subscribe_queues: int
    max_delete_ids: int
    page_size: int
    max_page_size: int
    sweep_chunk: int
    repair_grace_seconds: float
    long_poll_interval: float
    socket_backstop_seconds: float
    background_share: float
    background_chunk_seconds: float
    admission_wait_seconds: float
    admission_max_items: int
    max_request_threads: int
    max_waits_per_key: int
    health_interval: float
    health_listen: str
    min_free_bytes: int
    min_free_inodes: int
    metrics_public: bool
    redis_url: str
    processes: int
    # Django's DATA_UPLOAD_MAX_MEMORY_SIZE: the largest REST request body (a batch rides in
    # one); DEFAULT_MAX_BODY_BYTES when it is None or 0.
    max_body_bytes: int


_cached: Conf | None = None


def get_conf() -> Conf:
    """The settings, read once and again whenever ``TASKHOSTER`` (or the body limit) changes
    (``override_settings`` sends ``setting_changed``)."""
    global _cached
    if _cached is None:
        _cached = _read()
    return _cached


def _forget(*, setting: str, **_kwargs: Any) -> None:
    global _cached
    if setting in ("TASKHOSTER", "DATA_UPLOAD_MAX_MEMORY_SIZE"):
        _cached = None


setting_changed.connect(_forget)


def user_settings() -> Any:
    """``settings.TASKHOSTER`` as the project gives it (the checks look at it as it is)."""
    return getattr(settings, "TASKHOSTER", None)


def _read() -> Conf:
    user = user_settings()
    merged = {**DEFAULTS, **(user if isinstance(user, dict) else {})}
    return Conf(
        root=Path(merged["ROOT"]),
        fsync=bool(merged["FSYNC"]),
        flush=str(merged["FLUSH"]),
        committer=str(merged["COMMITTER"]),
        max_payload_bytes=int(merged["MAX_PAYLOAD_BYTES"]),
        max_json_depth=int(merged["MAX_JSON_DEPTH"]),
        max_batch=int(merged["MAX_BATCH"]),
        max_wait_seconds=float(merged["MAX_WAIT_SECONDS"]),
        max_claim=int(merged["MAX_CLAIM"]),
        max_capacity=int(merged["MAX_CAPACITY"]),
        max_socket_held_bytes=int(merged["MAX_SOCKET_HELD_BYTES"]),
        max_subscribe_queues=int(merged["MAX_SUBSCRIBE_QUEUES"]),
        max_delete_ids=int(merged["MAX_DELETE_IDS"]),
        page_size=int(merged["PAGE_SIZE"]),
        max_page_size=int(merged["MAX_PAGE_SIZE"]),
        sweep_chunk=int(merged["SWEEP_CHUNK"]),
        repair_grace_seconds=float(merged["REPAIR_GRACE_SECONDS"]),
        long_poll_interval=float(merged["LONG_POLL_INTERVAL"]),
        socket_backstop_seconds=float(merged["SOCKET_BACKSTOP_SECONDS"]),
        background_share=float(merged["BACKGROUND_SHARE"]),
        background_chunk_seconds=float(merged["BACKGROUND_CHUNK_SECONDS"]),
        admission_wait_seconds=float(merged["ADMISSION_WAIT_SECONDS"]),
        admission_max_items=int(merged["ADMISSION_MAX_ITEMS"]),
        max_request_threads=int(merged["MAX_REQUEST_THREADS"]),
        max_waits_per_key=int(merged["MAX_WAITS_PER_KEY"]),
        health_interval=float(merged["HEALTH_INTERVAL"]),
        health_listen=str(merged["HEALTH_LISTEN"]),
        min_free_bytes=int(merged["MIN_FREE_BYTES"]),
        min_free_inodes=int(merged["MIN_FREE_INODES"]),
        metrics_public=bool(merged["METRICS_PUBLIC"]),
        redis_url=str(merged["REDIS_URL"] or ""),
        processes=int(merged["PROCESSES"]),
        max_body_bytes=int(getattr(settings, "DATA_UPLOAD_MAX_MEMORY_SIZE", None) or 0)
        or DEFAULT_MAX_BODY_BYTES,
    )
