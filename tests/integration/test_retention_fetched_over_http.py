"""Rule 11 with ``retainFrom: "fetched"``, through HTTP and the sweep: a done item is kept
until a producer first reads it, and deleted ``retainSeconds`` after that read. "A producer's
read is ``GET /api/items/{id}`` (also its long-poll) of a terminal item; listings, reads of a
non-terminal item and the admin do not count" (SPEC section 3).

The engine's own clock is proved in ``tests/unit/test_engine_clocks.py`` with the read flag
set by the test; here every read is a real request to a real daphne, and the clock is the
real ``manage.py sweep``. The proof that a listing does not start the clock: the items are
listed BEFORE the reads that do, so once the sweep has deleted the read ones, an item whose
clock a listing had started would be past its time too, and would be gone with them.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest

from taskhoster.models import Item

from .wsclient import make_queue, post

pytestmark = pytest.mark.slow

RETAIN_SECONDS = 1


@pytest.fixture
def server(server_factory):
    return server_factory()


@pytest.fixture
def http(server, make_key):
    with httpx.Client(
        base_url=server.url, headers={"Authorization": f"Token {make_key()}"}, timeout=60
    ) as client:
        yield client


def finish_all(http: httpx.Client, ids: list[str]) -> None:
    claimed = http.post("/api/queues/q/claim", json={"max": len(ids)}).json()["items"]
    assert sorted(c["id"] for c in claimed) == sorted(ids)
    for item in ids:
        answer = http.post(f"/api/items/{item}/result", json={"result": item}).json()
        assert answer == {"accepted": True, "status": "finished"}


def listed(http: httpx.Client, **params: Any) -> set[str]:
    page = http.get("/api/queues/q/items", params={"limit": 1000, **params})
    assert page.status_code == 200, page.text
    return {i["id"] for i in page.json()["items"]}


def fetched_at(ids: list[str]) -> dict[str, Any]:
    return dict(Item.objects.filter(id__in=ids).values_list("id", "fetched_at"))


def test_retain_from_fetched_starts_at_a_producer_get_or_wait_and_never_at_a_listing(
    server, http, manage
):
    make_queue(http, retainFrom="fetched", retainSeconds=RETAIN_SECONDS)
    read = post(http, "read with a plain GET")
    waited = post(http, "read with ?wait once finished")
    long_polled = post(http, "long-polled before its verdict")
    listed_only = post(http, "only ever listed")
    read_early = post(http, "read only while it was pending")
    everything = [read, waited, long_polled, listed_only, read_early]

    # A read of a non-terminal item does not count.
    assert http.get(f"/api/items/{read_early}").json()["status"] == "pending"

    # A long-poll waiting for the verdict: it answers with the finished item, a read.
    answers: dict[str, Any] = {}

    def long_poll() -> None:
        answers["long_polled"] = http.get(f"/api/items/{long_polled}", params={"wait": 30})

    poller = threading.Thread(target=long_poll)
    poller.start()
    finish_all(http, everything)
    poller.join(60)
    assert not poller.is_alive()
    assert answers["long_polled"].json()["status"] == "finished"

    # Listings, every way: none of them is a producer's read of an item.
    assert listed(http) == set(everything)
    assert listed(http, status="finished") == set(everything)
    assert listed(http, limit=1) <= set(everything)

    # The reads, after the listings.
    assert http.get(f"/api/items/{read}").json()["status"] == "finished"
    assert http.get(f"/api/items/{waited}", params={"wait": 5}).json()["status"] == "finished"

    stamped = fetched_at(everything)
    assert {i for i, at in stamped.items() if at is not None} == {read, waited, long_polled}

    # The sweep deletes the three read items once their time is up, and nothing else.
    retained = 0
    deadline = time.monotonic() + 30
    while fetched_at([read, waited, long_polled]):
        assert time.monotonic() < deadline, (
            f"read items not deleted by the sweep: {fetched_at([read, waited, long_polled])}"
        )
        swept = manage("sweep").stdout
        retained += int(swept.split(" done item(s) deleted")[0].rsplit(" ", 1)[1])
        if fetched_at([read, waited, long_polled]):
            time.sleep(0.2)
    assert retained == 3
    assert fetched_at(everything) == {listed_only: None, read_early: None}
    assert listed(http) == {listed_only, read_early}
    for item in (read, waited, long_polled):
        assert http.get(f"/api/items/{item}").status_code == 404
