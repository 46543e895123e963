"""I1 under a power cut: with fsync on, every transition that rewrites an item's file makes
the new file durable (file and directory flushed) before the old file is removed, and a post
makes its files durable before its rows exist.

``os.fsync`` is wrapped by a spy that notes, at each call, which of the item's files exist;
the real ``os.fsync`` still runs.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from taskhoster import engine
from taskhoster.models import Item
from taskhoster.status import State

from .lifecycle_helpers import after, claim_one, post, row, states_on_disk

pytestmark = pytest.mark.django_db


class Flushes:
    def __init__(self) -> None:
        self.calls: list[tuple[str, list[str]]] = []  # (path flushed, states holding the file)


@pytest.fixture
def fsync_on(settings: Any, state_root: Path) -> None:
    settings.TASKHOSTER = {**settings.TASKHOSTER, "FSYNC": True}


def watch(monkeypatch: pytest.MonkeyPatch, root: Path, queue: str, item_id: str) -> Flushes:
    flushes = Flushes()
    real = os.fsync

    def fsync(fd: int) -> None:
        flushes.calls.append(
            (os.readlink(f"/proc/self/fd/{fd}"), states_on_disk(root, queue, item_id))
        )
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return flushes


def assert_new_file_durable_before_old_removed(
    flushes: Flushes, root: Path, queue: str, item_id: str, old: str, new: str
) -> None:
    new_dir = str(root / queue / new)
    at_dir_flush = [states for path, states in flushes.calls if path == new_dir]
    assert at_dir_flush, f"the {new}/ directory was never flushed: {flushes.calls}"
    # when the new directory entry was flushed, the new file was there and the old one too
    assert any(old in states and new in states for states in at_dir_flush), flushes.calls
    file_flushes = [
        states
        for path, states in flushes.calls
        if Path(path).parent == Path(new_dir) and path != new_dir
    ]
    assert file_flushes, f"no file in {new}/ was flushed: {flushes.calls}"
    assert all(old in states for states in file_flushes)
    assert states_on_disk(root, queue, item_id) == [new]


def _result(item_id: str) -> None:
    engine.submit_result(item_id=item_id, result="r")


def _late_result(item_id: str) -> None:
    engine.sweep(at=after(row(item_id).lease_expires_at))
    _result(item_id)


def _fail_retry(item_id: str) -> None:
    engine.fail(item_id=item_id, lease=row(item_id).lease, error="again")


def _fail_die(item_id: str) -> None:
    engine.fail(item_id=item_id, lease=row(item_id).lease, error="no", retry=False)


def _lapse(item_id: str) -> None:
    assert engine.requeue_if_lapsed(item_id=item_id, at=after(row(item_id).lease_expires_at))


def _drop(item_id: str) -> None:
    assert engine.requeue_held(item_id=item_id, lease=row(item_id).lease).accepted


def _timeout(item_id: str) -> None:
    assert engine.time_out_if_aged(item_id=item_id, at=after(row(item_id).posted_at, 10**6))


TRANSITIONS: dict[str, tuple[Callable[[str], None], str, str, dict[str, Any]]] = {
    "result": (_result, "processing", "done", {}),
    "fail_retry": (_fail_retry, "processing", "pending", {}),
    "fail_die": (_fail_die, "processing", "done", {}),
    "lease_lapse_requeue": (_lapse, "processing", "pending", {}),
    "lease_lapse_death": (_lapse, "processing", "done", {"maxAttempts": 1}),
    "socket_drop_requeue": (_drop, "processing", "pending", {}),
    "socket_drop_death": (_drop, "processing", "done", {"maxAttempts": 1}),
    "queue_timeout": (_timeout, "processing", "done", {}),
}


@pytest.mark.usefixtures("fsync_on")
@pytest.mark.parametrize("name", sorted(TRANSITIONS))
def test_transition_makes_new_file_durable_before_removing_the_old_one(
    make_queue, state_root: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    change, old, new, queue_settings = TRANSITIONS[name]
    make_queue("q", **queue_settings)
    item = post(payload="p")
    claim_one()
    flushes = watch(monkeypatch, state_root, "q", item.id)
    change(item.id)
    assert_new_file_durable_before_old_removed(flushes, state_root, "q", item.id, old, new)


@pytest.mark.usefixtures("fsync_on")
def test_late_result_from_pending_is_durable_before_pending_file_goes(
    make_queue, state_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_queue("q")
    item = post()
    claim_one()
    engine.sweep(at=after(row(item.id).lease_expires_at))
    flushes = watch(monkeypatch, state_root, "q", item.id)
    _result(item.id)
    assert_new_file_durable_before_old_removed(flushes, state_root, "q", item.id, "pending", "done")


@pytest.mark.usefixtures("fsync_on")
def test_restart_is_durable_before_the_done_file_goes(
    make_queue, state_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_queue("q")
    item = post()
    _fail_die(claim_one().id)
    flushes = watch(monkeypatch, state_root, "q", item.id)
    engine.restart(item_id=item.id)
    assert_new_file_durable_before_old_removed(flushes, state_root, "q", item.id, "done", "pending")


@pytest.mark.usefixtures("fsync_on")
def test_post_files_are_durable_before_their_rows_exist(
    make_queue, state_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_queue("q")
    rows_at_flush: list[int] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        rows_at_flush.append(Item.objects.count())
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    item = post(payload="p")
    assert rows_at_flush
    assert rows_at_flush == [0] * len(rows_at_flush)
    assert states_on_disk(state_root, "q", item.id) == [State.PENDING.value]


@pytest.mark.usefixtures("fsync_on")
def test_dead_letter_copy_is_durable(
    make_queue, state_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_queue("dlq")
    make_queue("q", deadLetterQueue="dlq")
    post()
    held = claim_one()
    flushed: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        flushed.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    _fail_die(held.id)
    copy = row(held.id).dead_letter
    assert copy is not None
    assert str(state_root / "dlq" / "pending") in flushed
