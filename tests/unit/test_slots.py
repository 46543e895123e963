"""A schedule's slots (``engine.slots``): intervals counted from the epoch, cron in wall-clock
time of the schedule's timezone, and the two daylight-saving days of a year (a slot in the
gap is skipped, a repeated wall time is one slot, at its first occurrence)."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from taskhoster.engine import slots
from taskhoster.engine.slots import Spec
from taskhoster.ids import ID_PATTERN


def series(spec: Spec, start: datetime, end: datetime) -> list[datetime]:
    """Every slot in (start, end]."""
    found: list[datetime] = []
    at = start
    while True:
        nxt = slots.next_slot(spec, at)
        assert nxt is not None
        if nxt > end:
            return found
        assert nxt > at
        found.append(nxt)
        at = nxt


def local(values: list[datetime], tz: str) -> list[str]:
    zone = slots.zone(tz)
    return [v.astimezone(zone).strftime("%m-%d %H:%M%z") for v in values]


def utc(
    year: int, month: int, day: int, hour: int = 0, minute: int = 0, second: int = 0
) -> datetime:
    return datetime(year, month, day, hour, minute, second, tzinfo=UTC)


# -- intervals -----------------------------------------------------------------------------------


def test_an_interval_has_a_slot_at_every_multiple_of_its_seconds_since_the_epoch():
    assert slots.next_slot(Spec(every=3600), utc(2026, 12, 3, 7, 59, 59)) == utc(2026, 12, 3, 8)
    assert slots.next_slot(Spec(every=3600), utc(2026, 12, 3, 8)) == utc(2026, 12, 3, 9)
    assert slots.next_slot(Spec(every=7), utc(1970, 1, 1)) == utc(1970, 1, 1, 0, 0, 7)
    half = utc(2026, 1, 1) + timedelta(microseconds=500_000)
    assert slots.next_slot(Spec(every=1), half) == utc(2026, 1, 1, 0, 0, 1)


@given(st.integers(1, 86400 * 3), st.integers(0, 2_000_000_000_000_000))
def test_an_intervals_next_slot_is_the_first_multiple_strictly_after(every, micros):
    at = slots.EPOCH + timedelta(microseconds=micros)
    found = slots.next_every(every, at)
    assert found > at
    assert found - timedelta(seconds=every) <= at
    assert (found - slots.EPOCH) % timedelta(seconds=every) == timedelta(0)


# -- cron and daylight saving -------------------------------------------------------------------


def test_a_daily_cron_in_the_gap_of_spring_forward_has_no_slot_that_day():
    # Europe/Berlin, 2026-03-29: 02:00 CET is 03:00 CEST; 02:30 does not exist.
    found = series(
        Spec(cron="30 2 * * *", timezone="Europe/Berlin"), utc(2026, 3, 27), utc(2026, 3, 31)
    )
    assert local(found, "Europe/Berlin") == [
        "03-27 02:30+0100",
        "03-28 02:30+0100",
        "03-30 02:30+0200",
    ]


def test_a_daily_cron_in_the_repeated_hour_of_fall_back_fires_once():
    # Europe/Berlin, 2026-10-25: 03:00 CEST is 02:00 CET; 02:30 happens twice.
    found = series(
        Spec(cron="30 2 * * *", timezone="Europe/Berlin"), utc(2026, 10, 23), utc(2026, 10, 27)
    )
    assert local(found, "Europe/Berlin") == [
        "10-23 02:30+0200",
        "10-24 02:30+0200",
        "10-25 02:30+0200",  # the first 02:30 only
        "10-26 02:30+0100",
    ]


def test_quarter_hours_across_both_transition_days_of_a_year():
    spec = Spec(cron="*/15 * * * *", timezone="Europe/Berlin")
    spring = series(spec, utc(2026, 3, 29, 0, 30), utc(2026, 3, 29, 1, 15))
    assert local(spring, "Europe/Berlin") == [
        "03-29 01:45+0100",
        "03-29 03:00+0200",  # 02:00-02:45 do not exist
        "03-29 03:15+0200",
    ]
    autumn = series(spec, utc(2026, 10, 24, 23, 30), utc(2026, 10, 25, 2, 15))
    assert local(autumn, "Europe/Berlin") == [
        "10-25 01:45+0200",
        "10-25 02:00+0200",
        "10-25 02:15+0200",
        "10-25 02:30+0200",
        "10-25 02:45+0200",
        "10-25 03:00+0100",  # the second pass through 02:00-02:45 posts nothing
        "10-25 03:15+0100",
    ]
    assert all(b - a >= timedelta(minutes=15) for a, b in itertools.pairwise(autumn))


@pytest.mark.parametrize(
    ("cron", "tz", "expected"),
    [
        # 48 half hours a day; spring forward loses 02:00 and 02:30; fall back repeats none.
        ("*/30 * * * *", "Europe/Berlin", 365 * 48 - 2),
        ("0 * * * *", "America/New_York", 365 * 24 - 1),
        ("30 2 * * *", "America/New_York", 365 - 1),
        ("30 1 * * *", "America/New_York", 365),  # 01:30 twice on 2026-11-01: one slot
        ("0 12 * * MON-FRI", "UTC", 261),
        ("0 0 1 JAN,jul *", "Asia/Tokyo", 2),
    ],
)
def test_a_years_slot_count_skips_the_gap_and_counts_the_repeated_hour_once(cron, tz, expected):
    zone = slots.zone(tz)
    start = datetime(2026, 1, 1, tzinfo=zone).astimezone(UTC) - timedelta(microseconds=1)
    end = datetime(2027, 1, 1, tzinfo=zone).astimezone(UTC) - timedelta(microseconds=1)
    found = series(Spec(cron=cron, timezone=tz), start, end)
    assert len(found) == expected
    assert len(set(found)) == len(found)


def test_a_cron_next_slot_from_inside_the_repeated_hours_second_pass_is_after_it():
    # 02:10 CET on 2026-10-25 (the second pass): the next quarter hour is 02:15 CET's...
    # which is in the second pass too, so not a slot: 03:00 CET is.
    after = utc(2026, 10, 25, 1, 10)
    found = slots.next_slot(Spec(cron="*/15 * * * *", timezone="Europe/Berlin"), after)
    assert found == utc(2026, 10, 25, 2, 0)


@pytest.mark.parametrize(
    "bad", ["* * * *", "* * * * * *", "61 * * * *", "0 0 31 2 *", "0 0 * 13 *", "a b c d e", ""]
)
def test_a_cron_that_is_not_five_valid_fields_is_refused(bad):
    with pytest.raises(slots.BadSpec):
        slots.check_cron(bad)


def test_cron_names_ranges_steps_and_lists_are_understood():
    assert slots.check_cron("0  9-17/2 * jan-MAR mon,wed,FRI") == "0 9-17/2 * jan-MAR mon,wed,FRI"
    found = series(Spec(cron="0 9-17/4 * * sat"), utc(2026, 12, 4, 23), utc(2026, 12, 6))
    assert [f.hour for f in found] == [9, 13, 17]


@pytest.mark.parametrize(
    "bad",
    ["Mars/Olympus", "", "../../etc/passwd", "/etc/localtime", "a\x00", "localtime", "Factory"],
)
def test_an_unknown_timezone_is_refused(bad):
    with pytest.raises(slots.BadSpec):
        slots.zone(bad)


# -- keys, ids, catch-up -------------------------------------------------------------------------


def test_a_slots_key_names_its_schedule_and_slot_and_reads_back():
    slot = utc(2026, 12, 3, 7, 30)
    key = slots.slot_key("nightly", slot)
    assert key == "schedule:nightly:2026-12-03T07:30:00Z"
    assert slots.schedule_of_key(key) == {"name": "nightly", "slot": "2026-12-03T07:30:00Z"}
    assert slots.schedule_of_key("dead-letter:x:1") is None
    assert slots.schedule_of_key(None) is None


def test_a_slots_item_id_is_the_same_each_time_and_differs_by_schedule_and_slot():
    slot = utc(2026, 12, 3, 7, 30)
    one = slots.slot_item_id("salt-a", slot)
    assert ID_PATTERN.fullmatch(one)
    assert one == slots.slot_item_id("salt-a", slot)
    assert one != slots.slot_item_id("salt-b", slot)
    assert one != slots.slot_item_id("salt-a", slot + timedelta(seconds=1))
    # It sorts by its slot, as ids sort by arrival.
    assert one < slots.slot_item_id("salt-b", slot + timedelta(seconds=1))
    many = {slots.slot_item_id(f"s{n}", slot) for n in range(5000)}
    assert len(many) == 5000


def test_due_slots_posts_the_late_ones_within_catchup_oldest_first_and_skips_the_rest():
    spec = Spec(every=10)
    post, skipped, after = slots.due_slots(spec, utc(2026, 1, 1), utc(2026, 1, 1, 0, 1), 25, 100)
    assert post == [utc(2026, 1, 1, 0, 0, 40), utc(2026, 1, 1, 0, 0, 50), utc(2026, 1, 1, 0, 1)]
    assert skipped == 4  # :00, :10, :20, :30
    assert after == utc(2026, 1, 1, 0, 1, 10)
    cron = Spec(cron="* * * * *")
    post, skipped, after = slots.due_slots(cron, utc(2026, 1, 1), utc(2026, 1, 1, 1), 600, 3)
    assert post == [utc(2026, 1, 1, 0, 50), utc(2026, 1, 1, 0, 51), utc(2026, 1, 1, 0, 52)]
    assert skipped == 50
    assert after == utc(2026, 1, 1, 0, 53)  # the rest in the next pass


def test_a_crons_slots_a_month_late_are_passed_over_without_walking_each():
    spec = Spec(cron="* * * * *")
    start = utc(2026, 1, 1)
    post, skipped, after = slots.due_slots(spec, start, utc(2026, 2, 1), 120, 100)
    assert post == [utc(2026, 1, 31, 23, 58), utc(2026, 1, 31, 23, 59), utc(2026, 2, 1)]
    assert skipped >= slots.MOST_COUNTED  # counted up to there, the rest jumped
    assert after == utc(2026, 2, 1, 0, 1)
