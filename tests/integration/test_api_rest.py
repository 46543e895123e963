"""The REST API of SPEC section 5, happy paths: every endpoint, with its exact wire names."""

from __future__ import annotations

import json
import os
import re
import threading
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import yaml
from django.db import connection
from rest_framework.test import APIClient

from taskhoster import engine
from taskhoster.conf import get_conf
from taskhoster.models import Item, Queue

ITEM_FIELDS = {
    "id",
    "queue",
    "status",
    "payload",
    "threadId",
    "scheduledAt",
    "postedAt",
    "attempts",
    "leaseExpiresAt",
    "finishedAt",
    "result",
    "error",
    "key",
    "priority",
    "progress",  # SPEC section 8.2
}
LISTED_FIELDS = ITEM_FIELDS - {"payload", "result"}
TIME_FIELDS = ("scheduledAt", "postedAt", "leaseExpiresAt", "finishedAt")
WIRE_TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{1,6})?Z$")
QUEUE_DEFAULTS = {
    "leaseSeconds": 60,
    "queueSeconds": 86400,
    "retainSeconds": 3600,
    "retainFrom": "finished",
    "maxAttempts": None,
    "backoffSeconds": 1,
    "backoffMaxSeconds": 300,
    "deadLetterQueue": None,
    # Flow control (SPEC section 8.1).
    "paused": False,
    "maxProcessing": None,
    "rateLimit": None,
    "threadLimit": 1,
}
NO_COUNTS = {"pending": 0, "processing": 0, "finished": 0, "failed": 0}


# -- helpers -----------------------------------------------------------------------------------


def ok(response: Any, status: int = 200) -> Any:
    assert response.status_code == status, (response.status_code, response.content)
    return response.json()


def parse_time(value: str) -> datetime:
    assert WIRE_TIME.match(value), value
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def assert_wire_item(item: dict[str, Any], fields: set[str] = ITEM_FIELDS) -> None:
    """Exactly the contract's names (plus origin, deadLetter or cancelReason when set); times in
    UTC with Z."""
    extra = set(item) - fields
    assert extra <= {"origin", "deadLetter", "cancelReason", "lease"}, extra
    assert fields <= set(item), fields - set(item)
    for name in TIME_FIELDS:
        if item[name] is not None:
            parse_time(item[name])
    assert isinstance(item["id"], str)
    assert re.fullmatch(r"[A-Za-z0-9_-]+", item["id"])


def post(api: APIClient, queue: str = "q", status: int = 201, **body: Any) -> dict[str, Any]:
    body.setdefault("payload", None)
    return dict(ok(api.post(f"/api/queues/{queue}/items", body, format="json"), status))


def claim(api: APIClient, queue: str = "q", **body: Any) -> list[dict[str, Any]]:
    return list(ok(api.post(f"/api/queues/{queue}/claim", body, format="json"))["items"])


def claim_one(api: APIClient, queue: str = "q") -> dict[str, Any]:
    items = claim(api, queue)
    assert len(items) == 1, items
    return items[0]


def finish(api: APIClient, item_id: str, result: Any = "ok") -> None:
    assert ok(api.post(f"/api/items/{item_id}/result", {"result": result}, format="json")) == {
        "accepted": True,
        "status": "finished",
    }


def kill(api: APIClient, item_id: str, lease: str, error: str = "boom") -> dict[str, Any]:
    return dict(
        ok(
            api.post(
                f"/api/items/{item_id}/fail",
                {"lease": lease, "error": error, "retry": False},
                format="json",
            )
        )
    )


def get(api: APIClient, item_id: str, query: str = "") -> dict[str, Any]:
    return dict(ok(api.get(f"/api/items/{item_id}{query}")))


def listing(api: APIClient, queue: str = "q", query: str = "") -> dict[str, Any]:
    return dict(ok(api.get(f"/api/queues/{queue}/items{query}")))


def walk(api: APIClient, queue: str, query: str, limit: int) -> list[list[str]]:
    """Every page of a listing, following ``next``."""
    pages: list[list[str]] = []
    cursor = ""
    while True:
        sep = "&" if query else ""
        page = listing(api, queue, f"?{query}{sep}limit={limit}{cursor}")
        assert len(page["items"]) <= limit
        pages.append([i["id"] for i in page["items"]])
        if page["next"] is None:
            return pages
        cursor = f"&cursor={page['next']}"
        assert len(pages) < 1000


def now() -> datetime:
    return datetime.now(UTC)


def wire(at: datetime) -> str:
    return at.isoformat().replace("+00:00", "Z")


def in_background(action: Callable[[], Any], delay: float) -> tuple[threading.Thread, list[Any]]:
    """Run ``action`` after ``delay`` seconds on a thread with its own DB connection."""
    out: list[Any] = []

    def run() -> None:
        try:
            time.sleep(delay)
            out.append(action())
        except BaseException as exc:  # reported by the test
            out.append(exc)
        finally:
            connection.close()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def client_like(api: APIClient) -> APIClient:
    other = APIClient()
    # APIClient keeps what credentials() set in _credentials, which its stubs leave out.
    key = api._credentials["HTTP_AUTHORIZATION"]  # type: ignore[attr-defined]
    other.credentials(HTTP_AUTHORIZATION=key)
    return other


@pytest.fixture
def q(make_queue: Any) -> Any:
    return make_queue("q")


# -- queues ------------------------------------------------------------------------------------


def test_put_queue_creates_with_201_then_updates_with_200_keeping_unsent_settings(api):
    created = ok(
        api.put("/api/queues/jobs", {"leaseSeconds": 30, "maxAttempts": 5}, format="json"), 201
    )
    assert created == {
        "name": "jobs",
        **QUEUE_DEFAULTS,
        "leaseSeconds": 30,
        "maxAttempts": 5,
        "counts": NO_COUNTS,
    }
    updated = ok(api.put("/api/queues/jobs", {"retainSeconds": 10}, format="json"), 200)
    assert updated == {**created, "retainSeconds": 10}
    no_held = {"paused": 0, "maxProcessing": 0, "rateLimit": 0, "thread": 0}
    assert ok(api.get("/api/queues/jobs")) == {**updated, "held": no_held}, "a GET adds held"
    again = ok(api.put("/api/queues/jobs", {}, format="json"), 200)
    assert again == updated


def test_put_queue_without_a_body_creates_it_with_the_spec_defaults(api):
    created = ok(api.put("/api/queues/plain"), 201)
    assert created == {"name": "plain", **QUEUE_DEFAULTS, "counts": NO_COUNTS}


def test_put_queue_sets_every_setting(api, make_queue):
    make_queue("dead")
    body = {
        "leaseSeconds": 1.5,
        "queueSeconds": 100,
        "retainSeconds": 0,
        "retainFrom": "fetched",
        "maxAttempts": 2,
        "backoffSeconds": 0.5,
        "backoffMaxSeconds": 4,
        "deadLetterQueue": "dead",
        "paused": True,
        "maxProcessing": 3,
        "rateLimit": {"count": 5, "seconds": 2},
        "threadLimit": 2,
    }
    assert ok(api.put("/api/queues/all", body, format="json"), 201) == {
        "name": "all",
        **body,
        "counts": NO_COUNTS,
    }
    cleared = ok(
        api.put("/api/queues/all", {"maxAttempts": None, "deadLetterQueue": None}, format="json")
    )
    assert cleared["maxAttempts"] is None
    assert cleared["deadLetterQueue"] is None
    assert cleared["leaseSeconds"] == 1.5


def test_get_queue_and_queue_list_report_live_counts_per_status(api, q, make_queue):
    make_queue("empty")
    for n in range(3):
        post(api, payload=n)
    held = claim_one(api)
    done = claim_one(api)
    finish(api, done["id"])
    post(api, payload="dies")
    dying = claim_one(api)
    kill(api, dying["id"], dying["lease"])
    post(api, payload="waiting")
    expected = {"pending": 2, "processing": 1, "finished": 1, "failed": 1}
    assert ok(api.get("/api/queues/q"))["counts"] == expected
    listed = {queue["name"]: queue for queue in ok(api.get("/api/queues"))}
    assert set(listed) == {"q", "empty"}
    assert listed["q"] == {"name": "q", **QUEUE_DEFAULTS, "counts": expected}
    assert listed["empty"]["counts"] == NO_COUNTS
    finish(api, held["id"])
    assert ok(api.get("/api/queues/q"))["counts"] == {**expected, "processing": 0, "finished": 2}


def test_delete_queue_removes_its_items_and_its_directory(api, q, make_queue, state_root):
    make_queue("keep")
    kept = post(api, "keep", payload="kept")
    ids = [post(api, payload=n)["id"] for n in range(3)]
    claim_one(api)
    assert (state_root / "q").is_dir()
    response = api.delete("/api/queues/q")
    assert response.status_code == 204, response.content
    assert not response.content
    assert api.get("/api/queues/q").status_code == 404
    for item_id in ids:
        assert api.get(f"/api/items/{item_id}").status_code == 404
    assert not (state_root / "q").exists()  # out of the namespace at once
    assert [x["name"] for x in ok(api.get("/api/queues"))] == ["keep"]
    assert get(api, kept["id"])["payload"] == "kept"
    recreated = ok(api.put("/api/queues/q", {}, format="json"), 201)  # the name is free
    assert recreated["counts"] == NO_COUNTS
    for item_id in ids:
        assert api.get(f"/api/items/{item_id}").status_code == 404
    # Rows and files are reclaimed behind it (after the commit, in the background; here,
    # inside the test's transaction, by hand).
    engine.reclaim_deleted_queues()
    assert not Item.objects.filter(id__in=ids).exists()
    assert Queue.objects.filter(name="q").count() == 1
    assert not any((state_root / ".trash").iterdir())
    assert get(api, kept["id"])["payload"] == "kept"


# -- posting -----------------------------------------------------------------------------------


def test_post_answers_201_with_the_item_in_its_wire_names(api, q):
    before = now()
    item = post(api, payload={"n": [1, "two", None]}, threadId="t-1", key="k-1")
    after = now()
    assert_wire_item(item)
    assert set(item) == ITEM_FIELDS
    assert item["queue"] == "q"
    assert item["status"] == "pending"
    assert item["payload"] == {"n": [1, "two", None]}
    assert item["threadId"] == "t-1"
    assert item["key"] == "k-1"
    assert item["attempts"] == 0
    assert item["leaseExpiresAt"] is None
    assert item["finishedAt"] is None
    assert item["result"] is None
    assert item["error"] is None
    assert before - timedelta(seconds=1) <= parse_time(item["postedAt"]) <= after
    assert item["scheduledAt"] == item["postedAt"]
    assert get(api, item["id"]) == item


def test_a_post_scheduled_past_the_queue_timeout_conflicts_with_409_and_stores_nothing(
    api, make_queue
):
    make_queue("short", queueSeconds=60)
    for body in (
        {"payload": 1, "delaySeconds": 61},
        {"items": [{"payload": 1, "delaySeconds": 120}]},
    ):
        answer = api.post("/api/queues/short/items", body, format="json")
        assert answer.status_code == 409
        assert answer.json()["error"]["code"] == "scheduled_beyond_timeout"
    assert ok(api.get("/api/queues/short/items"))["items"] == []
    post(api, queue="short", payload=1, delaySeconds=59)


@pytest.mark.parametrize(
    "payload", [None, 0, -1.5, "", "é€😀", [], {}, [{"a": {"b": [True]}}], 10**30]
)
def test_any_json_payload_round_trips(api, q, payload):
    item = post(api, payload=payload)
    assert item["payload"] == payload
    assert get(api, item["id"])["payload"] == payload
    assert claim_one(api)["payload"] == payload


def test_scheduled_at_with_an_offset_is_answered_in_utc_with_z(api, q):
    at = (now() + timedelta(minutes=10)).replace(microsecond=123456)
    local = at.astimezone(datetime.now().astimezone().tzinfo).isoformat()
    plus_two = at.astimezone(timezone(timedelta(hours=2))).isoformat()
    for sent in (local, plus_two, wire(at)):
        item = post(api, scheduledAt=sent)
        assert item["scheduledAt"].endswith("Z")
        assert parse_time(item["scheduledAt"]) == at


def test_a_scheduled_item_is_not_claimable_before_its_time(api, q):
    item = post(api, delaySeconds=30)
    assert parse_time(item["scheduledAt"]) - parse_time(item["postedAt"]) == timedelta(seconds=30)
    assert claim(api) == []
    soon = post(api)
    assert [c["id"] for c in claim(api, max=10)] == [soon["id"]]


def test_batch_post_answers_201_with_all_items_in_list_order(api, q):
    body = {
        "items": [
            {"payload": "a"},
            {"payload": "b", "threadId": "t"},
            {"payload": "c", "key": "kc", "delaySeconds": 5},
        ]
    }
    answer = ok(api.post("/api/queues/q/items", body, format="json"), 201)
    assert set(answer) == {"items"}
    items = answer["items"]
    assert [i["payload"] for i in items] == ["a", "b", "c"]
    for item in items:
        assert_wire_item(item)
        assert item["status"] == "pending"
    ids = [i["id"] for i in items]
    assert ids == sorted(ids)
    assert len(set(ids)) == 3
    assert items[1]["threadId"] == "t"
    assert items[2]["key"] == "kc"
    assert Item.objects.filter(queue__name="q").count() == 3


def test_a_batch_of_1000_items_is_accepted(api, q):
    body = {"items": [{"payload": n} for n in range(1000)]}
    items = ok(api.post("/api/queues/q/items", body, format="json"), 201)["items"]
    assert [i["payload"] for i in items] == list(range(1000))
    assert ok(api.get("/api/queues/q"))["counts"]["pending"] == 1000


def test_later_posts_sort_after_earlier_ones(api, q):
    ids = [post(api, payload=n)["id"] for n in range(20)]
    assert ids == sorted(ids)


def test_post_with_an_existing_key_answers_200_with_the_same_item(api, q):
    first = post(api, payload="first", key="order-1")
    again = post(api, status=200, payload="second", key="order-1")
    assert again == first
    assert Item.objects.filter(queue__name="q").count() == 1
    assert get(api, first["id"])["payload"] == "first"


def test_key_dedup_holds_in_every_state_until_the_item_is_deleted(api, q):
    first = post(api, payload=1, key="k")
    claim_one(api)
    assert post(api, status=200, payload=2, key="k")["id"] == first["id"]
    finish(api, first["id"], "done")
    again = post(api, status=200, payload=3, key="k")
    assert again["id"] == first["id"]
    assert again["status"] == "finished"
    assert again["payload"] == 1
    assert api.delete(f"/api/items/{first['id']}").status_code == 204
    fresh = post(api, payload=4, key="k")
    assert fresh["id"] != first["id"]
    assert fresh["payload"] == 4


def test_key_dedup_in_a_batch_returns_the_existing_item_in_its_place(api, q):
    first = post(api, payload="old", key="k")
    body = {
        "items": [
            {"payload": "new1"},
            {"payload": "dup", "key": "k"},
            {"payload": "new2", "key": "k2"},
            {"payload": "dup2", "key": "k2"},
        ]
    }
    items = ok(api.post("/api/queues/q/items", body, format="json"), 201)["items"]
    assert items[1]["id"] == first["id"]
    assert items[1]["payload"] == "old"
    assert items[2]["id"] == items[3]["id"]
    assert items[3]["payload"] == "new2"
    assert Item.objects.filter(queue__name="q").count() == 3


def test_a_key_is_scoped_to_its_queue(api, q, make_queue):
    make_queue("other")
    first = post(api, payload=1, key="k")
    second = post(api, "other", payload=2, key="k")
    assert second["id"] != first["id"]
    assert second["queue"] == "other"


def test_payload_of_exactly_the_limit_is_accepted(api, q, settings):
    settings.TASKHOSTER = {**settings.TASKHOSTER, "MAX_PAYLOAD_BYTES": 12}
    item = post(api, payload="x" * 10)  # '"xxxxxxxxxx"' is 12 bytes of JSON
    assert item["payload"] == "x" * 10
    assert api.post("/api/queues/q/items", {"payload": "x" * 11}, format="json").status_code == 413


# -- listing -----------------------------------------------------------------------------------


def test_listing_pages_items_without_payload_or_result(api, q):
    a = post(api, payload="a", threadId="t")
    b = post(api, payload="b")
    claim_one(api)
    finish(api, a["id"], "secret result")
    page = listing(api)
    assert set(page) == {"items", "next"}
    assert page["next"] is None
    assert [i["id"] for i in page["items"]] == [a["id"], b["id"]]
    for item in page["items"]:
        assert_wire_item(item, LISTED_FIELDS)
        assert "payload" not in item
        assert "result" not in item
    assert page["items"][0]["status"] == "finished"
    assert page["items"][0]["finishedAt"].endswith("Z")


def test_listing_filters_by_status(api, q):
    ids = [post(api, payload=n)["id"] for n in range(6)]
    c1, c2, c3 = claim(api, max=3)
    finish(api, c1["id"])
    kill(api, c2["id"], c2["lease"])
    expected = {
        "pending": ids[3:],
        "processing": [c3["id"]],
        "finished": [c1["id"]],
        "failed": [c2["id"]],
    }
    for status, wanted in expected.items():
        page = listing(api, query=f"?status={status}")
        assert [i["id"] for i in page["items"]] == wanted, status
        assert {i["status"] for i in page["items"]} <= {status}


def test_listing_filters_by_thread_id_and_by_both(api, q):
    t1 = [post(api, payload=n, threadId="t1")["id"] for n in range(3)]
    t2 = [post(api, payload=n, threadId="t/2 two")["id"] for n in range(2)]
    post(api, payload="loose")
    assert [i["id"] for i in listing(api, query="?threadId=t1")["items"]] == t1
    assert [i["id"] for i in listing(api, query="?threadId=t%2F2%20two")["items"]] == t2
    assert listing(api, query="?threadId=none")["items"] == []
    head = claim_one(api)
    assert head["id"] == t1[0]
    page = listing(api, query="?threadId=t1&status=pending")
    assert [i["id"] for i in page["items"]] == t1[1:]


def test_cursor_pagination_visits_every_item_once_in_arrival_order(api, q):
    ids = [post(api, payload=n)["id"] for n in range(7)]
    body = {"items": [{"payload": n} for n in range(16)]}
    ids += [i["id"] for i in ok(api.post("/api/queues/q/items", body, format="json"), 201)["items"]]
    pages = walk(api, "q", "", 5)
    assert [len(p) for p in pages] == [5, 5, 5, 5, 3]
    seen = [i for p in pages for i in p]
    assert seen == ids
    assert len(set(seen)) == len(ids)


def test_cursor_pagination_ends_without_an_empty_page_on_an_exact_multiple(api, q):
    ids = [post(api, payload=n)["id"] for n in range(10)]
    pages = walk(api, "q", "", 5)
    assert pages == [ids[:5], ids[5:]]


def test_cursor_pagination_with_a_status_filter_has_no_gaps_or_duplicates(api, q):
    ids = [post(api, payload=n)["id"] for n in range(12)]
    claimed = {c["id"] for c in claim(api, max=5)}
    pending = [i for i in ids if i not in claimed]
    pages = walk(api, "q", "status=pending", 2)
    assert [i for p in pages for i in p] == pending
    assert [i for p in walk(api, "q", "status=processing", 2) for i in p] == sorted(claimed)


def test_cursor_pagination_sees_items_posted_while_it_walks(api, q):
    ids = [post(api, payload=n)["id"] for n in range(4)]
    first = listing(api, query="?limit=3")
    assert [i["id"] for i in first["items"]] == ids[:3]
    ids.append(post(api, payload="late")["id"])
    second = listing(api, query=f"?limit=3&cursor={first['next']}")
    assert [i["id"] for i in second["items"]] == ids[3:]
    assert second["next"] is None


def test_listing_is_limited_to_its_queue(api, q, make_queue):
    make_queue("other")
    mine = post(api, payload=1)
    post(api, "other", payload=2)
    assert [i["id"] for i in listing(api)["items"]] == [mine["id"]]


# -- reading and long-polling ------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_get_item_wait_answers_as_soon_as_the_item_finishes(api, q):
    item = post(api, payload="job")
    claim_one(api)
    worker = client_like(api)
    thread, out = in_background(
        lambda: worker.post(
            f"/api/items/{item['id']}/result", {"result": {"answer": 42}}, format="json"
        ),
        0.3,
    )
    started = time.monotonic()
    read = get(api, item["id"], "?wait=10")
    elapsed = time.monotonic() - started
    thread.join(10)
    assert len(out) == 1
    assert not isinstance(out[0], BaseException), out
    assert out[0].status_code == 200
    assert read["status"] == "finished"
    assert read["result"] == {"answer": 42}
    assert 0.25 <= elapsed < 5, elapsed


@pytest.mark.django_db(transaction=True)
def test_get_item_wait_answers_as_soon_as_the_item_fails(api, q):
    item = post(api, payload="job")
    held = claim_one(api)
    worker = client_like(api)
    thread, out = in_background(
        lambda: worker.post(
            f"/api/items/{item['id']}/fail",
            {"lease": held["lease"], "error": "bad", "retry": False},
            format="json",
        ),
        0.3,
    )
    started = time.monotonic()
    read = get(api, item["id"], "?wait=10")
    elapsed = time.monotonic() - started
    thread.join(10)
    assert len(out) == 1
    assert not isinstance(out[0], BaseException), out
    assert out[0].json() == {"accepted": True, "status": "failed"}
    assert read["status"] == "failed"
    assert read["error"] == "bad"
    assert 0.25 <= elapsed < 5, elapsed


def test_get_item_wait_answers_at_the_end_of_the_wait_when_not_terminal(api, q):
    item = post(api, payload="job")
    started = time.monotonic()
    read = get(api, item["id"], "?wait=0.6")
    elapsed = time.monotonic() - started
    assert read["status"] == "pending"
    assert 0.55 <= elapsed < 5, elapsed


def test_get_item_wait_on_a_terminal_item_answers_at_once(api, q):
    item = post(api, payload="job")
    finish(api, item["id"], "r")
    started = time.monotonic()
    read = get(api, item["id"], "?wait=30")
    assert time.monotonic() - started < 5
    assert read["status"] == "finished"
    assert read["result"] == "r"


@pytest.mark.django_db(transaction=True)
def test_claim_wait_answers_as_soon_as_an_item_is_posted(api, q):
    producer = client_like(api)
    thread, out = in_background(
        lambda: producer.post("/api/queues/q/items", {"payload": "fresh"}, format="json"), 0.3
    )
    started = time.monotonic()
    items = claim(api, wait=10, max=5)
    elapsed = time.monotonic() - started
    thread.join(10)
    assert len(out) == 1
    assert not isinstance(out[0], BaseException), out
    assert [i["id"] for i in items] == [out[0].json()["id"]]
    assert items[0]["payload"] == "fresh"
    assert 0.25 <= elapsed < 5, elapsed


def test_claim_wait_answers_as_soon_as_a_scheduled_item_comes_due(api, q):
    # Measured against the item's own scheduledAt, not from the post's answer: a slow post
    # (the first group measures how to flush) spends part of the delay before the claim starts.
    item = post(api, delaySeconds=0.5)
    due = parse_time(item["scheduledAt"])
    assert due - parse_time(item["postedAt"]) == timedelta(seconds=0.5)
    items = claim(api, wait=10)
    answered = now()
    assert [i["id"] for i in items] == [item["id"]]
    assert due <= answered < due + timedelta(seconds=5), (due, answered)


def test_claim_wait_answers_empty_at_the_end_of_the_wait(api, q):
    post(api, delaySeconds=120)
    started = time.monotonic()
    assert claim(api, wait=0.6) == []
    elapsed = time.monotonic() - started
    assert 0.55 <= elapsed < 5, elapsed


# -- claiming and verdicts ---------------------------------------------------------------------


def test_claim_hands_out_the_earliest_items_with_a_lease(api, q):
    ids = [post(api, payload=n)["id"] for n in range(3)]
    before = now()
    items = claim(api, max=2)
    assert [i["id"] for i in items] == ids[:2]
    for n, item in enumerate(items):
        assert_wire_item(item, ITEM_FIELDS | {"lease"})
        assert set(item) == ITEM_FIELDS | {"lease"}
        assert item["status"] == "processing"
        assert item["attempts"] == 1
        assert item["payload"] == n
        assert isinstance(item["lease"], str)
        assert item["lease"]
        expires = parse_time(item["leaseExpiresAt"])
        assert before + timedelta(seconds=59) <= expires <= now() + timedelta(seconds=61)
    assert items[0]["lease"] != items[1]["lease"]
    read = get(api, ids[0])
    assert read["status"] == "processing"
    assert "lease" not in read
    assert get(api, ids[2])["status"] == "pending"


def test_claim_without_a_body_claims_one(api, q):
    ids = [post(api, payload=n)["id"] for n in range(2)]
    response = api.post("/api/queues/q/claim")
    assert [i["id"] for i in ok(response)["items"]] == ids[:1]


def test_claim_on_an_empty_queue_answers_an_empty_list(api, q):
    assert ok(api.post("/api/queues/q/claim", {"max": 100}, format="json")) == {"items": []}


def test_result_finishes_the_item_and_only_the_first_result_is_accepted(api, q):
    item = post(api, payload="job")
    claim_one(api)
    finish(api, item["id"], {"v": 1})
    second = ok(api.post(f"/api/items/{item['id']}/result", {"result": {"v": 2}}, format="json"))
    assert second == {"accepted": False, "status": "finished"}
    read = get(api, item["id"])
    assert read["status"] == "finished"
    assert read["result"] == {"v": 1}
    assert read["leaseExpiresAt"] is None
    assert read["error"] is None
    assert parse_time(read["finishedAt"]) <= now()


def test_result_is_accepted_for_a_pending_item_without_a_claim(api, q):
    item = post(api, payload="job")
    finish(api, item["id"], None)
    read = get(api, item["id"])
    assert read["status"] == "finished"
    assert read["result"] is None


def test_fail_with_retry_puts_the_item_back_with_backoff(api, make_queue):
    make_queue("q", backoffSeconds=10)
    item = post(api, payload="job")
    held = claim_one(api)
    answer = ok(
        api.post(
            f"/api/items/{item['id']}/fail", {"lease": held["lease"], "error": "x"}, format="json"
        )
    )
    assert answer == {"accepted": True, "status": "pending"}
    read = get(api, item["id"])
    assert read["status"] == "pending"
    assert read["attempts"] == 1
    assert read["leaseExpiresAt"] is None
    delay = parse_time(read["scheduledAt"]) - now()
    assert timedelta(seconds=8) < delay <= timedelta(seconds=10)
    assert claim(api) == []


def test_fail_without_retry_marks_the_item_failed_with_its_error(api, q):
    item = post(api, payload="job")
    held = claim_one(api)
    assert kill(api, item["id"], held["lease"], "it broke") == {
        "accepted": True,
        "status": "failed",
    }
    read = get(api, item["id"])
    assert read["status"] == "failed"
    assert read["error"] == "it broke"
    assert read["result"] is None
    assert read["finishedAt"].endswith("Z")
    assert "deadLetter" not in read


def test_fail_with_a_stale_lease_is_not_accepted(api, q):
    item = post(api, payload="job")
    held = claim_one(api)
    answer = ok(
        api.post(
            f"/api/items/{item['id']}/fail",
            {"lease": "not-the-lease", "retry": False},
            format="json",
        )
    )
    assert answer == {"accepted": False, "status": "processing"}
    read = get(api, item["id"])
    assert read["status"] == "processing"
    assert read["leaseExpiresAt"] == held["leaseExpiresAt"]


def test_a_death_is_copied_to_the_dead_letter_queue_with_its_origin(api, make_queue):
    make_queue("dlq")
    make_queue("q", deadLetterQueue="dlq")
    item = post(api, payload={"job": 1})
    held = claim_one(api)
    kill(api, item["id"], held["lease"], "fatal")
    dead = get(api, item["id"])
    assert_wire_item(dead)
    assert set(dead) == ITEM_FIELDS | {"deadLetter"}
    copy = get(api, dead["deadLetter"])
    assert_wire_item(copy)
    assert set(copy) == ITEM_FIELDS | {"origin"}
    assert copy["queue"] == "dlq"
    assert copy["status"] == "pending"
    assert copy["payload"] == {"job": 1}
    assert copy["origin"] == {"queue": "q", "id": item["id"], "error": "fatal", "attempts": 1}


def test_extend_pushes_the_lease_out_for_its_holder(api, q):
    item = post(api, payload="job")
    held = claim_one(api)
    time.sleep(0.01)
    answer = ok(
        api.post(f"/api/items/{item['id']}/extend", {"lease": held["lease"]}, format="json")
    )
    assert set(answer) == {"accepted", "leaseExpiresAt"}
    assert answer["accepted"] is True
    assert parse_time(answer["leaseExpiresAt"]) > parse_time(held["leaseExpiresAt"])
    assert get(api, item["id"])["leaseExpiresAt"] == answer["leaseExpiresAt"]
    short = ok(
        api.post(
            f"/api/items/{item['id']}/extend", {"lease": held["lease"], "seconds": 5}, format="json"
        )
    )
    assert short["accepted"] is True
    assert parse_time(short["leaseExpiresAt"]) <= now() + timedelta(seconds=5)


def test_extend_is_capped_at_the_queue_lease_seconds(api, q):
    item = post(api, payload="job")
    held = claim_one(api)
    answer = ok(
        api.post(
            f"/api/items/{item['id']}/extend",
            {"lease": held["lease"], "seconds": 3600},
            format="json",
        )
    )
    assert answer["accepted"] is True
    assert parse_time(answer["leaseExpiresAt"]) <= now() + timedelta(seconds=60)


def test_extend_with_a_stale_lease_is_not_accepted(api, q):
    item = post(api, payload="job")
    held = claim_one(api)
    answer = ok(api.post(f"/api/items/{item['id']}/extend", {"lease": "stale"}, format="json"))
    assert answer["accepted"] is False
    assert get(api, item["id"])["leaseExpiresAt"] == held["leaseExpiresAt"]


# -- deleting and restarting -------------------------------------------------------------------


def test_delete_item_answers_204_then_404_and_removes_its_file(api, q, state_root):
    item = post(api, payload="job")
    assert list(state_root.rglob(f"{item['id']}.json"))
    response = api.delete(f"/api/items/{item['id']}")
    assert response.status_code == 204
    assert not response.content
    assert api.get(f"/api/items/{item['id']}").status_code == 404
    assert api.delete(f"/api/items/{item['id']}").status_code == 404
    assert not list(state_root.rglob(f"{item['id']}*"))
    assert ok(api.get("/api/queues/q"))["counts"] == NO_COUNTS


def test_deleting_a_processing_item_frees_its_thread_at_once(api, q):
    first = post(api, payload=1, threadId="t")
    second = post(api, payload=2, threadId="t")
    assert claim_one(api)["id"] == first["id"]
    assert claim(api) == []
    assert api.delete(f"/api/items/{first['id']}").status_code == 204
    assert claim_one(api)["id"] == second["id"]


def test_a_late_result_for_a_deleted_item_is_not_accepted_and_does_not_revive_it(api, q):
    item = post(api, payload=1)
    claim_one(api)
    assert api.delete(f"/api/items/{item['id']}").status_code == 204
    late = api.post(f"/api/items/{item['id']}/result", {"result": 1}, format="json")
    assert ok(late) == {"accepted": False, "status": None}
    assert api.get(f"/api/items/{item['id']}").status_code == 404
    assert not Item.objects.filter(id=item["id"]).exists()


def test_bulk_delete_by_ids_deletes_exactly_those_of_its_queue(api, q, make_queue, state_root):
    make_queue("other")
    ids = [post(api, payload=n)["id"] for n in range(4)]
    foreign = post(api, "other", payload="x")["id"]
    claim_one(api)
    body = {"ids": [ids[0], ids[2], foreign, "0000000000000000000000"]}
    assert ok(api.post("/api/queues/q/items/delete", body, format="json")) == {"deleted": 2}
    assert [i["id"] for i in listing(api)["items"]] == [ids[1], ids[3]]
    assert get(api, foreign)["payload"] == "x"
    for gone in (ids[0], ids[2]):
        assert not list(state_root.rglob(f"{gone}.json"))


@pytest.mark.parametrize("status", ["pending", "processing", "finished", "failed"])
def test_bulk_delete_by_status_deletes_only_that_status(api, q, status):
    ids = [post(api, payload=n)["id"] for n in range(5)]
    c1, c2, _c3 = claim(api, max=3)
    finish(api, c1["id"])
    kill(api, c2["id"], c2["lease"])
    counts = {"pending": 2, "processing": 1, "finished": 1, "failed": 1}
    answer = ok(api.post("/api/queues/q/items/delete", {"status": status}, format="json"))
    assert answer == {"deleted": counts[status]}
    assert ok(api.get("/api/queues/q"))["counts"] == {**counts, status: 0}
    assert len(ids) - counts[status] == Item.objects.filter(queue__name="q").count()


@pytest.mark.parametrize("state", ["pending", "processing", "finished"])
def test_restart_answers_409_unless_the_item_failed(api, q, state):
    item = post(api, payload="job")
    if state != "pending":
        claim_one(api)
    if state == "finished":
        finish(api, item["id"])
    response = api.post(f"/api/items/{item['id']}/restart")
    assert response.status_code == 409, response.content
    assert set(response.json()["error"]) == {"code", "message"}
    assert get(api, item["id"])["status"] == state


def test_restart_makes_a_failed_item_a_brand_new_pending_arrival(api, q):
    item = post(api, payload={"job": 1}, threadId="t")
    held = claim_one(api)
    kill(api, item["id"], held["lease"], "broke")
    failed = get(api, item["id"])
    time.sleep(0.01)
    restarted = ok(api.post(f"/api/items/{item['id']}/restart"))
    assert_wire_item(restarted)
    assert restarted["id"] == item["id"]
    assert restarted["status"] == "pending"
    assert restarted["attempts"] == 0
    assert restarted["error"] is None
    assert restarted["result"] is None
    assert restarted["finishedAt"] is None
    assert restarted["payload"] == {"job": 1}
    assert restarted["threadId"] == "t"
    assert parse_time(restarted["postedAt"]) > parse_time(failed["postedAt"])
    assert restarted["scheduledAt"] == restarted["postedAt"]
    again = claim_one(api)
    assert again["id"] == item["id"]
    assert again["attempts"] == 1


# -- schema, health, metrics -------------------------------------------------------------------

SPEC_OPERATIONS = {
    "/api/queues": {"get"},
    "/api/queues/{queue}": {"put", "get", "delete"},
    "/api/queues/{queue}/items": {"post", "get"},
    "/api/queues/{queue}/items/delete": {"post"},
    "/api/queues/{queue}/claim": {"post"},
    "/api/items/{item_id}": {"get", "delete"},
    "/api/items/{item_id}/restart": {"post"},
    "/api/items/{item_id}/result": {"post"},
    "/api/items/{item_id}/fail": {"post"},
    "/api/items/{item_id}/extend": {"post"},
}


@pytest.mark.django_db
def test_schema_is_openapi_3_and_lists_every_api_path_and_method(client):
    response = client.get("/api/schema")
    assert response.status_code == 200, response.content[:2000]
    schema = yaml.safe_load(response.content)
    assert str(schema["openapi"]).startswith("3.")
    paths = schema["paths"]
    for path, methods in SPEC_OPERATIONS.items():
        assert path in paths, path
        assert methods <= set(paths[path]), (path, set(paths[path]))
    as_json = client.get("/api/schema", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert as_json.status_code == 200
    assert json.loads(as_json.content)["paths"].keys() == paths.keys()


@pytest.mark.django_db
def test_schema_names_the_item_wire_fields_and_the_claim_body(client):
    schema = yaml.safe_load(client.get("/api/schema").content)
    components = schema["components"]["schemas"]
    item = next(v for k, v in components.items() if k == "Item")
    assert set(item["properties"]) >= ITEM_FIELDS
    claim_op = schema["paths"]["/api/queues/{queue}/claim"]["post"]
    body_ref = claim_op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    claim_body = components[body_ref.rsplit("/", 1)[-1]]
    assert set(claim_body["properties"]) == {"max", "wait"}


@pytest.mark.django_db
def test_schema_documents_the_token_header_on_every_api_operation(client):
    schema = yaml.safe_load(client.get("/api/schema").content)
    schemes = schema["components"]["securitySchemes"]
    assert {"type": "apiKey", "in": "header", "name": "Authorization"}.items() <= next(
        iter(schemes.values())
    ).items()
    name = next(iter(schemes))
    for path, methods in SPEC_OPERATIONS.items():
        for method in methods:
            assert {name: []} in schema["paths"][path][method]["security"], (path, method)


@pytest.mark.django_db
def test_schema_offers_one_item_or_a_batch_as_the_post_body(client):
    schema = yaml.safe_load(client.get("/api/schema").content)
    components = schema["components"]["schemas"]
    op = schema["paths"]["/api/queues/{queue}/items"]["post"]
    ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    choices = components[ref.rsplit("/", 1)[-1]]["oneOf"]
    bodies = [components[c["$ref"].rsplit("/", 1)[-1]] for c in choices]
    assert sorted(sorted(b["properties"]) for b in bodies) == [
        ["delaySeconds", "key", "payload", "priority", "scheduledAt", "threadId"],
        ["items"],
    ]


@pytest.mark.django_db
def test_healthz_answers_200_without_a_key_and_names_nothing_else(client, state_root):
    """A load balancer needs no key; what the process uses (its database, paths, pid) is
    for callers with one."""
    state_root.mkdir()  # as a server's start does
    response = client.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {
        "status": "ok",
        "database": {"reachable": True},
        "bus": {"reachable": True},
        "stateRoot": {"reachable": True},
        "committer": {"ready": True},
    }
    assert str(state_root) not in response.content.decode()
    bogus = client.get("/healthz", HTTP_AUTHORIZATION="Token th_made-up")
    assert bogus.json() == response.json(), "a made-up key sees no more"


def test_healthz_names_what_this_process_uses_to_a_key(api, state_root):
    state_root.mkdir()  # as a server's start does
    response = api.get("/healthz")
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "ok"
    assert body["database"]["vendor"] == connection.vendor
    assert body["database"]["reachable"] is True
    root = body["stateRoot"]
    assert {k: root[k] for k in ("path", "reachable")} == {
        "path": str(state_root.resolve()),
        "reachable": True,
    }
    assert root["freeBytes"] > 0
    assert root["freeInodes"] > 0
    assert body["bus"]["reachable"] is True
    assert body["bus"]["kind"] == ("redis" if get_conf().redis_url else "doorbell")
    assert body["pid"] == os.getpid()


@pytest.mark.django_db
def test_healthz_answers_503_naming_a_missing_state_root(api, settings, tmp_path):
    settings.TASKHOSTER = {**settings.TASKHOSTER, "ROOT": str(tmp_path / "nowhere")}
    response = api.get("/healthz")
    assert response.status_code == 503
    body = response.json()
    assert body["status"] == "unavailable"
    assert body["stateRoot"]["path"] == str(tmp_path / "nowhere")
    assert body["stateRoot"]["reachable"] is False
    assert "missing" in body["stateRoot"]["error"]
    assert body["database"]["reachable"] is True


@pytest.mark.django_db
def test_healthz_answers_503_when_redis_does_not_answer_and_hides_its_password(
    api, settings, state_root
):
    state_root.mkdir()
    url = "redis://user:secret@127.0.0.1:9/0"  # the discard port: nothing listens
    settings.TASKHOSTER = {**settings.TASKHOSTER, "REDIS_URL": url}
    response = api.get("/healthz")
    assert response.status_code == 503
    bus = response.json()["bus"]
    assert bus["kind"] == "redis"
    assert bus["reachable"] is False
    assert bus["url"] == "redis://user:***@127.0.0.1:9/0"
    assert "secret" not in response.content.decode()


def _metric(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(f"{name}{{{want}}} "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.django_db(transaction=True)
def test_metrics_count_items_per_queue_and_status_and_claims_and_results(api, make_queue):
    name = f"m-{uuid.uuid4().hex[:8]}"
    make_queue(name)
    for n in range(4):
        post(api, name, payload=n)
    c1, c2, _c3 = claim(api, name, max=3)
    finish(api, c1["id"])
    kill(api, c2["id"], c2["lease"])
    response = api.get("/metrics")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain")
    text = response.content.decode()
    for status, n in {"pending": 1, "processing": 1, "finished": 1, "failed": 1}.items():
        assert _metric(text, "taskhoster_items", queue=name, status=status) == n, status
    assert _metric(text, "taskhoster_claims_total", queue=name) == 3
    assert _metric(text, "taskhoster_results_total", queue=name) == 1
    assert f'taskhoster_post_to_claim_seconds_count{{queue="{name}"}} 3' in text
    claim_one(api, name)
    text = api.get("/metrics").content.decode()
    assert _metric(text, "taskhoster_claims_total", queue=name) == 4
    assert _metric(text, "taskhoster_items", queue=name, status="pending") == 0
    assert _metric(text, "taskhoster_items", queue=name, status="processing") == 2


@pytest.mark.django_db(transaction=True)
def test_metrics_need_a_key_and_show_a_limited_key_only_its_live_queues(
    api, make_queue, make_key, client, settings
):
    make_queue("mine")
    make_queue("theirs")
    make_queue("gone")
    post(api, "mine", payload=1)
    post(api, "gone", payload=1)
    api.delete("/api/queues/gone")
    answer = client.get("/metrics")
    assert answer.status_code == 401
    assert answer.json()["error"]["code"] == "unauthorized"
    limited = APIClient()
    limited.credentials(HTTP_AUTHORIZATION=f"Token {make_key('produce', queues=['mine'])}")
    text = limited.get("/metrics").content.decode()
    assert 'queue="mine"' in text
    assert 'queue="theirs"' not in text
    everything = api.get("/metrics").content.decode()
    assert 'queue="theirs"' in everything
    assert 'queue="gone"' not in everything, "a deleted queue's name is not shown"
    settings.TASKHOSTER = {**settings.TASKHOSTER, "METRICS_PUBLIC": True}
    assert client.get("/metrics").status_code == 200


@pytest.mark.django_db(transaction=True)
def test_metrics_show_a_paused_queue_as_paused_to_the_keys_that_see_it(api, make_queue, make_key):
    make_queue("stopped", paused=True)
    make_queue("running")
    post(api, "stopped", payload=1)
    text = api.get("/metrics").content.decode()
    assert "# TYPE taskhoster_queue_paused gauge" in text
    assert 'taskhoster_queue_paused{queue="stopped"} 1' in text
    assert 'taskhoster_queue_paused{queue="running"} 0' in text
    limited = APIClient()
    limited.credentials(HTTP_AUTHORIZATION=f"Token {make_key('produce', queues=['running'])}")
    text = limited.get("/metrics").content.decode()
    assert 'taskhoster_queue_paused{queue="running"} 0' in text
    assert 'queue="stopped"' not in text
    ok(api.put("/api/queues/stopped", {"paused": False}, format="json"))
    text = api.get("/metrics").content.decode()
    assert 'taskhoster_queue_paused{queue="stopped"} 0' in text


@pytest.mark.django_db(transaction=True)
def test_metrics_count_a_paused_queues_due_item_as_held_by_the_pause(api, make_queue):
    from taskhoster import metrics

    make_queue("stopped", paused=True)
    make_queue("running")
    post(api, "stopped", payload=1)
    post(api, "stopped", payload=2, delaySeconds=3600)  # not due: not held
    post(api, "running", payload=3)
    text = api.get("/metrics").content.decode()
    assert "# TYPE taskhoster_queue_held_items gauge" in text
    held = {
        control: _metric(text, "taskhoster_queue_held_items", queue="stopped", control=control)
        for control in ("paused", "maxProcessing", "rateLimit", "thread")
    }
    assert held == {"paused": 1, "maxProcessing": 0, "rateLimit": 0, "thread": 0}
    assert 'taskhoster_queue_held_items{queue="running",control="paused"} 0' in text
    assert 'taskhoster_queue_paused{queue="stopped"} 1' in text
    hidden = metrics.render(lambda name: name == "running", held=engine.held_by_queue)
    assert 'queue="stopped"' not in hidden
    assert "taskhoster_queue_held_items" not in metrics.render(), "no source, no made-up zeros"


def test_state_root_holds_one_directory_per_state(api, q, state_root: Path):
    item = post(api, payload="job")
    assert (state_root / "q" / "pending" / f"{item['id']}.json").is_file()
    claim_one(api)
    assert (state_root / "q" / "processing" / f"{item['id']}.json").is_file()
    finish(api, item["id"])
    assert (state_root / "q" / "done" / f"{item['id']}.json").is_file()
    assert not (state_root / "q" / "pending" / f"{item['id']}.json").exists()


def test_a_threads_members_page_by_cursor_and_a_foreign_cursor_is_refused_first(api, q):
    """``GET /api/queues/{q}/threads/{t}``: members in head order, a page at a time; a cursor
    that names no member of the thread is ``invalid_cursor``, judged before the limit."""
    members = [post(api, payload=n, threadId="t")["id"] for n in range(5)]
    other = post(api, payload="x", threadId="u")["id"]
    seen: list[str] = []
    cursor = ""
    while True:
        page = ok(api.get(f"/api/queues/q/threads/t?limit=2{cursor}"), 200)
        seen += [m["id"] for m in page["members"]]
        if page["next"] is None:
            break
        cursor = f"&cursor={page['next']}"
    assert seen == members
    response = api.get(f"/api/queues/q/threads/t?limit=2&cursor={_cursor_of(api, other)}")
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_cursor"
    response = api.get(f"/api/queues/q/threads/t?limit=0&cursor={_cursor_of(api, other)}")
    assert response.json()["error"]["code"] == "invalid_cursor"


def _cursor_of(api: Any, item_id: str) -> str:
    """The cursor a page ending at ``item_id`` would give (an opaque string to a client)."""
    from taskhoster.api.cursors import encode_cursor

    return str(encode_cursor(item_id))
