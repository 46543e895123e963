"""The committer process's committer (``process.PipeCommitter``) waits on its pipe from the
server when idle; an operation handed in by another thread of its own process (a queue's
deletion reclaims its items from a thread of the process that ran the deletion) must wake it
there, not wait for the pipe to speak or for the idle round to end.

The real committer runs here on a thread of the test process, reading a real pipe, running
real groups against the test database and the state root.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future
from typing import Any

import pytest
from django.db import connection

from taskhoster.engine import runner
from taskhoster.engine.ops import NewItem
from taskhoster.engine.posts import prepare_post
from taskhoster.engine.process import FrameReader, PipeCommitter, _frame

from .lifecycle_helpers import row

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def pipe_committer(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A ``PipeCommitter`` running on a thread of its own, idle on a silent pipe for far
    longer than any test waits (so only a wake-up can answer within a test); the pipe's
    write end, to speak on it or close it."""
    monkeypatch.setattr(runner, "IDLE_SECONDS", 60.0)
    read_end, write_end = os.pipe()
    made: Future[PipeCommitter] = Future()

    def run() -> None:
        try:
            committer = PipeCommitter(FrameReader(read_end))
            made.set_result(committer)
            committer.run()
        finally:
            connection.close()

    thread = threading.Thread(target=run, name="test-pipe-committer", daemon=True)
    thread.start()
    committer = made.result(timeout=10)
    try:
        yield committer, write_end
    finally:
        os.close(write_end)  # the server closed the pipe: the committer ends
        thread.join(timeout=10)
        os.close(read_end)
        assert not thread.is_alive(), "the committer did not end when its pipe closed"
        # The ring lives as long as its committer process; here, as long as the thread.
        os.close(committer.ring_r)
        os.close(committer.ring_w)


def _until_idle(committer: PipeCommitter) -> None:
    """Wait until the committer has nothing left and waits (a short grace for it to reach
    its ``select``)."""
    threading.Event().wait(0.3)
    assert committer.waiting() == 0
    assert not committer.busy


def test_an_operation_handed_in_by_a_thread_of_the_committers_own_process_wakes_it(
    pipe_committer: Any, make_queue: Any
) -> None:
    committer, _ = pipe_committer
    make_queue("q")
    _until_idle(committer)
    op = prepare_post("q", [NewItem(payload={"n": 1})])
    op.future = Future()
    committer.submit(op)
    (made,) = op.future.result(timeout=10)  # without the wake-up: after the 60 s idle round
    assert row(made.row.id).status == "pending"


def test_an_operation_from_the_server_wakes_the_idle_committer_and_is_answered_by_its_number(
    pipe_committer: Any, make_queue: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    committer, write_end = pipe_committer
    make_queue("q")
    answered: list[tuple[int | None, bool, Any]] = []
    done = threading.Event()

    def hook(outcomes: Any) -> None:
        answered.extend((op.wire_id, ok, value) for op, ok, value in outcomes)
        if answered:
            done.set()

    monkeypatch.setattr(runner, "answer_hook", hook)
    _until_idle(committer)
    os.write(write_end, _frame([(41, prepare_post("q", [NewItem(payload={"n": 2})]))]))
    assert done.wait(10), "the committer did not wake for a frame on its pipe"
    ((wire_id, ok, value),) = answered
    assert (wire_id, ok) == (41, True)
    assert row(value[0].row.id).status == "pending"
