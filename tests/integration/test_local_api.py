"""``taskhoster.local``: posting, reading and waiting from code in the same Django project.

Real engine, real files, real database, real transactions (``transaction=True``: a test
wrapped in a transaction of its own could not show what a commit or a rollback does). The
REST API answers the same bodies in the same tests, so "the same validation and errors" is
checked, not assumed.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta, timezone
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
from asgiref.sync import sync_to_async
from django.contrib.auth.models import User
from django.db import connection, connections, transaction
from django.db.models.signals import post_save
from django.db.transaction import TransactionManagementError
from django.http import HttpRequest, JsonResponse
from django.test import Client
from django.urls import path
from rest_framework.test import APIClient

from taskhoster import engine, local
from taskhoster.errors import InvalidInput, QueueNotFound, TaskhosterError
from taskhoster.models import Item

TX = pytest.mark.django_db(transaction=True)


class Boom(Exception):
    """Raised to roll a block back."""


@contextmanager
def rolled_back(**atomic: Any) -> Iterator[None]:
    """A block of ``transaction.atomic`` that ends in a rollback."""
    try:
        with transaction.atomic(**atomic):
            yield
            raise Boom
    except Boom:
        pass


@pytest.fixture
def q(make_queue: Any) -> Any:
    return make_queue("q")


def files(root: Path, queue: str = "q") -> list[str]:
    """The item files of a queue, in every state."""
    return sorted(p.name for p in (root / queue).glob("*/*.json"))


def pending_file(root: Path, item_id: str, queue: str = "q") -> Path:
    return root / queue / "pending" / f"{item_id}.json"


def finish(item_id: str, result: Any, *, after: float = 0.0) -> threading.Thread:
    """A worker in another thread (its own connection): claim the item, hand in ``result``."""

    def work() -> None:
        try:
            time.sleep(after)
            claimed = engine.claim(queue_name="q", max_items=1)
            assert [c.row.id for c in claimed] == [item_id]
            engine.submit_result(item_id=item_id, result=result)
        finally:
            connections.close_all()

    thread = threading.Thread(target=work)
    thread.start()
    return thread


# -- posting now, or at the commit -----------------------------------------------------------


@TX
def test_a_post_outside_a_transaction_is_on_disk_when_it_returns(q, state_root):
    posting = local.post("q", {"to": "ada"}, thread_id="t1", key="k1")
    assert posting.posted
    assert not posting.deferred
    assert posting.created
    assert pending_file(state_root, posting.id).is_file()
    assert posting.item["payload"] == {"to": "ada"}
    assert posting.item["threadId"] == "t1"
    assert posting.item["key"] == "k1"
    assert posting.item["status"] == "pending"
    assert Item.objects.filter(id=posting.id).exists()


@TX
def test_a_post_inside_a_transaction_is_made_when_it_commits(q, state_root):
    with transaction.atomic():
        posting = local.post("q", {"n": 1})
        assert posting.deferred
        assert not posting.posted
        with pytest.raises(local.NotPosted):
            posting.id  # noqa: B018
        assert files(state_root) == []
        assert not Item.objects.exists()
    assert posting.posted
    assert pending_file(state_root, posting.id).is_file()
    assert Item.objects.get(id=posting.id).status == "pending"


@TX
def test_a_deferred_post_posts_the_payload_as_it_was_at_the_call(q):
    payload: dict[str, Any] = {"tags": ["a"]}
    with transaction.atomic():
        posting = local.post("q", payload)
        payload["tags"].append({"not": {"json"}})
    assert local.get(posting.id)["payload"] == {"tags": ["a"]}


@TX
def test_a_rollback_posts_nothing_and_leaves_no_file(q, state_root):
    with rolled_back():
        user = User.objects.create(username="ada")
        posting = local.post("q", {"user": user.pk})
        local.post_many("q", [1, 2])
    assert not posting.posted
    assert posting.error is None
    assert files(state_root) == []
    assert not Item.objects.exists()
    # Nothing is left for a repair to find either (an engine post made inside the transaction
    # would have left its flushed file behind, and repair would index it as an item).
    report = engine.repair(grace_seconds=0)
    assert not Item.objects.exists(), report


@TX
def test_a_rolled_back_savepoint_drops_its_own_posts_only(q, state_root):
    with transaction.atomic():
        before = local.post("q", "before")
        with rolled_back():
            dropped = local.post("q", "dropped")
        with transaction.atomic():
            inner = local.post("q", "inner")
        # A savepoint that commits is still inside the outer transaction: nothing yet.
        assert not inner.posted
        assert files(state_root) == []
        after = local.post("q", "after")
    assert [p.posted for p in (before, dropped, inner, after)] == [True, False, True, True]
    payloads = [local.get(p.id)["payload"] for p in (before, inner, after)]
    assert payloads == ["before", "inner", "after"]
    assert len(files(state_root)) == 3
    assert Item.objects.count() == 3


@TX
def test_a_worker_never_gets_an_item_before_the_rows_it_needs_are_committed(q):
    seen: list[tuple[str, bool]] = []
    stop = threading.Event()

    def worker() -> None:
        try:
            while not stop.is_set():
                for claimed in engine.claim(queue_name="q", max_items=1):
                    user_id = claimed.payload["user"]
                    seen.append((claimed.row.id, User.objects.filter(pk=user_id).exists()))
                time.sleep(0.01)
        finally:
            connections.close_all()

    thread = threading.Thread(target=worker)
    thread.start()
    try:
        with transaction.atomic():
            user = User.objects.create(username="grace")
            posting = local.post("q", {"user": user.pk})
            time.sleep(0.3)  # the worker keeps claiming meanwhile
            assert seen == []
        deadline = time.monotonic() + 10
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        stop.set()
        thread.join(10)
    assert seen == [(posting.id, True)]


@TX
def test_a_post_waits_for_the_commit_of_the_alias_it_names_and_of_taskhosters_own(q):
    # Only one database here, so ``using`` names it; the hook of each alias runs once, so a
    # post never waits forever (see test_captured_on_commit_callbacks_post_inside_a_test).
    with transaction.atomic(using="default"):
        posting = local.post("q", 1, using="default")
        assert not posting.posted
    assert posting.posted


@TX
def test_a_transaction_managed_by_hand_is_refused(q, state_root):
    transaction.set_autocommit(False)
    try:
        with pytest.raises(TransactionManagementError):
            local.post("q", 1)
    finally:
        transaction.rollback()
        transaction.set_autocommit(True)
    assert files(state_root) == []


def test_captured_on_commit_callbacks_post_inside_a_test(q, django_capture_on_commit_callbacks):
    """A test in a transaction of its own (``db``) never commits: a post waits for ever,
    unless the test runs the hooks, as Django's ``captureOnCommitCallbacks(execute=True)``
    does (the post then runs in the test's transaction)."""
    with django_capture_on_commit_callbacks(execute=True):
        posting = local.post("q", {"n": 1})
        assert not posting.posted
    assert posting.posted
    assert local.get(posting.id)["payload"] == {"n": 1}


# -- failures at the commit ------------------------------------------------------------------


@TX
def test_a_deferred_post_that_fails_at_the_commit_raises_after_the_commit(q, state_root):
    made: list[local.Posting] = []

    def block() -> None:
        with transaction.atomic():
            user = User.objects.create(username="linus")
            # Runs first at the commit: the queue is gone when the post is made.
            transaction.on_commit(lambda: engine.delete_queue(queue_name="q"))
            made.append(local.post("q", {"user": user.pk}, key="welcome-linus"))

    with pytest.raises(QueueNotFound):
        block()
    [posting] = made
    assert User.objects.filter(username="linus").exists()  # the transaction did commit
    assert isinstance(posting.error, QueueNotFound)
    with pytest.raises(QueueNotFound):
        posting.id  # noqa: B018
    assert not Item.objects.exists()


@TX
def test_a_robust_deferred_post_that_fails_is_logged_and_kept_on_the_posting(q, caplog):
    with transaction.atomic():
        transaction.on_commit(lambda: engine.delete_queue(queue_name="q"))
        posting = local.post("q", 1, key="welcome-1", robust=True)
    assert isinstance(posting.error, QueueNotFound)
    assert not posting.posted
    logged = [r for r in caplog.records if r.name == "taskhoster.local"]
    assert len(logged) == 1
    assert logged[0].levelname == "ERROR"
    assert "'q'" in logged[0].getMessage()
    assert "welcome-1" in logged[0].getMessage()


@TX
def test_robust_does_not_hide_the_error_of_a_post_made_at_once(q):
    with pytest.raises(QueueNotFound):
        local.post("gone", 1, robust=True)


# -- the same validation and errors as REST --------------------------------------------------

REST_CASES: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    # (name, local keyword arguments, REST body)
    ("payload over the limit", {"payload": "x" * 200}, {"payload": "x" * 200}),
    ("empty threadId", {"thread_id": ""}, {"threadId": ""}),
    ("unprintable threadId", {"thread_id": "a\nb"}, {"threadId": "a\nb"}),
    ("threadId not a string", {"thread_id": 7}, {"threadId": 7}),
    ("key too long", {"key": "k" * 201}, {"key": "k" * 201}),
    ("empty key", {"key": ""}, {"key": ""}),
    ("NUL in key", {"key": "a\x00b"}, {"key": "a\x00b"}),
    ("negative delay", {"delay": -1}, {"delaySeconds": -1}),
    ("delay over a year", {"delay": 367 * 86400}, {"delaySeconds": 367 * 86400}),
    ("delay not a number", {"delay": "soon"}, {"delaySeconds": "soon"}),
    ("delay a boolean", {"delay": True}, {"delaySeconds": True}),
    (
        "delay and scheduled_at",
        {"delay": 5, "scheduled_at": "2030-01-01T00:00:00Z"},
        {"delaySeconds": 5, "scheduledAt": "2030-01-01T00:00:00Z"},
    ),
    (
        "time without offset",
        {"scheduled_at": "2030-01-01T00:00:00"},
        {"scheduledAt": "2030-01-01T00:00:00"},
    ),
    ("not a time", {"scheduled_at": "tomorrow"}, {"scheduledAt": "tomorrow"}),
    ("beyond the queue timeout", {"delay": 2 * 86400}, {"delaySeconds": 2 * 86400}),
    (
        "scheduled beyond the queue timeout",
        {"scheduled_at": datetime.now(UTC) + timedelta(days=2)},
        {"scheduledAt": (datetime.now(UTC) + timedelta(days=2)).isoformat().replace("+00:00", "Z")},
    ),
    ("priority over 9", {"priority": 10}, {"priority": 10}),
    ("negative priority", {"priority": -1}, {"priority": -1}),
    ("priority not an integer", {"priority": 1.5}, {"priority": 1.5}),
    ("priority a string", {"priority": "high"}, {"priority": "high"}),
    ("priority a boolean", {"priority": True}, {"priority": True}),
    ("unknown queue", {"queue": "nope"}, {"queue": "nope"}),
    ("queue name not allowed", {"queue": "bad*name"}, {"queue": "bad*name"}),
]


def local_error(call: Callable[[], Any]) -> tuple[int, str, str]:
    with pytest.raises(TaskhosterError) as caught:
        call()
    return caught.value.http_status, caught.value.code, caught.value.message


def rest_error(api: APIClient, queue: str, body: Any) -> tuple[int, str, str]:
    answer = api.post(f"/api/queues/{queue}/items", body, format="json")
    error = answer.json()["error"]
    return answer.status_code, error["code"], error["message"]


@TX
@pytest.mark.parametrize("inside", [False, True], ids=["now", "in-a-transaction"])
@pytest.mark.parametrize(("name", "kwargs", "body"), REST_CASES, ids=[c[0] for c in REST_CASES])
def test_bad_input_raises_what_the_rest_api_answers_and_changes_nothing(
    api, q, settings, state_root, inside, name, kwargs, body
):
    settings.TASKHOSTER = {**settings.TASKHOSTER, "MAX_PAYLOAD_BYTES": 100}
    kwargs = dict(kwargs)
    queue = kwargs.pop("queue", "q")
    payload = kwargs.pop("payload", {"n": 1})
    body = {"payload": payload, **{k: v for k, v in body.items() if k != "queue"}}
    expected = rest_error(api, queue, body)
    assert 400 <= expected[0] < 500, expected

    def call() -> Any:
        return local.post(queue, payload, **kwargs)

    if inside:
        with transaction.atomic():
            got = local_error(call)
    else:
        got = local_error(call)
    assert got == expected
    assert not Item.objects.exists()
    assert files(state_root) == []


BATCH_CASES: list[tuple[str, list[Any], list[Any]]] = [
    ("over MAX_BATCH", [1, 2, 3, 4], [{"payload": n} for n in (1, 2, 3, 4)]),
    ("empty", [], []),
    (
        "one bad member",
        [1, local.NewItem(2, key="k" * 201)],
        [{"payload": 1}, {"payload": 2, "key": "k" * 201}],
    ),
    (
        "a member with delay and scheduled_at",
        [1, local.NewItem(2, delay=5, scheduled_at="2030-01-01T00:00:00Z")],
        [{"payload": 1}, {"payload": 2, "delaySeconds": 5, "scheduledAt": "2030-01-01T00:00:00Z"}],
    ),
    (
        "a member beyond the timeout",
        [1, local.NewItem(2, delay=timedelta(days=2))],
        [{"payload": 1}, {"payload": 2, "delaySeconds": 2 * 86400}],
    ),
    (
        "a member with priority over 9",
        [1, local.NewItem(2, priority=10)],
        [{"payload": 1}, {"payload": 2, "priority": 10}],
    ),
]


@TX
@pytest.mark.parametrize("inside", [False, True], ids=["now", "in-a-transaction"])
@pytest.mark.parametrize(("name", "items", "body"), BATCH_CASES, ids=[c[0] for c in BATCH_CASES])
def test_a_bad_batch_raises_what_the_rest_api_answers_and_posts_none(
    api, q, settings, state_root, inside, name, items, body
):
    settings.TASKHOSTER = {**settings.TASKHOSTER, "MAX_BATCH": 3}
    expected = rest_error(api, "q", {"items": body})
    if inside:
        with transaction.atomic():
            got = local_error(lambda: local.post_many("q", items))
    else:
        got = local_error(lambda: local.post_many("q", items))
    assert got == expected
    assert not Item.objects.exists()
    assert files(state_root) == []


def test_a_bad_member_of_a_batch_is_named_by_its_index(q):
    both = local.NewItem(2, delay=5, scheduled_at="2030-01-01T00:00:00Z")
    with pytest.raises(InvalidInput) as caught:
        local.post_many("q", [1, both])
    assert caught.value.message == "give items[1].scheduledAt or items[1].delaySeconds, not both"


class Opaque:
    pass


@pytest.mark.parametrize(
    ("payload", "where"),
    [
        ({1, 2}, "payload is a set"),
        ((1, 2), "payload is a tuple"),
        ({"a": [1, float("nan")]}, 'payload["a"][1] must be finite'),
        ({"a": {1: "x"}}, 'payload["a"] has the key 1'),
        ([Opaque()], "payload[0] is a Opaque"),
        ("\ud800", "payload holds a lone surrogate"),
        ({"when": datetime(2030, 1, 1, tzinfo=UTC)}, 'payload["when"] is a datetime'),
    ],
)
def test_a_payload_json_cannot_hold_is_refused_naming_where(q, payload, where):
    with pytest.raises(InvalidInput) as caught:
        local.post("q", payload)
    assert caught.value.code == "invalid"
    assert caught.value.message.startswith(where), caught.value.message


def test_a_payload_nested_too_deeply_is_refused(q):
    deep: list[Any] = []
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(InvalidInput, match="nested more than 100 levels"):
        local.post("q", deep)
    shallower: list[Any] = []
    for _ in range(150):  # deeper than MAX_JSON_DEPTH, yet within Python's own limits
        shallower = [shallower]
    with pytest.raises(InvalidInput, match="nested more than 100 levels") as caught:
        local.post("q", shallower)
    assert caught.value.code == "too_deep"


def test_a_naive_datetime_is_refused(q):
    with pytest.raises(InvalidInput, match="aware datetime"):
        local.post("q", 1, scheduled_at=datetime(2030, 1, 1))


@TX
def test_python_values_mean_what_their_wire_forms_mean(q):
    at = datetime(2020, 1, 1, 13, tzinfo=timezone(timedelta(hours=1)))  # in the past
    scheduled = local.post("q", 1, scheduled_at=at)
    assert scheduled.item["scheduledAt"] == "2020-01-01T12:00:00.000000Z"
    delayed = local.post("q", 2, delay=timedelta(seconds=30))
    posted_at = datetime.fromisoformat(delayed.item["postedAt"].replace("Z", "+00:00"))
    scheduled_at = datetime.fromisoformat(delayed.item["scheduledAt"].replace("Z", "+00:00"))
    assert scheduled_at - posted_at == timedelta(seconds=30)


# -- keys ------------------------------------------------------------------------------------


@TX
def test_a_repeated_key_answers_the_first_item(q, state_root):
    first = local.post("q", {"n": 1}, key="once")
    again = local.post("q", {"n": 2}, key="once")
    assert again.id == first.id
    assert (first.created, again.created) == (True, False)
    assert again.item["payload"] == {"n": 1}
    with transaction.atomic():
        deferred = local.post("q", {"n": 3}, key="once")
        twice = [local.post("q", {"n": 4}, key="fresh") for _ in range(2)]
    assert deferred.id == first.id
    assert not deferred.created
    assert twice[0].id == twice[1].id
    assert [p.created for p in twice] == [True, False]
    assert len(files(state_root)) == 2


@TX
def test_a_repeated_key_of_a_finished_item_answers_its_result_as_a_read_does(q):
    first = local.post("q", {"n": 1}, key="done-once")
    [claimed] = engine.claim(queue_name="q")
    assert claimed.row.id == first.id
    engine.submit_result(item_id=first.id, result={"sent": True})
    again = local.post("q", {"n": 2}, key="done-once")
    assert not again.created
    assert again.item["status"] == "finished"
    assert again.item["result"] == {"sent": True}
    assert again.item == local.get(first.id)


# -- batches ---------------------------------------------------------------------------------


@TX
def test_post_many_posts_all_in_order_now_or_at_the_commit(q, state_root):
    now = local.post_many("q", [{"n": 1}, local.NewItem({"n": 2}, thread_id="t", key="b2")])
    assert [p.item["payload"] for p in now] == [{"n": 1}, {"n": 2}]
    assert now[1].item["threadId"] == "t"
    assert now[0].id < now[1].id
    with transaction.atomic():
        later = local.post_many("q", ["a", "b"])
        assert not any(p.posted for p in later)
    assert [local.get(p.id)["payload"] for p in later] == ["a", "b"]
    assert len(files(state_root)) == 4


# -- priority --------------------------------------------------------------------------------


@TX
def test_priority_passes_through_a_post_a_batch_and_a_deferred_post(q):
    plain = local.post("q", "plain")
    urgent = local.post("q", "urgent", priority=7)
    optioned = local.post("q", "optioned", options=local.ItemOptions(priority=2))
    batch = local.post_many("q", ["bare", local.NewItem("high", priority=9)])
    with transaction.atomic():
        deferred = local.post("q", "deferred", priority=5)
    assert [p.item["priority"] for p in (plain, urgent, optioned, *batch, deferred)] == [
        0,
        7,
        2,
        0,
        9,
        5,
    ]
    assert local.get(urgent.id)["priority"] == 7
    assert Item.objects.get(id=urgent.id).priority == 7


@TX
def test_a_higher_priority_is_claimed_first_then_arrival_order(q):
    low = local.post("q", "low")
    high = local.post("q", "high", priority=7)
    middle, higher = local.post_many(
        "q", [local.NewItem("middle", priority=3), local.NewItem("higher", priority=7)]
    )
    claimed = engine.claim(queue_name="q", max_items=4)
    assert [c.row.id for c in claimed] == [high.id, higher.id, middle.id, low.id]


@TX
def test_a_post_with_priority_answers_what_a_rest_post_answers(api, q):
    posting = local.post("q", {"n": 1}, priority=4)
    assert local.get(posting.id) == api.get(f"/api/items/{posting.id}").json()
    rest = api.post("/api/queues/q/items", {"payload": {"n": 2}, "priority": 4}, format="json")
    assert set(rest.json()) == set(posting.item)
    assert rest.json()["priority"] == posting.item["priority"] == 4


# -- reading ---------------------------------------------------------------------------------


@TX
def test_get_answers_what_the_rest_api_answers(api, q):
    posting = local.post("q", {"n": 1}, key="read-me")
    assert local.get(posting.id) == api.get(f"/api/items/{posting.id}").json()
    finish(posting.id, {"ok": True}).join(10)
    item = local.get(posting.id)
    assert item["status"] == "finished"
    assert item["result"] == {"ok": True}
    assert item == api.get(f"/api/items/{posting.id}").json()


@TX
def test_get_of_a_missing_or_malformed_id_raises_what_the_rest_api_answers(api, q):
    for item_id in ("0" * 20, "not/an id", "x" * 65):
        answer = api.get(f"/api/items/{item_id}")
        if answer.status_code == 404 and answer.json()["error"]["code"] == "not_found":
            continue  # the URL itself does not match ('/'): nothing to compare
        error = answer.json()["error"]
        got = local_error(partial(local.get, item_id))
        assert got == (answer.status_code, error["code"], error["message"])


# -- waiting ---------------------------------------------------------------------------------


@TX
def test_wait_returns_as_soon_as_a_worker_finishes_the_item(q):
    posting = local.post("q", "job")
    worker = finish(posting.id, {"answer": 42}, after=0.3)
    started = time.monotonic()
    item = local.wait(posting.id, 10)
    elapsed = time.monotonic() - started
    worker.join(10)
    assert item["status"] == "finished"
    assert item["result"] == {"answer": 42}
    assert 0.25 <= elapsed < 5, elapsed


@TX
def test_wait_times_out_with_the_item_as_it_is(q):
    posting = local.post("q", "job")
    started = time.monotonic()
    item = local.wait(posting.id, timedelta(seconds=0.3))
    assert 0.3 <= time.monotonic() - started < 5
    assert item["status"] == "pending"
    assert item["id"] == posting.id


@TX
def test_wait_refuses_a_bad_timeout_a_missing_item_and_an_open_transaction(q):
    posting = local.post("q", "job")
    for bad in (-1, float("nan"), float("inf"), "5", True):
        with pytest.raises(InvalidInput) as caught:
            local.wait(posting.id, bad)  # type: ignore[arg-type]  # wrong types on purpose
        assert caught.value.code == "invalid_wait"
    with pytest.raises(TaskhosterError) as missing:
        local.wait("0" * 20, 1)
    assert missing.value.code == "item_not_found"
    with transaction.atomic(), pytest.raises(TransactionManagementError):
        local.wait(posting.id, 1)


@pytest.mark.slow
@TX
def test_wait_wakes_for_a_verdict_made_in_another_process(server_factory, make_key, q):
    server = server_factory()
    key = make_key(scopes="work")
    posting = local.post("q", "remote job")
    done: list[int] = []

    def remote_worker() -> None:
        headers = {"Authorization": f"Token {key}"}
        with httpx.Client(base_url=server.url, headers=headers, timeout=30) as http:
            claimed = http.post("/api/queues/q/claim", json={"max": 1, "wait": 10}).json()
            time.sleep(0.3)
            item_id = claimed["items"][0]["id"]
            answer = http.post(f"/api/items/{item_id}/result", json={"result": "from afar"})
            done.append(answer.status_code)

    thread = threading.Thread(target=remote_worker)
    thread.start()
    started = time.monotonic()
    item = local.wait(posting.id, 20)
    elapsed = time.monotonic() - started
    thread.join(20)
    assert done == [200]
    assert item["status"] == "finished"
    assert item["result"] == "from afar"
    assert elapsed < 10, elapsed


# -- async -----------------------------------------------------------------------------------


@TX
def test_the_async_calls_post_read_and_wait_without_holding_the_sync_thread(q):
    async def main() -> tuple[Any, ...]:
        try:
            posting = await local.post_async("q", {"n": 1}, key="async")
            read = await local.get_async(posting.id)
            waiting = asyncio.ensure_future(local.wait_async(posting.id, 10))
            await asyncio.sleep(0.1)
            # The wait holds a thread of its own: calls that need Django's sync thread run.
            started = time.monotonic()
            again = await local.get_async(posting.id)
            quick = time.monotonic() - started
            assert not waiting.done()
            worker = await asyncio.to_thread(finish, posting.id, "done")
            finished = await waiting
            await asyncio.to_thread(worker.join, 10)
            many = await local.post_many_async("q", [1, local.NewItem(2, key="a2")])
            return posting, read, again, quick, finished, many
        finally:
            await sync_to_async(connections.close_all)()

    posting, read, again, quick, finished, many = asyncio.run(main())
    assert posting.posted
    assert read["status"] == again["status"] == "pending"
    assert quick < 2, quick
    assert finished["status"] == "finished"
    assert finished["result"] == "done"
    assert [p.item["payload"] for p in many] == [1, 2]


# -- from a view and a signal handler --------------------------------------------------------


def signup(request: HttpRequest) -> JsonResponse:
    user = User.objects.create(username=request.GET["name"])
    if request.GET.get("fail"):
        raise RuntimeError("the view failed after the post")
    return JsonResponse({"user": user.pk}, status=201)


urlpatterns = [path("signup", signup)]


def welcome(sender: Any, instance: User, created: bool, **kwargs: Any) -> None:
    if created:
        local.post("welcome", {"user": instance.pk}, key=f"welcome-{instance.pk}")


@pytest.fixture
def welcome_on_signup(make_queue: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """ATOMIC_REQUESTS, and a post_save handler that posts a welcome for each new user."""
    make_queue("welcome")
    monkeypatch.setitem(connection.settings_dict, "ATOMIC_REQUESTS", True)
    post_save.connect(welcome, sender=User)
    yield
    post_save.disconnect(welcome, sender=User)


@TX
@pytest.mark.urls(__name__)
def test_a_view_posts_from_a_signal_handler_when_its_request_commits(welcome_on_signup):
    answer = Client().get("/signup?name=ada")
    assert answer.status_code == 201
    user_id = answer.json()["user"]
    item = Item.objects.get(key=f"welcome-{user_id}")
    assert local.get(item.id)["payload"] == {"user": user_id}


@TX
@pytest.mark.urls(__name__)
def test_a_view_that_fails_posts_nothing(welcome_on_signup, state_root):
    answer = Client(raise_request_exception=False).get("/signup?name=ada&fail=1")
    assert answer.status_code == 500
    assert not User.objects.exists()
    assert not Item.objects.exists()
    assert files(state_root, "welcome") == []
