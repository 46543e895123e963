"""Repair (``manage.py sweep --repair``) rebuilds the index from the state directories alone.

The files are the truth (DESIGN-NOTES, "Two records of one item"): with every index row gone,
items, queues and threads come back as they were; duplicate files left by a crash resolve to
the higher ``rev``; a row without a file goes; a stale temporary goes; a missing directory or
an empty state root never empties the index; ``grace`` keeps recent files and rows alone.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from taskhoster import engine
from taskhoster.models import Item, Queue, Thread
from taskhoster.status import Status
from taskhoster.store import encode_line
from taskhoster.timeutil import now as utcnow
from taskhoster.timeutil import to_wire

from .consistency import (
    assert_index_matches_directories,
    assert_threads_consistent,
    files_on_disk,
    read_file,
)

MAIN_SETTINGS = {
    "leaseSeconds": 30,
    "queueSeconds": 5000,
    "retainSeconds": 100,
    "retainFrom": "fetched",
    "maxAttempts": 3,
    "backoffSeconds": 20,
    "backoffMaxSeconds": 50,
    "deadLetterQueue": "dlq",
    # Flow control comes back too (none of it holds back this test's claims).
    "maxProcessing": 50,
    "rateLimit": {"count": 1000, "seconds": 1},
}
# Not ``fetched_at``: a producer's first read stamps only the row, never the file, so a lost
# index forgets it (the item is then kept until it is read again: the safe direction).
SNAPSHOT_FIELDS = (
    "queue__name",
    "status",
    "attempts",
    "key",
    "thread_id",
    "seq",
    "scheduled_at",
    "posted_at",
    "finished_at",
    "error",
    "origin",
    "dead_letter",
    "rev",
)


def post(queue: str = "main", **spec: Any) -> str:
    return engine.post_items(queue_name=queue, items=[engine.NewItem(**spec)])[0].row.id


def claim_one(expected: str, queue: str = "main") -> str:
    claimed = engine.claim(queue_name=queue, max_items=1)
    assert [c.row.id for c in claimed] == [expected]
    return claimed[0].row.lease or ""


def snapshot() -> dict[str, dict[str, Any]]:
    rows = Item.objects.values("id", *SNAPSHOT_FIELDS)
    return {row.pop("id"): row for row in rows}


def forget_everything() -> None:
    """Lose the whole index: item rows, thread rows and even the queue rows."""
    Item.objects.all().delete()
    Thread.objects.all().delete()
    Queue.objects.all().delete()
    assert not Item.objects.exists()


def make_every_state() -> dict[str, str]:
    engine.upsert_queue(name="dlq", body={})
    engine.upsert_queue(name="main", body=MAIN_SETTINGS)
    ids: dict[str, str] = {}
    ids["processing"] = post(payload="p")
    claim_one(ids["processing"])
    ids["finished"] = post(payload="f")
    claim_one(ids["finished"])
    assert engine.submit_result(item_id=ids["finished"], result={"answer": 42}).accepted
    ids["dead"] = post(payload="d", key="dead-key")
    lease = claim_one(ids["dead"])
    assert engine.fail(item_id=ids["dead"], lease=lease, error="boom", retry=False).accepted
    ids["dead_letter"] = Item.objects.get(id=ids["dead"]).dead_letter or ""
    ids["retrying"] = post(payload="r")
    lease = claim_one(ids["retrying"])
    assert engine.fail(item_id=ids["retrying"], lease=lease, error="again").accepted
    ids["restarted"] = post(payload="s")
    lease = claim_one(ids["restarted"])
    assert engine.fail(item_id=ids["restarted"], lease=lease, error="x", retry=False).accepted
    engine.restart(item_id=ids["restarted"])
    ids["t1_head"] = post(payload="t1a", thread_id="t1")
    ids["t1_second"] = post(payload="t1b", thread_id="t1")
    claimed = {c.row.id for c in engine.claim(queue_name="main", max_items=2)}
    assert claimed == {ids["restarted"], ids["t1_head"]}
    ids["t1_third"] = post(payload="t1c", thread_id="t1")
    ids["t2_head"] = post(payload="t2a", thread_id="t2")
    ids["t2_second"] = post(payload="t2b", thread_id="t2", delay_seconds=1)
    claim_one(ids["t2_head"])
    ids["t3_finished"] = post(payload="t3a", thread_id="t3")
    claim_one(ids["t3_finished"])
    assert engine.submit_result(item_id=ids["t3_finished"], result=[3]).accepted
    ids["t3_second"] = post(payload="t3b", thread_id="t3")
    ids["plain"] = post(payload="plain")
    ids["delayed"] = post(payload="later", delay_seconds=300)
    ids["keyed"] = post(payload="k", key="the-key")
    return ids


@pytest.mark.django_db
def test_repair_rebuilds_items_queues_and_threads_from_the_directories_alone(state_root: Path):
    ids = make_every_state()
    before = snapshot()
    settings_before = {q.name: engine.queue_settings(q) for q in Queue.objects.all()}
    results_before = {i: engine.get_item(item_id=i)[1].get("result") for i in before}
    assert before[ids["retrying"]]["scheduled_at"] > utcnow()
    assert_threads_consistent()

    forget_everything()
    report = engine.repair(grace_seconds=0)

    assert report.queues_restored == 2
    assert report.rows_added == len(before)
    after = snapshot()
    assert set(after) == set(before)
    for item_id, values in before.items():
        assert after[item_id] == values, f"item {item_id} came back different"
    assert {q.name: engine.queue_settings(q) for q in Queue.objects.all()} == settings_before
    assert {i: engine.get_item(item_id=i)[1].get("result") for i in after} == results_before
    assert results_before[ids["finished"]] == {"answer": 42}
    # a processing item counts its claim and its lease has lapsed: the next sweep re-queues it
    for name in ("processing", "restarted", "t1_head", "t2_head"):
        row = Item.objects.get(id=ids[name])
        assert (row.status, row.attempts) == ("processing", 1), name
        assert row.lease_expires_at is not None
        assert row.lease_expires_at <= utcnow()
    assert_index_matches_directories(state_root)
    assert_threads_consistent()
    assert Thread.objects.get(thread_id="t1").member_count == 3
    again = engine.repair(grace_seconds=0)
    assert (again.rows_added, again.rows_corrected, again.rows_removed) == (0, 0, 0)
    assert again.stale_files_removed == 0

    dup = engine.post_items(queue_name="main", items=[engine.NewItem(payload="dup", key="the-key")])
    assert (dup[0].created, dup[0].row.id) == (False, ids["keyed"])

    claimed = {c.row.id for c in engine.claim(queue_name="main", max_items=100)}
    assert claimed == {ids["plain"], ids["keyed"], ids["t3_second"]}, (
        "busy threads, delayed and backing-off items must not be claimable"
    )

    engine.sweep()
    assert Item.objects.get(id=ids["t1_head"]).status == Status.PENDING
    assert Item.objects.get(id=ids["t1_head"]).eligible
    assert_threads_consistent()


@pytest.mark.slow
def test_sweep_repair_command_restores_a_lost_index_and_requeues_lost_claims(
    manage, state_root: Path
):
    engine.upsert_queue(name="main", body={"leaseSeconds": 45, "maxAttempts": 5})
    first = post(payload=1, thread_id="t")
    second = post(payload=2, thread_id="t")
    claim_one(first)
    done = post(payload=3)
    claim_one(done)
    engine.submit_result(item_id=done, result="r")
    forget_everything()

    out = manage("sweep", "--repair", "--grace", "0").stdout
    assert "1 queue(s) restored, 3 row(s) added" in out, out
    assert "1 lapsed lease(s) re-queued" in out, out
    statuses = dict(Item.objects.values_list("id", "status"))
    assert statuses == {first: "pending", second: "pending", done: "finished"}
    assert Item.objects.get(id=first).attempts == 1
    assert Queue.objects.get(name="main").lease_seconds == 45
    assert_index_matches_directories(state_root)
    assert_threads_consistent()
    assert [c.row.id for c in engine.claim(queue_name="main", max_items=5)] == [first]


def _write_copy(root: Path, item_id: str, state: str, rev: int, **changes: Any) -> None:
    record = read_file(root, "main", "pending", item_id)
    record.update(rev=rev, **changes)
    (root / "main" / state / f"{item_id}.json").write_bytes(encode_line(record))


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("newer", "older", "status"),
    [
        ("done", "pending", "finished"),
        ("pending", "done", "pending"),
        ("done", "processing", "finished"),
        ("processing", "done", "processing"),
    ],
)
def test_repair_keeps_the_higher_rev_of_duplicate_files(state_root: Path, newer, older, status):
    engine.upsert_queue(name="main", body={})
    item_id = post(payload="x")
    keep: dict[str, dict[str, Any]] = {
        "done": {"status": "finished", "result": "newer", "finishedAt": to_wire(utcnow())},
        "pending": {"status": "pending"},
        "processing": {"status": "pending"},
    }
    stale: dict[str, dict[str, Any]] = {
        "done": {"status": "finished", "result": "older", "finishedAt": to_wire(utcnow())},
        "pending": {"status": "pending"},
        "processing": {"status": "pending"},
    }
    _write_copy(state_root, item_id, older, 4, **stale[older])
    _write_copy(state_root, item_id, newer, 5, **keep[newer])
    if "pending" not in (newer, older):
        os.unlink(state_root / "main" / "pending" / f"{item_id}.json")

    report = engine.repair(grace_seconds=0)

    assert files_on_disk(state_root)[item_id] == [("main", newer)]
    row = Item.objects.get(id=item_id)
    assert (row.status, row.rev) == (status, 5)
    assert report.stale_files_removed == 1
    if newer == "done":
        assert engine.get_item(item_id=item_id)[1]["result"] == "newer"
        assert not engine.submit_result(item_id=item_id, result="late").accepted
    assert_index_matches_directories(state_root)
    assert_threads_consistent()


@pytest.mark.django_db
def test_repair_drops_a_row_without_a_file_and_advances_its_thread(state_root: Path):
    engine.upsert_queue(name="main", body={})
    gone = post(payload="a", thread_id="t")
    nxt = post(payload="b", thread_id="t")
    plain = post(payload="c")
    os.unlink(state_root / "main" / "pending" / f"{gone}.json")

    report = engine.repair(grace_seconds=0)

    assert report.rows_removed == 1
    assert set(Item.objects.values_list("id", flat=True)) == {nxt, plain}
    assert Thread.objects.get(thread_id="t").member_count == 1
    assert_index_matches_directories(state_root)
    assert_threads_consistent()
    assert {c.row.id for c in engine.claim(queue_name="main", max_items=5)} == {nxt, plain}


def _age(path: Path, seconds: float) -> None:
    past = time.time() - seconds
    os.utime(path, (past, past))


@pytest.mark.django_db
def test_repair_removes_a_stale_temporary_file_and_never_indexes_it(state_root: Path):
    engine.upsert_queue(name="main", body={})
    item_id = post(payload="a")
    tmp = state_root / "main" / "pending" / f".{item_id}.0badcafe.tmp"
    tmp.write_text(json.dumps(read_file(state_root, "main", "pending", item_id)))
    _age(tmp, 3600)

    report = engine.repair(grace_seconds=0)

    assert not tmp.exists()
    assert report.stale_files_removed == 1
    assert report.rows_added == 0
    assert_index_matches_directories(state_root)


@pytest.mark.django_db
def test_repair_leaves_a_queue_whose_directory_is_missing_alone(state_root: Path):
    engine.upsert_queue(name="gone", body={"leaseSeconds": 7})
    engine.upsert_queue(name="kept", body={})
    lost = [post("gone", payload=1), post("gone", payload=2, thread_id="t")]
    kept = post("kept", payload=3)
    before = snapshot()
    shutil.rmtree(state_root / "gone")

    report = engine.repair(grace_seconds=0)

    assert report.rows_removed == 0
    assert snapshot() == before
    assert Queue.objects.get(name="gone").lease_seconds == 7
    assert set(Item.objects.values_list("id", flat=True)) == {*lost, kept}
    assert Thread.objects.filter(queue__name="gone", thread_id="t").exists()


@pytest.mark.django_db
def test_repair_of_an_empty_state_root_never_empties_the_index(state_root: Path):
    engine.upsert_queue(name="main", body={})
    ids = [post(payload=n, thread_id="t" if n else None) for n in range(3)]
    before = snapshot()
    shutil.rmtree(state_root)

    report = engine.repair(grace_seconds=0)

    assert (report.rows_removed, report.rows_added, report.rows_corrected) == (0, 0, 0)
    assert snapshot() == before
    assert set(Item.objects.values_list("id", flat=True)) == set(ids)
    assert Queue.objects.filter(name="main").exists()


@pytest.mark.django_db
def test_repair_grace_leaves_recent_files_and_rows_alone(state_root: Path):
    engine.upsert_queue(name="main", body={})
    unindexed = post(payload="a")
    fileless = post(payload="b")
    Item.objects.filter(id=unindexed).delete()
    os.unlink(state_root / "main" / "pending" / f"{fileless}.json")
    tmp = state_root / "main" / "pending" / f".{unindexed}.12345678.tmp"
    tmp.write_text("{}")

    report = engine.repair(grace_seconds=60)

    assert (report.rows_added, report.rows_removed, report.stale_files_removed) == (0, 0, 0)
    assert not Item.objects.filter(id=unindexed).exists()
    assert Item.objects.filter(id=fileless).exists()
    assert tmp.exists()

    report = engine.repair(grace_seconds=0)

    assert (report.rows_added, report.rows_removed, report.stale_files_removed) == (1, 1, 1)
    assert set(Item.objects.values_list("id", flat=True)) == {unindexed}
    assert_index_matches_directories(state_root)


@pytest.mark.django_db
def test_repair_grace_leaves_a_just_renamed_file_alone(state_root: Path):
    # A claim renames pending/ -> processing/ before it commits; the rename changes the
    # file's ctime, not its mtime, and repair beside a live server must not race it.
    engine.upsert_queue(name="main", body={})
    item_id = post(payload="a")
    pending = state_root / "main" / "pending" / f"{item_id}.json"
    _age(pending, 3600)
    os.rename(pending, state_root / "main" / "processing" / f"{item_id}.json")

    report = engine.repair(grace_seconds=60)

    assert (report.rows_added, report.rows_corrected, report.rows_removed) == (0, 0, 0)
    assert files_on_disk(state_root)[item_id] == [("main", "processing")]
    row = Item.objects.get(id=item_id)
    assert (row.status, row.attempts, row.lease_expires_at) == ("pending", 0, None)


@pytest.mark.django_db
def test_repair_undoes_a_claim_that_never_committed(state_root: Path):
    # The file was renamed to processing/ but the row is still pending at the file's rev: the
    # claim's transaction rolled back, so it never answered and no worker holds the item.
    engine.upsert_queue(name="main", body={"maxAttempts": 1})
    head = post(payload="a", thread_id="t")
    behind = post(payload="b", thread_id="t")
    os.rename(
        state_root / "main" / "pending" / f"{head}.json",
        state_root / "main" / "processing" / f"{head}.json",
    )

    report = engine.repair(grace_seconds=0)
    engine.sweep()

    assert report.rows_corrected == 1
    row = Item.objects.get(id=head)
    assert (row.status, row.attempts, row.error) == ("pending", 0, None)
    assert_index_matches_directories(state_root)
    assert_threads_consistent()
    claimed = engine.claim(queue_name="main", max_items=5)
    assert [(c.row.id, c.row.attempts) for c in claimed] == [(head, 1)]
    assert Item.objects.get(id=behind).status == Status.PENDING


@pytest.mark.django_db
def test_repair_quarantines_an_unreadable_file_and_reports_it(state_root: Path):
    # A new file whose data a power cut lost before its group's flush: never acknowledged.
    engine.upsert_queue(name="main", body={})
    good = post(payload="a")
    bad = state_root / "main" / "pending" / "0000000000000000bad000.json"
    bad.write_text('{"id": "0000000000000000bad000", "payl')

    report = engine.repair(grace_seconds=0)

    assert len(report.unreadable_files) == 1
    assert report.unreadable_files[0].startswith(str(bad))
    assert not bad.exists()
    assert (state_root / ".quarantine" / "main.pending.0000000000000000bad000.json").exists()
    assert set(Item.objects.values_list("id", flat=True)) == {good}


# -- the crash table of docs/architecture.md, row by row: what a crash leaves, what repair does --


def states_of(root: Path, item_id: str) -> list[str]:
    """The state directories of queue main holding the item's file."""
    return [state for _queue, state in files_on_disk(root).get(item_id, [])]


def file_of(root: Path, item_id: str) -> Path:
    (state,) = states_of(root, item_id)
    return root / "main" / state / f"{item_id}.json"


def next_line(item_id: str, **patch: Any) -> bytes:
    """A line that would follow the item's last one."""
    return encode_line({"rev": Item.objects.get(id=item_id).rev + 1, **patch})


@pytest.mark.django_db
@pytest.mark.parametrize("forget", [False, True], ids=["index-kept", "index-lost"])
@pytest.mark.parametrize("where", ["processing", "pending"])
def test_crash_table_row_2_a_verdict_line_outside_done_is_moved_to_done(
    state_root: Path, where: str, forget: bool
):
    # The verdict's line was written, its rename lost: the line says where the file belongs.
    engine.upsert_queue(name="main", body={})
    item = post(payload="a")
    claim_one(item)
    path = file_of(state_root, item)
    line = next_line(item, status="finished", result={"answer": 1}, finishedAt=to_wire(utcnow()))
    with open(path, "ab") as handle:
        handle.write(line)
    if where == "pending":
        path.rename(state_root / "main" / "pending" / path.name)
    if forget:
        forget_everything()

    engine.repair(grace_seconds=0)

    assert states_of(state_root, item) == ["done"]
    assert Item.objects.get(id=item).status == "finished"
    assert read_file(state_root, "main", "done", item)["result"] == {"answer": 1}
    assert_index_matches_directories(state_root)


@pytest.mark.django_db
@pytest.mark.parametrize("forget", [False, True], ids=["index-kept", "index-lost"])
def test_crash_table_row_3_a_file_in_done_without_a_verdict_goes_back_to_processing_lapsed(
    state_root: Path, forget: bool
):
    # The rename reached the disk, the verdict's line did not: the item is still held (its
    # result was never acknowledged). Rebuilt from the file alone its lease has lapsed; with
    # the index kept it keeps the lease it had (its worker may still send the result). Either
    # way the sweep re-queues it once the lease has lapsed.
    engine.upsert_queue(name="main", body={"maxAttempts": 3})
    item = post(payload="a")
    claim_one(item)
    held = Item.objects.get(id=item).lease_expires_at
    assert held is not None
    path = file_of(state_root, item)
    path.rename(state_root / "main" / "done" / path.name)
    if forget:
        forget_everything()

    engine.repair(grace_seconds=0)

    assert states_of(state_root, item) == ["processing"]
    row = Item.objects.get(id=item)
    assert row.status == "processing"
    assert row.lease_expires_at is not None
    if forget:
        assert row.lease_expires_at <= utcnow()
    else:
        assert row.lease_expires_at == held
    assert_index_matches_directories(state_root)
    engine.sweep(at=max(utcnow(), held) + timedelta(seconds=1))
    assert Item.objects.get(id=item).status == "pending"
    assert states_of(state_root, item) == ["pending"]
    assert [c.row.id for c in engine.claim(queue_name="main", max_items=5)] == [item]


@pytest.mark.django_db
@pytest.mark.parametrize("more", [False, True], ids=["torn-last", "torn-then-more"])
def test_crash_table_row_6_a_torn_line_ends_the_record_and_repair_cuts_the_file_there(
    state_root: Path, more: bool
):
    # A write a power cut cut short: the record ends at the first torn line (nothing after
    # it was flushed), and repair cuts the file there, so later appends start on a whole line.
    engine.upsert_queue(name="main", body={})
    item = post(payload="a")
    path = file_of(state_root, item)
    whole = path.read_bytes()
    torn = encode_line({"rev": 2, "status": "failed", "error": "x"})[:-7]
    with open(path, "ab") as handle:
        handle.write(torn + (encode_line({"rev": 3, "status": "finished"}) if more else b""))

    report = engine.repair(grace_seconds=0)

    assert report.torn_lines_cut == 1
    assert path.read_bytes() == whole
    assert Item.objects.get(id=item).status == "pending"
    assert read_file(state_root, "main", "pending", item)["rev"] == 1
    assert_index_matches_directories(state_root)


@pytest.mark.django_db
def test_crash_table_row_7_an_indexed_item_whose_file_has_no_whole_first_line_loses_its_row(
    state_root: Path,
):
    # The database kept a group's rows, the disk lost the data of its new files (a post never
    # acknowledged): the file is quarantined and the row goes with it, so the index equals the
    # files and a retried post with the same key makes a new item, not one with no payload.
    engine.upsert_queue(name="main", body={})
    good = post(payload="a")
    lost = post(payload="b", key="k")
    file_of(state_root, lost).write_bytes(b"")

    report = engine.repair(grace_seconds=0)

    assert len(report.unreadable_files) == 1
    assert report.rows_removed == 1
    assert set(Item.objects.values_list("id", flat=True)) == {good}
    assert_index_matches_directories(state_root)
    again = engine.post_items(queue_name="main", items=[engine.NewItem(payload="b", key="k")])[0]
    assert again.created
    assert read_file(state_root, "main", "pending", again.row.id)["payload"] == "b"
