"""Work in flight (SPEC section 8.2) against a real daphne and real sockets: cancel, progress,
each attempt's story, the registry of connected workers, and drain.

The socket backstop is a minute here: whatever reaches a socket came by news, at once. The
cross-process proofs (two daphnes on PostgreSQL + Redis: a cancel reaching a socket of the
other process within a second, the workers of both listed, a drain reaching the other
process) are ``test_across_two_processes_...`` at the end.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import httpx
import pytest

from ..conftest import Server
from .test_processes import REDIS_URL, needs_shared, wait_for
from .wsclient import (
    COMMITTER_PONG,
    assert_nothing_before,
    connect,
    make_queue,
    ping_committer,
    post,
    recv,
    send,
    status_of,
    subscribe,
)

pytestmark = pytest.mark.slow

ALIVE_SECONDS = 7  # registry.ALIVE_SECONDS: a dead process's sockets are gone by then


@pytest.fixture
def server(server_factory):
    return server_factory(TASKHOSTER_SOCKET_BACKSTOP_SECONDS="60")


def claim(http: httpx.Client, queue: str = "q", n: int = 1) -> list[dict[str, Any]]:
    response = http.post(f"/api/queues/{queue}/claim", json={"max": n})
    assert response.status_code == 200, response.text
    return list(response.json()["items"])


def cancel(http: httpx.Client, item: str, **body: Any) -> httpx.Response:
    return http.post(f"/api/items/{item}/cancel", json=body)


def attempts(http: httpx.Client, item: str) -> list[dict[str, Any]]:
    response = http.get(f"/api/items/{item}/attempts")
    assert response.status_code == 200, response.text
    assert response.json()["omitted"] == 0
    return list(response.json()["attempts"])


def workers(http: httpx.Client) -> list[dict[str, Any]]:
    response = http.get("/api/workers")
    assert response.status_code == 200, response.text
    return list(response.json()["workers"])


def listed(http: httpx.Client, name: str, **expected: Any) -> dict[str, Any]:
    """The worker named ``name`` once the registry shows it as ``expected`` (it is written by
    its process about once a second)."""

    def found() -> dict[str, Any] | None:
        for worker in workers(http):
            if worker["name"] == name and all(worker[k] == v for k, v in expected.items()):
                return worker
        return None

    return wait_for(found, 10, f"worker {name} listed with {expected}")


async def subscribe_named(ws: Any, name: str, capacity: int = 1, queues: Any = ("q",)) -> None:
    await send(
        ws, {"type": "subscribe", "queues": list(queues), "capacity": capacity, "name": name}
    )


async def nothing_pushed(ws: Any) -> None:
    """Nothing was pushed to ``ws`` by what the server committed so far (a marker that the
    committer answers after it; decided by order, not by a clock)."""
    await ping_committer(ws)
    await assert_nothing_before(ws, COMMITTER_PONG)


# -- cancel --------------------------------------------------------------------------------------


def test_cancel_fails_a_held_item_tells_its_socket_at_once_and_refuses_its_later_frames(
    server, http, key
):
    make_queue(http, "dead")
    make_queue(http, deadLetterQueue="dead", maxAttempts=1)

    async def run() -> str:
        async with await connect(server, key) as ws:
            await subscribe_named(ws, "w-cancel")
            item = await asyncio.to_thread(post, http, "work")
            frame = await recv(ws)
            assert (frame["type"], frame["id"]) == ("item", item)
            answer = await asyncio.to_thread(cancel, http, item, reason="not wanted")
            assert answer.status_code == 200, answer.text
            body = answer.json()
            assert (body["status"], body["error"], body["cancelReason"]) == (
                "failed",
                "cancelled",
                "not wanted",
            )
            assert await recv(ws) == {"type": "cancel", "id": item, "reason": "cancelled"}
            # The worker's later frames change nothing.
            for frame in (
                {"type": "progress", "id": item, "progress": 50},
                {"type": "extend", "id": item},
                {"type": "fail", "id": item, "error": "late"},
                {"type": "result", "id": item, "result": "late"},
            ):
                await send(ws, frame)
                ack = await recv(ws)
                assert (ack["type"], ack["id"], ack["accepted"]) == ("ack", item, False), frame
        return item

    item = asyncio.run(run())
    late = http.post(f"/api/items/{item}/result", json={"result": "late"}).json()
    assert late == {"accepted": False, "status": "failed"}
    final = status_of(http, item)
    assert (final["status"], final["error"], final["cancelReason"]) == (
        "failed",
        "cancelled",
        "not wanted",
    )
    assert "deadLetter" not in final, "a cancelled item gets no dead-letter copy"
    assert http.get("/api/queues/dead").json()["counts"]["pending"] == 0
    (only,) = attempts(http, item)
    assert (only["attempt"], only["worker"], only["outcome"], only["error"]) == (
        1,
        "w-cancel",
        "cancelled",
        "cancelled",
    )


def test_cancel_advances_the_thread_at_once_and_a_terminal_item_is_409(server, http, key):
    make_queue(http)
    a = post(http, "A", threadId="t")
    b = post(http, "B", threadId="t")
    c = post(http, "C", threadId="t")
    assert [i["id"] for i in claim(http, n=3)] == [a]

    async def run() -> None:
        async with await connect(server, key) as ws:
            await subscribe(ws, ["q"], 1)
            await nothing_pushed(ws)  # B waits behind A
            # C is pending, behind B: cancelled (a body is optional), it leaves the thread
            # without a claim.
            no_body = await asyncio.to_thread(http.post, f"/api/items/{c}/cancel")
            assert no_body.status_code == 200, no_body.text
            answer = await asyncio.to_thread(cancel, http, a)
            assert answer.status_code == 200
            assert "cancelReason" not in answer.json(), "no reason given, none shown"
            frame = await recv(ws)  # A's cancel made B the head: pushed at once
            assert (frame["type"], frame["id"]) == ("item", b)

    asyncio.run(run())
    assert status_of(http, c)["status"] == "failed"
    assert attempts(http, c) == [], "never claimed: no attempt"
    again = cancel(http, a)
    assert again.status_code == 409, again.text
    assert again.json()["error"]["code"] == "terminal"
    assert cancel(http, "0" * 20).status_code == 404
    assert cancel(http, b, reason="x" * 501).status_code == 400
    not_an_object = http.post(
        f"/api/items/{b}/cancel", content=b"false", headers={"Content-Type": "application/json"}
    )
    assert not_an_object.status_code == 400, not_an_object.text
    # (re-queued when the socket closed; the refused cancels changed nothing)
    assert status_of(http, b)["status"] == "pending"


def test_a_key_limited_to_other_queues_cannot_cancel_or_read_an_items_attempts(
    server, http, make_key
):
    make_queue(http)
    make_queue(http, "other")
    item = post(http, "mine")
    limited = make_key("produce,manage", queues=["other"])
    with httpx.Client(
        base_url=server.url, headers={"Authorization": f"Token {limited}"}, timeout=30
    ) as other:
        assert cancel(other, item).status_code == 404
        assert other.get(f"/api/items/{item}/attempts").status_code == 404
    assert status_of(http, item)["status"] == "pending"


# -- progress ------------------------------------------------------------------------------------


def test_progress_is_kept_while_processing_and_does_not_extend_the_lease(server, http, key):
    make_queue(http, leaseSeconds=600, backoffSeconds=0)
    item = post(http, "work")
    (held,) = claim(http)
    assert held["progress"] is None
    lease = held["lease"]

    def report(value: Any, with_lease: str = lease) -> httpx.Response:
        return http.post(
            f"/api/items/{item}/progress", json={"lease": with_lease, "progress": value}
        )

    assert report({"done": 10}).json() == {"accepted": True}
    now = status_of(http, item)
    assert now["progress"] == {"done": 10}
    assert now["leaseExpiresAt"] == held["leaseExpiresAt"], "progress does not extend"
    assert report({"done": 20}, with_lease="stale").json() == {"accepted": False}
    too_big = report("x" * 5000)
    assert too_big.status_code == 413, too_big.text
    assert status_of(http, item)["progress"] == {"done": 10}, "refused reports change nothing"
    failed = http.post(f"/api/items/{item}/fail", json={"lease": lease, "error": "again"})
    assert failed.json() == {"accepted": True, "status": "pending"}

    async def run() -> None:
        async with await connect(server, key) as ws:
            await subscribe(ws, ["q"], 1)
            frame = await recv(ws)
            assert (frame["id"], frame["attempts"]) == (item, 2)
            assert frame["progress"] is None, "each attempt starts without progress"
            await send(ws, {"type": "progress", "id": item, "progress": [1, 2, 3]})
            assert await recv(ws) == {"type": "ack", "id": item, "accepted": True}
            assert (await asyncio.to_thread(status_of, http, item))["progress"] == [1, 2, 3]
            await send(ws, {"type": "progress", "id": "0" * 20, "progress": 1})
            assert (await recv(ws))["accepted"] is False, "not held: refused"
            await send(ws, {"type": "progress", "id": item, "progress": "y" * 5000})
            assert (await recv(ws))["code"] == "too_large"

    asyncio.run(run())


# -- attempts ------------------------------------------------------------------------------------


def test_attempts_tell_each_claim_and_survive_a_restart_of_the_server(server, http, key, manage):
    """Failed once over HTTP, lapsed once, finished over a socket: three attempts, read back
    after the server restarts."""
    make_queue(http, leaseSeconds=1, backoffSeconds=0, maxAttempts=5)
    item = post(http, "story")
    (first,) = claim(http)
    answer = http.post(
        f"/api/items/{item}/fail", json={"lease": first["lease"], "error": "boom"}
    ).json()
    assert answer == {"accepted": True, "status": "pending"}
    (second,) = claim(http)
    assert second["attempts"] == 2
    time.sleep(1.3)
    assert "1 lapsed lease(s) re-queued" in manage("sweep").stdout

    async def run() -> None:
        async with await connect(server, key) as ws:
            await subscribe_named(ws, "finisher")
            frame = await recv(ws)
            assert (frame["id"], frame["attempts"]) == (item, 3)
            running = attempts(http, item)[-1]
            assert (running["attempt"], running["worker"], running["outcome"]) == (
                3,
                "finisher",
                None,
            )
            await send(ws, {"type": "result", "id": item, "result": "ok"})
            assert (await recv(ws))["accepted"] is True

    asyncio.run(run())
    server.stop()
    server.start()
    story = attempts(http, item)
    assert [(a["attempt"], a["worker"], a["outcome"], a["error"]) for a in story] == [
        (1, "http", "fail", "boom"),
        (2, "http", "lapsed", "lease expired"),
        (3, "finisher", "result", None),
    ]
    for entry in story:
        assert entry["claimedAt"] <= entry["endedAt"]


# -- the registry and drain ----------------------------------------------------------------------


def test_workers_lists_each_open_socket_with_what_it_holds_and_forgets_a_closed_one(
    server, http, key
):
    make_queue(http)
    make_queue(http, "r")

    async def run() -> None:
        one = await connect(server, key)
        two = await connect(server, key)
        await subscribe_named(one, "alpha", capacity=2, queues=["q", "r"])
        await subscribe_named(two, "beta", capacity=1)
        item = await asyncio.to_thread(post, http, "x", "r")
        assert (await recv(one))["id"] == item
        alpha = await asyncio.to_thread(listed, http, "alpha", held=[item])
        assert (alpha["queues"], alpha["capacity"], alpha["draining"]) == (["q", "r"], 2, False)
        assert alpha["connectedAt"] <= alpha["lastSeenAt"]
        beta = await asyncio.to_thread(listed, http, "beta", held=[])
        assert alpha["id"] != beta["id"]
        await two.close()
        await asyncio.to_thread(
            wait_for,
            lambda: all(w["name"] != "beta" for w in workers(http)),
            10,
            "a closed socket leaves the list",
        )
        await one.close()

    asyncio.run(run())


def test_workers_lists_an_item_pushed_to_a_socket_already_listed_idle(server, http, key):
    """A socket listed as holding nothing, which then gets an item pushed without sending a
    frame, is listed with it: its process lists a socket again once what it holds moved,
    not only once it was heard from."""
    make_queue(http)

    async def run() -> None:
        ws = await connect(server, key)
        await subscribe_named(ws, "gamma")
        await asyncio.to_thread(listed, http, "gamma", held=[])
        await asyncio.sleep(1.5)  # listed idle by a later report too
        item = await asyncio.to_thread(post, http, "x")
        assert (await recv(ws))["id"] == item
        await asyncio.to_thread(listed, http, "gamma", held=[item])
        await ws.close()

    asyncio.run(run())


def test_a_drained_worker_gets_nothing_new_and_its_held_items_result_is_accepted(server, http, key):
    make_queue(http)

    async def run() -> None:
        async with await connect(server, key) as ws, await connect(server, key) as spare:
            await subscribe_named(ws, "deploy-1", capacity=5)
            held = await asyncio.to_thread(post, http, "held")
            assert (await recv(ws))["id"] == held
            me = await asyncio.to_thread(listed, http, "deploy-1")
            answer = await asyncio.to_thread(http.post, f"/api/workers/{me['id']}/drain")
            assert answer.status_code == 200, answer.text
            assert answer.json()["draining"] is True
            assert await recv(ws) == {"type": "drain"}
            later = await asyncio.to_thread(post, http, "later")
            await nothing_pushed(ws)
            await subscribe_named(spare, "spare")
            assert (await recv(spare))["id"] == later, "the other socket takes it"
            await send(ws, {"type": "result", "id": held, "result": "done"})
            ack = await recv(ws)
            assert (ack["accepted"], ack["status"]) == (True, "finished")
            await asyncio.to_thread(listed, http, "deploy-1", draining=True, held=[])

    asyncio.run(run())
    assert http.post("/api/workers/0123456789abcdef/drain").status_code == 404
    assert http.post("/api/workers/nothex/drain").status_code == 400


def test_drain_by_name_prefix_drains_those_workers_only(server, http, key):
    make_queue(http)

    async def run() -> None:
        async with (
            await connect(server, key) as a,
            await connect(server, key) as b,
            await connect(server, key) as c,
        ):
            await subscribe_named(a, "web-1:10")
            await subscribe_named(b, "web-2:11")
            await subscribe_named(c, "batch-1:12")
            for name in ("web-1:10", "web-2:11", "batch-1:12"):
                await asyncio.to_thread(listed, http, name)
            answer = await asyncio.to_thread(
                http.post, "/api/workers/drain", json={"namePrefix": "web-"}
            )
            assert answer.status_code == 200, answer.text
            assert sorted(w["name"] for w in answer.json()["workers"]) == ["web-1:10", "web-2:11"]
            assert await recv(a) == {"type": "drain"}
            assert await recv(b) == {"type": "drain"}
            item = await asyncio.to_thread(post, http, "for batch")
            assert (await recv(c))["id"] == item

    asyncio.run(run())
    bad = http.post("/api/workers/drain", json={})
    assert bad.status_code == 400


def test_a_key_limited_to_some_queues_sees_and_drains_only_their_workers(
    server, http, key, make_key
):
    make_queue(http)
    make_queue(http, "other")
    limited = make_key("manage", queues=["other"])

    async def run() -> None:
        async with await connect(server, key) as ws:
            await subscribe_named(ws, "q-worker")
            me = await asyncio.to_thread(listed, http, "q-worker")
            with httpx.Client(
                base_url=server.url, headers={"Authorization": f"Token {limited}"}, timeout=30
            ) as other:
                assert workers(other) == []
                assert other.post(f"/api/workers/{me['id']}/drain").status_code == 404
                drained = other.post("/api/workers/drain", json={"namePrefix": "q-"}).json()
                assert drained == {"workers": []}
            await nothing_pushed(ws)

    asyncio.run(run())


def test_a_killed_server_process_leaves_the_worker_list_within_seconds(
    server, http, key, server_factory
):
    make_queue(http)
    doomed = server_factory(TASKHOSTER_SOCKET_BACKSTOP_SECONDS="60")

    async def run() -> None:
        ws = await connect(doomed, key)
        await subscribe_named(ws, "on-doomed")
        await asyncio.to_thread(listed, http, "on-doomed")
        assert doomed.proc is not None
        os.kill(doomed.proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        await asyncio.to_thread(
            wait_for,
            lambda: all(w["name"] != "on-doomed" for w in workers(http)),
            ALIVE_SECONDS + 5,
            "a dead process's sockets leave the list",
        )
        assert time.monotonic() - killed <= ALIVE_SECONDS + 5
        with pytest.raises(Exception):  # noqa: B017,PT011 (the socket died with its server)
            await ws.recv()

    asyncio.run(run())


# -- across processes (PostgreSQL + Redis) -------------------------------------------------------


@needs_shared
def test_across_two_processes_a_cancel_reaches_the_other_process_socket_within_a_second(
    transactional_db, state_root, make_key
):
    """Workers of both processes listed by either; a cancel made on one process reaches the
    socket holding the item on the other within a second; a drain made on one reaches a
    socket of the other."""
    env = {"REDIS_URL": REDIS_URL, "TASKHOSTER_SOCKET_BACKSTOP_SECONDS": "60"}
    servers = [Server(state_root, **env).start(), Server(state_root, **env).start()]
    key = make_key()
    headers = {"Authorization": f"Token {key}"}
    try:
        with (
            httpx.Client(base_url=servers[0].url, headers=headers, timeout=30) as first,
            httpx.Client(base_url=servers[1].url, headers=headers, timeout=30) as second,
        ):
            make_queue(first)

            async def run() -> None:
                async with (
                    await connect(servers[0], key) as on_first,
                    await connect(servers[1], key) as on_second,
                ):
                    await subscribe_named(on_second, "holder-on-second")
                    await subscribe_named(on_first, "idle-on-first", capacity=0)
                    for http in (first, second):
                        await asyncio.to_thread(listed, http, "holder-on-second")
                        await asyncio.to_thread(listed, http, "idle-on-first")
                    item = await asyncio.to_thread(post, first, "cross")
                    frame = await recv(on_second)
                    assert frame["id"] == item
                    answer = await asyncio.to_thread(cancel, first, item)
                    assert answer.status_code == 200
                    # Within a second of the cancel's answer, on the other process.
                    told = await recv(on_second, timeout=1.0)
                    assert told == {"type": "cancel", "id": item, "reason": "cancelled"}
                    idle = await asyncio.to_thread(listed, second, "idle-on-first")
                    drained = await asyncio.to_thread(
                        second.post, f"/api/workers/{idle['id']}/drain"
                    )
                    assert drained.status_code == 200
                    assert await recv(on_first) == {"type": "drain"}

            asyncio.run(run())
    finally:
        for server in servers:
            server.stop()
