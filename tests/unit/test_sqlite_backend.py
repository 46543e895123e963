"""The SQLite backend's WAL checkpoints: taken by a thread of their own, never by a commit.

Each test opens a SQLite file of its own through ``taskhoster.db.sqlite`` (so it runs in the
PostgreSQL suite too) and reads the database file as a crash would leave it without its WAL:
a copy of the main file alone holds only what a checkpoint has copied back.
"""

from __future__ import annotations

import contextlib
import shutil
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db.utils import ConnectionHandler

from taskhoster.db.sqlite import base

OPTIONS = {
    "transaction_mode": "IMMEDIATE",
    "init_command": "PRAGMA journal_mode=WAL;PRAGMA synchronous=NORMAL;",
}


@pytest.fixture
def database(tmp_path: Path, django_db_blocker: Any) -> Iterator[tuple[Any, Path]]:
    """A database of the test's own (not the test database: pytest-django's guard is
    lifted for it alone)."""
    path = tmp_path / "index.sqlite3"
    handler = ConnectionHandler(
        {"default": {"ENGINE": "taskhoster.db.sqlite", "NAME": str(path), "OPTIONS": OPTIONS}}
    )
    connection = handler["default"]
    with django_db_blocker.unblock():
        with connection.cursor() as cursor:
            cursor.execute("CREATE TABLE t (n INTEGER, body TEXT)")
        yield connection, path
        connection.close()


def rows_in_the_main_file(path: Path, scratch: Path) -> int:
    """Rows of ``t`` in the database file alone (its WAL left behind)."""
    copy = scratch / "main-only.sqlite3"
    shutil.copyfile(path, copy)
    with contextlib.closing(sqlite3.connect(copy)) as db:
        try:
            return int(db.execute("SELECT count(*) FROM t").fetchone()[0])
        except sqlite3.DatabaseError:  # the table not checkpointed yet, or a copy taken
            return 0  # while the checkpoint wrote the file (looked at again)


def commit_rows(connection: Any, count: int) -> None:
    for n in range(count):
        with connection.cursor() as cursor:
            connection.set_autocommit(False)
            cursor.execute("INSERT INTO t VALUES (%s, %s)", [n, "x" * 200])
            connection.commit()
            connection.set_autocommit(True)


def test_a_commit_leaves_the_checkpoint_to_the_thread_which_copies_it_back_soon(
    database: tuple[Any, Path], tmp_path: Path
) -> None:
    """Commits do not checkpoint below the backstop (far above what they wrote here), yet
    within a moment of them their rows are in the database file: the checkpoint thread,
    woken by the commits, copied them back."""
    connection, path = database
    with connection.cursor() as cursor:
        cursor.execute("PRAGMA wal_autocheckpoint")
        assert cursor.fetchone()[0] == base.CHECKPOINT_BACKSTOP_PAGES
    commit_rows(connection, 50)
    deadline = time.monotonic() + 10
    while rows_in_the_main_file(path, tmp_path) < 50 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rows_in_the_main_file(path, tmp_path) == 50
    assert any(t.name == "taskhoster-checkpoint" for t in threading.enumerate())


def test_without_the_thread_the_rows_stay_in_the_wal(
    database: tuple[Any, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other side of the test above: with the thread's checkpoint stopped, commits
    stay in the WAL, even past SQLite's own threshold (1,000 pages: each of these commits
    writes one at least), so it is the thread that copies them back, not the commits."""
    connection, path = database
    monkeypatch.setattr(base._Checkpointer, "nudge", lambda self: None)
    commit_rows(connection, 1500)
    assert (path.parent / f"{path.name}-wal").stat().st_size > 1000 * 4096
    time.sleep(base.CHECKPOINT_DELAY_SECONDS * 3)
    assert rows_in_the_main_file(path, tmp_path) == 0
