"""The sweep's schedule step (``engine.schedules``, ``group._fire``) with a chosen clock, on the
test's database and a real state root: what a step read before a change does, two steps for
one slot, a leftover file at a slot's id, and what idle schedules cost a pass."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from taskhoster import engine
from taskhoster import errors as engine_errors
from taskhoster.engine import schedules, slots
from taskhoster.engine.committer import execute
from taskhoster.engine.ops import Fire
from taskhoster.models import Item, Schedule

pytestmark = pytest.mark.django_db

T0 = datetime(2026, 12, 3, 8, 0, tzinfo=UTC)


@pytest.fixture
def queue(make_queue):
    return make_queue("q")


def make(name: str = "s", **body) -> Schedule:
    body.setdefault("payload", {"n": name})
    body.setdefault("every", 60)
    return engine.put_schedule("q", name, body, at=T0 - timedelta(seconds=1))[0]


def items() -> list[Item]:
    return list(Item.objects.filter(queue__name="q").order_by("id"))


def test_a_slot_is_posted_once_with_its_key_id_and_schedule(queue):
    made = make(every=60, priority=2, threadId="t")
    assert made.next_at == T0
    report = engine.fire_due(at=T0 + timedelta(seconds=1))
    assert (report.posted, report.lost) == (1, 0)
    (item,) = items()
    assert item.key == "schedule:s:2026-12-03T08:00:00Z"
    assert item.id == slots.slot_item_id(made.salt, T0)
    assert (item.priority, item.thread_id) == (2, "t")
    wire = engine.item_json(item)
    assert wire["schedule"] == {"name": "s", "slot": "2026-12-03T08:00:00Z"}
    again = engine.fire_due(at=T0 + timedelta(seconds=2))
    assert (again.posted, again.found) == (0, 0)
    assert len(items()) == 1
    schedule = Schedule.objects.get(name="s")
    assert schedule.next_at == T0 + timedelta(seconds=60)
    assert (schedule.last_slot, schedule.last_item) == (T0, item.id)


def test_a_step_read_before_a_change_or_a_pause_or_a_delete_posts_nothing(queue):
    for change in ({"payload": {"new": 1}}, {"paused": True}, None):
        make("s")
        schedule = Schedule.objects.select_related("queue").get(name="s")
        steps, _ = schedules._firings(schedule, T0 + timedelta(seconds=1))
        if change is None:
            engine.delete_schedule("q", "s")
        else:
            engine.put_schedule("q", "s", change)
        (answer,) = execute(Fire(firings=steps))
        assert not answer.done, change
        assert items() == []
        if change is not None:
            engine.delete_schedule("q", "s")


def test_two_steps_for_one_slot_post_one_item(queue):
    make("s")
    schedule = Schedule.objects.select_related("queue").get(name="s")
    first, _ = schedules._firings(schedule, T0 + timedelta(seconds=1))
    second, _ = schedules._firings(schedule, T0 + timedelta(seconds=1))
    (a,) = execute(Fire(firings=first))
    (b,) = execute(Fire(firings=second))
    assert a.done
    assert a.created
    assert not b.done
    assert len(items()) == 1


def test_a_slots_item_already_there_under_its_key_is_found_not_made_again(queue):
    """As after a power cut that took back the record of a slot but not its item's file."""
    make("s")
    engine.fire_due(at=T0 + timedelta(seconds=1))
    Schedule.objects.filter(name="s").update(next_at=T0, last_slot=None, last_item=None)
    report = engine.fire_due(at=T0 + timedelta(seconds=2))
    assert (report.posted, report.found) == (0, 1)
    assert len(items()) == 1
    assert Schedule.objects.get(name="s").last_item == items()[0].id


def test_a_leftover_file_at_a_slots_id_is_replaced_not_kept_beside_it(queue, state_root):
    made = make("s")
    item_id = slots.slot_item_id(made.salt, T0)
    leftover = state_root / "q" / "pending" / f"{item_id}.json"
    leftover.parent.mkdir(parents=True, exist_ok=True)
    leftover.write_bytes(b'{"torn')
    report = engine.fire_due(at=T0 + timedelta(seconds=1))
    assert report.posted == 1
    record = json.loads(leftover.read_bytes().splitlines()[0])
    assert record["key"] == "schedule:s:2026-12-03T08:00:00Z"
    assert [i.id for i in items()] == [item_id]
    assert len(list((state_root / "q").glob("*/*.json"))) == 1
    # Kept aside, not unlinked: had a row held it, the group's rollback would put it back.
    (aside,) = (state_root / ".quarantine").glob(f"q.pending.{item_id}.*.json")
    assert aside.read_bytes() == b'{"torn'


def test_a_group_that_fails_after_replacing_a_file_puts_the_file_back(queue, state_root):
    from taskhoster.engine.common import store

    batch = store().batch()
    path = state_root / "q" / "pending" / "abc.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"theirs\n")
    batch.create("q", "abc", b"ours\n", replace=True)
    assert path.read_bytes() == b"ours\n"
    batch.rollback()
    assert path.read_bytes() == b"theirs\n"
    assert list((state_root / ".quarantine").iterdir()) == []


def test_a_slot_found_a_little_late_is_posted_whatever_catchup_seconds(queue):
    make("s", every=60, catchupSeconds=0)
    report = engine.fire_due(at=T0 + timedelta(seconds=1.5))  # a sweep's ordinary delay
    assert (report.posted, report.skipped) == (1, 0)
    late = engine.fire_due(at=T0 + timedelta(seconds=60 + 3))  # its next slot, 3 s late
    assert (late.posted, late.skipped) == (0, 1)


def test_a_timing_change_never_moves_the_next_slot_back_to_one_posted(queue):
    make("s", every=60)
    engine.fire_due(at=T0 + timedelta(seconds=1))
    # A change made on a host whose clock is a minute behind the sweep's.
    changed, _ = engine.put_schedule("q", "s", {"every": 30}, at=T0 - timedelta(seconds=60))
    assert changed.next_at is not None
    assert changed.next_at > T0


def test_overlap_skip_in_one_pass_posts_the_first_late_slot_and_passes_the_rest(queue):
    make("s", every=1, overlap="skip", catchupSeconds=10)
    report = engine.fire_due(at=T0 + timedelta(seconds=5))
    assert (report.posted, report.overlapped) == (1, 5)
    assert len(items()) == 1
    allow = engine.put_schedule("q", "a", {"every": 1, "payload": 1, "catchupSeconds": 10}, at=T0)
    assert allow[0].next_at == T0 + timedelta(seconds=1)
    report = engine.fire_due(at=T0 + timedelta(seconds=5))
    assert report.posted == 5  # a's five slots (s's previous item is still pending)


def test_late_slots_are_posted_oldest_first_up_to_catchup_seconds_and_older_ones_skipped(queue):
    make("s", every=10, catchupSeconds=25)
    report = engine.fire_due(at=T0 + timedelta(seconds=60))
    assert (report.posted, report.skipped) == (3, 4)
    keys = [i.key for i in items()]
    assert keys == [
        "schedule:s:2026-12-03T08:00:40Z",
        "schedule:s:2026-12-03T08:00:50Z",
        "schedule:s:2026-12-03T08:01:00Z",
    ]
    assert Schedule.objects.get(name="s").next_at == T0 + timedelta(seconds=70)


def test_a_thousand_schedules_not_due_cost_a_pass_one_indexed_query(queue):
    for n in range(1000):
        make(f"s{n}", every=3600)
    with CaptureQueriesContext(connection) as queries:
        report = engine.fire_due(at=T0 - timedelta(milliseconds=500))  # each due at T0
    assert report.posted == 0
    assert len(queries.captured_queries) == 1, [q["sql"][:120] for q in queries]
    sql = queries.captured_queries[0]["sql"]
    with connection.cursor() as cursor:
        if connection.vendor == "sqlite":
            cursor.execute("EXPLAIN QUERY PLAN " + sql)
            plan = " ".join(str(row) for row in cursor.fetchall())
        else:
            cursor.execute("SET LOCAL enable_seqscan = off")  # the table is small: may it?
            cursor.execute("EXPLAIN " + sql)
            plan = " ".join(row[0] for row in cursor.fetchall())
    assert "schedule_due" in plan, plan


def test_a_check_only_put_refuses_as_a_put_does_and_changes_nothing(queue, state_root):
    with pytest.raises(engine_errors.InvalidInput):
        engine.put_schedule("q", "s", {"cron": "61 * * * *", "payload": 1}, check_only=True)
    made, created = engine.put_schedule("q", "s", {"every": 5, "payload": 1}, check_only=True)
    assert created
    assert made.pk is None
    assert not Schedule.objects.exists()
    assert not (state_root / "q" / "schedules.json").exists()
    make("s")
    before = (state_root / "q" / "schedules.json").read_bytes()
    engine.put_schedule("q", "s", {"paused": True, "payload": 2}, check_only=True)
    assert (state_root / "q" / "schedules.json").read_bytes() == before
    row = Schedule.objects.get(name="s")
    assert (row.paused, row.payload, row.rev) == (False, {"n": "s"}, 1)
