"""PostgreSQL as Django's own backend, with a connection pool that does not hold a request
while the database is away.

Django's pool (``psycopg_pool``) is built for a database that is there: a request that finds
no free connection waits for one up to the pool's ``timeout`` (30 s by default), and a pool
that could not connect tries again later and later (1 s, 2 s, 4 s, ...). Through a database
restart that meant every request, ``/healthz``'s own check among them, waiting the whole
outage or 30 s, and a server that went on refusing work for half a minute after the
database was back.

Here each process keeps, per database, what its latest attempt to connect found
(``Reachability``: a failed attempt marks the database away, a successful one present again;
an attempt refused for "too many clients" says neither), and a request that waits for a
connection (``Checkout.getconn``):

- waits in short slices (``SLICE_SECONDS``), as long as the pool's ``timeout`` allows, while
  the database is present: a busy pool's connections come back (a waiter joins the back of
  the pool's queue again at each slice: under a pool exhausted for long, who is served
  first is looser than the pool's own order);
- stops waiting, with the attempt's error, once the database is away: the caller answers 503
  ``unavailable`` at once, unless the pool holds a free connection (an attempt may have
  failed only because the database had no room for another: ``too many clients``);
- while it is away, one caller in ``RETRY_SECONDS`` waits a slice anyway; any wait has the
  pool try to connect if it is not trying already, and the first attempt that succeeds
  marks the database present again.

Until an attempt has failed the database counts as present: one that drops packets rather
than refusing is found away only when an attempt gives up (``connect_timeout``, 5 s in
``project/settings.py``).

The pool gives up a series of attempts after ``RECONNECT_SECONDS`` (its
``reconnect_timeout``, 5 minutes by default), so the next request's wait starts a new attempt
at once instead of a far-off one. Each process judges from its own attempts: nothing is
shared that another process could not find out the same way.

A new connection where statements are to be kept prepared (``prepare_threshold``) asks which
server process answers it: behind a connection pooler or a proxy that is not the one it was
told of when it connected, and then nothing is kept prepared on it (``direct``). A pooler in
transaction mode would otherwise run a statement prepared on one server process by its
number on another, where that number may name another connection's statement.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from typing import Any

import psycopg
from django.db import DEFAULT_DB_ALIAS
from django.db.backends.postgresql import base
from psycopg_pool import ConnectionPool, PoolTimeout

log = logging.getLogger(__name__)

SLICE_SECONDS = 0.25  # a request waiting for a connection looks at the database this often
RETRY_SECONDS = 0.5  # while the database is away, one request in this long tries it
RECONNECT_SECONDS = 2.0  # the pool gives up a series of attempts after this long
HELD_SECONDS = 0.01  # (psycopg_pool hands out none, not even one it holds, with no wait)


#: An attempt refused for want of room ("too many clients": SQLSTATE 53300, which psycopg
#: does not carry on a failed connect) says nothing of whether the database answers. (The
#: server's English messages: with ``lc_messages`` in another language such a refusal
#: counts as the database away, and only a held connection still serves.)
NO_ROOM = ("too many clients", "remaining connection slots are reserved")


class Reachability:
    """Whether the latest attempt of this process to connect to one database succeeded
    (latest by its start: a slow attempt that fails after a later one connected changes
    nothing)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._away: str | None = None  # the latest attempt's error, until one succeeds
        self._latest = 0.0  # when the attempt whose outcome is known started
        self._next_try = 0.0

    def failed(self, exc: BaseException, started: float) -> None:
        text = str(exc)
        if any(phrase in text for phrase in NO_ROOM):
            return
        self._outcome(started, f"{type(exc).__name__}: {text}".strip()[:300])

    def succeeded(self, started: float) -> None:
        self._outcome(started, None)

    def _outcome(self, started: float, away: str | None) -> None:
        with self._lock:
            if started >= self._latest:
                self._latest = started
                self._away = away

    def away(self) -> str | None:
        """The error of the latest attempt to connect if it failed, else None."""
        return self._away

    def may_try(self) -> bool:
        """Whether this caller is the one of ``RETRY_SECONDS`` to try the database."""
        with self._lock:
            now = time.monotonic()
            if now < self._next_try:
                return False
            self._next_try = now + RETRY_SECONDS
            return True


class WatchedConnection(psycopg.Connection[Any]):
    """psycopg's connection, its attempts to connect told to its class's ``reachability``
    (one per database: ``watched_class``)."""

    reachability = Reachability()

    @classmethod
    def connect(cls, *args: Any, **kwargs: Any) -> Any:
        started = time.monotonic()
        try:
            conn = super().connect(*args, **kwargs)
        except psycopg.OperationalError as exc:
            cls.reachability.failed(exc, started)
            raise
        cls.reachability.succeeded(started)
        return conn


_watched: dict[str, type[WatchedConnection]] = {}
_watched_lock = threading.Lock()


def watched_class(alias: str) -> type[WatchedConnection]:
    """The connection class of database ``alias``'s pool, with a ``Reachability`` of its
    own."""
    with _watched_lock:
        found = _watched.get(alias)
        if found is None:
            name = "WatchedConnection_" + re.sub(r"\W", "_", alias)
            found = type(name, (WatchedConnection,), {"reachability": Reachability()})
            found.__qualname__ = name
            globals()[name] = found  # (so that it pickles, as settings do in a parallel run)
            _watched[alias] = found
        return found


class Checkout:
    """The pool as Django's connection uses it (``open``, ``getconn``, ``close``), with a wait
    for a connection that ends once the database is found away."""

    def __init__(self, pool: ConnectionPool[Any]) -> None:
        self.pool = pool

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pool, name)

    def getconn(self, timeout: float | None = None) -> Any:
        kind = self.pool.connection_class
        reachability: Reachability | None = getattr(kind, "reachability", None)
        if reachability is None:  # a pool of plain connections: its own wait
            return self.pool.getconn(timeout)
        deadline = time.monotonic() + (self.pool.timeout if timeout is None else timeout)
        while True:
            away = reachability.away()
            if away is not None:
                # A connection the pool holds is handed out at once (an attempt to connect may
                # have failed only for want of a free one: "too many clients"); else this
                # caller waits only if it is the one to try the database.
                try:
                    return self.pool.getconn(timeout=HELD_SECONDS)
                except PoolTimeout:
                    if not reachability.may_try():
                        raise _away_error(away) from None
            left = deadline - time.monotonic()
            try:
                return self.pool.getconn(timeout=max(0.0, min(SLICE_SECONDS, left)))
            except PoolTimeout:
                if left <= SLICE_SECONDS:
                    raise
                away = reachability.away()
                if away is not None:
                    raise _away_error(away) from None


def _away_error(away: str) -> psycopg.OperationalError:
    return psycopg.OperationalError(f"the database does not answer: {away}")


def direct(connection: psycopg.Connection[Any]) -> bool:
    """Whether ``connection`` reaches PostgreSQL directly: the server process it talks to is
    the one it was told of when it connected. A pooler, or a proxy that answers the
    connection itself, tells a process id of its own, and may run each transaction in
    another server process; a proxy that only forwards the bytes passes the server's on,
    and counts as direct (it is: one client, one server process). A pooler in session mode
    counts as a pooler too, which costs it speed only."""
    with connection.cursor() as cursor:
        # Never prepared (``prepare_threshold`` 0 would prepare it at once: its Parse and
        # its run could then reach two server processes of a pooler).
        cursor.execute("SELECT pg_backend_pid()", prepare=False)
        found = cursor.fetchone()
    return found is not None and found[0] == connection.info.backend_pid


_told_pooler = False


def _prepare_only_when_direct(connection: psycopg.Connection[Any], alias: str) -> None:
    """Behind a pooler or a proxy nothing is kept prepared on ``connection``. A pooler in
    transaction mode runs each transaction in any of its server processes, where a prepared
    statement's name (``_pg3_0``, numbered per connection) is missing, or names another
    connection's statement, which is refused (``bind message supplies 1 parameters, but
    prepared statement "_pg3_0" requires 4``) or, with as many parameters, could run with
    this one's values. Whether a pooler carries prepared statements (PgBouncer 1.21 and
    later, with ``max_prepared_statements``) cannot be asked, so none is trusted to."""
    global _told_pooler
    if direct(connection):
        return
    connection.prepare_threshold = None
    if not _told_pooler:
        _told_pooler = True
        log.warning(
            "database %r is reached through a connection pooler or a proxy (the server "
            "process answering is not the one the connection was told of): statements are "
            "not kept prepared on its connections (set TASKHOSTER_DB_PREPARE=0 to say so)",
            alias,
        )


class DatabaseWrapper(base.DatabaseWrapper):
    def __init__(self, settings_dict: dict[str, Any], alias: str = DEFAULT_DB_ALIAS) -> None:
        super().__init__(settings_dict, alias)
        options = self.settings_dict["OPTIONS"]
        pool = options.get("pool")
        if pool is True or isinstance(pool, dict):
            # A copy: another alias may share the dict, and each has a class of its own.
            pool = {} if pool is True else dict(pool)
            options["pool"] = pool
            pool.setdefault("connection_class", watched_class(alias))
            pool.setdefault("reconnect_timeout", RECONNECT_SECONDS)

    @property
    def pool(self) -> Checkout | None:
        found = super().pool
        return None if found is None else Checkout(found)

    def _configure_connection(self, connection: Any) -> bool:
        """Django's set-up of a new connection (its time zone, its role; from the pool, or
        for a connection made without one), and, where statements are to be kept prepared,
        whether they may be (``_prepare_only_when_direct``)."""
        commit = bool(super()._configure_connection(connection))  # type: ignore[misc]
        if getattr(connection, "prepare_threshold", None) is not None:
            _prepare_only_when_direct(connection, self.alias)
            commit = True  # (a connection not in autocommit: the look's transaction ended)
        return commit
