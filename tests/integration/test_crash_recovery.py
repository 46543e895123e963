"""Crash recovery (SPEC I1, I2, I5, I7) against a real daphne server and real files.

Each test arms a crash point (``TASKHOSTER_CRASH_AT``) so that the process SIGKILLs itself between
the two writes of one transition (the item's file and its index row), sends the request that
reaches it, recovers with ``manage.py sweep --repair --grace 0`` (or a plain sweep), restarts a
normal server and proves: nothing acknowledged is lost, nothing is finished twice, the index
matches the state directories, nothing stays processing past its lease plus one sweep, and the
item can then be claimed and finished normally.
"""

from __future__ import annotations

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
from taskhoster.models import Item
from taskhoster.status import State, Status
from taskhoster.timeutil import now as utcnow

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
    before = seed("q", {"payload": "old", "threadId": "t"})
    batch = [{"payload": n, "threadId": f"t{n % 3}" if n % 2 else None} for n in range(12)]
    server = server_factory(TASKHOSTER_CRASH_AT="post.after_files")
    crash_during(server, lambda: connect(server).post("/api/queues/q/items", json={"items": batch}))
    manage(*REPAIR)
    assert_index_matches_directories(state_root)
    assert_threads_consistent()
    recovered = Item.objects.exclude(id__in=before)
    assert recovered.count() in (0, len(batch)), "a batch is all or none, also across a crash"
    assert status_of(*before) == dict.fromkeys(before, "pending")

    http = connect(server_factory())
    finished = finish_everything(http, "q")
    assert set(before) <= set(finished)
    assert sorted(str(p) for p in finished.values()) == sorted(
        ["old"] + ([str(n) for n in range(12)] if recovered.count() else [])
    )
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
    lapse = max(
        Item.objects.filter(status=Status.PROCESSING).values_list("lease_expires_at", flat=True),
        default=utcnow(),
    )
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


# -- a crash in the middle of a crowded group ----------------------------------------------


def _crowd(server: Any, key: str, held: list[dict[str, Any]]) -> dict[str, Any]:
    """Many requests at once, so that they share groups: posts with keys (some threaded),
    results and failures for held items, claims. Returns what was answered."""
    headers = {"Authorization": f"Token {key}"}
    acked: dict[str, Any] = {"posts": {}, "results": {}, "failed": set()}

    def send(n: int) -> None:
        with httpx.Client(base_url=server.url, headers=headers, timeout=15) as http:
            try:
                if n < 10:
                    body = {"payload": f"p{n}", "key": f"k{n}", "threadId": f"t{n % 3}"}
                    answer = http.post("/api/queues/q/items", json=body)
                    if answer.status_code == 201:
                        acked["posts"][answer.json()["id"]] = f"p{n}"
                elif n < 10 + len(held):
                    item = held[n - 10]
                    if n % 4:
                        answer = http.post(
                            f"/api/items/{item['id']}/result", json={"result": {"r": n}}
                        )
                        if answer.status_code == 200 and answer.json()["accepted"]:
                            acked["results"][item["id"]] = {"r": n}
                    else:
                        answer = http.post(
                            f"/api/items/{item['id']}/fail",
                            json={"lease": item["lease"], "retry": False, "error": "no"},
                        )
                        if answer.status_code == 200 and answer.json()["accepted"]:
                            acked["failed"].add(item["id"])
                else:
                    http.post("/api/queues/q/claim", json={"max": 2})
            except httpx.TransportError:
                pass  # the server died: not acknowledged

    with ThreadPoolExecutor(max_workers=24) as pool:
        list(pool.map(send, range(10 + len(held) + 4)))
    return acked


@pytest.mark.parametrize(
    "point", ["group.after_files", "group.before_commit", "group.after_commit"]
)
def test_sigkill_inside_a_crowded_group_loses_nothing_acknowledged(
    server_factory, manage, connect, make_key, state_root: Path, point: str
):
    """Files written but no rows; rows written but not committed; committed but unanswered:
    whatever a SIGKILL in a group of many leaves, repair resolves it without losing an
    acknowledged post or verdict, without a second verdict, and without two members of a
    thread at work."""
    seed(
        "q",
        *({"payload": f"s{n}", "threadId": f"t{n % 3}" if n % 2 else None} for n in range(12)),
        leaseSeconds=600,
        maxAttempts=5,
    )
    normal = server_factory()
    http = connect(normal)
    held = http.post("/api/queues/q/claim", json={"max": 12}).json()["items"]
    assert len(held) >= 6
    normal.stop()

    # The committer waits for a crowd of 8 before its first group (the crowd is 20 or more
    # requests at once), so the crash point always meets a group of 4 or more.
    server = server_factory(
        TASKHOSTER_CRASH_AT=point, TASKHOSTER_CRASH_MIN_OPS="4", TASKHOSTER_FAULT_GATHER="8"
    )
    key = make_key()
    acked = _crowd(server, key, held)
    assert server.proc.wait(20) == -signal.SIGKILL, "the server did not die inside a group"

    manage(*REPAIR)
    assert_index_matches_directories(state_root)
    assert_threads_consistent()
    for item_id, payload in acked["posts"].items():
        assert Item.objects.get(id=item_id).key is not None, payload
    for item_id in acked["results"]:
        assert Item.objects.get(id=item_id).status == Status.FINISHED
    for item_id in acked["failed"]:
        assert Item.objects.get(id=item_id).status == Status.FAILED

    http = connect(server_factory())
    for item_id, result in acked["results"].items():
        assert http.get(f"/api/items/{item_id}").json()["result"] == result
        late = http.post(f"/api/items/{item_id}/result", json={"result": "second"}).json()
        assert late == {"accepted": False, "status": "finished"}, "a second verdict"
    manage("sweep", TASKHOSTER_CRASH_AT="")  # lapsed leases of the dead server come back
    for n in range(10):
        again = http.post(
            "/api/queues/q/items",
            json={"payload": f"p{n}", "key": f"k{n}", "threadId": f"t{n % 3}"},
        )
        assert again.status_code in (200, 201)
        if again.json()["id"] in acked["posts"]:
            assert again.status_code == 200, "a retried post made a second item"
    # Whatever was held by the dead server lapses (600 s): take it back as the sweep would.
    engine.sweep(at=utcnow() + timedelta(seconds=601))
    finish_everything(http, "q")
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
