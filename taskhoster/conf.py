"""Taskhoster's settings, read lazily from ``settings.TASKHOSTER`` so ``override_settings`` works.

Every setting is declared once, as an attribute of ``Conf``: ``max_batch = Setting(INT, 1000,
...)`` is the key ``MAX_BATCH`` (the attribute's name in capitals) with its kind (which is also
the Python type of ``get_conf().max_batch``), its default, its doc and its bounds. ``SETTINGS``
lists them: ``get_conf`` reads them, the system checks (``taskhoster.checks``) hold a
project's values against them, and ``docs/configuration.md`` lists them (a test holds it to
them). Every limit a request can meet is either one of these or fixed by the wire format
(``taskhoster.contract``).

``project/settings.py`` fills ``TASKHOSTER`` from the environment (``TASKHOSTER_ROOT``,
``TASKHOSTER_FSYNC``, ...); nothing here is read at import time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import KW_ONLY, FrozenInstanceError, dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar, cast, overload

from django.conf import settings
from django.core.signals import setting_changed

# The request body limit when DATA_UPLOAD_MAX_MEMORY_SIZE is None (Django's "no limit"): a
# body is read into memory whole, so there is always one.
DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024


T = TypeVar("T")


@dataclass(frozen=True)
class Kind(Generic[T]):
    """What a setting holds: ``name`` for its checks (``Setting.problem``), and ``read``,
    which turns the project's value into the one ``get_conf`` gives (of type ``T``)."""

    name: str
    read: Callable[[Any], T]


BOOL = Kind("bool", bool)
INT = Kind("int", int)
FLOAT = Kind("float", float)  # an int will do
PATH = Kind("path", Path)
CHOICE = Kind("choice", str)  # one of the setting's ``choices``
URL: Kind[str] = Kind("url", lambda value: str(value or ""))  # empty for none
ADDRESS = Kind("address", str)  # "host:port", empty for none


@dataclass(frozen=True)
class Setting(Generic[T]):
    """One key of ``TASKHOSTER``, declared as an attribute of ``Conf``: the key is the
    attribute's name in capitals, ``get_conf().<attribute>`` its value, of ``kind``'s type.

    ``minimum`` (with ``above``: the value must be greater) bounds a number. ``contract``: the
    default is the figure SPEC gives clients (a batch of 1000, a claim of 100, a wait of 60 s);
    a lower value refuses requests that clients written to the contract, ``taskhoster.client``
    among them, may send.
    """

    kind: Kind[T]
    default: Any
    doc: str
    _: KW_ONLY
    minimum: float | None = None
    above: bool = False
    maximum: float | None = None
    choices: tuple[str, ...] = ()
    contract: bool = False
    name: str = field(init=False, default="")  # the key, set from the attribute's name
    attr: str = field(init=False, default="")

    def __set_name__(self, owner: type, attr: str) -> None:
        object.__setattr__(self, "attr", attr)
        object.__setattr__(self, "name", attr.upper())

    @overload
    def __get__(self, conf: None, owner: type | None = None) -> Setting[T]: ...

    @overload
    def __get__(self, conf: Conf, owner: type | None = None) -> T: ...

    def __get__(self, conf: Conf | None, owner: type | None = None) -> Setting[T] | T:
        # A Conf holds its values in its own __dict__, which is read first: this runs only
        # for the class's attribute, the declaration.
        if conf is None:
            return self
        return cast(T, vars(conf)[self.attr])

    def read(self, value: Any) -> T:
        """The value ``get_conf`` gives for the project's ``value``."""
        return self.kind.read(value)

    def problem(self, value: Any) -> tuple[str, str] | None:
        """``(what, why)`` for a value of this setting, or None if it is fine: ``what`` is
        ``"type"`` for a value of the wrong type, ``"value"`` for one out of range."""
        kind = self.kind.name
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


class Conf:
    """The settings, as ``get_conf`` reads them; frozen. Each ``Setting`` here declares a key
    of ``TASKHOSTER`` (its name in capitals) and the attribute that holds its value."""

    root = Setting(
        PATH,
        "var/state",
        "The state directories: one folder per queue, an item's file in the folder of its "
        "state. Give an absolute path: a relative one is resolved against each process's "
        "working directory.",
    )
    fsync = Setting(
        BOOL,
        True,
        "Make each acknowledged change durable before answering. False is faster, but a "
        "power cut may lose acknowledged items.",
    )
    flush = Setting(
        CHOICE,
        "auto",
        "How a group's files are made durable: syncfs (one call for the whole filesystem; "
        "Linux, else fsync is used), fsync (each written file and each touched directory), "
        "or auto: syncfs, but a group that wrote one file and touched two directories at "
        "most the way a measurement on the filesystem found cheaper for one file.",
        choices=("auto", "syncfs", "fsync"),
    )
    committer = Setting(
        CHOICE,
        "thread",
        "Where group commits run: thread (a thread of this process) or process (a process of "
        "its own beside it, off its GIL: a server's choice).",
        choices=("thread", "process"),
    )
    max_payload_bytes = Setting(
        INT,
        1024 * 1024,
        "The largest payload or result, as compact JSON (413 above it).",
        minimum=1,
    )
    max_json_depth = Setting(
        INT,
        100,
        "The deepest nesting of JSON a request body or a /work frame may have (400 too_deep "
        "above it).",
        minimum=1,
    )
    max_batch = Setting(
        INT,
        1000,
        "The most items one post may carry (413 above it).",
        minimum=1,
        contract=True,
    )
    max_wait_seconds = Setting(
        FLOAT,
        60,
        "The longest long-poll: GET /api/items/{id}?wait= and a claim's wait.",
        minimum=0,
        contract=True,
    )
    max_claim = Setting(
        INT,
        100,
        "The most items one claim takes: a REST claim's max, and each claim the socket "
        "dispatcher makes for its sockets' free slots on a queue (it claims again for the "
        "rest).",
        minimum=1,
        contract=True,
    )
    max_capacity = Setting(
        INT,
        1000,
        "The largest capacity a /work socket may subscribe with.",
        minimum=1,
    )
    max_socket_held_bytes = Setting(
        INT,
        16 * 1024 * 1024,
        "A /work socket gets no more items while the frames of those it holds add up to "
        "this many bytes (a worker that does not read costs the server this much, not its "
        "capacity times the largest payload); it always may hold one.",
        minimum=1,
    )
    max_subscribe_queues = Setting(
        INT,
        100,
        "The most queues one /work subscription may name.",
        minimum=1,
    )
    max_delete_ids = Setting(
        INT,
        10_000,
        "The most ids one POST /api/queues/{queue}/items/delete may name.",
        minimum=1,
    )
    page_size = Setting(
        INT,
        100,
        "Items or threads per page when a listing gives no limit.",
        minimum=1,
    )
    max_page_size = Setting(
        INT,
        1000,
        "The largest limit a listing may ask for (at least PAGE_SIZE).",
        minimum=1,
    )
    sweep_chunk = Setting(
        INT,
        500,
        "Items the sweep handles per transaction.",
        minimum=1,
    )
    repair_grace_seconds = Setting(
        FLOAT,
        60,
        "sweep --repair leaves files younger than this to a server that may be writing them.",
        minimum=0,
    )
    long_poll_interval = Setting(
        FLOAT,
        1.0,
        "How often a long-poll looks again when no news woke it (news of its item or queue "
        "wakes it at once, from any process).",
        minimum=0,
        above=True,
    )
    socket_backstop_seconds = Setting(
        FLOAT,
        5.0,
        "How often a server re-checks for work its idle sockets could take, in case news was lost.",
        minimum=0,
        above=True,
    )
    background_share = Setting(
        FLOAT,
        0.25,
        "The largest share of the time background work (reclaiming a deleted queue, deletes "
        "by status, retention of many items, unlinking behind them, repair beside a live "
        "server) may take while foreground work runs on the host: after each chunk it rests in "
        "proportion; alone it never rests. 1 runs it flat out always.",
        minimum=0,
        above=True,
        maximum=1,
    )
    background_chunk_seconds = Setting(
        FLOAT,
        0.02,
        "About how long one chunk of background work may run while foreground work runs: "
        "chunks are sized to it, so that work waits at most about this long behind one "
        "(alone, chunks grow to five times this).",
        minimum=0,
        above=True,
    )
    admission_wait_seconds = Setting(
        FLOAT,
        0.5,
        "Overload: while the oldest operation waiting for this process's committer has waited "
        "longer than this, new posts are refused at once (503 overloaded, with Retry-After) "
        "rather than queued behind it.",
        minimum=0,
        above=True,
    )
    admission_max_items = Setting(
        INT,
        10_000,
        "Overload: while this many items or more (of posts, claims, results...) wait for "
        "this process's committer, new posts are refused at once (503 overloaded).",
        minimum=1,
    )
    max_request_threads = Setting(
        INT,
        64,
        "Under taskhoster.asgi's handler, the most threads that answer requests at once "
        "(16 kept, the rest made for the moment); beyond, a request is refused at once with "
        "503 overloaded.",
        minimum=16,
    )
    max_waits_per_key = Setting(
        INT,
        50,
        "The most long-polls (a GET of an item with wait, a claim with wait) one key may have "
        "waiting in one server process; more are answered at once, without waiting.",
        minimum=1,
    )
    health_listen = Setting(
        ADDRESS,
        "",
        'Where a server process also answers GET /healthz in a thread of its own, "host:port" '
        '(":port": every interface; empty: nowhere). Under a flood of requests the event '
        "loop serves every connection in turn, and a /healthz on the main port waits its "
        "turn; on this port it does not. Only the public body (no key is read here).",
    )
    health_interval = Setting(
        FLOAT,
        1.0,
        "How often a server process makes its /healthz report (in a thread of its own; "
        "/healthz answers at once with the latest).",
        minimum=0,
        above=True,
    )
    min_free_bytes = Setting(
        INT,
        64 * 1024 * 1024,
        "Readiness: /healthz answers 503 while the state root's filesystem has less free "
        "space than this (as an unprivileged process sees it).",
        minimum=0,
    )
    min_free_inodes = Setting(
        INT,
        4096,
        "Readiness: /healthz answers 503 while the state root's filesystem has fewer free "
        "inodes than this (each item is a file).",
        minimum=0,
    )
    metrics_public = Setting(
        BOOL,
        False,
        "Serve /metrics without a key. By default it needs a key of any scope (as GET "
        "/api/queues), and shows only the queues a key limited to some may use.",
    )
    redis_url = Setting(
        URL,
        "",
        "Redis for news between server processes on any host (redis://, rediss:// or "
        "unix://). Empty: a doorbell under the state root, which reaches the processes of "
        "this host only.",
    )
    processes = Setting(
        INT,
        1,
        "How many server processes serve this database and state root (declared; "
        "scripts/serve-many sets it from TASKHOSTER_PROCESSES). Read by the system checks: "
        "several need PostgreSQL, and Redis across hosts.",
        minimum=1,
    )
    # Not a key of TASKHOSTER: Django's DATA_UPLOAD_MAX_MEMORY_SIZE, the largest REST request
    # body (a batch rides in one); DEFAULT_MAX_BODY_BYTES when it is None or 0.
    max_body_bytes: int

    def __init__(self, values: dict[str, Any], *, max_body_bytes: int) -> None:
        # In the instance's own __dict__, so that reading a setting is a plain attribute.
        vars(self).update(values, max_body_bytes=max_body_bytes)

    def __setattr__(self, name: str, value: Any) -> None:
        raise FrozenInstanceError(f"cannot assign to field {name!r}")

    def __delattr__(self, name: str) -> None:
        raise FrozenInstanceError(f"cannot delete field {name!r}")

    def __eq__(self, other: object) -> bool:
        return vars(self) == vars(other) if isinstance(other, Conf) else NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(vars(self).items()))

    def __repr__(self) -> str:
        return f"Conf({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"


SETTINGS: tuple[Setting[Any], ...] = tuple(s for s in vars(Conf).values() if isinstance(s, Setting))
BY_NAME = {s.name: s for s in SETTINGS}
DEFAULTS: dict[str, Any] = {s.name: s.default for s in SETTINGS}


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
    given = user if isinstance(user, dict) else {}
    body = getattr(settings, "DATA_UPLOAD_MAX_MEMORY_SIZE", None)
    return Conf(
        {s.attr: s.read(given.get(s.name, s.default)) for s in SETTINGS},
        max_body_bytes=int(body or 0) or DEFAULT_MAX_BODY_BYTES,
    )
