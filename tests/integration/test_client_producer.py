"""taskhoster.client producers (sync and async) against a real daphne: every call, typed
errors, and resends that are safe because posts carry an idempotency key."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta

import httpx
import pytest

from taskhoster.client import (
    AsyncProducer,
    BadRequest,
    Conflict,
    ConnectionFailed,
    Forbidden,
    Item,
    ItemFailed,
    ItemOptions,
    Job,
    NewItem,
    NotFound,
    Producer,
    QueueInfo,
    RateLimit,
    TooLarge,
    Unauthorized,
    WaitTimeout,
    _wire,
)

from .tcpproxy import TcpProxy

pytestmark = pytest.mark.slow

MAX_PAYLOAD = 64 * 1024


@pytest.fixture
def server(server_factory):
    return server_factory(TASKHOSTER_MAX_PAYLOAD_BYTES=str(MAX_PAYLOAD))


@pytest.fixture
def producer(server, key):
    with Producer(server.url, key) as producer:
        yield producer


@pytest.fixture
def http(server, key):
    """Plain HTTP for what a producer does not do (claim, result, fail)."""
    with httpx.Client(
        base_url=server.url, headers={"Authorization": f"Token {key}"}, timeout=10
    ) as client:
        yield client


@pytest.fixture
def proxy(server):
    proxy = TcpProxy(server.port)
    yield proxy
    proxy.close()


def claim(http, queue="q"):
    items = http.post(f"/api/queues/{queue}/claim", json={"max": 1, "wait": 5}).json()["items"]
    assert items, "nothing to claim"
    return items[0]


def finish(http, item_id, result):
    answer = http.post(f"/api/items/{item_id}/result", json={"result": result}).json()
    assert answer["accepted"] is True


def claim_now(http, queue="q", most=1):
    """The ids a claim that does not wait hands out (none when nothing may be)."""
    answer = http.post(f"/api/queues/{queue}/claim", json={"max": most, "wait": 0})
    assert answer.status_code == 200, answer.text
    return [i["id"] for i in answer.json()["items"]]


def fail_for_good(http, queue="q"):
    claimed = claim(http, queue)
    answer = http.post(
        f"/api/items/{claimed['id']}/fail",
        json={"lease": claimed["lease"], "error": "boom", "retry": False},
    ).json()
    assert answer == {"accepted": True, "status": "failed"}
    return claimed["id"]


# -- queues ----------------------------------------------------------------------------------


def test_put_queue_creates_then_updates_only_the_given_settings(producer):
    created = producer.put_queue("q", lease_seconds=30, max_attempts=5)
    assert (created.name, created.lease_seconds, created.max_attempts) == ("q", 30, 5)
    assert created.counts == {"pending": 0, "processing": 0, "finished": 0, "failed": 0}
    updated = producer.put_queue("q", backoff_seconds=2, max_attempts=None)
    assert updated.lease_seconds == 30  # kept
    assert updated.backoff_seconds == 2
    assert updated.max_attempts is None  # None is sent: unlimited


def test_queues_and_queue_report_live_counts(producer):
    producer.put_queue("a")
    producer.put_queue("b")
    producer.post("a", 1)
    producer.post("a", 2)
    assert producer.queue("a").counts["pending"] == 2
    assert {q.name: q.counts["pending"] for q in producer.queues()} == {"a": 2, "b": 0}


def test_delete_queue_removes_it_and_its_items(producer):
    producer.put_queue("q")
    item = producer.post("q", 1)
    producer.delete_queue("q")
    with pytest.raises(NotFound) as missing:
        producer.queue("q")
    assert missing.value.code == "queue_not_found"
    with pytest.raises(NotFound):
        producer.get(item.id)


def test_put_queue_sets_the_flow_controls_and_none_clears_the_limits(producer):
    fresh = producer.put_queue("q")
    assert (fresh.paused, fresh.max_processing, fresh.rate_limit, fresh.thread_limit) == (
        False,
        None,
        None,
        1,
    )
    limited = producer.put_queue(
        "q", max_processing=3, rate_limit=RateLimit(10, 1), thread_limit=2, paused=True
    )
    assert (limited.max_processing, limited.rate_limit, limited.thread_limit) == (
        3,
        RateLimit(10, 1),
        2,
    )
    assert limited.paused is True
    assert limited.raw["rateLimit"] == {"count": 10, "seconds": 1}
    read = producer.queue("q")
    assert (read.max_processing, read.rate_limit, read.thread_limit, read.paused) == (
        3,
        RateLimit(10, 1),
        2,
        True,
    )
    # The wire form is taken too; other settings are kept when these change.
    halved = producer.put_queue("q", rate_limit={"count": 5, "seconds": 0.5})
    assert halved.rate_limit == RateLimit(5, 0.5)
    assert (halved.max_processing, halved.thread_limit, halved.paused) == (3, 2, True)
    cleared = producer.put_queue("q", max_processing=None, rate_limit=None, paused=False)
    assert (cleared.max_processing, cleared.rate_limit, cleared.paused) == (None, None, False)
    assert cleared.thread_limit == 2  # not given: kept


def test_put_queue_refuses_a_bad_flow_control_with_the_servers_message(producer):
    producer.put_queue("q")
    with pytest.raises(BadRequest) as bad:
        producer.put_queue("q", rate_limit=RateLimit(0, 1))
    assert bad.value.code == "invalid_setting"
    assert "rateLimit.count" in bad.value.message
    with pytest.raises(BadRequest) as bad:
        producer.put_queue("q", thread_limit=0)
    assert "threadLimit" in bad.value.message
    assert producer.queue("q").thread_limit == 1  # nothing changed


def test_pause_holds_back_claims_and_resume_hands_the_item_out(producer, http):
    producer.put_queue("q")
    paused = producer.pause("q")
    assert paused.paused is True
    item = producer.post("q", "held")  # posts go on while paused
    assert claim_now(http) == []
    read = producer.queue("q")
    assert read.held == {"paused": 1, "maxProcessing": 0, "rateLimit": 0, "thread": 0}
    assert read.counts["pending"] == 1  # held back, still pending
    resumed = producer.resume("q")
    assert resumed.paused is False
    assert claim_now(http) == [item.id]
    assert producer.get(item.id).attempts == 1  # the pause cost it no attempt


def test_held_is_read_for_one_queue_and_left_none_in_listings(producer):
    producer.put_queue("q")
    assert producer.queue("q").held == {
        "paused": 0,
        "maxProcessing": 0,
        "rateLimit": 0,
        "thread": 0,
    }
    assert [q.held for q in producer.queues()] == [None]


def test_max_processing_caps_what_claims_hand_out(producer, http):
    producer.put_queue("q", max_processing=2)
    producer.post_many("q", [1, 2, 3])
    assert len(claim_now(http, most=3)) == 2
    assert claim_now(http) == []
    assert producer.queue("q").held["maxProcessing"] == 1


def test_a_queue_from_a_server_without_flow_control_reads_as_the_defaults():
    wire = {
        "name": "q",
        "leaseSeconds": 60,
        "queueSeconds": 86400,
        "retainSeconds": 3600,
        "retainFrom": "finished",
        "maxAttempts": None,
        "backoffSeconds": 1,
        "backoffMaxSeconds": 300,
        "deadLetterQueue": None,
        "counts": {},
    }
    queue = QueueInfo.from_wire(wire)
    assert (queue.paused, queue.max_processing, queue.rate_limit, queue.thread_limit) == (
        False,
        None,
        None,
        1,
    )
    assert queue.held is None
    assert Item.from_wire({"id": "x", "status": "pending"}).priority == 0


def test_a_socket_item_frame_gives_the_job_its_priority_and_0_when_left_out():
    frame = {"type": "item", "id": "x", "queue": "q", "payload": 1, "lease": "l"}
    assert Job.from_frame({**frame, "priority": 7}).priority == 7
    assert Job.from_frame(frame).priority == 0


# -- posting ---------------------------------------------------------------------------------


def test_post_with_priority_7_reads_back_7_and_the_default_is_0(producer):
    producer.put_queue("q")
    plain = producer.post("q", "plain")
    urgent = producer.post("q", "urgent", priority=7)
    assert (plain.priority, urgent.priority) == (0, 7)
    assert urgent.raw["priority"] == 7
    assert producer.get(urgent.id).priority == 7
    assert [i.priority for i in producer.items("q")] == [0, 7]  # listings carry it too
    optioned = producer.post("q", "optioned", options=ItemOptions(priority=3))
    assert optioned.priority == 3
    batch = producer.post_many("q", ["bare", NewItem("high", priority=9)])
    assert [i.priority for i in batch] == [0, 9]


def test_the_higher_priority_is_claimed_first_then_arrival_order(producer, http):
    producer.put_queue("q")
    low = producer.post("q", "low")
    high = producer.post("q", "high", priority=7)
    middle, higher = producer.post_many(
        "q", [NewItem("middle", priority=3), NewItem("higher", priority=7)]
    )
    assert claim_now(http, most=4) == [high.id, higher.id, middle.id, low.id]


def test_a_priority_outside_0_to_9_is_refused(producer):
    producer.put_queue("q")
    for bad in (10, -1):
        with pytest.raises(BadRequest) as refused:
            producer.post("q", 1, priority=bad)
        assert "priority" in refused.value.message
    assert producer.queue("q").counts["pending"] == 0


def test_post_carries_thread_id_delay_and_scheduled_at(producer):
    producer.put_queue("q")
    before = datetime.now(UTC)
    plain = producer.post("q", {"n": 1}, thread_id="t-1")
    assert (plain.status, plain.payload, plain.thread_id, plain.attempts) == (
        "pending",
        {"n": 1},
        "t-1",
        0,
    )
    delayed = producer.post("q", 2, delay=timedelta(minutes=5))
    assert delayed.scheduled_at - before >= timedelta(minutes=5)
    assert delayed.scheduled_at - before < timedelta(minutes=5, seconds=30)
    at = (before + timedelta(hours=1)).replace(microsecond=0)
    scheduled = producer.post("q", 3, scheduled_at=at)
    assert scheduled.scheduled_at == at
    with pytest.raises(ValueError, match="not both"):
        producer.post("q", 4, delay=1, scheduled_at=at)


def test_post_with_the_same_key_returns_the_first_item(producer):
    producer.put_queue("q")
    first = producer.post("q", "welcome", key="welcome-ada")
    again = producer.post("q", "other payload", key="welcome-ada")
    assert again.id == first.id
    assert again.payload == "welcome"
    assert producer.queue("q").counts["pending"] == 1


def test_post_without_a_key_gets_one_made_up(producer):
    producer.put_queue("q")
    one, two = producer.post("q", 1), producer.post("q", 1)
    assert one.key
    assert two.key
    assert one.key != two.key
    assert one.id != two.id


def test_a_post_whose_answer_is_lost_is_resent_and_makes_one_item(server, key, proxy):
    with Producer(server.url, key) as direct:
        direct.put_queue("q")
    proxy.lose_answers = 1
    with Producer(proxy.url, key) as producer:
        item = producer.post("q", {"once": True})
        assert proxy.lost == 1  # the first answer was cut off after the server posted it
        assert producer.queue("q").counts["pending"] == 1
        assert [i.id for i in producer.items("q")] == [item.id]


def test_a_batch_whose_answer_is_lost_is_resent_and_posts_once(server, key, proxy):
    with Producer(server.url, key) as direct:
        direct.put_queue("q")
    proxy.lose_answers = 1
    with Producer(proxy.url, key) as producer:
        items = producer.post_many("q", [1, 2, 3])
        assert proxy.lost == 1
        assert [i.payload for i in items] == [1, 2, 3]
        assert producer.queue("q").counts["pending"] == 3


def test_without_auto_keys_a_post_with_a_lost_answer_is_not_resent(server, key, proxy):
    with Producer(server.url, key) as direct:
        direct.put_queue("q")
    proxy.lose_answers = 1
    with Producer(proxy.url, key, auto_key=False) as producer, pytest.raises(ConnectionFailed):
        producer.post("q", 1)
    with Producer(server.url, key) as direct:
        assert direct.queue("q").counts["pending"] == 1  # it did arrive, once


def test_post_many_keeps_list_order_options_and_chunks_past_1000(producer):
    producer.put_queue("q")
    items = producer.post_many(
        "q",
        [
            "bare",
            NewItem({"x": 1}, thread_id="t", key="k-1"),
            NewItem(3, delay=60),
        ],
    )
    assert [i.payload for i in items] == ["bare", {"x": 1}, 3]
    assert items[1].thread_id == "t"
    assert items[1].key == "k-1"
    assert items[2].scheduled_at > items[0].scheduled_at + timedelta(seconds=50)
    many = producer.post_many("q", range(1001))
    assert [i.payload for i in many] == list(range(1001))
    assert [i.id for i in many] == sorted(i.id for i in many)
    assert producer.queue("q").counts["pending"] == 1004


# -- reading ---------------------------------------------------------------------------------


def test_get_returns_the_item_with_its_payload(producer):
    producer.put_queue("q")
    posted = producer.post("q", {"to": "ada"}, thread_id="t")
    got = producer.get(posted.id)
    assert (got.id, got.queue, got.payload, got.thread_id) == (posted.id, "q", {"to": "ada"}, "t")
    assert got.posted_at is not None
    assert not got.terminal


def test_wait_returns_as_soon_as_a_worker_finishes_the_item(producer, http):
    producer.put_queue("q")
    item = producer.post("q", 21)

    def work():
        time.sleep(0.5)
        finish(http, claim(http)["id"], 42)

    worker = threading.Thread(target=work)
    worker.start()
    started = time.monotonic()
    done = producer.wait(item.id, timeout=20)
    elapsed = time.monotonic() - started
    worker.join()
    assert (done.status, done.result) == ("finished", 42)
    assert 0.4 < elapsed < 3, elapsed


def test_wait_raises_wait_timeout_when_the_item_is_not_done_in_time(producer):
    producer.put_queue("q")
    item = producer.post("q", 1)
    started = time.monotonic()
    with pytest.raises(WaitTimeout) as timed_out:
        producer.wait(item.id, timeout=0.6)
    assert 0.5 < time.monotonic() - started < 3
    assert timed_out.value.item.status == "pending"


def test_result_returns_the_value_or_raises_item_failed(producer, http):
    producer.put_queue("q")
    good = producer.post("q", 1)
    finish(http, claim(http)["id"], {"ok": True})
    assert producer.result(good.id, timeout=5) == {"ok": True}
    bad = producer.post("q", 2)
    assert fail_for_good(http) == bad.id
    with pytest.raises(ItemFailed) as failed:
        producer.result(bad.id, timeout=5)
    assert failed.value.message == "boom"
    assert failed.value.item.status == "failed"


def test_items_pages_through_a_queue_in_arrival_order(producer):
    producer.put_queue("q")
    posted = producer.post_many("q", range(7))
    listed = list(producer.items("q", page_size=3))
    assert [i.id for i in listed] == [i.id for i in posted]
    assert all(i.payload is None for i in listed)  # listings carry no payload
    threaded = producer.post("q", "t", thread_id="only")
    assert [i.id for i in producer.items("q", thread_id="only")] == [threaded.id]


# -- deleting and restarting -----------------------------------------------------------------


def test_delete_removes_the_item_and_get_then_raises_not_found(producer):
    producer.put_queue("q")
    item = producer.post("q", 1)
    producer.delete(item.id)
    with pytest.raises(NotFound) as missing:
        producer.get(item.id)
    assert missing.value.code == "item_not_found"
    assert missing.value.status == 404
    with pytest.raises(NotFound):
        producer.delete(item.id)


def test_delete_many_by_ids_and_by_status(producer, http):
    producer.put_queue("q")
    a, b, c = producer.post_many("q", ["a", "b", "c"])
    assert producer.delete_many("q", ids=[a.id, b.id]) == 2
    finish(http, claim(http)["id"], 1)
    d = producer.post("q", "d")
    assert producer.delete_many("q", status="finished") == 1
    assert [i.id for i in producer.items("q")] == [d.id]
    with pytest.raises(NotFound):
        producer.get(c.id)


def test_restart_requeues_a_failed_item_and_conflicts_on_a_live_one(producer, http):
    producer.put_queue("q")
    item = producer.post("q", 1)
    fail_for_good(http)
    restarted = producer.restart(item.id)
    assert (restarted.status, restarted.attempts, restarted.error) == ("pending", 0, None)
    with pytest.raises(Conflict) as conflict:
        producer.restart(item.id)
    assert conflict.value.status == 409


# -- errors ----------------------------------------------------------------------------------


def test_errors_are_typed_and_carry_the_servers_code_and_message(server, producer, make_key):
    producer.put_queue("q")
    producer.put_queue("other")
    with Producer(server.url, "not-a-key") as stranger, pytest.raises(Unauthorized) as no:
        stranger.queues()
    assert no.value.code == "unauthorized"
    assert no.value.status == 401
    assert no.value.message
    with Producer(server.url, make_key("produce", queues=["q"])) as limited:
        with pytest.raises(Forbidden) as forbidden:
            limited.post("other", 1)
        assert forbidden.value.code == "forbidden"
        assert "other" in forbidden.value.message
    with pytest.raises(NotFound) as missing:
        producer.post("nope", 1)
    assert missing.value.code == "queue_not_found"
    with pytest.raises(BadRequest) as bad:
        producer.post("q", 1, thread_id="")
    assert bad.value.status == 400
    assert "threadId" in bad.value.message
    with pytest.raises(TooLarge) as large:
        producer.post("q", "x" * (MAX_PAYLOAD + 1))
    assert large.value.code == "too_large"
    assert producer.queue("q").counts["pending"] == 0  # none of it changed anything


def test_an_unreachable_server_raises_connection_failed_after_the_retries(key, proxy):
    proxy.refuse = True
    started = time.monotonic()
    with Producer(proxy.url, key, retries=2) as producer, pytest.raises(ConnectionFailed):
        producer.queues()
    assert proxy.accepted == 3  # the first try and two resends
    assert time.monotonic() - started < 5


def test_a_kept_connection_the_server_closed_while_idle_carries_no_call(server, key, proxy):
    # A post without a key is not safe to resend: sent on a connection the server had
    # closed while it sat idle (a restart, an idle timeout), it would fail for nothing.
    with Producer(server.url, key) as direct:
        direct.put_queue("q")
    with Producer(proxy.url, key, auto_key=False, retries=0) as producer:
        producer.post("q", 1)
        proxy.drop_all()
        time.sleep(0.2)  # the close reaches the producer's end
        producer.post("q", 2)
        assert proxy.accepted == 2
    with Producer(server.url, key) as direct:
        assert direct.queue("q").counts["pending"] == 2


def test_calls_in_turn_share_one_kept_connection(server, key, proxy):
    with Producer(proxy.url, key) as producer:
        producer.put_queue("q")
        for n in range(5):
            producer.post("q", n)
        assert producer.queue("q").counts["pending"] == 5
    assert proxy.accepted == 1


def test_a_connection_idle_past_the_keep_alive_expiry_is_not_used_again(
    server, key, proxy, monkeypatch
):
    # A firewall or load balancer may forget an idle connection without a word: one kept
    # longer than httpx's 5 s (here 1 s) is closed, a post without a key on a new one.
    monkeypatch.setattr(_wire, "KEEP_IDLE_SECONDS", 1.0)
    with Producer(proxy.url, key, auto_key=False, retries=0) as producer:
        producer.put_queue("q")
        producer.post("q", 1)
        assert proxy.accepted == 1
        time.sleep(1.5)
        producer.post("q", 2)
        assert proxy.accepted == 2


def test_a_server_that_does_not_answer_raises_connection_failed_after_the_timeout(
    server, key, proxy
):
    with Producer(server.url, key) as direct:
        direct.queues()  # the server's first API call (its connections, caches) made
    proxy.go_dark()
    started = time.monotonic()
    with Producer(proxy.url, key, timeout=1.0, retries=0) as producer:
        with pytest.raises(ConnectionFailed) as failed:
            producer.queues()
        assert 0.9 < time.monotonic() - started < 4
        assert "no answer in 1 s" in str(failed.value)
        # The connection that went dark is not kept: the next call takes a new one.
        proxy.light()
        assert producer.queues() == []
        assert proxy.accepted == 2


def test_a_batch_over_the_body_limit_raises_too_large_not_a_connection_error(server_factory, key):
    # The server answers 413 as soon as it has the headers and closes, the body still
    # being sent: the answer is read, not the broken write (resent, then ConnectionFailed).
    server = server_factory(TASKHOSTER_MAX_BODY_BYTES="100000")
    with Producer(server.url, key) as producer:
        producer.put_queue("q")
        with pytest.raises(TooLarge) as large:
            producer.post_many("q", ["x" * 100_000 for _ in range(300)])
        assert large.value.code == "too_large"
        assert producer.queue("q").counts["pending"] == 0


def test_a_closed_producer_refuses_a_call_at_once(server, key):
    producer = Producer(server.url, key)
    producer.close()
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="closed"):
        producer.queues()
    assert time.monotonic() - started < 0.5  # not resent as a network error


def test_one_producer_shared_by_eight_threads_posts_each_item_once(server, key):
    # No key made up and no resend: a connection shared by two threads at once (an answer
    # read by the wrong thread, or lost) is an error or a wrong item here, not a resend
    # the server deduplicates.
    with Producer(server.url, key, auto_key=False, retries=0) as producer:
        producer.put_queue("q")

        def post_25(thread: int) -> list[Item]:
            return [producer.post("q", {"thread": thread, "n": n}) for n in range(25)]

        with ThreadPoolExecutor(8) as pool:
            posted = list(pool.map(post_25, range(8)))
        for thread, items in enumerate(posted):
            assert [i.payload for i in items] == [{"thread": thread, "n": n} for n in range(25)]
        ids = [i.id for items in posted for i in items]
        assert len(set(ids)) == 200
        assert sorted(i.id for i in producer.items("q")) == sorted(ids)


def test_an_http_proxy_of_the_environment_is_honoured_and_no_proxy_too(
    server, key, proxy, monkeypatch
):
    # The "proxy": a call that goes through it fails. With a proxy set, httpx carries the
    # calls and reads NO_PROXY (the standard library's reading differs from it).
    proxy.refuse = True
    for name in ("NO_PROXY", "no_proxy", "ALL_PROXY", "all_proxy", "http_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTP_PROXY", proxy.url)
    with Producer(server.url, key, retries=0) as producer, pytest.raises(ConnectionFailed):
        producer.queues()
    assert proxy.accepted == 1
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    with Producer(server.url, key, retries=0) as producer:
        producer.queues()
    assert proxy.accepted == 1


# -- async -----------------------------------------------------------------------------------


def test_async_producer_makes_every_call(server, key, http):
    async def run():
        async with AsyncProducer(server.url, key) as producer:
            queue = await producer.put_queue("q", lease_seconds=20)
            assert queue.lease_seconds == 20
            assert [q.name for q in await producer.queues()] == ["q"]
            one = await producer.post("q", {"n": 1}, thread_id="t", key="k")
            assert (await producer.post("q", "dup", key="k")).id == one.id
            later = await producer.post("q", 2, delay=30)
            assert later.scheduled_at is not None
            assert one.scheduled_at is not None
            assert later.scheduled_at > one.scheduled_at
            batch = await producer.post_many("q", [3, NewItem(4, thread_id="u")])
            assert [i.payload for i in batch] == [3, 4]
            assert (await producer.get(one.id)).payload == {"n": 1}
            assert (await producer.queue("q")).counts["pending"] == 4
            listed = [i.id async for i in producer.items("q", page_size=2)]
            assert listed == [one.id, later.id, batch[0].id, batch[1].id]

            async def work():
                await asyncio.sleep(0.3)
                claimed = await asyncio.to_thread(claim, http)
                await asyncio.to_thread(finish, http, claimed["id"], "done")
                return claimed["id"]

            worker = asyncio.create_task(work())
            done = await producer.wait(one.id, timeout=10)
            assert await worker == one.id
            assert (done.status, done.result) == ("finished", "done")
            assert await producer.result(one.id) == "done"
            with pytest.raises(WaitTimeout):
                await producer.wait(later.id, timeout=0.3)

            failed_id = await asyncio.to_thread(fail_for_good, http)
            with pytest.raises(ItemFailed):
                await producer.result(failed_id, timeout=5)
            restarted = await producer.restart(failed_id)
            assert restarted.status == "pending"
            with pytest.raises(Conflict):
                await producer.restart(failed_id)

            await producer.delete(later.id)
            with pytest.raises(NotFound):
                await producer.get(later.id)
            assert await producer.delete_many("q", status="pending") == 2
            await producer.delete_queue("q")
            with pytest.raises(NotFound):
                await producer.queue("q")

    asyncio.run(run())


def test_async_producer_pauses_resumes_sets_flow_controls_and_posts_with_priority(
    server, key, http
):
    async def run():
        async with AsyncProducer(server.url, key) as producer:
            queue = await producer.put_queue(
                "q", max_processing=5, rate_limit=RateLimit(100, 2), thread_limit=3
            )
            assert (queue.max_processing, queue.rate_limit, queue.thread_limit) == (
                5,
                RateLimit(100, 2),
                3,
            )
            assert (await producer.pause("q")).paused is True
            low = await producer.post("q", "low")
            high = await producer.post("q", "high", priority=7)
            assert (low.priority, high.priority) == (0, 7)
            [batched] = await producer.post_many("q", [NewItem("b", priority=2)])
            assert batched.priority == 2
            assert await asyncio.to_thread(claim_now, http) == []
            held = (await producer.queue("q")).held
            assert held is not None
            assert held["paused"] == 3
            assert (await producer.resume("q")).paused is False
            claimed = await asyncio.to_thread(claim_now, http, "q", 3)
            assert claimed == [high.id, batched.id, low.id]

    asyncio.run(run())


def test_async_post_whose_answer_is_lost_is_resent_and_makes_one_item(server, key, proxy):
    async def run():
        async with AsyncProducer(server.url, key) as direct:
            await direct.put_queue("q")
        proxy.lose_answers = 1
        async with AsyncProducer(proxy.url, key) as producer:
            item = await producer.post("q", 1)
            assert proxy.lost == 1
            assert [i.id async for i in producer.items("q")] == [item.id]

    asyncio.run(run())


def test_async_errors_are_typed(server, key):
    async def run():
        async with AsyncProducer(server.url, "wrong") as stranger:
            with pytest.raises(Unauthorized):
                await stranger.queues()
        async with AsyncProducer(server.url, key) as producer:
            with pytest.raises(NotFound) as missing:
                await producer.post("nope", 1)
            assert missing.value.code == "queue_not_found"

    asyncio.run(run())


# -- the async producer's wire ---------------------------------------------------------------
# The same rules as the blocking producer's wire above, for AsyncProducer's (AsyncWire).


def test_async_a_kept_connection_the_server_closed_while_idle_carries_no_call(server, key, proxy):
    async def run() -> None:
        async with AsyncProducer(server.url, key) as direct:
            await direct.put_queue("q")
        async with AsyncProducer(proxy.url, key, auto_key=False, retries=0) as producer:
            await producer.post("q", 1)
            proxy.drop_all()
            await asyncio.sleep(0.2)  # the close reaches the producer's end
            await producer.post("q", 2)
            assert proxy.accepted == 2
        async with AsyncProducer(server.url, key) as direct:
            assert (await direct.queue("q")).counts["pending"] == 2

    asyncio.run(run())


def test_async_calls_in_turn_share_one_kept_connection_and_each_event_loop_its_own(
    server, key, proxy
):
    # Within one loop the calls share a connection. A producer made once and used from one
    # asyncio.run after another makes a connection for each loop (Windows' loop binds a
    # socket to itself for good), and the old loop's is closed, not kept.
    producer = AsyncProducer(proxy.url, key)

    async def post_five() -> None:
        await producer.put_queue("q")
        for n in range(5):
            await producer.post("q", n)

    async def count() -> int:
        return (await producer.queue("q")).counts["pending"]

    try:
        asyncio.run(post_five())
        assert proxy.accepted == 1
        asyncio.run(post_five())
        assert asyncio.run(count()) == 10
        assert proxy.accepted == 3
        assert len(producer._wire._pool._idle) == 1  # type: ignore[union-attr]
    finally:
        asyncio.run(producer.aclose())


def test_async_a_connection_idle_past_the_keep_alive_expiry_is_not_used_again(
    server, key, proxy, monkeypatch
):
    monkeypatch.setattr(_wire, "KEEP_IDLE_SECONDS", 1.0)

    async def run() -> None:
        async with AsyncProducer(proxy.url, key, auto_key=False, retries=0) as producer:
            await producer.put_queue("q")
            await producer.post("q", 1)
            assert proxy.accepted == 1
            await asyncio.sleep(1.5)
            await producer.post("q", 2)
            assert proxy.accepted == 2

    asyncio.run(run())


def test_async_a_server_that_does_not_answer_raises_connection_failed_after_the_timeout(
    server, key, proxy
):
    async def run() -> None:
        async with AsyncProducer(server.url, key) as direct:
            await direct.queues()  # the server's first API call (its connections, caches) made
        proxy.go_dark()
        started = time.monotonic()
        async with AsyncProducer(proxy.url, key, timeout=1.0, retries=0) as producer:
            with pytest.raises(ConnectionFailed) as failed:
                await producer.queues()
            assert 0.9 < time.monotonic() - started < 4
            assert "no answer in 1 s" in str(failed.value)
            proxy.light()
            assert await producer.queues() == []
            assert proxy.accepted == 2  # the connection that went dark was not kept

    asyncio.run(run())


def test_async_a_cancelled_call_does_not_leave_its_connection_for_the_next(server, key, proxy):
    # A call cancelled while it waits (here a long-poll for a verdict) leaves its answer
    # unread on its connection: were the connection kept, the next call would read that.
    async def run() -> None:
        async with AsyncProducer(proxy.url, key, auto_key=False, retries=0) as producer:
            await producer.put_queue("q")
            item = await producer.post("q", 1)
            waiting = asyncio.create_task(producer.wait(item.id, timeout=5))
            await asyncio.sleep(0.3)
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            second = await producer.post("q", 2)
            assert second.payload == 2
            assert proxy.accepted == 2
            assert [i.id async for i in producer.items("q")] == [item.id, second.id]

    asyncio.run(run())


def test_async_a_batch_over_the_body_limit_raises_too_large_not_a_connection_error(
    server_factory, key
):
    server = server_factory(TASKHOSTER_MAX_BODY_BYTES="100000")

    async def run() -> None:
        async with AsyncProducer(server.url, key) as producer:
            await producer.put_queue("q")
            with pytest.raises(TooLarge) as large:
                await producer.post_many("q", ["x" * 100_000 for _ in range(300)])
            assert large.value.code == "too_large"
            assert (await producer.queue("q")).counts["pending"] == 0

    asyncio.run(run())


def test_async_a_closed_producer_refuses_a_call_at_once(server, key):
    async def run() -> None:
        producer = AsyncProducer(server.url, key)
        await producer.aclose()
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="closed"):
            await producer.queues()
        assert time.monotonic() - started < 0.5

    asyncio.run(run())


def test_async_one_producer_shared_by_eight_tasks_posts_each_item_once(server, key):
    async def run() -> None:
        async with AsyncProducer(server.url, key, auto_key=False, retries=0) as producer:
            await producer.put_queue("q")

            async def post_25(task: int) -> list[Item]:
                return [await producer.post("q", {"task": task, "n": n}) for n in range(25)]

            posted = await asyncio.gather(*(post_25(task) for task in range(8)))
            for task, items in enumerate(posted):
                assert [i.payload for i in items] == [{"task": task, "n": n} for n in range(25)]
            ids = [i.id for items in posted for i in items]
            assert len(set(ids)) == 200
            assert sorted([i.id async for i in producer.items("q")]) == sorted(ids)

    asyncio.run(run())


def test_async_an_http_proxy_of_the_environment_is_honoured_and_no_proxy_too(
    server, key, proxy, monkeypatch
):
    proxy.refuse = True
    for name in ("NO_PROXY", "no_proxy", "ALL_PROXY", "all_proxy", "http_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTP_PROXY", proxy.url)

    async def run() -> None:
        async with AsyncProducer(server.url, key, retries=0) as producer:
            with pytest.raises(ConnectionFailed):
                await producer.queues()
        assert proxy.accepted == 1
        monkeypatch.setenv("NO_PROXY", "127.0.0.1")
        async with AsyncProducer(server.url, key, retries=0) as producer:
            await producer.queues()
        assert proxy.accepted == 1

    asyncio.run(run())


class _HandWrittenServer:
    """An HTTP/1.1 server (a thread, a socket) that answers every request with the same
    bytes: the answers daphne does not give (chunked, interim 1xx, no length), as a proxy or
    another server in front of Taskhoster may. Counts connections and requests."""

    def __init__(self, answer: bytes, *, close: bool = False) -> None:
        self.answer = answer
        self.close_each = close
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.connections = 0
        self.requests = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        with conn:
            data = b""
            while True:
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    data += chunk
                head, _, data = data.partition(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                while len(data) < length:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    data += chunk
                data = data[length:]
                self.requests += 1
                conn.sendall(self.answer)
                framed = b"content-length" in self.answer.lower() or (
                    b"chunked" in self.answer.lower()
                )
                if self.close_each or not framed:
                    return  # an answer without a length ends where the connection does

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept
        self.listener.close()
        self._thread.join(5)


_OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"


@pytest.mark.parametrize("producer_type", ["Producer", "AsyncProducer"])
@pytest.mark.parametrize(
    ("answer", "kept"),
    [
        pytest.param(_OK + b"Content-Length: 2\r\n\r\n[]", True, id="a length"),
        pytest.param(
            _OK + b"Transfer-Encoding: chunked\r\n\r\n"
            b"1;ext=1\r\n[\r\n1\r\n]\r\n0\r\nX-Trailer: 1\r\n\r\n",
            True,
            id="chunked, with an extension and a trailer",
        ),
        pytest.param(
            _OK + b"Transfer-Encoding: chunked\r\nContent-Length: 9\r\n\r\n2\r\n[]\r\n0\r\n\r\n",
            False,
            id="chunked beside a length: chunked, the connection not kept",
        ),
        pytest.param(
            b"HTTP/1.1 100 Continue\r\n\r\n" + _OK + b"Content-Length: 2\r\n\r\n[]",
            True,
            id="an interim 100 first",
        ),
        pytest.param(
            b"HTTP/1.1 103 Early Hints\r\nLink: </s.css>; rel=preload\r\n\r\n"
            + _OK
            + b"Content-Length: 2\r\n\r\n[]",
            True,
            id="early hints (103) first",
        ),
        pytest.param(_OK + b"\r\n[]", False, id="no length: ends with the connection"),
    ],
)
def test_an_answer_of_any_http_1_1_framing_is_read_whole(
    producer_type: str, answer: bytes, kept: bool, key
):
    # The blocking wire reads answers with the standard library's parser, the async wire with
    # its own: each must read every framing HTTP/1.1 allows, and keep the connection only
    # where the framing lets the next answer be found (else the next call reads this one's).
    server = _HandWrittenServer(answer)
    try:
        if producer_type == "Producer":
            with Producer(server.url, key, retries=0) as producer:
                assert producer.queues() == []
                assert producer.queues() == []
        else:

            async def run() -> None:
                async with AsyncProducer(server.url, key, retries=0) as producer:
                    assert await producer.queues() == []
                    assert await producer.queues() == []

            asyncio.run(run())
        assert server.requests == 2
        assert server.connections == (1 if kept else 2)
    finally:
        server.close()


@pytest.mark.parametrize(
    "answer",
    [
        pytest.param(b"SMTP ready\r\n\r\n", id="not HTTP"),
        pytest.param(b"HTTP/1.1 2\xb20 OK\r\nContent-Length: 2\r\n\r\n[]", id="not a status"),
        pytest.param(_OK + b"Content-Length: 5\r\n\r\n[]", id="cut short"),
        pytest.param(_OK + b"Content-Length: -1\r\n\r\n[]", id="a bad length"),
        pytest.param(_OK + b"Content-Length: 2\r\nContent-Length: 7\r\n\r\n[]", id="two lengths"),
        pytest.param(
            _OK + b"Transfer-Encoding: chunked\r\n\r\n0x2\r\n[]\r\n0\r\n\r\n",
            id="a bad chunk size",
        ),
        pytest.param(
            b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\nContent-Length: 0\r\n\r\n",
            id="a 101 not asked for (the connection left open)",
        ),
    ],
)
def test_async_an_answer_that_is_not_http_raises_connection_failed_at_once(answer: bytes, key):
    # The server keeps the connection open (but for the answer cut short, which it ends):
    # an answer read as wrong raises at once, one misread waits for more until the timeout.
    server = _HandWrittenServer(answer, close=b"Content-Length: 5" in answer)
    try:

        async def run() -> None:
            async with AsyncProducer(server.url, key, timeout=5, retries=0) as producer:
                started = time.monotonic()
                with pytest.raises(ConnectionFailed):
                    await producer.queues()
                assert time.monotonic() - started < 2  # read as wrong, not waited out

        asyncio.run(run())
    finally:
        server.close()
