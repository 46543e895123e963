"""``/metrics`` counts re-queues and timeouts (SPEC section 5: "claims, results, re-queues,
timeouts"), by exactly what happened, against a real daphne and the real ``manage.py
sweep``:

- a socket dropped while holding an item re-queues it (rule 6): ``requeues`` + 1;
- a lease that lapses is re-queued by the sweep (rule 6): ``requeues`` + 1;
- items older than ``queueSeconds``, pending or processing, are failed by the sweep (rule 8):
  ``timeouts`` + 2 (and ``failures`` + 2), by a sweep running beside the server (``--every``,
  as ``scripts/serve`` runs it) and by a one-shot ``manage.py sweep`` (as from cron), whose
  process ends as soon as its pass is done.

Counters are written behind the work (each process adds its counts to the database about
once a second), so each test waits, with a generous deadline, for the counter to reach the
expected value, and never lets it pass it. "Exactly" is then checked behind a barrier: a
claim made afterwards is waited for in ``/metrics``; the counts of the same process made
before it are written by then.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ..conftest import REPO, server_env, stop_process
from .wsclient import (
    connect,
    make_queue,
    metric,
    post,
    recv,
    status_of,
    subscribe,
    wait_for_metric,
)

pytestmark = pytest.mark.slow

DEADLINE = 30


@pytest.fixture
def server(server_factory):
    return server_factory(TASKHOSTER_SOCKET_BACKSTOP_SECONDS="120")


def barrier(http: httpx.Client) -> None:
    """Wait until the server's counts made so far are in ``/metrics``: one more claim of an
    empty queue, waited for there (the process flushes all its counts at once)."""
    before = metric(http, "claim_attempts", "barrier")
    assert http.post("/api/queues/barrier/claim", json={}).json() == {"items": []}
    wait_for_metric(http, "claim_attempts", before + 1, "barrier")


def sweep_until(manage, what: str, expected: int) -> int:
    """Run ``manage.py sweep`` until its reports add up to ``expected`` of ``what``
    ("lapsed lease(s) re-queued", "item(s) timed out"); the total reported."""
    total = 0
    deadline = time.monotonic() + DEADLINE
    while total < expected:
        assert time.monotonic() < deadline, f"the sweep reported {total} {what}, not {expected}"
        report = manage("sweep").stdout
        found = re.search(rf"(\d+) {re.escape(what)}", report)
        assert found, report
        total += int(found.group(1))
        if total < expected:
            time.sleep(0.2)
    return total


@pytest.mark.parametrize("drop", ["close", "abort"])
def test_a_socket_dropped_while_holding_an_item_counts_one_requeue(server, http, key, drop):
    make_queue(http)
    make_queue(http, "barrier")
    barrier(http)
    requeues = metric(http, "requeues")
    timeouts = metric(http, "timeouts")

    async def run() -> str:
        ws = await connect(server, key)
        await subscribe(ws, ["q"], 1)
        item = await asyncio.to_thread(post, http, "x")
        frame = await recv(ws, DEADLINE)
        assert (frame["type"], frame["id"]) == ("item", item)
        if drop == "close":
            await ws.close()
        else:  # the connection is cut, no closing handshake
            ws.transport.abort()
        return item

    item = asyncio.run(run())
    deadline = time.monotonic() + DEADLINE
    while status_of(http, item)["status"] != "pending":
        assert time.monotonic() < deadline, "the dropped socket's item was not re-queued"
        time.sleep(0.05)
    wait_for_metric(http, "requeues", requeues + 1)
    barrier(http)
    assert metric(http, "requeues") == requeues + 1
    assert metric(http, "timeouts") == timeouts


def test_a_lease_that_lapses_counts_one_requeue_from_the_sweep(server, http, manage):
    make_queue(http, leaseSeconds=0.5)
    make_queue(http, "barrier")
    barrier(http)
    requeues = metric(http, "requeues")
    timeouts = metric(http, "timeouts")
    item = post(http, "x")
    claimed = http.post("/api/queues/q/claim", json={}).json()["items"]
    assert [c["id"] for c in claimed] == [item]

    assert sweep_until(manage, "lapsed lease(s) re-queued", 1) == 1
    assert status_of(http, item)["status"] == "pending"
    wait_for_metric(http, "requeues", requeues + 1)
    barrier(http)
    assert metric(http, "requeues") == requeues + 1
    assert metric(http, "timeouts") == timeouts


def timed_out_pair(http: httpx.Client) -> tuple[str, str]:
    """Queue ``q`` times items out after a second; one item held (claimed), one pending."""
    make_queue(http, queueSeconds=1, leaseSeconds=3600)
    held = post(http, "processing when it times out")
    claimed = http.post("/api/queues/q/claim", json={}).json()["items"]
    assert [c["id"] for c in claimed] == [held]
    waiting = post(http, "pending when it times out")
    return held, waiting


def assert_timed_out(http: httpx.Client, items: tuple[str, ...]) -> None:
    deadline = time.monotonic() + DEADLINE
    for item in items:
        while (seen := status_of(http, item))["status"] != "failed":
            assert time.monotonic() < deadline, f"not timed out: {seen}"
            time.sleep(0.1)
        assert seen["error"] == "timeout", seen


@contextlib.contextmanager
def running_sweep(state_root: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``manage.py sweep --every 0.5`` beside the server, as ``scripts/serve`` runs it."""
    log = open(state_root.parent / "sweep.log", "ab")  # noqa: SIM115 (closed below)
    sweep = subprocess.Popen(
        [sys.executable, "manage.py", "sweep", "--every", "0.5"],
        cwd=REPO,
        env=server_env(state_root),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        yield sweep
    finally:
        stop_process(sweep, within=30)
        log.close()


def test_items_past_the_queue_timeout_count_timeouts_from_a_running_sweep(server, http, state_root):
    make_queue(http, "barrier")
    barrier(http)
    requeues = metric(http, "requeues")
    timeouts = metric(http, "timeouts")
    failures = metric(http, "failures")
    held, waiting = timed_out_pair(http)

    with running_sweep(state_root):
        assert_timed_out(http, (held, waiting))
        wait_for_metric(http, "timeouts", timeouts + 2)
        wait_for_metric(http, "failures", failures + 2)
    barrier(http)
    assert metric(http, "timeouts") == timeouts + 2
    assert metric(http, "failures") == failures + 2
    assert metric(http, "requeues") == requeues


def test_items_past_the_queue_timeout_count_timeouts_from_a_one_shot_sweep(server, http, manage):
    """``manage.py sweep`` alone (one pass, as from cron): what it did is counted, though
    the process ends as soon as it is done."""
    make_queue(http, "barrier")
    barrier(http)
    requeues = metric(http, "requeues")
    timeouts = metric(http, "timeouts")
    failures = metric(http, "failures")
    held, waiting = timed_out_pair(http)

    assert sweep_until(manage, "item(s) timed out", 2) == 2
    assert_timed_out(http, (held, waiting))
    wait_for_metric(http, "failures", failures + 2)
    wait_for_metric(http, "timeouts", timeouts + 2)
    barrier(http)
    assert metric(http, "timeouts") == timeouts + 2
    assert metric(http, "failures") == failures + 2
    assert metric(http, "requeues") == requeues
