"""SQLite, with write transactions handed over in order within a process, and each distinct
statement's ``%s`` marks converted to SQLite's ``?`` once.

SQLite allows one writer at a time. A thread that finds the write lock taken is made to
wait by SQLite's busy handler, which sleeps and retries (sleeps of up to 100 ms), so under
concurrency a short transaction can wait far longer than the one before it took. Here the
threads of one process queue on a lock of our own before ``BEGIN IMMEDIATE``, so the lock
passes straight from one to the next; only other processes (a sweep, a second server) still
meet the busy handler.

Django's SQLite cursor converts every statement's ``%s`` marks with a regular expression each
time it runs; a group commit runs the same few statements again and again, so the converted
text is kept (``_qmark``, a bounded cache). Everything else of Django's cursor stays: its
wrappers, query logging, ``execute_wrapper`` hooks and error translation.

A WAL file is copied back into the database by a checkpoint, which SQLite runs inside the
commit that takes the WAL past ``wal_autocheckpoint`` pages (1,000 by default): that commit,
a post's say, then waits for the copy and two fsyncs, some 2-4 ms here, every few hundred
posts. Here a thread of its own (``_Checkpointer``) runs a ``PASSIVE`` checkpoint, which
never blocks a writer, shortly after commits; the commits' own threshold stays as a backstop
(``CHECKPOINT_BACKSTOP_PAGES``) for a burst the thread has not caught up with.
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import threading
import time
from functools import lru_cache
from pathlib import Path
from typing import Any

from django.db.backends.sqlite3 import base

log = logging.getLogger(__name__)

_writer = threading.Lock()

# A commit checkpoints the WAL itself only past this many pages (4 KiB each); the checkpoint
# thread normally has done so long before.
CHECKPOINT_BACKSTOP_PAGES = 4000
# How long the checkpoint thread lets commits gather after the first one it is woken by.
CHECKPOINT_DELAY_SECONDS = 0.25


class _Checkpointer:
    """Checkpoints one database file's WAL from a thread of its own, on a connection of its
    own, a moment after commits (``nudge``), so that no commit waits for it. Asleep while
    nothing commits."""

    def __init__(self, path: str) -> None:
        self.path = path
        # Read-write, never create: a database removed meanwhile stays removed.
        self.uri = f"{Path(path).resolve().as_uri()}?mode=rw"
        self.wake = threading.Event()
        threading.Thread(target=self._loop, name="taskhoster-checkpoint", daemon=True).start()

    def nudge(self) -> None:
        if not self.wake.is_set():
            self.wake.set()

    def _loop(self) -> None:
        while True:
            self.wake.wait()
            time.sleep(CHECKPOINT_DELAY_SECONDS)
            self.wake.clear()
            try:
                with contextlib.closing(sqlite3.connect(self.uri, uri=True, timeout=0)) as db:
                    db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
            except sqlite3.Error as exc:  # busy, or the file went (a test database)
                log.debug("checkpoint of %s: %s", self.path, exc)


_checkpointers: dict[str, _Checkpointer] = {}
_checkpointers_lock = threading.Lock()


def _checkpointer(path: str) -> _Checkpointer:
    found = _checkpointers.get(path)
    if found is None:
        with _checkpointers_lock:
            found = _checkpointers.get(path)
            if found is None:
                found = _checkpointers[path] = _Checkpointer(path)
    return found


@lru_cache(maxsize=256)
def _qmark(query: str) -> str:
    """Django's conversion of a statement's ``%s`` marks (``%%`` is a literal ``%``)."""
    return base.FORMAT_QMARK_REGEX.sub("?", query).replace("%%", "%")


class CursorWrapper(base.SQLiteCursorWrapper):
    def convert_query(self, query: str, *, param_names: Any = None) -> str:
        if param_names is None:
            return _qmark(query)
        return str(super().convert_query(query, param_names=param_names))


class DatabaseWrapper(base.DatabaseWrapper):
    holds_writer = False
    checkpointer: _Checkpointer | None = None

    def get_new_connection(self, conn_params: Any) -> Any:
        conn = super().get_new_connection(conn_params)
        path = str(conn_params.get("database") or "")
        # (A file: URI or a database in memory keeps SQLite's own checkpoints.)
        if path and not path.startswith("file:") and not self.creation.is_in_memory_db(path):
            conn.execute(f"PRAGMA wal_autocheckpoint={CHECKPOINT_BACKSTOP_PAGES}")
            self.checkpointer = _checkpointer(path)
        return conn

    def create_cursor(self, name: Any = None) -> Any:
        return self.connection.cursor(factory=CursorWrapper)

    def _start_transaction_under_autocommit(self) -> None:
        _writer.acquire()
        self.holds_writer = True
        try:
            super()._start_transaction_under_autocommit()  # type: ignore[misc]
        except BaseException:
            self._release_writer()
            raise

    def _release_writer(self) -> None:
        if self.holds_writer:
            self.holds_writer = False
            _writer.release()

    def _commit(self) -> Any:
        try:
            return super()._commit()  # type: ignore[misc]
        finally:
            self._release_writer()
            if self.checkpointer is not None:
                self.checkpointer.nudge()

    def _rollback(self) -> Any:
        try:
            return super()._rollback()  # type: ignore[misc]
        finally:
            self._release_writer()

    def _close(self) -> Any:
        try:
            return super()._close()  # type: ignore[misc]
        finally:
            self._release_writer()
