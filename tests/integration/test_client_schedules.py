"""Schedules (SPEC section 8.3) through taskhoster.client (sync and async producers) and the
``taskhoster`` command, against a real daphne; a slot's item, posted by one ``manage.py
sweep``, read back with its ``schedule``."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest

from taskhoster.client import (
    AsyncProducer,
    BadRequest,
    NotFound,
    Producer,
    Schedule,
    ScheduleSlot,
)

from ..conftest import REPO, Server, server_env

pytestmark = pytest.mark.slow

COMMAND = Path(sys.executable).with_name("taskhoster")
# The command runs this checkout's code, wherever the package was installed from.
CODE = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


@pytest.fixture
def server(server_factory: Callable[..., Server]) -> Server:
    return server_factory()


@pytest.fixture
def producer(server: Server, key: str) -> Iterator[Producer]:
    with Producer(server.url, key) as producer:
        producer.put_queue("q")
        yield producer


@pytest.fixture
def cli(
    server: Server, key: str, tmp_path: Path
) -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run ``taskhoster ARGS`` with the server and key in the environment."""

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "TASKHOSTER_URL": server.url, "TASKHOSTER_KEY": key, **CODE}
        return subprocess.run(
            [str(COMMAND), *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
            cwd=tmp_path,
        )

    return run


def test_create_get_change_pause_resume_and_delete(producer: Producer) -> None:
    made = producer.put_schedule(
        "q",
        "nightly",
        cron="30 2 * * *",
        timezone="Europe/Berlin",
        payload={"job": "report"},
        thread_id="reports",
        priority=3,
        overlap="skip",
        catchup_seconds=120,
    )
    assert isinstance(made, Schedule)
    assert (made.queue, made.name, made.cron, made.every) == ("q", "nightly", "30 2 * * *", None)
    assert (made.timezone, made.payload, made.thread_id) == (
        "Europe/Berlin",
        {"job": "report"},
        "reports",
    )
    assert (made.priority, made.overlap, made.catchup_seconds, made.paused) == (
        3,
        "skip",
        120.0,
        False,
    )
    assert made.next_at is not None
    assert made.next_at.tzinfo is not None
    local = made.next_at.astimezone(ZoneInfo("Europe/Berlin"))
    assert (local.hour, local.minute) == (2, 30)
    assert made.last_slot is None
    assert made.last_item is None
    assert isinstance(made.created_at, datetime)
    assert isinstance(made.updated_at, datetime)
    assert made.raw["threadId"] == "reports"

    got = producer.get_schedule("q", "nightly")
    assert got == made

    # Only what is given changes: the rest (payload, timing, thread) is kept.
    changed = producer.put_schedule("q", "nightly", priority=7)
    assert changed.priority == 7
    assert (changed.payload, changed.cron, changed.thread_id) == (
        {"job": "report"},
        "30 2 * * *",
        "reports",
    )
    assert changed.next_at == made.next_at
    # thread_id=None takes the thread away; a null payload is a payload.
    cleared = producer.put_schedule("q", "nightly", thread_id=None, payload=None)
    assert cleared.thread_id is None
    assert cleared.payload is None
    assert cleared.raw["payload"] is None
    switched = producer.put_schedule("q", "nightly", every=60)
    assert (switched.cron, switched.every) == (None, 60)
    assert switched.next_at is not None
    assert switched.next_at.second == 0

    paused = producer.pause_schedule("q", "nightly")
    assert paused.paused is True
    assert paused.next_at is None  # a paused schedule has no next slot
    assert producer.get_schedule("q", "nightly").paused is True
    resumed = producer.resume_schedule("q", "nightly")
    assert resumed.paused is False
    assert resumed.next_at is not None

    producer.delete_schedule("q", "nightly")
    with pytest.raises(NotFound) as gone:
        producer.get_schedule("q", "nightly")
    assert gone.value.code == "schedule_not_found"
    assert gone.value.status == 404
    with pytest.raises(NotFound) as again:
        producer.delete_schedule("q", "nightly")
    assert again.value.code == "schedule_not_found"
    assert list(producer.list_schedules("q")) == []


def test_list_schedules_reads_every_page(producer: Producer) -> None:
    names = [f"s{n}" for n in range(5)]
    for name in reversed(names):
        producer.put_schedule("q", name, every=3600, payload={"name": name})
    listed = list(producer.list_schedules("q", page_size=2))  # three pages
    assert [s.name for s in listed] == names
    assert [s.payload for s in listed] == [{"name": n} for n in names]
    assert all(s.every == 3600 and s.queue == "q" for s in listed)
    assert [s.name for s in producer.list_schedules("q")] == names


def test_errors_carry_the_servers_code(producer: Producer) -> None:
    with pytest.raises(BadRequest) as bad_cron:
        producer.put_schedule("q", "s", cron="61 * * * *", payload=1)
    assert bad_cron.value.code == "invalid_schedule"
    assert bad_cron.value.status == 400
    assert bad_cron.value.message  # the server's own words
    with pytest.raises(BadRequest) as no_payload:
        producer.put_schedule("q", "s", every=5)
    assert no_payload.value.code == "missing_field"
    with pytest.raises(BadRequest) as no_timing:
        producer.put_schedule("q", "s", payload=1)
    assert no_timing.value.code == "missing_field"
    # Pausing a schedule that does not exist would create it: it has no timing.
    with pytest.raises(BadRequest) as pause_new:
        producer.pause_schedule("q", "s")
    assert pause_new.value.code == "missing_field"
    with pytest.raises(NotFound) as no_queue:
        producer.put_schedule("nope", "s", every=5, payload=1)
    assert no_queue.value.code == "queue_not_found"
    with pytest.raises(ValueError, match="cron or every"):
        producer.put_schedule("q", "s", cron="* * * * *", every=5, payload=1)
    assert list(producer.list_schedules("q")) == []


def test_the_async_producer_manages_schedules(server: Server, key: str) -> None:
    async def scenario() -> None:
        async with AsyncProducer(server.url, key) as producer:
            await producer.put_queue("q")
            for name in ("b", "a", "c"):
                made = await producer.put_schedule("q", name, every=60, payload=name)
                assert made.every == 60
            assert [s.name async for s in producer.list_schedules("q", page_size=2)] == [
                "a",
                "b",
                "c",
            ]
            assert (await producer.pause_schedule("q", "a")).paused is True
            assert (await producer.resume_schedule("q", "a")).paused is False
            changed = await producer.put_schedule("q", "a", cron="*/5 * * * *")
            assert (changed.cron, changed.every, changed.payload) == ("*/5 * * * *", None, "a")
            assert (await producer.get_schedule("q", "a")) == changed
            await producer.delete_schedule("q", "a")
            with pytest.raises(NotFound) as gone:
                await producer.get_schedule("q", "a")
            assert gone.value.code == "schedule_not_found"

    asyncio.run(scenario())


def test_a_slots_item_has_its_schedule(producer: Producer, state_root: Path) -> None:
    made = producer.put_schedule("q", "tick", every=1, payload={"tick": True})
    assert made.next_at is not None
    time.sleep(max(0.0, (made.next_at - datetime.now(UTC)).total_seconds()) + 0.2)
    subprocess.run(
        [sys.executable, "manage.py", "sweep"],
        env=server_env(state_root),
        cwd=REPO,
        check=True,
        capture_output=True,
        timeout=120,
    )
    items = list(producer.items("q"))
    assert items, "the sweep posted the due slot"
    # Listed (without payloads) with their schedule too.
    slots = {i.id: i.schedule.slot for i in items if i.schedule and i.schedule.name == "tick"}
    assert len(slots) == len(items)
    item = producer.get(min(slots, key=slots.__getitem__))
    assert isinstance(item.schedule, ScheduleSlot)
    assert item.schedule.name == "tick"
    assert item.schedule.slot == made.next_at
    assert item.key == f"schedule:tick:{item.raw['schedule']['slot']}"
    assert item.payload == {"tick": True}
    after = producer.get_schedule("q", "tick")
    assert after.last_slot is not None
    assert after.last_slot >= made.next_at
    assert after.last_item in {i.id for i in items}
    # An item a producer posted has none.
    assert producer.post("q", 1).schedule is None


def test_the_cli_manages_schedules(
    cli: Callable[..., subprocess.CompletedProcess[str]], producer: Producer
) -> None:
    made = cli(
        "put-schedule",
        "q",
        "digest",
        "--cron",
        "0 8 * * 1-5",
        "--timezone",
        "Europe/Paris",
        "--payload",
        '{"kind": "digest"}',
        "--thread-id",
        "mail",
        "--priority",
        "4",
        "--overlap",
        "skip",
        "--catchup-seconds",
        "30",
    )
    assert made.returncode == 0, made.stderr
    schedule = json.loads(made.stdout)
    assert schedule["cron"] == "0 8 * * 1-5"
    assert (schedule["timezone"], schedule["payload"], schedule["threadId"]) == (
        "Europe/Paris",
        {"kind": "digest"},
        "mail",
    )
    assert (schedule["priority"], schedule["overlap"], schedule["catchupSeconds"]) == (
        4,
        "skip",
        30,
    )
    made_every = cli("put-schedule", "q", "tick", "--every", "60", "--payload", "1", "--paused")
    assert made_every.returncode == 0, made_every.stderr
    assert json.loads(made_every.stdout)["paused"] is True

    # A change sends only what is given.
    changed = cli("put-schedule", "q", "digest", "--priority", "6", "--thread", "none")
    assert changed.returncode == 0, changed.stderr
    assert json.loads(changed.stdout)["priority"] == 6
    got = producer.get_schedule("q", "digest")
    assert (got.priority, got.thread_id, got.payload) == (6, None, {"kind": "digest"})

    shown = cli("schedule", "q", "digest")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout) == got.raw

    listed = cli("schedules", "q")
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert lines[0].split() == ["SCHEDULE", "TIMING", "NEXT", "LAST", "SLOT", "STATE"]
    assert lines[1].startswith("digest ")
    assert "cron 0 8 * * 1-5 Europe/Paris" in lines[1]
    assert got.next_at is not None
    assert got.next_at.strftime("%Y-%m-%dT%H:%M:%SZ") in lines[1]
    assert lines[1].split()[-2:] == ["-", "active"]  # no slot posted yet
    assert lines[2].split() == ["tick", "every", "60s", "-", "-", "paused"]
    as_json = json.loads(cli("schedules", "q", "--json").stdout)
    assert [s["name"] for s in as_json] == ["digest", "tick"]

    resumed = cli("resume-schedule", "q", "tick")
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout)["paused"] is False
    paused = cli("pause-schedule", "q", "digest")
    assert paused.returncode == 0, paused.stderr
    assert json.loads(paused.stdout)["paused"] is True
    assert producer.get_schedule("q", "digest").paused is True

    deleted = cli("delete-schedule", "q", "tick")
    assert (deleted.returncode, deleted.stdout) == (0, "")
    assert [s.name for s in producer.list_schedules("q")] == ["digest"]


def test_the_cli_tells_the_servers_errors(
    cli: Callable[..., subprocess.CompletedProcess[str]], producer: Producer
) -> None:
    for args in (
        ("schedule", "q", "nope"),
        ("delete-schedule", "q", "nope"),
        ("pause-schedule", "nope-queue", "nope"),
        ("schedules", "nope-queue"),
    ):
        done = cli(*args)
        assert done.returncode == 1, (args, done.stdout, done.stderr)
        assert done.stdout == ""
        assert done.stderr.startswith("taskhoster: 404 "), done.stderr
    missing = cli("schedule", "q", "nope")
    assert "schedule_not_found" in missing.stderr
    assert "'nope'" in missing.stderr  # the server's message names it
    bad = cli("put-schedule", "q", "s", "--cron", "61 * * * *", "--payload", "1")
    assert bad.returncode == 1
    assert bad.stderr.startswith("taskhoster: 400 invalid_schedule: "), bad.stderr
    # Usage errors are the command's own (exit 2), before any request.
    both = cli("put-schedule", "q", "s", "--cron", "* * * * *", "--every", "5")
    assert both.returncode == 2
    assert "not allowed with argument" in both.stderr
    not_json = cli("put-schedule", "q", "s", "--every", "5", "--payload", "{x")
    assert not_json.returncode == 2
    assert "argument --payload" in not_json.stderr
    assert list(producer.list_schedules("q")) == []
