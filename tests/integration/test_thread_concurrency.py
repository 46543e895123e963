"""Threads under real concurrency (issue 3): several OS processes claiming from one server
and one state root never have two members of a thread processing at once, claim each
thread's members in head order, and a crash in the middle of a claim neither blocks a
thread nor lets two members through."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("thread_worker.py")
THREADS = 20
MEMBERS = 12
UNTHREADED = 60
PROCESSES = 4


def test_no_two_members_of_a_thread_overlap_across_four_worker_processes(
    server_factory, make_key, tmp_path
):
    server = server_factory()
    key = make_key()
    headers = {"Authorization": f"Token {key}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=30) as http:
        assert http.put("/api/queues/q", json={"leaseSeconds": 120}).status_code == 201
        batch = []
        for member in range(MEMBERS):
            for thread in range(THREADS):
                batch.append({"payload": [thread, member], "threadId": f"t{thread}"})
        batch += [{"payload": ["solo", n]} for n in range(UNTHREADED)]
        posted = http.post("/api/queues/q/items", json={"items": batch})
        assert posted.status_code == 201
        ids = [i["id"] for i in posted.json()["items"]]

        deadline = time.time() + 90
        logs = [tmp_path / f"worker-{n}.jsonl" for n in range(PROCESSES)]
        workers = [
            subprocess.Popen(
                [sys.executable, str(WORKER), server.url, key, str(log), str(deadline)]
            )
            for log in logs
        ]
        for worker in workers:
            assert worker.wait(120) == 0

        counts = http.get("/api/queues/q").json()["counts"]
        assert counts == {"pending": 0, "processing": 0, "finished": len(ids), "failed": 0}

    intervals: dict[str | None, list[dict]] = defaultdict(list)
    seen = []
    for log in logs:
        for line in log.read_text().splitlines():
            entry = json.loads(line)
            intervals[entry["thread"]].append(entry)
            seen.append(entry["id"])
    assert sorted(seen) == sorted(ids), "every item processed exactly once"
    busy = [n for n, log in enumerate(logs) if log.read_text()]
    assert len(busy) >= 2, "the test needs real concurrency"

    for thread_id, entries in intervals.items():
        if thread_id is None:
            continue
        entries.sort(key=lambda e: e["start"])
        for before, after in itertools.pairwise(entries):
            assert before["end"] < after["start"], f"thread {thread_id}: overlap {before} {after}"
        # head order: posted in arrival order with no scheduledAt, so claimed in id order
        assert [e["id"] for e in entries] == sorted(e["id"] for e in entries), thread_id


def _post_thread(http, members=3):
    assert http.put("/api/queues/q", json={"leaseSeconds": 1}).status_code in (200, 201)
    items = [{"payload": n, "threadId": "T"} for n in range(members)]
    return [
        i["id"] for i in http.post("/api/queues/q/items", json={"items": items}).json()["items"]
    ]


def _claim(http, wait=0):
    answer = http.post("/api/queues/q/claim", json={"max": 10, "wait": wait})
    return [i["id"] for i in answer.json()["items"]]


def _crash_a_threaded_claim(server_factory, make_key, point):
    """Post a thread of three, kill the server at ``point`` of the claim of its head, and
    start a fresh server: returns (a client for it, the members' ids)."""
    headers = {"Authorization": f"Token {make_key()}"}
    crashing = server_factory(TASKHOSTER_CRASH_AT=point)
    with httpx.Client(base_url=crashing.url, headers=headers, timeout=10) as http:
        ids = _post_thread(http)
        with pytest.raises(httpx.HTTPError):
            http.post("/api/queues/q/claim", json={"max": 10})
    crashing.proc.wait(10)
    return httpx.Client(base_url=server_factory().url, headers=headers, timeout=10), ids


def test_crash_after_taking_a_threads_turn_before_commit_does_not_block_the_thread(
    server_factory, make_key
):
    http, ids = _crash_a_threaded_claim(server_factory, make_key, "claim.after_rename")
    with http:
        # No repair needed: the claim never committed, so the head is still the head. (The
        # first claim loses to the file the dead claim left in processing/ and puts it back;
        # a long-poll claim hears of it at once.)
        assert _claim(http, wait=10) == [ids[0]]
        assert _claim(http) == []  # one member at a time
        assert http.post(f"/api/items/{ids[0]}/result", json={"result": 1}).json()["accepted"]
        assert _claim(http) == [ids[1]]


def test_crash_after_the_claim_committed_releases_the_thread_after_lease_and_sweep(
    server_factory, make_key, manage
):
    http, ids = _crash_a_threaded_claim(server_factory, make_key, "claim.after_commit")
    with http:
        assert _claim(http) == []  # the head is processing under the lost claim: no one else
        time.sleep(1.2)  # past the 1 s lease
        assert "1 lapsed lease(s) re-queued" in manage("sweep").stdout
        assert _claim(http) == [ids[0]]  # the head again, not the next member
        item = http.get(f"/api/items/{ids[0]}").json()
        assert item["attempts"] == 2
