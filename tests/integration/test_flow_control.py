"""Flow control (SPEC section 8.1) against a real daphne, real sockets and REST claims:
priorities, pause and resume, ``maxProcessing``, ``rateLimit`` and ``threadLimit``; what
each holds back is counted in ``GET /api/queues/{q}``; a control that opens wakes waiting
sockets and long-polls at once (the socket backstop is a minute here, so nothing is found by
it); nothing held back costs an attempt.

The cross-process proof (two daphnes on PostgreSQL + Redis, socket workers and HTTP
claimers on both, every lease interval recorded from the workers' side) is
``test_two_processes_never_exceed_max_processing_or_thread_limit``.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections import defaultdict
from datetime import UTC, datetime, timedelta

import httpx
import pytest

from ..conftest import Server
from .test_processes import REDIS_URL, needs_shared
from .wsclient import (
    COMMITTER_PONG,
    assert_nothing_before,
    connect,
    item_of,
    make_queue,
    ping_committer,
    post,
    recv,
    send,
    status_of,
    subscribe,
)

pytestmark = pytest.mark.slow


@pytest.fixture
def server(server_factory):
    # A long backstop proves that wake-ups are pushed, not found by the periodic re-check.
    return server_factory(TASKHOSTER_SOCKET_BACKSTOP_SECONDS="60")


def claim(http: httpx.Client, queue: str = "q", n: int = 10, wait: float = 0) -> list[dict]:
    response = http.post(f"/api/queues/{queue}/claim", json={"max": n, "wait": wait})
    assert response.status_code == 200, response.text
    return list(response.json()["items"])


def finish(http: httpx.Client, item: dict) -> None:
    response = http.post(f"/api/items/{item['id']}/result", json={"result": 1})
    assert response.status_code == 200, response.text


def held(http: httpx.Client, queue: str = "q") -> dict[str, int]:
    return dict(http.get(f"/api/queues/{queue}").json()["held"])


def at(seconds: float) -> str:
    """A wire time ``seconds`` from now."""
    return (datetime.now(UTC) + timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


# -- priorities ----------------------------------------------------------------------------------


def test_higher_priority_is_claimed_first_then_earliest_scheduled_then_arrival(http):
    make_queue(http)
    low = post(http, "low")
    late = post(http, "late", priority=5, scheduledAt=at(-1))
    early = post(http, "early", priority=5, scheduledAt=at(-60))
    tied = post(http, "tied", priority=5, scheduledAt=at(-1))
    top = post(http, "top", priority=9)
    delayed_top = post(http, "delayed", priority=9, delaySeconds=3600)
    got = [i["id"] for i in claim(http, n=10)]
    assert got == [top, early, late, tied, low]
    assert delayed_top not in got, "a delayed item of a high priority is not due"
    assert status_of(http, top)["priority"] == 9
    assert status_of(http, low)["priority"] == 0


def test_priority_rides_on_the_socket_item_frame_and_in_batches(http, server, key):
    make_queue(http)
    response = http.post(
        "/api/queues/q/items",
        json={"items": [{"payload": 1, "priority": 2}, {"payload": 2, "priority": 8}]},
    )
    assert response.status_code == 201
    assert [i["priority"] for i in response.json()["items"]] == [2, 8]

    async def run() -> list[int]:
        ws = await connect(server, key)
        await subscribe(ws, ["q"], 2)
        frames = [await recv(ws), await recv(ws)]
        await ws.close()
        return [f["priority"] for f in frames]

    assert sorted(asyncio.run(run())) == [2, 8]


def test_a_thread_head_is_still_chosen_by_scheduled_at_whatever_its_members_priority(http):
    make_queue(http)
    first = post(http, "first", threadId="t", scheduledAt=at(-10))
    post(http, "urgent", threadId="t", priority=9)
    other = post(http, "other", priority=1)
    got = [i["id"] for i in claim(http, n=1)]
    assert got == [other], "the thread's head (priority 0) ranks below priority 1"
    assert [i["id"] for i in claim(http, n=5)] == [first]


# -- pause and resume ----------------------------------------------------------------------------


def test_a_paused_queue_hands_nothing_out_and_resuming_wakes_a_socket_at_once(http, server, key):
    make_queue(http, paused=True)
    assert http.get("/api/queues/q").json()["paused"] is True
    item = post(http, "x")
    assert claim(http) == []
    assert held(http) == {"paused": 1, "maxProcessing": 0, "rateLimit": 0, "thread": 0}

    async def run() -> float:
        ws = await connect(server, key)
        await subscribe(ws, ["q"], 5)
        await ping_committer(ws)
        await assert_nothing_before(ws, COMMITTER_PONG)  # subscribed, and given nothing
        started = time.monotonic()
        await asyncio.to_thread(make_queue, http, "q", paused=False)
        frame = await assert_nothing_before(ws, item_of(item), timeout=10)
        waited = time.monotonic() - started
        assert frame["attempts"] == 1, "being held back cost no attempt"
        await ws.close()
        return waited

    assert asyncio.run(run()) < 5, "woken by the resume, not by the minute's backstop"


def test_a_paused_queue_still_takes_posts_verdicts_and_its_clocks(http, manage):
    make_queue(http, leaseSeconds=0.5)
    held_item = post(http, "held")
    lapsing = post(http, "lapsing")
    claimed = claim(http, n=2)
    assert [i["id"] for i in claimed] == [held_item, lapsing]
    make_queue(http, paused=True)
    assert post(http, "still posted")
    finish(http, claimed[0])
    assert status_of(http, held_item)["status"] == "finished"
    time.sleep(0.6)
    manage("sweep")  # the lease clock runs while paused
    lapsed = status_of(http, lapsing)
    assert (lapsed["status"], lapsed["error"], lapsed["attempts"]) == (
        "pending",
        "lease expired",
        1,
    )
    assert claim(http) == [], "and, lapsed, it is held by the pause like the rest"


def test_a_long_poll_on_a_paused_queue_is_woken_by_the_resume(http, server, key):
    make_queue(http, paused=True)
    item = post(http, "x")

    def resume() -> None:
        time.sleep(0.5)
        with httpx.Client(base_url=server.url, headers={"Authorization": f"Token {key}"}) as own:
            make_queue(own, "q", paused=False)

    resumer = threading.Thread(target=resume)
    resumer.start()
    started = time.monotonic()
    got = claim(http, n=1, wait=20)
    resumer.join(30)
    assert [i["id"] for i in got] == [item]
    assert time.monotonic() - started < 10


# -- maxProcessing -------------------------------------------------------------------------------


def test_max_processing_caps_what_is_processing_and_a_freed_slot_wakes_a_socket(http, server, key):
    make_queue(http, maxProcessing=2)
    ids = [post(http, n) for n in range(4)]

    async def run() -> None:
        ws = await connect(server, key)
        await subscribe(ws, ["q"], 10)
        first = [await recv(ws), await recv(ws)]
        assert [f["id"] for f in first] == ids[:2]
        await ping_committer(ws)
        await assert_nothing_before(ws, COMMITTER_PONG)  # at the cap: nothing more
        assert await asyncio.to_thread(claim, http) == [], "nor over HTTP"
        counts = await asyncio.to_thread(held, http)
        assert counts["maxProcessing"] == 2
        await send(ws, {"type": "result", "id": first[0]["id"], "result": 1})
        # The ack, and the freed slot's item at once (its claim may join the result's own
        # group commit, so either may come first).
        frames = {f["type"]: f for f in [await recv(ws, timeout=10), await recv(ws, timeout=10)]}
        assert frames["ack"]["accepted"] is True
        assert frames["item"]["id"] == ids[2]
        await ping_committer(ws)
        await assert_nothing_before(ws, COMMITTER_PONG)
        await ws.close()

    asyncio.run(run())


# -- rateLimit -----------------------------------------------------------------------------------


def test_a_rate_limit_starts_at_most_count_claims_per_window_and_wakes_when_it_opens(
    http, server, key
):
    make_queue(http, rateLimit={"count": 2, "seconds": 2}, leaseSeconds=60)
    assert http.get("/api/queues/q").json()["rateLimit"] == {"count": 2, "seconds": 2}
    ids = [post(http, n) for n in range(5)]

    async def run() -> tuple[list[datetime], list[float]]:
        ws = await connect(server, key)
        await subscribe(ws, ["q"], 10)
        claimed, received, got = [], [], []
        for _ in range(5):
            frame = await recv(ws, timeout=15)
            got.append(frame["id"])
            received.append(time.monotonic())
            # When the server claimed it: its lease's expiry less the queue's leaseSeconds.
            expires = datetime.fromisoformat(frame["leaseExpiresAt"].replace("Z", "+00:00"))
            claimed.append(expires - timedelta(seconds=60))
        await ws.close()
        assert got == ids
        return claimed, received

    claimed, received = asyncio.run(run())
    # Claims started in any 2 seconds: at most 2, by the server's own claim times.
    for n in range(2, 5):
        assert (claimed[n] - claimed[n - 2]).total_seconds() >= 2.0 - 1e-6, claimed
    # And the window's opening woke the socket, not the minute's backstop.
    assert received[-1] - received[0] < 10, received


# -- threadLimit ---------------------------------------------------------------------------------


def test_thread_limit_two_hands_out_the_two_earliest_scheduled_members(http):
    make_queue(http, threadLimit=2)
    later = post(http, "later", threadId="t")
    earliest = post(http, "earliest", threadId="t", scheduledAt=at(-20))
    second = post(http, "second", threadId="t", scheduledAt=at(-10))
    got = claim(http, n=10)
    assert [i["id"] for i in got] == [earliest, second]
    assert claim(http) == []
    assert held(http)["thread"] == 1
    finish(http, got[0])
    assert [i["id"] for i in claim(http)] == [later]


def test_a_claim_hands_out_many_threads_heads_before_a_second_member_of_one(http):
    make_queue(http, threadLimit=3)
    a1 = post(http, "a1", threadId="a")
    a2 = post(http, "a2", threadId="a")
    a3 = post(http, "a3", threadId="a")
    b1 = post(http, "b1", threadId="b")
    c1 = post(http, "c1", threadId="c")
    got = [i["id"] for i in claim(http, n=3)]
    assert got == [a1, b1, c1]
    assert [i["id"] for i in claim(http, n=3)] == [a2, a3]


def test_raising_the_thread_limit_makes_more_members_eligible_at_once(http, server, key):
    make_queue(http)
    ids = [post(http, n, threadId="t") for n in range(3)]
    assert [i["id"] for i in claim(http, n=10)] == ids[:1]

    async def run() -> None:
        ws = await connect(server, key)
        await subscribe(ws, ["q"], 10)
        await ping_committer(ws)
        await assert_nothing_before(ws, COMMITTER_PONG)
        await asyncio.to_thread(make_queue, http, "q", threadLimit=3)
        got = {(await recv(ws, timeout=10))["id"], (await recv(ws, timeout=10))["id"]}
        assert got == set(ids[1:])
        await ws.close()

    asyncio.run(run())


# -- bad input -------------------------------------------------------------------------------


BAD_SETTINGS = [
    {"paused": "yes"},
    {"maxProcessing": 0},
    {"maxProcessing": 1.5},
    {"threadLimit": 0},
    {"threadLimit": None},
    {"rateLimit": {"count": 0, "seconds": 1}},
    {"rateLimit": {"count": 1, "seconds": 0}},
    {"rateLimit": {"count": 1}},
    {"rateLimit": {"count": 1, "seconds": 1, "burst": 2}},
    {"rateLimit": [1, 1]},
]


def test_a_bad_control_setting_is_a_400_and_changes_nothing(http):
    make_queue(http)
    before = http.get("/api/queues/q").json()
    for body in BAD_SETTINGS:  # (one server for all of them: each is one request)
        response = http.put("/api/queues/q", json=body)
        assert response.status_code == 400, (body, response.text)
        assert response.json()["error"]["code"] == "invalid_setting", body
        assert http.get("/api/queues/q").json() == before, body


def test_a_bad_priority_is_a_400_and_posts_nothing(http):
    make_queue(http)
    for priority in (-1, 10, 1.5, "high", True):
        response = http.post("/api/queues/q/items", json={"payload": 1, "priority": priority})
        assert response.status_code == 400, (priority, response.text)
        assert http.get("/api/queues/q").json()["counts"]["pending"] == 0, priority


# -- across two processes ------------------------------------------------------------------------

MAX_PROCESSING = 3
THREAD_LIMIT = 2
THREADS = 10
MEMBERS = 10
SINGLES = 100


def most_at_once(intervals: list[tuple[float, float]]) -> int:
    """The most intervals open at one instant (an end and a start at the same instant do
    not overlap: the end is the worker's send, before the server's verdict)."""
    events = sorted([(s, 1) for s, _e in intervals] + [(e, -1) for _s, e in intervals])
    most = now = 0
    for _t, step in events:
        now += step
        most = max(most, now)
    return most


@needs_shared
def test_two_processes_never_exceed_max_processing_or_thread_limit(
    transactional_db, state_root, make_key
):
    env = {"REDIS_URL": REDIS_URL, "TASKHOSTER_SOCKET_BACKSTOP_SECONDS": "60"}
    servers = [Server(state_root, **env).start(), Server(state_root, **env).start()]
    key = make_key()
    headers = {"Authorization": f"Token {key}"}
    try:
        with httpx.Client(base_url=servers[0].url, headers=headers, timeout=30) as http:
            make_queue(http, "cap", maxProcessing=MAX_PROCESSING, threadLimit=THREAD_LIMIT)
            items = [
                {"payload": [t, m], "threadId": f"t{t}"}
                for m in range(MEMBERS)
                for t in range(THREADS)
            ]
            items += [{"payload": ["solo", n]} for n in range(SINGLES)]
            random.Random(7).shuffle(items)
            response = http.post("/api/queues/cap/items", json={"items": items})
            assert response.status_code == 201
            threads = {i["id"]: i["threadId"] for i in response.json()["items"]}
        intervals = asyncio.run(_race(servers, key, set(threads)))
    finally:
        for server in servers:
            server.stop()

    assert sorted(i for i, _s, _e, _w in intervals) == sorted(threads), "each item once"
    by_worker: dict[str, int] = defaultdict(int)
    for _i, _s, _e, worker in intervals:
        by_worker[worker] += 1
    assert {w.split(":")[0] for w in by_worker} == {"socket0", "socket1", "http0", "http1"}, (
        by_worker
    )
    spans = [(s, e) for _i, s, e, _w in intervals]
    assert most_at_once(spans) <= MAX_PROCESSING
    assert most_at_once(spans) == MAX_PROCESSING, "the cap was reached: the test raced"
    per_thread = defaultdict(list)
    for item_id, s, e, _w in intervals:
        if threads[item_id] is not None:
            per_thread[threads[item_id]].append((s, e))
    for thread, spans_of in per_thread.items():
        assert most_at_once(spans_of) <= THREAD_LIMIT, thread
    print(f"\ntwo processes: {len(intervals)} lease intervals checked, {dict(by_worker)}")


async def _race(
    servers: list[Server], key: str, ids: set[str]
) -> list[tuple[str, float, float, str]]:
    """Socket workers and HTTP claimers on both processes until every item is done; each
    lease interval from the worker's side: from receiving the item to sending its result."""
    intervals: list[tuple[str, float, float, str]] = []
    done: set[str] = set()
    rng = random.Random(11)

    async def hold() -> None:
        await asyncio.sleep(rng.uniform(0.005, 0.03))

    async def socket_worker(n: int, server: Server) -> None:
        ws = await connect(server, key)
        await send(ws, {"type": "subscribe", "queues": ["cap"], "capacity": 2})
        held: dict[str, float] = {}
        pending: set[asyncio.Task[None]] = set()

        async def work(item_id: str) -> None:
            await hold()
            intervals.append((item_id, held.pop(item_id), time.monotonic(), f"socket{n % 2}:{n}"))
            done.add(item_id)
            await send(ws, {"type": "result", "id": item_id, "result": 1})

        try:
            while len(done) < len(ids):
                try:
                    frame = json.loads(await asyncio.wait_for(ws.recv(), 0.5))
                except TimeoutError:
                    continue
                if frame["type"] == "item":
                    held[frame["id"]] = time.monotonic()
                    task = asyncio.create_task(work(frame["id"]))
                    pending.add(task)
                    task.add_done_callback(pending.discard)
                elif frame["type"] == "ack":
                    assert frame["accepted"] is True, frame
        finally:
            await asyncio.gather(*pending)
            await ws.close()

    async def http_claimer(n: int, server: Server) -> None:
        async with httpx.AsyncClient(
            base_url=server.url, headers={"Authorization": f"Token {key}"}, timeout=30
        ) as client:
            while len(done) < len(ids):
                response = await client.post("/api/queues/cap/claim", json={"max": 2, "wait": 1})
                assert response.status_code == 200, response.text
                got = response.json()["items"]
                started = time.monotonic()
                for item in got:
                    await hold()
                    intervals.append((item["id"], started, time.monotonic(), f"http{n % 2}:{n}"))
                    done.add(item["id"])
                    answer = await client.post(
                        f"/api/items/{item['id']}/result", json={"result": 1}
                    )
                    assert answer.status_code == 200
                    assert answer.json()["accepted"] is True

    workers = [socket_worker(n, servers[n % 2]) for n in range(4)]
    workers += [http_claimer(n, servers[n % 2]) for n in range(4)]
    await asyncio.wait_for(asyncio.gather(*workers), 180)
    return intervals
