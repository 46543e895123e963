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
"""

from __future__ import annotations

import threading
from functools import lru_cache
from typing import Any

from django.db.backends.sqlite3 import base

_writer = threading.Lock()


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
