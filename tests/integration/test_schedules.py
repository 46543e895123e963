"""Schedules (SPEC section 8.3) against a real daphne and real ``manage.py sweep`` processes:
each slot posts exactly one item under its key, whatever the number of sweeps and across a
kill -9 of one between the post and the record; ``overlap: "skip"``; catch-up and its limit;
pause and delete stop a schedule at once; a thread keeps a schedule's items one at a time.

The slot arithmetic (intervals, cron, daylight-saving days) is ``tests/unit/test_slots.py``;
the engine's step with a chosen clock is ``test_schedule_steps.py``.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from ..conftest import REPO, server_env
from .test_processes import wait_for
from .wsclient import connect, make_queue, recv, send, subscribe

pytestmark = pytest.mark.slow


@pytest.fixture
def server(server_factory):
    return server_factory()


def parse(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def items_of(http: httpx.Client, queue: str = "q") -> list[dict[str, Any]]:
    """Every item of the queue (all pages), listing order."""
    found: list[dict[str, Any]] = []
    cursor = None
    while True:
        params: dict[str, Any] = {"limit": 500}
        if cursor:
            params["cursor"] = cursor
        page = http.get(f"/api/queues/{queue}/items", params=params).json()
        found.extend(page["items"])
        cursor = page["next"]
        if not cursor:
            return found


def put_schedule(http: httpx.Client, name: str, queue: str = "q", **body: Any) -> dict:
    body.setdefault("payload", {"job": name})
    response = http.put(f"/api/queues/{queue}/schedules/{name}", json=body)
    assert response.status_code in (200, 201), response.text
    return dict(response.json())


def slots_of(items: list[dict[str, Any]], name: str | None = None) -> Counter[str]:
    """How many items each slot has (the schedule's, or every schedule's), by key."""
    return Counter(
        i["key"]
        for i in items
        if i.get("schedule") and (name is None or i["schedule"]["name"] == name)
    )


class Sweeps:
    """``manage.py sweep --every S`` processes against the test's database and state root."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[Any] = []

    def start(self, every: float = 0.2, **env: str) -> subprocess.Popen[bytes]:
        log = open(self.root.parent / f"sweep-{len(self.procs)}.log", "ab")  # noqa: SIM115
        self.logs.append(log)
        proc = subprocess.Popen(
            [sys.executable, "manage.py", "sweep", "--every", str(every)],
            cwd=REPO,
            env=server_env(self.root, **env),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.flush()
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        time.sleep(0.2)  # its committer process writes what it counted as it exits
        for log in self.logs:
            log.close()
        self.logs.clear()

    def log(self, n: int) -> str:
        return (self.root.parent / f"sweep-{n}.log").read_text()


@pytest.fixture
def sweeps(server, state_root):
    found = Sweeps(state_root)
    yield found
    found.stop()


# -- the API -----------------------------------------------------------------------------------


def test_put_creates_a_schedule_with_its_next_slot_and_a_second_put_changes_it(http, server):
    make_queue(http)
    response = http.put(
        "/api/queues/q/schedules/nightly",
        json={"cron": "30 2 * * *", "timezone": "Europe/Berlin", "payload": {"a": 1}},
    )
    assert response.status_code == 201, response.text
    made = response.json()
    assert made["cron"] == "30 2 * * *"
    assert made["every"] is None
    assert made["overlap"] == "allow"
    assert made["catchupSeconds"] == 60
    assert not made["paused"]
    assert made["lastSlot"] is None
    assert made["lastItem"] is None
    local = parse(made["nextAt"]).astimezone(__import__("zoneinfo").ZoneInfo("Europe/Berlin"))
    assert (local.hour, local.minute) == (2, 30)
    changed = http.put("/api/queues/q/schedules/nightly", json={"priority": 7})
    assert changed.status_code == 200, changed.text
    assert changed.json()["priority"] == 7
    assert changed.json()["payload"] == {"a": 1}
    assert changed.json()["nextAt"] == made["nextAt"]  # timing unchanged: same next slot
    switched = http.put("/api/queues/q/schedules/nightly", json={"every": 60}).json()
    assert switched["cron"] is None
    assert switched["every"] == 60
    assert parse(switched["nextAt"]).second == 0
    got = http.get("/api/queues/q/schedules/nightly").json()
    assert got == switched
    listing = http.get("/api/queues/q/schedules").json()
    assert [s["name"] for s in listing["schedules"]] == ["nightly"]
    assert listing["next"] is None


def test_schedules_are_listed_by_name_a_page_at_a_time(http, server):
    make_queue(http)
    for name in ("c", "a", "b"):
        put_schedule(http, name, every=60)
    first = http.get("/api/queues/q/schedules", params={"limit": 2}).json()
    assert [s["name"] for s in first["schedules"]] == ["a", "b"]
    assert first["next"]
    bad = http.get("/api/queues/q/schedules", params={"cursor": "LmJhZA"})  # ".bad"
    assert bad.status_code == 400
    assert bad.json()["error"]["code"] == "invalid_cursor"
    rest = http.get("/api/queues/q/schedules", params={"limit": 2, "cursor": first["next"]})
    assert [s["name"] for s in rest.json()["schedules"]] == ["c"]
    assert rest.json()["next"] is None


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"cron": "* * * *", "payload": 1}, 400, "invalid_schedule"),
        ({"cron": "61 * * * *", "payload": 1}, 400, "invalid_schedule"),
        ({"cron": "0 0 31 2 *", "payload": 1}, 400, "invalid_schedule"),
        ({"cron": "0 0 * * * *", "payload": 1}, 400, "invalid_schedule"),
        ({"cron": "* * * * *", "every": 5, "payload": 1}, 400, "invalid"),
        ({"every": 0, "payload": 1}, 400, "invalid_schedule"),
        ({"every": 1.5, "payload": 1}, 400, "invalid_schedule"),
        ({"every": 5, "timezone": "Mars/Olympus", "payload": 1}, 400, "invalid_schedule"),
        ({"every": 5, "timezone": "../../etc/passwd", "payload": 1}, 400, "invalid_schedule"),
        ({"every": 5, "overlap": "sometimes", "payload": 1}, 400, "invalid_schedule"),
        ({"every": 5, "catchupSeconds": -1, "payload": 1}, 400, "invalid_schedule"),
        ({"every": 5, "priority": 10, "payload": 1}, 400, "invalid"),
        ({"every": 5, "threadId": "", "payload": 1}, 400, "invalid_thread_id"),
        ({"every": 5, "payload": 1, "colour": "red"}, 400, "unknown_field"),
        ({"every": 5}, 400, "missing_field"),
        ({"payload": 1}, 400, "missing_field"),
        ([1, 2], 400, "invalid_body"),
    ],
)
def test_a_bad_schedule_is_refused_with_a_clear_error_and_makes_nothing(
    http, server, body, status, code
):
    make_queue(http)
    response = http.put("/api/queues/q/schedules/s", json=body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["code"] == code
    assert http.get("/api/queues/q/schedules").json()["schedules"] == []


def test_unknown_queue_schedule_and_bad_names_answer_4xx(http, server):
    make_queue(http)
    assert (
        http.put("/api/queues/nope/schedules/s", json={"every": 5, "payload": 1}).json()["error"][
            "code"
        ]
        == "queue_not_found"
    )
    assert http.get("/api/queues/q/schedules/none").json()["error"]["code"] == "schedule_not_found"
    assert http.delete("/api/queues/q/schedules/none").status_code == 404
    bad = http.put("/api/queues/q/schedules/.hidden", json={"every": 5, "payload": 1})
    assert bad.status_code == 400
    assert bad.json()["error"]["code"] == "invalid_schedule_name"


def test_a_producer_key_may_not_take_a_schedules_slot_key(http, server):
    make_queue(http)
    response = http.post(
        "/api/queues/q/items", json={"payload": 1, "key": "schedule:s:2026-01-01T00:00:00Z"}
    )
    assert response.status_code == 400, response.text
    assert "schedule:" in response.json()["error"]["message"]


def test_managing_schedules_needs_the_manage_scope_and_the_queue(server, make_key):
    with httpx.Client(
        base_url=server.url, headers={"Authorization": f"Token {make_key()}"}
    ) as admin:
        make_queue(admin)
        make_queue(admin, "other")
    produce = make_key("produce")
    other = make_key("manage", queues=["other"])
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Token {produce}"}) as c:
        assert (
            c.put("/api/queues/q/schedules/s", json={"every": 5, "payload": 1}).status_code == 403
        )
        assert c.get("/api/queues/q/schedules").status_code == 200
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Token {other}"}) as c:
        assert (
            c.put("/api/queues/q/schedules/s", json={"every": 5, "payload": 1}).status_code == 403
        )
        assert (
            c.put("/api/queues/other/schedules/s", json={"every": 5, "payload": 1}).status_code
            == 201
        )


# -- each slot, one item -------------------------------------------------------------------------


def test_each_slot_posts_one_item_under_its_key_with_its_schedule(http, server, sweeps):
    make_queue(http)
    made = put_schedule(http, "tick", every=1, priority=3, payload={"n": 1})
    sweeps.start(every=0.2)
    wait_for(lambda: len(items_of(http)) >= 3, 15, "three slots posted")
    sweeps.stop()
    items = items_of(http)
    keys = slots_of(items, "tick")
    assert set(keys.values()) == {1}, keys  # no slot twice
    first = parse(made["nextAt"])
    slots = sorted(parse(i["schedule"]["slot"]) for i in items)
    assert slots[0] == first
    assert all(b - a == timedelta(seconds=1) for a, b in itertools.pairwise(slots))
    for item in items:
        assert item["key"] == f"schedule:tick:{item['schedule']['slot']}"
        assert item["priority"] == 3
        full = http.get(f"/api/items/{item['id']}").json()
        assert full["payload"] == {"n": 1}
        # Posted within one sweep interval (and the scheduling slack of a busy machine).
        assert parse(full["postedAt"]) - parse(item["schedule"]["slot"]) < timedelta(seconds=3)
    got = http.get("/api/queues/q/schedules/tick").json()
    assert got["lastSlot"] == max(i["schedule"]["slot"] for i in items).replace("Z", ".000000Z")
    assert got["lastItem"] in {i["id"] for i in items}


def test_three_sweeps_at_once_post_every_slot_exactly_once(http, server, sweeps):
    make_queue(http)
    names = [f"s{n}" for n in range(20)]
    for name in names:
        put_schedule(http, name, every=1)
    for _ in range(3):
        sweeps.start(every=0.1)
    # From the first slot of every schedule on, not from the start: a sweep's start (Django's,
    # its committer process's) took 3 s of the 6 this test once gave them on a loaded machine.
    deadline = time.monotonic() + 60
    while not all(slots_of(items_of(http), name) for name in names):
        assert time.monotonic() < deadline, "no slot of every schedule within a minute"
        time.sleep(0.2)
    time.sleep(4.5)
    sweeps.stop()
    items = items_of(http)
    for name in names:
        keys = slots_of(items, name)
        assert keys, name
        assert set(keys.values()) == {1}, (name, keys)
        slots = sorted(parse(k.split(":", 2)[2]) for k in keys)
        span = int((slots[-1] - slots[0]).total_seconds()) + 1
        assert len(slots) == span, (name, "a slot was missed between the first and the last")
        assert len(slots) >= 4


def test_a_sweep_killed_between_the_post_and_the_record_makes_no_second_item(
    http, server, sweeps, manage
):
    make_queue(http)
    put_schedule(http, "tick", every=1, catchupSeconds=30)
    crashed = sweeps.start(every=0.2, TASKHOSTER_CRASH_AT="schedule.after_post")
    crashed.wait(30)
    assert "crash point schedule.after_post reached" in sweeps.log(0)
    # Its slot's file is there, neither its row nor the schedule's move committed.
    files = list((server.root / "q" / "pending").glob("*.json"))
    assert len(files) == 1
    assert items_of(http) == []
    left = files[0].stem
    sweeps.start(every=0.2)
    wait_for(lambda: len(items_of(http)) >= 3, 15, "the sweep going on")
    sweeps.stop()
    items = items_of(http)
    assert set(slots_of(items).values()) == {1}
    assert left in {i["id"] for i in items}  # the same slot, the same item (its file replaced)
    on_disk = {p.stem for p in (server.root / "q").glob("*/*.json")}
    assert on_disk == {i["id"] for i in items}
    # A repair finds nothing to index that nobody posted (and its sweep goes on posting).
    report = manage("sweep", "--repair", "--grace", "0").stdout
    assert "0 row(s) added" in report, report
    assert set(slots_of(items_of(http)).values()) == {1}


def test_a_sweep_killed_after_the_commit_before_the_flush_posts_its_slot_once(http, server, sweeps):
    make_queue(http)
    put_schedule(http, "tick", every=1, catchupSeconds=30)
    crashed = sweeps.start(every=0.2, TASKHOSTER_CRASH_AT="schedule.after_commit")
    crashed.wait(30)
    assert "crash point schedule.after_commit reached" in sweeps.log(0)
    # The first group's slots: one, or more when the sweep process took over a second to
    # start (a loaded machine) and found several slots due at its first pass.
    committed = items_of(http)
    assert committed, "the group committed before the crash"
    assert set(slots_of(committed).values()) == {1}
    sweeps.start(every=0.2)
    wait_for(lambda: len(items_of(http)) >= len(committed) + 2, 15, "the sweep going on")
    sweeps.stop()
    assert set(slots_of(items_of(http)).values()) == {1}


# -- overlap, catch-up, pause, delete --------------------------------------------------------


def test_overlap_skip_posts_nothing_while_the_previous_item_is_not_terminal(http, server, sweeps):
    make_queue(http)
    put_schedule(http, "once", every=1, overlap="skip")
    sweeps.start(every=0.2)
    wait_for(lambda: items_of(http), 15, "the first slot")
    time.sleep(3)
    items = items_of(http)
    assert len(items) == 1, "a slot was posted while the previous item was pending"
    claimed = http.post("/api/queues/q/claim", json={"max": 1}).json()["items"]
    time.sleep(2.5)
    assert len(items_of(http)) == 1, "a slot was posted while the previous item was processing"
    assert http.post(f"/api/items/{claimed[0]['id']}/result", json={"result": 1}).status_code == 200
    wait_for(lambda: len(items_of(http)) == 2, 10, "the next slot once the item finished")
    sweeps.stop()


def test_slots_missed_while_no_sweep_ran_are_posted_up_to_catchup_seconds_late(
    http, server, sweeps
):
    make_queue(http)
    made = put_schedule(http, "tick", every=1, catchupSeconds=4)
    first = parse(made["nextAt"])
    time.sleep(9)  # no sweep: the slots from first on come and go
    sweeps.start(every=0.2)
    wait_for(lambda: items_of(http), 15, "a sweep")
    time.sleep(0.5)
    sweeps.stop()
    items = [http.get(f"/api/items/{i['id']}").json() for i in items_of(http)]
    slots = sorted(parse(i["schedule"]["slot"]) for i in items)
    assert slots[0] > first, "a slot later than catchupSeconds was posted"
    assert all(b - a == timedelta(seconds=1) for a, b in itertools.pairwise(slots))
    late = {
        i["schedule"]["slot"]: parse(i["postedAt"]) - parse(i["schedule"]["slot"])
        for i in items
        if parse(i["postedAt"]) - parse(i["schedule"]["slot"]) > timedelta(seconds=1)
    }
    # The slots of the last catchupSeconds before the first pass: posted, none later than that.
    assert len(late) >= 3, late
    assert max(late.values()) <= timedelta(seconds=4.5), late


def test_pausing_or_deleting_a_schedule_stops_it_at_once(http, server, sweeps):
    make_queue(http)
    put_schedule(http, "a", every=1)
    put_schedule(http, "b", every=1)
    sweeps.start(every=0.1)
    wait_for(lambda: len(slots_of(items_of(http), "a")) >= 2, 15, "slots of a")
    paused = http.put("/api/queues/q/schedules/a", json={"paused": True}).json()
    assert paused["paused"]
    assert paused["nextAt"] is None
    assert http.delete("/api/queues/q/schedules/b").status_code == 204
    at_stop = items_of(http)
    time.sleep(2.5)
    after = items_of(http)
    # At most a step that had committed before the change answered (none after).
    assert {i["id"] for i in after} == {i["id"] for i in at_stop}
    resumed = http.put("/api/queues/q/schedules/a", json={"paused": False}).json()
    assert parse(resumed["nextAt"]) > datetime.now(UTC) - timedelta(seconds=1)
    wait_for(lambda: len(items_of(http)) > len(after), 10, "the resumed schedule")
    sweeps.stop()
    new = [i for i in items_of(http) if i["id"] not in {j["id"] for j in after}]
    assert all(parse(i["schedule"]["slot"]) >= parse(resumed["nextAt"]) for i in new)
    assert {i["schedule"]["name"] for i in new} == {"a"}


def test_deleting_the_queue_deletes_its_schedules(http, server, sweeps):
    make_queue(http)
    put_schedule(http, "tick", every=1)
    assert http.delete("/api/queues/q").status_code == 204
    make_queue(http)
    assert http.get("/api/queues/q/schedules").json()["schedules"] == []
    sweeps.start(every=0.2)
    time.sleep(2)
    sweeps.stop()
    assert items_of(http) == []


# -- threads ---------------------------------------------------------------------------------


def test_a_threaded_schedule_with_overlap_allow_never_runs_two_items_at_once(
    http, server, sweeps, key
):
    """Every slot posts (overlap allow), but its items share a thread, so a worker that takes
    longer than the interval still gets them one at a time."""
    make_queue(http)
    put_schedule(http, "slow", every=1, threadId="slow-job")
    sweeps.start(every=0.2)

    async def work() -> list[tuple[float, float, str]]:
        spans: list[tuple[float, float, str]] = []
        ws = await connect(server, key)
        await subscribe(ws, ["q"], 4)  # room for four at once: only the thread holds it to one
        # Eight seconds from the first item (a sweep process takes a while to start).
        deadline = time.monotonic() + 30
        held: dict[str, float] = {}
        while time.monotonic() < deadline:
            try:
                frame = await recv(ws, timeout=0.5)
            except TimeoutError:
                frame = None
            now = time.monotonic()
            if frame and frame["type"] == "item":
                assert not held, f"{frame['id']} pushed while {list(held)} was held"
                held[frame["id"]] = now
                if not spans and deadline - now > 8:
                    deadline = now + 8
            for item_id, since in list(held.items()):
                if now - since >= 1.6:  # longer than the interval
                    await send(ws, {"type": "result", "id": item_id, "result": 1})
                    del held[item_id]
                    spans.append((since, time.monotonic(), item_id))
        await ws.close()
        return spans

    spans = asyncio.run(work())
    sweeps.stop()
    assert len(spans) >= 3
    items = items_of(http)
    assert len(items) > len(spans), "every slot posted (overlap allow), more than were run"
    assert set(slots_of(items).values()) == {1}


# -- a database that lost a change -------------------------------------------------------------


def test_repair_restores_schedules_a_lost_database_forgot_from_the_state_root(http, server, manage):
    from taskhoster.models import Schedule

    make_queue(http)
    kept = put_schedule(http, "kept", cron="*/5 * * * *", timezone="Asia/Tokyo", priority=4)
    put_schedule(http, "changed", every=60, overlap="skip")
    salt = Schedule.objects.get(name="kept").salt
    assert (server.root / "q" / "schedules.json").exists()
    # What a power cut can do to an index that need not be durable: a schedule gone, a change
    # undone, a deleted one back.
    Schedule.objects.filter(name="kept").delete()
    Schedule.objects.filter(name="changed").update(overlap="allow", every=30)
    ghost = Schedule.objects.get(name="changed")
    ghost.pk, ghost.name, ghost.salt = None, "ghost", "x"
    ghost.save()
    report = manage("sweep", "--repair", "--grace", "0").stdout
    assert "3 schedule(s) restored from schedules.json" in report, report
    names = [s["name"] for s in http.get("/api/queues/q/schedules").json()["schedules"]]
    assert names == ["changed", "kept"]
    back = http.get("/api/queues/q/schedules/kept").json()
    for field in ("cron", "timezone", "priority", "payload", "overlap", "catchupSeconds"):
        assert back[field] == kept[field], field
    assert Schedule.objects.get(name="kept").salt == salt  # its slots' ids as before
    changed = http.get("/api/queues/q/schedules/changed").json()
    assert changed["overlap"] == "skip"
    assert changed["every"] == 60
