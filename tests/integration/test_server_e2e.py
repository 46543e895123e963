"""End to end: a real daphne subprocess driven over HTTP with httpx, and ``manage.py sweep`` run
as its own process beside it (SPEC sections 3, 5 and 7; rule 12: two sweeps at once do no harm).
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from taskhoster.models import Item
from taskhoster.timeutil import parse_wire
from tests.conftest import REPO, server_env

from .consistency import assert_index_matches_directories, assert_threads_consistent

pytestmark = pytest.mark.slow

SWEEP_LINE = re.compile(r"(\d+) lapsed lease\(s\) re-queued, (\d+) item\(s\) timed out")


def sweep_counts(out: str) -> tuple[int, ...]:
    """The two counts of ``manage.py sweep``'s summary line."""
    found = SWEEP_LINE.search(out)
    assert found is not None, out
    return tuple(map(int, found.groups()))


@pytest.fixture
def http(server_factory, make_key: Callable[..., str]) -> Iterator[httpx.Client]:
    server = server_factory()
    headers = {"Authorization": f"Token {make_key()}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=20) as client:
        yield client


def utc() -> datetime:
    return datetime.now(UTC)


def claim(http: httpx.Client, queue: str, **body: Any) -> list[dict[str, Any]]:
    answer = http.post(f"/api/queues/{queue}/claim", json=body)
    assert answer.status_code == 200, answer.text
    return list(answer.json()["items"])


def assert_backoff(http: httpx.Client, item: dict[str, Any], delay: float) -> None:
    """Fail the claimed item (retryable) and check it is re-scheduled ``delay`` seconds out."""
    before = utc()
    answer = http.post(
        f"/api/items/{item['id']}/fail", json={"lease": item["lease"], "error": "try again"}
    )
    after = utc()
    assert answer.json() == {"accepted": True, "status": "pending"}
    scheduled = parse_wire(http.get(f"/api/items/{item['id']}").json()["scheduledAt"])
    slack = timedelta(seconds=0.05)
    assert before + timedelta(seconds=delay) - slack <= scheduled
    assert scheduled <= after + timedelta(seconds=delay) + slack


def popen_manage(root: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "manage.py", *args],
        cwd=REPO,
        env=server_env(root, PYTHONUNBUFFERED="1"),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def test_rest_lifecycle_over_http_post_claim_fail_extend_result_restart_delete(http, state_root):
    assert (
        http.put(
            "/api/queues/jobs",
            json={"leaseSeconds": 30, "backoffSeconds": 0.5, "backoffMaxSeconds": 10},
        ).status_code
        == 201
    )
    assert http.put("/api/queues/jobs", json={"maxAttempts": 5}).json()["leaseSeconds"] == 30
    single = http.post("/api/queues/jobs/items", json={"payload": {"n": 0}})
    assert single.status_code == 201
    batch = http.post(
        "/api/queues/jobs/items", json={"items": [{"payload": {"n": n}} for n in (1, 2, 3)]}
    )
    assert batch.status_code == 201
    ids = [single.json()["id"], *(i["id"] for i in batch.json()["items"])]
    assert ids == sorted(ids), "ids sort in arrival order"

    claimed = claim(http, "jobs", max=10)
    assert [c["id"] for c in claimed] == ids
    assert [c["payload"] for c in claimed] == [{"n": n} for n in range(4)]
    first, second, third, fourth = claimed

    # fail with retry: back to pending with backoff 0.5 s, then 1 s (doubling)
    assert_backoff(http, first, 0.5)
    assert claim(http, "jobs") == [], "not claimable before its backoff has passed"
    time.sleep(0.6)
    (retried,) = claim(http, "jobs")
    assert (retried["id"], retried["attempts"]) == (first["id"], 2)
    assert (
        http.post(f"/api/items/{first['id']}/fail", json={"lease": first["lease"]}).json()[
            "accepted"
        ]
        is False
    ), "a stale worker's fail is refused"
    assert_backoff(http, retried, 1.0)

    # extend
    extended = http.post(
        f"/api/items/{second['id']}/extend", json={"lease": second["lease"]}
    ).json()
    assert extended["accepted"] is True
    assert parse_wire(extended["leaseExpiresAt"]) > parse_wire(second["leaseExpiresAt"])
    assert (
        http.post(f"/api/items/{second['id']}/extend", json={"lease": "not-the-lease"}).json()[
            "accepted"
        ]
        is False
    )

    # a producer's long-poll read answers as soon as the result lands
    with ThreadPoolExecutor(1) as pool:
        started = time.monotonic()
        waiting = pool.submit(http.get, f"/api/items/{second['id']}", params={"wait": 10})
        time.sleep(0.5)
        assert not waiting.done()
        verdict = http.post(f"/api/items/{second['id']}/result", json={"result": "ok"}).json()
        assert verdict == {"accepted": True, "status": "finished"}
        read = waiting.result(timeout=10).json()
        assert time.monotonic() - started < 5
    assert (read["status"], read["result"]) == ("finished", "ok")
    assert (
        http.post(f"/api/items/{second['id']}/result", json={"result": "late"}).json()["accepted"]
        is False
    )

    # die, then restart as a brand-new arrival; only a failed item restarts
    died = http.post(
        f"/api/items/{third['id']}/fail",
        json={"lease": third["lease"], "error": "bad input", "retry": False},
    )
    assert died.json() == {"accepted": True, "status": "failed"}
    assert http.get(f"/api/items/{third['id']}").json()["error"] == "bad input"
    restarted = http.post(f"/api/items/{third['id']}/restart")
    assert restarted.status_code == 200
    assert (restarted.json()["status"], restarted.json()["attempts"]) == ("pending", 0)
    assert restarted.json()["error"] is None
    assert http.post(f"/api/items/{second['id']}/restart").status_code == 409

    # delete
    assert http.delete(f"/api/items/{fourth['id']}").status_code == 204
    assert http.get(f"/api/items/{fourth['id']}").status_code == 404
    counts = http.get("/api/queues/jobs").json()["counts"]
    assert counts == {"pending": 2, "processing": 0, "finished": 1, "failed": 0}
    assert_index_matches_directories(state_root)
    assert_threads_consistent()


def test_claim_long_poll_answers_when_a_post_arrives_during_the_wait(http):
    assert http.put("/api/queues/later", json={}).status_code == 201
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(claim, http, "later", wait=30)
        time.sleep(0.5)
        assert not waiting.done(), "nothing to claim yet: the claim must wait"
        posted_at = time.monotonic()
        item = http.post("/api/queues/later/items", json={"payload": "now"}).json()
        claimed = waiting.result(timeout=40)
        latency = time.monotonic() - posted_at
    assert [(c["id"], c["payload"]) for c in claimed] == [(item["id"], "now")]
    # (a claim that did not see the post would answer empty, or at the end of its 30 s)
    assert latency < 15, f"the waiting claim took {latency:.2f}s to see the post"


def test_sweep_process_requeues_a_lapsed_lease_and_prints_what_it_did(http, manage, state_root):
    http.put("/api/queues/q", json={"leaseSeconds": 0.5})
    item = http.post("/api/queues/q/items", json={"payload": 1, "threadId": "t"}).json()
    behind = http.post("/api/queues/q/items", json={"payload": 2, "threadId": "t"}).json()
    (held,) = claim(http, "q", max=5)
    assert held["id"] == item["id"]
    time.sleep(0.7)

    out = manage("sweep").stdout
    assert "1 lapsed lease(s) re-queued" in out, out
    read = http.get(f"/api/items/{item['id']}").json()
    assert (read["status"], read["attempts"], read["scheduledAt"]) == (
        "pending",
        1,
        item["scheduledAt"],
    ), "re-queued with scheduledAt unchanged"
    assert "0 lapsed lease(s) re-queued" in manage("sweep").stdout
    (again,) = claim(http, "q", max=5)
    assert (again["id"], again["attempts"]) == (item["id"], 2), "the thread head stays head"
    assert (
        http.post(f"/api/items/{item['id']}/fail", json={"lease": held["lease"]}).json()["accepted"]
        is False
    )
    assert http.get(f"/api/items/{behind['id']}").json()["status"] == "pending"
    assert_index_matches_directories(state_root)
    assert_threads_consistent()


def test_two_sweeps_at_once_requeue_or_time_out_each_item_exactly_once(http, state_root):
    n = 60
    http.put("/api/queues/lapsed", json={"leaseSeconds": 0.5})
    http.put("/api/queues/aged", json={"queueSeconds": 1, "leaseSeconds": 600})
    http.post(
        "/api/queues/lapsed/items",
        json={
            "items": [{"payload": i, "threadId": f"t{i % 7}" if i % 2 else None} for i in range(n)]
        },
    )
    http.post(
        "/api/queues/aged/items",
        json={
            "items": [{"payload": i, "threadId": f"t{i % 5}" if i % 3 else None} for i in range(n)]
        },
    )
    lapsed = {c["id"] for _ in range(10) for c in claim(http, "lapsed", max=100)}
    held_aged = {c["id"] for c in claim(http, "aged", max=40)}
    assert held_aged
    time.sleep(1.1)
    lapsed_count = Item.objects.filter(queue__name="lapsed", status="processing").count()
    assert lapsed_count == len(lapsed)

    sweeps = [popen_manage(state_root, "sweep") for _ in range(2)]
    outputs = [s.communicate(timeout=60) for s in sweeps]
    assert [s.returncode for s in sweeps] == [0, 0], outputs
    counts = [sweep_counts(out) for out, _err in outputs]
    assert sum(c[0] for c in counts) == len(lapsed), counts
    assert sum(c[1] for c in counts) == n, counts

    lapsed_rows = Item.objects.filter(queue__name="lapsed")
    assert set(lapsed_rows.filter(id__in=lapsed).values_list("status", "attempts")) == {
        ("pending", 1)
    }
    aged_rows = Item.objects.filter(queue__name="aged")
    assert set(aged_rows.values_list("status", "error")) == {("failed", "timeout")}
    assert_index_matches_directories(state_root)
    assert_threads_consistent()


def test_sweep_every_keeps_sweeping_until_terminated_and_exits_cleanly(http, state_root):
    http.put("/api/queues/q", json={"leaseSeconds": 0.3})
    item = http.post("/api/queues/q/items", json={"payload": 1}).json()
    sweeper = popen_manage(state_root, "sweep", "--every", "0.2")
    try:
        time.sleep(1.0)  # the first passes have found nothing to do
        assert sweeper.poll() is None
        assert [c["id"] for c in claim(http, "q")] == [item["id"]]
        deadline = time.monotonic() + 5
        while Item.objects.get(id=item["id"]).status != "pending":
            assert time.monotonic() < deadline, "a later pass should have re-queued the lease"
            time.sleep(0.1)
    finally:
        sweeper.send_signal(signal.SIGTERM)
        out, err = sweeper.communicate(timeout=10)
    assert sweeper.returncode == 0, err
    assert "Traceback" not in err, err
    assert "1 lapsed lease(s) re-queued" in out, out
    assert_index_matches_directories(state_root)
