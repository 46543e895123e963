"""A server process's listing of its sockets in the worker registry (``taskhoster.work.registry``)
comes back whole after another process forgot it."""

from __future__ import annotations

from datetime import timedelta

import pytest

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
