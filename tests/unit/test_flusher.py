"""A group's flush beside the next group (``runner.Flusher``).

When more operations wait for the committer, a group's flush and the answers behind it go to
the flusher's thread and the committer runs the next group meanwhile. Nothing that waits for
the flush is answered before it; flushes and their answers keep the order of the commits;
one group at most waits there (the next one's flush waits for it), so a disk that stalls
stalls the committer. Real groups, files and database; the disk is a real one whose flushes
the test holds back (a stand-in for a slow disk, as the faults are).
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future
from typing import Any

import pytest

from taskhoster.engine import runner
from taskhoster.engine.common import store
from taskhoster.engine.ops import Claim, NewItem, Post
from taskhoster.engine.posts import prepare_post
from taskhoster.errors import StoreError
from taskhoster.models import Item
from taskhoster.status import State
from taskhoster.store import Syscalls

pytestmark = pytest.mark.django_db(transaction=True)


class HeldDisk(Syscalls):
    """This machine's disk, whose flushes wait until the test lets them go (or fail)."""

    def __init__(self, *, fails: bool = False) -> None:
        self.go = threading.Event()
        self.flushing = threading.Event()
        self.flushed: list[str] = []
        self.fails = fails

    def _held(self, path: str) -> None:
        self.flushing.set()
        assert self.go.wait(10), "the test never let the flush go"
        if self.fails:
            raise OSError(5, "Input/output error")
        self.flushed.append(path)

    def fsync(self, path: str) -> None:
        self._held(path)
        super().fsync(path)

    def syncfs(self, path: str) -> None:
        self._held(path)
        super().syncfs(path)


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> Any:
    def hold(*, fails: bool = False) -> HeldDisk:
        disk = HeldDisk(fails=fails)
        monkeypatch.setattr(store(), "sys", disk)
        disks.append(disk)
        return disk

    disks: list[HeldDisk] = []
    yield hold
    for disk in disks:
        disk.go.set()
    runner.flusher.idle()


def a_post(n: int, answered: list[int]) -> Post:
    op = prepare_post("q", [NewItem(payload={"n": n})])
    op.future = Future()
    op.future.add_done_callback(lambda _f: answered.append(n))
    return op


def test_a_group_handed_to_the_flusher_is_answered_only_once_its_file_is_flushed(
    make_queue, held
):
    make_queue("q")
    disk = held()
    answered: list[int] = []
    op = a_post(1, answered)
    runner.run_group([op], 0, handoff=lambda: True)  # returns with the flush still held
    assert disk.flushing.wait(10)
    assert Item.objects.filter(queue__name="q").count() == 1, "committed"
    time.sleep(0.05)
    assert not op.future.done(), "answered before its file was durable"
    disk.go.set()
    (posted,) = op.future.result(timeout=10)
    assert posted.row.id and disk.flushed, "answered after the flush"


def test_the_next_group_runs_beside_a_flush_and_is_answered_after_it(make_queue, held):
    make_queue("q")
    disk = held()
    answered: list[int] = []
    first, second = a_post(1, answered), a_post(2, answered)
    runner.run_group([first], 0, handoff=lambda: True)
    assert disk.flushing.wait(10)
    nxt = threading.Thread(
        target=runner.run_group, args=([second], 0), kwargs={"handoff": lambda: True}
    )
    nxt.start()
    deadline = time.monotonic() + 10
    while Item.objects.filter(queue__name="q").count() < 2:
        assert time.monotonic() < deadline, "the next group did not run beside the flush"
        time.sleep(0.01)
    time.sleep(0.05)
    assert nxt.is_alive(), "the next group's flush did not wait for the one before"
    assert answered == []
    disk.go.set()
    nxt.join(10)
    assert not nxt.is_alive()
    first.future.result(timeout=10)
    second.future.result(timeout=10)
    assert answered == [1, 2], "answers out of the commits' order"


def test_a_lone_group_is_flushed_and_answered_by_the_committer_itself(make_queue, held):
    make_queue("q")
    disk = held()
    disk.go.set()
    answered: list[int] = []
    op = a_post(1, answered)
    runner.run_group([op], 0, handoff=lambda: False)
    assert op.future.done(), "a lone group waited for another thread"
    assert answered == [1] and disk.flushed


def test_a_flush_that_fails_on_the_flusher_acknowledges_nothing_that_waited_for_it(
    make_queue, held
):
    make_queue("q")
    disk = held(fails=True)
    answered: list[int] = []
    op = a_post(1, answered)
    runner.run_group([op], 0, handoff=lambda: True)
    assert disk.flushing.wait(10)
    disk.go.set()
    with pytest.raises(StoreError, match="could not flush"):
        op.future.result(timeout=10)
    runner.flusher.idle()
    # The flusher is still there for the next group.
    disk.fails = False
    again = a_post(2, answered)
    runner.run_group([again], 0, handoff=lambda: True)
    again.future.result(timeout=10)


def test_a_post_the_next_group_claimed_meanwhile_is_flushed_where_it_is_now(
    make_queue, held, settings, monkeypatch
):
    """The common case of a flush beside the next group: a worker waits, so the post's
    claim is the next group, and it moves the post's file to ``processing/`` before the
    post's own flush (a file by file flush) has run."""
    settings.TASKHOSTER = {**settings.TASKHOSTER, "FSYNC": True, "FLUSH": "fsync"}
    make_queue("q")
    disk = held()
    answered: list[int] = []
    op = a_post(1, answered)
    runner.run_group([op], 0, handoff=lambda: True)
    assert disk.flushing.wait(10)
    claim = Claim(queue_name="q", max_items=1)
    claim.future = Future()
    claimer = threading.Thread(target=runner.run_group, args=([claim], 0))
    claimer.start()
    (claimed,) = claim.future.result(timeout=10)  # answered at its commit, beside the flush
    assert not op.future.done()
    disk.go.set()
    claimer.join(10)
    (posted,) = op.future.result(timeout=10)
    assert claimed.row.id == posted.row.id
    now = store().item_file("q", State.PROCESSING, posted.row.id)
    assert now in disk.flushed, "the post's data flushed under the name it has now"
    assert os.path.dirname(now) in disk.flushed, "and the directory it is in now"
