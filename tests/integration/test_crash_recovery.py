"""Crash recovery (SPEC I1, I2, I5, I7) against a real daphne server and real files.

Each test arms a crash point (``TASKHOSTER_CRASH_AT``) so that the process SIGKILLs itself between
the two writes of one transition (the item's file and its index row), sends the request that
reaches it, recovers with ``manage.py sweep --repair --grace 0`` (or a plain sweep), restarts a
normal server and proves: nothing acknowledged is lost, nothing is finished twice, the index
matches the state directories, nothing stays processing past its lease plus one sweep, and the
item can then be claimed and finished normally.

A point armed as ``name@K`` fires at its K-th visit, so the same server first answers work
that must then survive the crash; each point says in the server's log where it fired (and,
in a group, the group's size), and the tests check that it fired where they meant. A SIGKILL
keeps the page cache, so these tests prove the order of the writes and what repair makes of
them; what a power cut keeps is test_power_cut.py's.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from taskhoster import engine
from taskhoster.engine.common import store
from taskhoster.faults import CRASH_POINTS
from taskhoster.models import Item
from taskhoster.status import State, Status
from taskhoster.timeutil import now as utcnow

from ..conftest import REPO
from .consistency import (
    assert_index_matches_directories,
    assert_threads_consistent,
    files_on_disk,
    read_file,
)

pytestmark = pytest.mark.slow

REPAIR = ("sweep", "--repair", "--grace", "0")


@pytest.fixture
def connect(make_key: Callable[..., str]) -> Iterator[Callable[[Any], httpx.Client]]:
    headers = {"Authorization": f"Token {make_key()}"}
    clients: list[httpx.Client] = []

    def open_client(server: Any) -> httpx.Client:
        client = httpx.Client(base_url=server.url, headers=headers, timeout=15)
        clients.append(client)
        return client

    yield open_client
    for client in clients:
        client.close()


def seed(queue: str, *specs: dict[str, Any], **settings: Any) -> list[str]:
    """Create the queue (in this process, on the shared database and state root) and post."""
    engine.upsert_queue(name=queue, body=settings)
    posted = engine.post_items(
        queue_name=queue,
        items=[
            engine.NewItem(payload=s.get("payload"), thread_id=s.get("threadId"), key=s.get("key"))
            for s in specs
        ],
    )
    return [p.row.id for p in posted]


def crash_during(server: Any, send: Callable[[], Any]) -> None:
    """Send a request to an armed server: the connection drops and the server died of SIGKILL."""
    with pytest.raises(httpx.TransportError):
        send()
    assert server.proc.wait(10) == -signal.SIGKILL, "the server did not die at its crash point"


def status_of(*ids: str) -> dict[str, str]:
    return dict(Item.objects.filter(id__in=ids).values_list("id", "status"))


def finish_everything(http: httpx.Client, queue: str) -> dict[str, Any]:
    """Claim and finish every claimable item; each result is accepted once and only once."""
    finished: dict[str, Any] = {}
    for _round in range(20):
        claimed = http.post(f"/api/queues/{queue}/claim", json={"max": 100}).json()["items"]
        if not claimed:
            return finished
        for item in claimed:
            answer = http.post(
                f"/api/items/{item['id']}/result", json={"result": {"done": item["payload"]}}
            ).json()
            assert answer == {"accepted": True, "status": "finished"}, item
            again = http.post(f"/api/items/{item['id']}/result", json={"result": "twice"}).json()
            assert again == {"accepted": False, "status": "finished"}, item
            finished[item["id"]] = item["payload"]
    raise AssertionError("items kept coming back")


def assert_all_finished_once(http: httpx.Client, ids: list[str]) -> None:
    for item_id in ids:
        item = http.get(f"/api/items/{item_id}").json()
        assert item["status"] == "finished", item
        assert item["result"] == {"done": item["payload"]}, item


def assert_kept(state_root: Path, item_id: str, **fields: Any) -> None:
    """The item has its row and exactly one file, in the directory of the row's status, and
    the file holds ``fields`` (its payload, its key, its result ...)."""
    row = Item.objects.get(id=item_id)
    state = Status(row.status).state.value
    assert files_on_disk(state_root)[item_id] == [("q", state)], item_id
    record = read_file(state_root, "q", state, item_id)
    assert {name: record.get(name) for name in fields} == fields, record


def crash_line(server: Any, point: str) -> str:
    """The line the crash point wrote into the server's log before the kill."""
    found = [
        line
        for line in server.log.read_text(errors="replace").splitlines()
        if f"crash point {point} reached" in line
    ]
    assert len(found) == 1, f"the server did not crash at {point} once: {found}"
    return found[0]


def test_every_crash_point_is_in_the_code_and_armed_here():
    """Each name of ``faults.CRASH_POINTS`` is a ``crash_point`` call in the code and is armed
    by a test of this module, or of ``test_schedules.py`` for a schedule's (a point nobody
    arms proves nothing; a name the code lost would make its test arm nothing)."""
    code = "".join(p.read_text() for p in (REPO / "taskhoster").rglob("*.py"))
    here = Path(__file__).read_text() + (Path(__file__).parent / "test_schedules.py").read_text()
    for point in CRASH_POINTS:
        assert f'crash_point("{point}"' in code, point
        assert f'"{point}"' in here or f'"{point}@' in here, point


# -- post ---------------------------------------------------------------------------------


def test_post_killed_after_files_loses_nothing_and_repair_indexes_the_durable_file(
    server_factory, manage, connect, state_root: Path
):
    before = seed(
        "q", {"payload": "a", "threadId": "t"}, {"payload": "b", "threadId": "t"}, {"payload": "c"}
    )
    server = server_factory(TASKHOSTER_CRASH_AT="post.after_files")
    crash_during(
        server,
        lambda: connect(server).post(
            "/api/queues/q/items", json={"payload": "crashed", "key": "k1", "threadId": "t"}
        ),
    )

    orphans = [i for i in files_on_disk(state_root) if i not in before]
    assert len(orphans) == 1, "the crash should leave exactly one file without a row"
    assert not Item.objects.filter(id=orphans[0]).exists()

    out = manage(*REPAIR).stdout
    assert "1 row(s) added" in out, out
    assert_index_matches_directories(state_root)
    assert_threads_consistent()
    assert status_of(*before) == dict.fromkeys(before, "pending")

    http = connect(server_factory())
    retried = http.post(
        "/api/queues/q/items", json={"payload": "crashed", "key": "k1", "threadId": "t"}
    )
    assert retried.status_code == 200, "a retry with the key must find the recovered item"
    assert retried.json()["id"] == orphans[0]
    finished = finish_everything(http, "q")
    assert sorted(finished) == sorted([*before, orphans[0]])
    assert_all_finished_once(http, [*before, orphans[0]])
    assert_index_matches_directories(state_root)


def test_batch_post_killed_after_files_is_recovered_all_or_nothing(
    server_factory, manage, connect, state_root: Path
):
    """A batch is one operation: ``post.after_files`` is reached once, after the last of its
    files is written and before any row, so the crash leaves every file of the batch in
    pending/ and no row of it. The post was never answered, and repair indexes what the
    files hold (the crash table's first row): here the whole batch comes back, each item
    once, with its payload and thread. Nothing comes back is wrong here, and so is a part."""
    before = seed("q", {"payload": "old", "threadId": "t"})
    batch = [{"payload": n, "threadId": f"t{n % 3}" if n % 2 else None} for n in range(12)]
    server = server_factory(TASKHOSTER_CRASH_AT="post.after_files")
    crash_during(server, lambda: connect(server).post("/api/queues/q/items", json={"items": batch}))
    left = {i: where for i, where in files_on_disk(state_root).items() if i not in before}
    assert sorted(left.values()) == [[("q", "pending")]] * len(batch), left
    assert not Item.objects.filter(id__in=list(left)).exists(), "rows before the commit"
    by_payload = {read_file(state_root, "q", "pending", i)["payload"]: i for i in left}
    assert sorted(by_payload) == list(range(len(batch)))

    out = manage(*REPAIR).stdout
    assert f"{len(batch)} row(s) added, 0 corrected, 0 removed" in out, out
    assert_index_matches_directories(state_root)
    assert_threads_consistent()
    recovered = Item.objects.exclude(id__in=before)
    assert sorted(recovered.values_list("id", flat=True)) == sorted(left)
    for n, spec in enumerate(batch):
        row = Item.objects.get(id=by_payload[n])
        assert (row.status, row.thread_id, row.key) == ("pending", spec["threadId"], None), n
    assert status_of(*before) == dict.fromkeys(before, "pending")

    http = connect(server_factory())
    for n, item_id in by_payload.items():
        assert http.get(f"/api/items/{item_id}").json()["payload"] == n
    finished = finish_everything(http, "q")
    assert finished == {before[0]: "old", **{i: n for n, i in by_payload.items()}}
    assert_all_finished_once(http, list(finished))
    assert_index_matches_directories(state_root)


def test_post_killed_after_index_keeps_the_item_and_its_key(
    server_factory, manage, connect, state_root: Path
):
    before = seed("q", {"payload": "a"}, {"payload": "b", "key": "kb"})
    server = server_factory(TASKHOSTER_CRASH_AT="post.after_index")
    crash_during(
        server,
        lambda: connect(server).post(
            "/api/queues/q/items", json={"payload": "crashed", "key": "k1"}
        ),
    )
    crashed = Item.objects.get(key="k1")
    assert crashed.status == Status.PENDING

    out = manage(*REPAIR).stdout
    assert "0 row(s) added, 0 corrected, 0 removed" in out, out
    assert_index_matches_directories(state_root)

    http = connect(server_factory())
    retried = http.post("/api/queues/q/items", json={"payload": "crashed", "key": "k1"})
    assert (retried.status_code, retried.json()["id"]) == (200, crashed.id)
    assert Item.objects.count() == 3
    finished = finish_everything(http, "q")
    assert sorted(finished) == sorted([*before, crashed.id])
    assert_index_matches_directories(state_root)


# -- claim --------------------------------------------------------------------------------


def test_claim_killed_after_rename_is_pending_again_after_repair_and_one_sweep(
    server_factory, manage, connect, state_root: Path
):
    # A long lease: an uncommitted claim must not have to wait it out.
    t1, t2, a = seed(
        "q",
        {"payload": 1, "threadId": "t"},
        {"payload": 2, "threadId": "t"},
        {"payload": 3},
        leaseSeconds=600,
    )
    server = server_factory(TASKHOSTER_CRASH_AT="claim.after_rename")
    crash_during(server, lambda: connect(server).post("/api/queues/q/claim", json={"max": 1}))
    assert files_on_disk(state_root)[t1] == [("q", "processing")]
    assert status_of(t1)[t1] == "pending", "the claim's transaction should have rolled back"

    manage(*REPAIR)
    assert status_of(t1, t2, a) == {t1: "pending", t2: "pending", a: "pending"}
    assert Item.objects.get(id=t1).attempts == 0, "a claim that never answered is no attempt"
    assert_index_matches_directories(state_root)
    assert_threads_consistent()

    http = connect(server_factory())
    claimed = http.post("/api/queues/q/claim", json={"max": 10}).json()["items"]
    assert sorted(c["id"] for c in claimed) == sorted([t1, a]), "t2 waits behind its thread head"
    for item in claimed:
        assert http.post(f"/api/items/{item['id']}/result", json={"result": 1}).json() == {
            "accepted": True,
            "status": "finished",
        }
        assert http.post(f"/api/items/{item['id']}/result", json={"result": 2}).json() == {
            "accepted": False,
            "status": "finished",
        }
    assert sorted(finish_everything(http, "q")) == [t2]
    assert_index_matches_directories(state_root)


def test_claim_killed_after_rename_is_claimable_by_a_restarted_server_without_repair(
    server_factory, connect, state_root: Path
):
    (a,) = seed("q", {"payload": "a"})
    server = server_factory(TASKHOSTER_CRASH_AT="claim.after_rename")
    crash_during(server, lambda: connect(server).post("/api/queues/q/claim", json={}))

    http = connect(server_factory())
    # The first claim loses to the file the dead claim left in processing/ (a claim never
    # takes a file that is not in pending/), puts it back and announces it: the long-poll
    # takes it at once.
    started = time.monotonic()
    claimed = http.post("/api/queues/q/claim", json={"wait": 30}).json()["items"]
    assert [(c["id"], c["attempts"]) for c in claimed] == [(a, 1)]
    assert time.monotonic() - started < 15, "woken by the news, not by the end of the wait"
    assert_index_matches_directories(state_root)
    assert http.post(f"/api/items/{a}/result", json={"result": "ok"}).json()["accepted"] is True
    assert http.post(f"/api/items/{a}/result", json={"result": "no"}).json()["accepted"] is False
    assert http.get(f"/api/items/{a}").json()["result"] == "ok"
    assert_index_matches_directories(state_root)


def test_claim_killed_after_commit_does_not_stay_processing_past_lease_plus_one_sweep(
    server_factory, manage, connect, state_root: Path
):
    a, b, c = seed(
        "q",
        {"payload": "a"},
        {"payload": "b", "threadId": "t"},
        {"payload": "c", "threadId": "t"},
        leaseSeconds=0.5,
    )
    server = server_factory(TASKHOSTER_CRASH_AT="claim.after_commit")
    crash_during(server, lambda: connect(server).post("/api/queues/q/claim", json={"max": 5}))
    assert status_of(a, b, c) == {a: "processing", b: "processing", c: "pending"}

    manage(*REPAIR)
    assert_index_matches_directories(state_root)
    assert_threads_consistent()
    leases = Item.objects.filter(status=Status.PROCESSING).values_list(
        "lease_expires_at", flat=True
    )
    lapse = max((t for t in leases if t is not None), default=utcnow())
    time.sleep(max(0.0, (lapse - utcnow()).total_seconds()) + 0.1)
    manage("sweep")
    assert status_of(a, b, c) == dict.fromkeys((a, b, c), "pending"), (
        "a claim lost in a crash must be pending again after its lease and one sweep"
    )
    assert [Item.objects.get(id=i).attempts for i in (a, b, c)] == [1, 1, 0]
    assert_index_matches_directories(state_root)
    assert_threads_consistent()

    http = connect(server_factory())
    finished = finish_everything(http, "q")
    assert sorted(finished) == sorted([a, b, c])
    assert [http.get(f"/api/items/{i}").json()["attempts"] for i in (a, b, c)] == [2, 2, 1]
    assert_index_matches_directories(state_root)


# -- result -------------------------------------------------------------------------------


def test_result_killed_after_done_file_keeps_the_first_result_and_accepts_no_second(
    server_factory, manage, connect, state_root: Path
):
    x, y = seed("q", {"payload": "x", "threadId": "t"}, {"payload": "y", "threadId": "t"})
    server = server_factory(TASKHOSTER_CRASH_AT="result.after_done_file")
    http = connect(server)
    (claimed,) = http.post("/api/queues/q/claim", json={"max": 5}).json()["items"]
    assert claimed["id"] == x
    crash_during(server, lambda: http.post(f"/api/items/{x}/result", json={"result": "first"}))
    assert files_on_disk(state_root)[x] == [("q", "done")]
    assert status_of(x)[x] == "processing"

    manage(*REPAIR)
    assert status_of(x, y) == {x: "finished", y: "pending"}
    assert_index_matches_directories(state_root)
    assert_threads_consistent()

    http = connect(server_factory())
    second = http.post(f"/api/items/{x}/result", json={"result": "second"}).json()
    assert second == {"accepted": False, "status": "finished"}
    item = http.get(f"/api/items/{x}").json()
    assert (item["status"], item["result"], item["attempts"]) == ("finished", "first", 1)
    assert sorted(finish_everything(http, "q")) == [y], "the thread advanced past x"
    assert_index_matches_directories(state_root)


def test_result_killed_after_commit_accepts_no_second_result(
    server_factory, manage, connect, state_root: Path
):
    x, other = seed("q", {"payload": "x"}, {"payload": "other", "threadId": "t"})
    server = server_factory(TASKHOSTER_CRASH_AT="result.after_commit")
    http = connect(server)
    claimed = http.post("/api/queues/q/claim", json={"max": 1}).json()["items"]
    assert [c["id"] for c in claimed] == [x]
    crash_during(server, lambda: http.post(f"/api/items/{x}/result", json={"result": "first"}))
    assert status_of(x)[x] == "finished"

    out = manage(*REPAIR).stdout
    assert "0 row(s) added, 0 corrected, 0 removed" in out, out
    assert_index_matches_directories(state_root)

    http = connect(server_factory())
    second = http.post(f"/api/items/{x}/result", json={"result": "second"}).json()
    assert second == {"accepted": False, "status": "finished"}
    assert http.get(f"/api/items/{x}").json()["result"] == "first"
    assert sorted(finish_everything(http, "q")) == [other]
    assert_index_matches_directories(state_root)


# -- re-queue (the sweep's own process) ---------------------------------------------------


@pytest.mark.parametrize("recovery", [("sweep",), REPAIR], ids=["plain-sweep", "repair"])
def test_requeue_killed_after_pending_file_is_completed_by_the_next_sweep(
    server_factory, manage, connect, state_root: Path, recovery
):
    a, b, c = seed(
        "q",
        {"payload": "a", "threadId": "t"},
        {"payload": "b", "threadId": "t"},
        {"payload": "c"},
        leaseSeconds=0.5,
    )
    http = connect(server_factory())
    claimed = http.post("/api/queues/q/claim", json={"max": 1}).json()["items"]
    assert [i["id"] for i in claimed] == [a]
    time.sleep(0.7)

    crashed = manage("sweep", check=False, TASKHOSTER_CRASH_AT="requeue.after_pending_file")
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    assert files_on_disk(state_root)[a] == [("q", "pending")]
    assert status_of(a)[a] == "processing"
    assert read_file(state_root, "q", "pending", a)["attempts"] == 1

    manage(*recovery)
    assert status_of(a, b, c) == dict.fromkeys((a, b, c), "pending")
    assert Item.objects.get(id=a).attempts == 1
    assert_index_matches_directories(state_root)
    assert_threads_consistent()

    again = http.post("/api/queues/q/claim", json={"max": 10}).json()["items"]
    assert sorted((i["id"], i["attempts"]) for i in again) == sorted([(a, 2), (c, 1)])
    for item in again:
        assert (
            http.post(
                f"/api/items/{item['id']}/result", json={"result": {"done": item["payload"]}}
            ).json()["accepted"]
            is True
        )
    assert sorted(finish_everything(http, "q")) == [b]
    assert_all_finished_once(http, [a, b, c])
    assert_index_matches_directories(state_root)


def test_claim_killed_after_rename_does_not_use_up_an_attempt(
    server_factory, manage, connect, state_root: Path
):
    # The claim never committed, so it never answered: no worker holds the item, and with
    # maxAttempts 1 recovery must not let it die of a lease nobody was given.
    (a,) = seed("q", {"payload": "a"}, maxAttempts=1)
    server = server_factory(TASKHOSTER_CRASH_AT="claim.after_rename")
    crash_during(server, lambda: connect(server).post("/api/queues/q/claim", json={}))

    manage(*REPAIR)
    row = Item.objects.get(id=a)
    assert (row.status, row.attempts, row.error) == ("pending", 0, None)
    assert_index_matches_directories(state_root)

    http = connect(server_factory())
    claimed = http.post("/api/queues/q/claim", json={}).json()["items"]
    assert [(c["id"], c["attempts"]) for c in claimed] == [(a, 1)]
    assert http.post(f"/api/items/{a}/result", json={"result": "ok"}).json()["accepted"] is True
    assert_index_matches_directories(state_root)


# -- between an append and its rename; inside the barrier ---------------------------------
#
# A SIGKILL keeps the page cache: every write, rename and fsync'd or unflushed byte made before
# the kill is still there after it. So these tests prove the order of the steps and what repair
# does with what they leave, not that anything reached the disk; tests/integration/
# test_power_cut.py holds the flushes to a power cut.


def test_result_killed_between_append_and_rename_is_finished_by_repair(
    server_factory, manage, connect, state_root: Path
):
    """``file.after_append``: the verdict's line is in the item's file, the file is still in
    processing/, and no row has changed (the crash table's second row). Nothing was answered;
    repair moves the file where its last line says, so the item is finished with that result
    and the thread moves on. The same server's earlier work, answered, is all kept: a claim
    (no line: it only renames), a post (it creates), and a result, the first append of its
    life (the crash is armed for the second: ``@2``). SIGKILL keeps the page cache: this
    proves the order and the repair, not a flush."""
    x, y, z = seed(
        "q",
        {"payload": "x", "threadId": "t"},
        {"payload": "y", "threadId": "t"},
        {"payload": "z"},
        leaseSeconds=600,
    )
    server = server_factory(TASKHOSTER_CRASH_AT="file.after_append@2")
    http = connect(server)
    claimed = http.post("/api/queues/q/claim", json={"max": 5}).json()["items"]
    assert sorted(c["id"] for c in claimed) == sorted([x, z]), "y waits behind its thread head"
    posted = http.post("/api/queues/q/items", json={"payload": "p", "key": "kp"})
    assert posted.status_code == 201
    p = posted.json()["id"]
    done = http.post(f"/api/items/{z}/result", json={"result": "z done"}).json()
    assert done == {"accepted": True, "status": "finished"}
    crash_during(server, lambda: http.post(f"/api/items/{x}/result", json={"result": "first"}))
    assert crash_line(server, "file.after_append").endswith("(visit 2)")
    assert files_on_disk(state_root)[x] == [("q", "processing")], "the rename came first"
    line = read_file(state_root, "q", "processing", x)
    assert (line["status"], line["result"], line["rev"]) == ("finished", "first", 2)
    assert status_of(x)[x] == "processing"

    out = manage(*REPAIR).stdout
    assert "1 file(s) moved to the state their last line names" in out, out
    assert_index_matches_directories(state_root)
    assert_threads_consistent()
    assert status_of(x, y, z, p) == {x: "finished", y: "pending", z: "finished", p: "pending"}
    assert_kept(state_root, x, status="finished", result="first")
    assert_kept(state_root, z, status="finished", result="z done")
    assert_kept(state_root, p, payload="p", key="kp")

    http = connect(server_factory())
    for item_id, result in ((x, "first"), (z, "z done")):
        late = http.post(f"/api/items/{item_id}/result", json={"result": "second"}).json()
        assert late == {"accepted": False, "status": "finished"}
        item = http.get(f"/api/items/{item_id}").json()
        assert (item["result"], item["attempts"]) == (result, 1)
    again = http.post("/api/queues/q/items", json={"payload": "p", "key": "kp"})
    assert (again.status_code, again.json()["id"]) == (200, p)
    assert finish_everything(http, "q") == {y: "y", p: "p"}, "the thread moved past x"
    assert_index_matches_directories(state_root)
    assert_threads_consistent()


def test_sweep_killed_between_append_and_rename_inside_its_group_is_completed(
    server_factory, manage, connect, state_root: Path
):
    """One sweep chunk is one group re-queueing every lapsed lease. Killed at its second
    append (``file.after_append@2``): the first item's file is in pending/ with its re-queue
    line, the second's line is written but the file is still in processing/, the others are
    untouched, and no row changed. Repair (here without the sweep ``sweep --repair`` runs
    after it) indexes each as its file says: the first pending, the second still processing,
    its lease lapsed, at its file's ``rev``; the next sweep re-queues the rest. No attempt
    is counted twice, and what the server answered before is kept. SIGKILL keeps the page
    cache: this proves the order and the repair, not a flush."""
    ids = seed("q", *({"payload": n} for n in range(5)), leaseSeconds=0.5)
    http = connect(server_factory())
    claimed = http.post("/api/queues/q/claim", json={"max": 5}).json()["items"]
    assert sorted(c["id"] for c in claimed) == sorted(ids)
    done = http.post(f"/api/items/{ids[0]}/result", json={"result": "kept"}).json()
    assert done == {"accepted": True, "status": "finished"}
    posted = http.post("/api/queues/q/items", json={"payload": "p", "key": "kp"})
    assert posted.status_code == 201
    p = posted.json()["id"]
    lapsed = ids[1:]
    leases = Item.objects.filter(id__in=lapsed).values_list("lease_expires_at", flat=True)
    lapse = max(at for at in leases if at is not None)
    deadline = time.monotonic() + 30
    while utcnow() <= lapse:
        assert time.monotonic() < deadline, "the leases never lapsed"
        time.sleep(0.05)

    crashed = manage("sweep", check=False, TASKHOSTER_CRASH_AT="file.after_append@2")
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    assert "crash point file.after_append reached (visit 2)" in crashed.stderr
    on_disk = {i: files_on_disk(state_root)[i] for i in lapsed}
    revs = {
        i: read_file(state_root, *on_disk[i][0], i)["rev"] for i in lapsed if len(on_disk[i]) == 1
    }
    moved = [i for i in lapsed if on_disk[i] == [("q", "pending")]]
    caught = [i for i in lapsed if on_disk[i] == [("q", "processing")] and revs[i] == 2]
    untouched = [i for i in lapsed if on_disk[i] == [("q", "processing")] and revs[i] == 1]
    assert (len(moved), len(caught), len(untouched)) == (1, 1, 2), (on_disk, revs)
    assert revs[moved[0]] == 2
    assert status_of(*lapsed) == dict.fromkeys(lapsed, "processing"), "nothing committed"

    engine.repair(grace_seconds=0)
    assert_index_matches_directories(state_root)
    assert_threads_consistent()
    assert status_of(*lapsed) == {
        **dict.fromkeys(untouched, "processing"),
        moved[0]: "pending",
        caught[0]: "processing",
    }
    assert Item.objects.get(id=caught[0]).rev == 2
    assert "3 lapsed lease(s) re-queued" in manage("sweep").stdout
    assert status_of(*lapsed) == dict.fromkeys(lapsed, "pending")
    assert [Item.objects.get(id=i).attempts for i in lapsed] == [1] * len(lapsed)
    assert_index_matches_directories(state_root)
    assert_threads_consistent()
    assert_kept(state_root, ids[0], status="finished", result="kept")
    assert_kept(state_root, p, payload="p", key="kp")

    http = connect(server_factory())
    again = http.post("/api/queues/q/items", json={"payload": "p", "key": "kp"})
    assert (again.status_code, again.json()["id"]) == (200, p)
    assert finish_everything(http, "q") == {**{i: ids.index(i) for i in lapsed}, p: "p"}
    assert [http.get(f"/api/items/{i}").json()["attempts"] for i in lapsed] == [2] * len(lapsed)
    assert http.get(f"/api/items/{ids[0]}").json()["result"] == "kept"
    assert_index_matches_directories(state_root)


# The barrier fsyncs each written file, then each touched directory, with FLUSH = "fsync"
# (syncfs is one call: nothing to stop between). Servers read it from their settings.
FSYNC_SERVER = {
    "DJANGO_SETTINGS_MODULE": "tests.integration.limits_settings",
    "TASKHOSTER_TEST_LIMITS": json.dumps({"FLUSH": "fsync"}),
}


@pytest.mark.parametrize(
    ("point", "visit"),
    [
        # one visit per barrier: the claim's, the post's, the first result's, then ours
        ("barrier.after_files", 4),
        # one visit per directory flushed: the claim's pending/ and processing/, the post's
        # pending/, the first result's done/ and processing/, then our done/ (not processing/)
        ("barrier.after_directory", 6),
    ],
)
def test_sigkill_inside_the_barrier_answers_nothing_and_loses_nothing_acknowledged(
    server_factory, manage, connect, state_root: Path, point: str, visit: int
):
    """Killed inside a result's barrier, after its commit: between the fsync of its file and
    those of its directories, or between its two directories. The result was not answered
    (the kill waits ``TASKHOSTER_CRASH_DELAY`` first, so an answer sent before the flush
    would reach the client and fail the test); what the same server answered before (a
    claim, a post, a result, each flushed by a barrier of its own) is all kept, the claim's
    lease still holds, and the committed result stands without repair having to change a
    row. SIGKILL keeps the page cache: this proves the order and the repair, not the
    fsyncs (test_power_cut.py does)."""
    x, y, z, w = seed(
        "q",
        {"payload": "x", "threadId": "t"},
        {"payload": "y", "threadId": "t"},
        {"payload": "z"},
        {"payload": "w"},
        leaseSeconds=600,
    )
    server = server_factory(
        TASKHOSTER_CRASH_AT=f"{point}@{visit}", TASKHOSTER_CRASH_DELAY="3", **FSYNC_SERVER
    )
    http = connect(server)
    claimed = {
        c["id"]: c for c in http.post("/api/queues/q/claim", json={"max": 5}).json()["items"]
    }
    assert sorted(claimed) == sorted([x, z, w]), "y waits behind its thread head"
    posted = http.post("/api/queues/q/items", json={"payload": "p", "key": "kp"})
    assert posted.status_code == 201
    p = posted.json()["id"]
    done = http.post(f"/api/items/{z}/result", json={"result": "z done"}).json()
    assert done == {"accepted": True, "status": "finished"}
    crash_during(server, lambda: http.post(f"/api/items/{x}/result", json={"result": "first"}))
    assert crash_line(server, point).endswith(f"(visit {visit})")
    assert status_of(x)[x] == "finished", "the crash came after the commit"

    out = manage(*REPAIR).stdout
    assert "0 row(s) added, 0 corrected, 0 removed" in out, out
    assert "file(s) moved" not in out, out
    assert_index_matches_directories(state_root)
    assert_threads_consistent()
    assert status_of(x, y, z, w, p) == {
        x: "finished",
        y: "pending",
        z: "finished",
        w: "processing",
        p: "pending",
    }
    assert_kept(state_root, x, status="finished", result="first")
    assert_kept(state_root, z, status="finished", result="z done")
    assert_kept(state_root, p, payload="p", key="kp")

    http = connect(server_factory())
    for item_id, result in ((x, "first"), (z, "z done")):
        late = http.post(f"/api/items/{item_id}/result", json={"result": "second"}).json()
        assert late == {"accepted": False, "status": "finished"}
        assert http.get(f"/api/items/{item_id}").json()["result"] == result
    again = http.post("/api/queues/q/items", json={"payload": "p", "key": "kp"})
    assert (again.status_code, again.json()["id"]) == (200, p)
    # the claim answered before the crash still holds its item: its lease is the lease
    gave_up = http.post(
        f"/api/items/{w}/fail", json={"lease": claimed[w]["lease"], "retry": False, "error": "e"}
    ).json()
    assert gave_up == {"accepted": True, "status": "failed"}
    assert finish_everything(http, "q") == {y: "y", p: "p"}
    assert_index_matches_directories(state_root)
    assert_threads_consistent()


# -- a crash in the middle of a crowded group ----------------------------------------------

CROWD = 8  # operations in each wave, and the group the armed server's committer waits for


def _send_all(server: Any, key: str, requests: list[tuple[str, dict[str, Any]]]) -> list[Any]:
    """Send every request at once, one thread each; the answers in order, None for a request
    the server never answered (it died)."""
    headers = {"Authorization": f"Token {key}"}

    def send(request: tuple[str, dict[str, Any]]) -> Any:
        path, body = request
        with httpx.Client(base_url=server.url, headers=headers, timeout=30) as http:
            try:
                return http.post(path, json=body)
            except httpx.TransportError:
                return None

    with ThreadPoolExecutor(max_workers=len(requests)) as pool:
        return list(pool.map(send, requests))


def _post(n: int) -> tuple[str, dict[str, Any]]:
    return "/api/queues/q/items", {"payload": f"p{n}", "key": f"k{n}", "threadId": f"t{n % 3}"}


def _result(item: dict[str, Any], result: Any) -> tuple[str, dict[str, Any]]:
    return f"/api/items/{item['id']}/result", {"result": result}


def _fail(item: dict[str, Any], *, retry: bool) -> tuple[str, dict[str, Any]]:
    return f"/api/items/{item['id']}/fail", {"lease": item["lease"], "retry": retry, "error": "no"}


@pytest.mark.parametrize(
    "point", ["group.after_files", "group.before_commit", "group.after_commit"]
)
def test_sigkill_inside_a_crowded_group_loses_nothing_acknowledged(
    server_factory, manage, connect, make_key, state_root: Path, point: str
):
    """Files written but no rows; rows written but not committed; committed but unanswered:
    whatever a SIGKILL in a group of many leaves, repair resolves it without losing an
    acknowledged post or verdict, without a second verdict, and without two members of a
    thread at work.

    The armed server's committer waits for a crowd of ``CROWD`` operations before each group
    (``TASKHOSTER_FAULT_GATHER``), and the crash point counts only groups that large
    (``TASKHOSTER_CRASH_MIN_OPS``) and fires in the second (``@2``). The first wave, one
    group of ``CROWD``, is answered in full; the second, another, is where the server dies,
    as its log says, and none of it is answered. Then what the files of the second wave say
    holds too: a verdict line, a post's file, a re-queue are recovered as they were written,
    and a claim that never committed is undone."""
    seed(
        "q",
        *({"payload": f"s{n}", "threadId": f"t{n % 3}" if n % 2 else None} for n in range(12)),
        leaseSeconds=600,
        maxAttempts=5,
    )
    normal = server_factory()
    http = connect(normal)
    held = http.post("/api/queues/q/claim", json={"max": 12}).json()["items"]
    # six unthreaded items and the heads of threads t0, t1, t2; their other members wait
    assert len(held) == 9, held
    normal.stop()

    server = server_factory(
        TASKHOSTER_CRASH_AT=f"{point}@2",
        TASKHOSTER_CRASH_MIN_OPS=str(CROWD),
        TASKHOSTER_FAULT_GATHER=str(CROWD),
        # posts wait for the crowd in the committer: not a backlog to refuse them for
        TASKHOSTER_ADMISSION_WAIT_SECONDS="600",
    )
    key = make_key()
    first = [*(_post(n) for n in range(4)), *(_result(held[i], {"r": i}) for i in range(3))]
    first.append(_fail(held[3], retry=False))
    assert len(first) == CROWD
    answers = _send_all(server, key, first)
    assert [a.status_code if a is not None else None for a in answers] == [201] * 4 + [200] * 4, [
        a.text if a is not None else None for a in answers
    ]
    posts = {answers[n].json()["id"]: f"p{n}" for n in range(4)}
    assert len(posts) == 4
    for answer in answers[4:]:
        assert answer.json()["accepted"] is True, answer.json()
    results = {held[i]["id"]: {"r": i} for i in range(3)}
    failed = held[3]["id"]

    second = [
        _post(4),
        _post(5),
        _post(0),  # a retry of an acknowledged post: must find it, not make a second item
        _result(held[4], {"r": 4}),
        _result(held[5], {"r": 5}),
        _fail(held[6], retry=True),
        _result(held[0], "second"),  # finished in the first wave: refused
        ("/api/queues/q/claim", {"max": 2}),
    ]
    assert len(second) == CROWD
    answers = _send_all(server, key, second)
    assert server.proc.wait(30) == -signal.SIGKILL, "the server did not die inside a group"
    assert answers == [None] * CROWD, "an answer went out before its group was durable"
    assert crash_line(server, point).endswith(f"(visit 2, group of {CROWD})")

    manage(*REPAIR)
    assert_index_matches_directories(state_root)
    assert_threads_consistent()
    # acknowledged in the first wave
    for item_id, payload in posts.items():
        n = int(payload[1:])
        assert_kept(state_root, item_id, payload=payload, key=f"k{n}", threadId=f"t{n % 3}")
    for item_id, result in results.items():
        assert Item.objects.get(id=item_id).status == Status.FINISHED
        assert_kept(state_root, item_id, status="finished", result=result)
    assert Item.objects.get(id=failed).status == Status.FAILED
    assert_kept(state_root, failed, status="failed", error="no")
    # never answered, recovered as the files say (they were all written)
    for n in (4, 5):
        (made,) = Item.objects.filter(key=f"k{n}").values_list("id", flat=True)
        assert_kept(state_root, made, payload=f"p{n}", key=f"k{n}", threadId=f"t{n % 3}")
    assert Item.objects.filter(key="k0").count() == 1
    for i in (4, 5):
        assert_kept(state_root, held[i]["id"], status="finished", result={"r": i})
    assert Item.objects.get(id=held[6]["id"]).status == Status.PENDING
    # held[7] and held[8] are still held; the claim's two items only if it committed
    claimed_too = 2 if point == "group.after_commit" else 0
    assert Item.objects.filter(status=Status.PROCESSING).count() == 2 + claimed_too

    http = connect(server_factory())
    for item_id, payload in posts.items():
        assert http.get(f"/api/items/{item_id}").json()["payload"] == payload
    for item_id, result in {**results, held[4]["id"]: {"r": 4}, held[5]["id"]: {"r": 5}}.items():
        assert http.get(f"/api/items/{item_id}").json()["result"] == result
        late = http.post(f"/api/items/{item_id}/result", json={"result": "late"}).json()
        assert late == {"accepted": False, "status": "finished"}, "a second verdict"
    recovered = {Item.objects.get(key=f"k{n}").id: f"p{n}" for n in range(6)}
    assert set(posts) < set(recovered)
    for n in range(6):
        path, body = _post(n)
        again = http.post(path, json=body)
        assert again.status_code == 200, "a retried post made a second item"
        assert recovered[again.json()["id"]] == f"p{n}"
    # Whatever was held by the dead server lapses (600 s): take it back as the sweep would.
    engine.sweep(at=utcnow() + timedelta(seconds=601))
    finished = finish_everything(http, "q")
    assert set(recovered) <= set(finished)
    counts = http.get("/api/queues/q").json()["counts"]
    assert counts["pending"] == counts["processing"] == 0, counts
    assert_index_matches_directories(state_root)
    assert_threads_consistent()


# -- deletes of many: files unlinked behind the group, by a durable list -------------------------


def test_a_large_delete_lists_its_files_and_they_go_behind_it(state_root: Path, transactional_db):
    """Rows and the answer at once; the files by the list, after the group is durable."""
    ids = seed("q", *({"payload": n} for n in range(150)))
    assert engine.delete_by_status(queue_name="q", status=Status.PENDING) == 150
    assert not Item.objects.filter(id__in=ids).exists()
    deadline = time.monotonic() + 20
    while files_on_disk(state_root) or store().unlink_lists():
        assert time.monotonic() < deadline, "the listed files were not reclaimed"
        time.sleep(0.05)
    assert_index_matches_directories(state_root)


@pytest.mark.parametrize("point", ["group.before_commit", "group.after_commit"])
def test_a_large_delete_killed_mid_group_never_brings_deleted_items_back(
    server_factory, manage, connect, state_root: Path, point: str
):
    """Killed with its list written (not committed, or committed but not flushed nor
    reclaimed): repair finishes the list before it indexes a file, so an item is either
    still there whole or gone for good, never back from the dead."""
    ids = seed("q", *({"payload": n} for n in range(150)))
    server = server_factory(TASKHOSTER_CRASH_AT=point, TASKHOSTER_CRASH_MIN_OPS="1")
    http = connect(server)
    body = {"status": "pending"}
    crash_during(server, lambda: http.post("/api/queues/q/items/delete", json=body))
    assert store().unlink_lists(), "the delete died without its list: the test proves nothing"
    manage(*REPAIR)
    assert not store().unlink_lists()
    assert_index_matches_directories(state_root)
    left = set(Item.objects.filter(id__in=ids).values_list("id", flat=True))
    if point == "group.after_commit":
        assert left == set(), "a committed delete came back"
    # and a later sweep or repair changes nothing more
    manage(*REPAIR)
    assert set(Item.objects.filter(id__in=ids).values_list("id", flat=True)) == left
    assert_index_matches_directories(state_root)


def test_repair_beside_a_live_reclaim_never_indexes_a_listed_file(
    state_root: Path, transactional_db
):
    """A committed delete whose list is young (its reclaim still running elsewhere): repair
    with the default grace must not take the listed files, whose rows are gone, as items to
    index."""
    seed("q", *({"payload": n} for n in range(80)))
    st = store()
    batch = st.batch()
    rows = list(Item.objects.all())
    for row in rows:
        batch.remove("q", row.id, State.PENDING)
    batch.apply_unlinks()  # a list, not unlinks: 80 >= DEFER_UNLINKS_AT
    batch.flush()
    assert len(st.unlink_lists()) == 1
    assert len(files_on_disk(state_root)) == 80
    Item.objects.all().delete()  # the group's rows, committed
    # The list is young (written "now + 1 h"), the files are not: repair leaves the list
    # to its reclaimer, and must not index the files it names.
    (listed,) = st.unlink_lists()
    soon = time.time() + 3600
    os.utime(listed, (soon, soon))
    engine.repair(grace_seconds=0)
    assert not Item.objects.exists(), "repair brought deleted items back"
    assert len(files_on_disk(state_root)) == 80
    os.utime(listed, (time.time() - 10, time.time() - 10))
    engine.repair(grace_seconds=0)  # old enough now: the list is finished
    assert not files_on_disk(state_root)
    assert not st.unlink_lists()
