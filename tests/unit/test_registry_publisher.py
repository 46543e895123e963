"""A server process's listing of its sockets in the worker registry (``taskhoster.work.registry``)
comes back whole after another process forgot it."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, connections

from taskhoster.metrics import PROCESS
from taskhoster.models import ServerProcess, WorkerSocket
from taskhoster.timeutil import now as utcnow
from taskhoster.work import registry


@pytest.mark.django_db
def test_a_process_forgotten_while_its_heartbeat_stopped_lists_its_idle_sockets_again() -> None:
    """A process whose heartbeat stopped for ``FORGET_SECONDS`` (the database away that long)
    has its rows deleted by another process's publish. Once it beats again, its sockets are
    listed again, the idle ones too, whose entries did not change."""
    at = utcnow()
    idle = registry.Entry(
        id="0123456789abcdef",
        name="idle",
        key_id=None,
        queues=("q",),
        capacity=1,
        held=(),
        draining=False,
        connected_at=at,
        last_seen_at=at,
    )
    publisher = registry.Publisher()
    publisher.publish([idle], 100.0)
    assert WorkerSocket.objects.filter(id=idle.id).exists()
    stopped = utcnow() - timedelta(seconds=registry.FORGET_SECONDS + 5)
    ServerProcess.objects.filter(process=PROCESS).update(seen_at=stopped)
    registry._forget_gone()  # as another process's publish does
    assert not WorkerSocket.objects.filter(id=idle.id).exists()
    publisher.publish([idle], 100.0 + registry.HEARTBEAT_SECONDS)
    assert ServerProcess.objects.filter(process=PROCESS).exists()
    assert WorkerSocket.objects.filter(id=idle.id).exists(), "the idle socket is listed again"


@pytest.mark.django_db(transaction=True)
def test_a_heartbeat_that_commits_while_gone_processes_are_forgotten_keeps_its_rows() -> None:
    """Another process reads a process as stale while that process's heartbeat is in flight
    (its row updated, not yet committed). The rows deleted are those still stale when the
    delete runs: the process whose heartbeat committed meanwhile keeps its row and its
    sockets' rows, which its publisher believes written."""
    at = utcnow()
    stale = at - timedelta(seconds=registry.FORGET_SECONDS + 5)
    ServerProcess.objects.create(process="other", host="h", pid=1, started_at=stale, seen_at=stale)
    WorkerSocket.objects.create(
        id="fedcba9876543210",
        process="other",
        name="w",
        queues=["q"],
        capacity=1,
        connected_at=stale,
        last_seen_at=stale,
    )
    table = ServerProcess._meta.db_table
    holding, read = threading.Event(), threading.Event()

    def heartbeat_in_flight() -> None:
        """The other process's ``_touch``, committed once ``_forget_gone`` has read the
        process table (and found it stale)."""
        other = connections.create_connection("default")
        try:
            with other.cursor() as cursor:
                begin = "BEGIN IMMEDIATE" if other.vendor == "sqlite" else "BEGIN"
                cursor.execute(begin)
                cursor.execute(
                    f"UPDATE {table} SET seen_at = %s WHERE process = %s", [utcnow(), "other"]
                )
                holding.set()
                read.wait(10)
                cursor.execute("COMMIT")
        finally:
            other.close()

    def reads_the_process_table(execute: Any, sql: str, *args: Any) -> Any:
        try:
            return execute(sql, *args)
        finally:
            if table in sql:
                read.set()

    beating = threading.Thread(target=heartbeat_in_flight)
    beating.start()
    try:
        assert holding.wait(10)
        with connection.execute_wrapper(reads_the_process_table):
            registry._forget_gone()  # waits for the heartbeat's transaction to write
    finally:
        read.set()
        beating.join(30)

    assert ServerProcess.objects.filter(process="other").exists(), "a live process was forgotten"
    assert WorkerSocket.objects.filter(process="other").exists(), "its sockets were deleted"
