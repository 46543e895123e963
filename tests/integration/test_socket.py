"""The /work socket (SPEC section 6) against a real daphne and a real websocket client."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import textwrap
import time
from datetime import UTC, datetime

import httpx
import pytest
import websockets

from .wsclient import (
    PONG,
    assert_nothing_before,
    committed,
    connect,
    item_of,
    make_queue,
    ping,
    post,
    recv,
    send,
    settled_metric,
    status_of,
    subscribe,
    subscribed,
    ws_url,
)

pytestmark = pytest.mark.slow


@pytest.fixture
def server(server_factory):
    # A long backstop proves that wake-ups are pushed, not found by the periodic re-check.
    return server_factory(TASKHOSTER_SOCKET_BACKSTOP_SECONDS="60")


def test_socket_without_key_is_refused_with_close_code_4401(server):
    async def run():
        ws = await connect(server, None)
        frame = await recv(ws)
        assert frame["type"] == "error"
        assert frame["code"] == "unauthorized"
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await ws.recv()
        assert closed.value.rcvd is not None
        assert closed.value.rcvd.code == 4401

    asyncio.run(run())


def test_socket_with_key_lacking_work_scope_is_refused_with_4403(server, make_key):
    producer = make_key("produce")

    async def run():
        ws = await connect(server, producer)
        assert (await recv(ws))["code"] == "forbidden"
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await ws.recv()
        assert closed.value.rcvd is not None
        assert closed.value.rcvd.code == 4403

    asyncio.run(run())


def test_key_limited_to_queues_cannot_subscribe_to_others(server, http, make_key):
    make_queue(http, "a")
    make_queue(http, "b")

    limited = make_key("work", queues=["a"])

    async def run():
        ws = await connect(server, limited)
        await subscribe(ws, ["b"], 1)
        assert (await recv(ws))["code"] == "forbidden"
        await subscribe(ws, ["a"], 1)
        # Taken: no error (it would come before the ping's answer), and in force.
        await ping(ws)
        await assert_nothing_before(ws, PONG)
        item = post(http, "for a", queue="a")
        await assert_nothing_before(ws, item_of(item))
        await ws.close()

    asyncio.run(run())


def test_items_are_pushed_up_to_capacity_and_a_result_frees_a_slot(server, http, key):
    make_queue(http)

    async def run():
        ws = await connect(server, key)
        await subscribe(ws, ["q"], 2)
        ids = [post(http, n) for n in range(4)]
        first = [await recv(ws), await recv(ws)]
        assert [f["id"] for f in first] == ids[:2]
        assert first[0]["type"] == "item"
        assert first[0]["payload"] == 0
        assert set(first[0]) >= {
            "id",
            "queue",
            "payload",
            "attempts",
            "threadId",
            "scheduledAt",
            "leaseExpiresAt",
            "lease",
        }
        await send(ws, {"type": "result", "id": ids[0], "result": "done"})
        # The ack and the push into the freed slot come from one group commit, either first.
        answers = sorted([await recv(ws), await recv(ws)], key=lambda f: f["type"])
        assert answers[0] == {"type": "ack", "id": ids[0], "accepted": True, "status": "finished"}
        assert (answers[1]["type"], answers[1]["id"]) == ("item", ids[2])
        # Full again (ids 1 and 2): the last item goes to a second socket. Then every item is
        # accounted for, so none was pushed to the first beyond its capacity, before the
        # result or after it (were one, the second socket would wait for it in vain).
        other = await connect(server, key)
        await subscribe(other, ["q"], 2)
        assert (await recv(other, 30))["id"] == ids[3]
        await ping(ws)
        await assert_nothing_before(ws, PONG)
        await other.close()
        await ws.close()

    asyncio.run(run())


def test_items_arrive_in_claim_order(server, http, key):
    make_queue(http)
    later = post(http, "later", scheduledAt="2020-01-01T00:00:02Z")
    earlier = post(http, "earlier", scheduledAt="2020-01-01T00:00:01Z")
    plain = post(http, "now")

    async def run():
        ws = await connect(server, key)
        await subscribe(ws, ["q"], 3)
        got = [(await recv(ws))["id"] for _ in range(3)]
        assert got == [earlier, later, plain]
        await ws.close()

    asyncio.run(run())


def test_items_are_spread_fairly_over_sockets(server, http, key):
    make_queue(http)

    async def run():
        sockets = await subscribed(server, key, 3, ["q"], 5)
        # Each subscription's claim is over (one still in flight holds its socket's
        # slots: the next claim, for the others' alone, would take every item for them).
        committed(http)
        ids = [post(http, n) for n in range(3)]
        # One each ([1, 1, 1]): a socket given two would leave another waiting in vain. Then
        # every item is accounted for: nothing more can come.
        firsts = await asyncio.gather(*(recv(ws, 30) for ws in sockets))
        assert sorted(f["id"] for f in firsts) == sorted(ids)
        for ws in sockets:
            await ws.close()

    asyncio.run(run())


def test_items_that_come_together_are_dealt_one_per_socket_before_any_gets_two(server, http, key):
    """Items one claim takes together (a batch: one commit, one piece of news, one claim for
    every free slot) are dealt round the sockets, least recently served first: not all to
    the first socket while the others, idle, wait. (CI caught the sequential posts above
    taken by one claim once, when a post committed before the claim its news woke.)"""
    make_queue(http)

    async def run():
        sockets = await subscribed(server, key, 3, ["q"], 5)
        # Each subscription's claim is over: one still in flight holds its socket's slots,
        # and the batch's claim would be for the other sockets alone.
        committed(http)
        answer = http.post(
            "/api/queues/q/items", json={"items": [{"payload": n} for n in range(6)]}
        )
        assert answer.status_code == 201, answer.text
        ids = [i["id"] for i in answer.json()["items"]]
        # Two each (six items, three sockets of five free slots): a third item for a socket
        # would come before its PONG.
        got = []
        for ws in sockets:
            got += [(await recv(ws, 30))["id"] for _ in range(2)]
            await ping(ws)
            await assert_nothing_before(ws, PONG)
        assert sorted(got) == sorted(ids)
        for ws in sockets:
            await ws.close()

    asyncio.run(run())


def test_resubscribe_replaces_queues_and_capacity(server, http, key):
    make_queue(http, "a")
    make_queue(http, "b")

    async def run():
        async with await connect(server, key) as ws:
            await subscribe(ws, ["a"], 1)
            await subscribe(ws, ["b"], 2)
            # An item of b arriving shows the second subscription is in force (there is no
            # ack for a subscribe); from then on nothing of a may come.
            b1 = post(http, "b1", queue="b")
            assert (await recv(ws))["id"] == b1
            for_a = post(http, "for a", queue="a")
            # A claim for a would be handed to the committer as "for a" is posted, before b2
            # is: its item would come first (and fill the second slot, so b2 would not come).
            b2 = post(http, "b2", queue="b")
            await assert_nothing_before(ws, item_of(b2))
            b3 = post(http, "b3", queue="b")  # capacity 2 is full
            # A second socket gets b3 and "for a": every item is accounted for, so neither
            # went to the first.
            async with await connect(server, key) as other:
                await subscribe(other, ["a"], 1)
                assert (await recv(other, 30))["id"] == for_a
                await subscribe(other, ["b"], 2)
                assert (await recv(other, 30))["id"] == b3
            await ping(ws)
            await assert_nothing_before(ws, PONG)

    asyncio.run(run())


def test_a_subscribe_to_several_queues_gets_the_waiting_work_of_each_without_the_backstop(
    server_factory, key
):
    # The subscribe wakes a claim per queue at once; the first reserves every free slot and
    # fills one. The others, finding no free slot, must look again when it ends (they returned
    # for good, and b's item waited for the backstop: 60 s here).
    server = server_factory(TASKHOSTER_SOCKET_BACKSTOP_SECONDS="60")
    with httpx.Client(
        base_url=server.url, headers={"Authorization": f"Token {key}"}, timeout=10
    ) as http:
        for name in ("a", "b", "c"):
            make_queue(http, name)
        items = {post(http, f"for {name}", queue=name) for name in ("a", "b", "c")}

        async def run():
            async with await connect(server, key) as ws:
                await subscribe(ws, ["a", "b", "c"], 3)
                got = {(await recv(ws, 30))["id"] for _ in range(3)}
                assert got == items

        asyncio.run(run())


def _slow_first_claim(server_factory, key):
    """A server whose first claim with slots to fill waits a second before it claims."""
    server = server_factory(
        TASKHOSTER_SOCKET_BACKSTOP_SECONDS="60", TASKHOSTER_FAULT="dispatch.slow_claim=1"
    )
    client = httpx.Client(
        base_url=server.url, headers={"Authorization": f"Token {key}"}, timeout=10
    )
    return server, client


def test_an_item_claimed_for_a_queue_the_socket_has_left_goes_back_without_an_attempt(
    server_factory, key
):
    server, http = _slow_first_claim(server_factory, key)
    with http:
        make_queue(http, "a")
        make_queue(http, "b")
        item = post(http, "for a", queue="a")

        async def run():
            async with await connect(server, key) as ws:
                await subscribe(ws, ["a"], 1)  # its claim is in flight for a second
                await asyncio.sleep(0.3)
                await subscribe(ws, ["b"], 1)
                # The claim for a holds the socket's only slot until it has dealt its item:
                # an item of b comes after that, into the freed slot. Had the item of a been
                # pushed here, it would come first (and b's would not come at all).
                other = post(http, "for b", queue="b")
                await assert_nothing_before(ws, item_of(other))

        asyncio.run(run())
        row = status_of(http, item)
        assert (row["status"], row["attempts"]) == ("pending", 0)


def test_a_slot_an_empty_claim_gives_back_serves_news_for_the_sockets_other_queue(
    server_factory, key
):
    server, http = _slow_first_claim(server_factory, key)
    with http:
        make_queue(http, "a")
        make_queue(http, "b")

        async def run():
            async with await connect(server, key) as ws:
                # The claim for a holds the only slot for a second and finds nothing; the
                # item posted to b meanwhile must not wait for the 60 s backstop.
                await subscribe(ws, ["a", "b"], 1)
                await asyncio.sleep(0.3)
                item = post(http, "for b", queue="b")
                # Well within the backstop's first look (60 s after the socket came).
                assert (await recv(ws, timeout=30))["id"] == item

        asyncio.run(run())


def test_clean_close_requeues_held_items_at_once(server, http, key):
    make_queue(http)
    item = post(http, "x")

    async def run():
        ws = await connect(server, key)
        await subscribe(ws, ["q"], 1)
        assert (await recv(ws))["id"] == item
        await ws.close()

    asyncio.run(run())
    deadline = time.monotonic() + 3
    while status_of(http, item)["status"] != "pending":
        assert time.monotonic() < deadline, "not re-queued at once"
        time.sleep(0.05)
    assert status_of(http, item)["attempts"] == 1


WORKER = textwrap.dedent("""
    import asyncio, json, sys, websockets
    async def main(url, key):
        headers = {"Authorization": "Token " + key}
        async with websockets.connect(url, additional_headers=headers) as ws:
            await ws.send(json.dumps({"type": "subscribe", "queues": ["q"], "capacity": 1}))
            frame = json.loads(await ws.recv())
            print(frame["id"], flush=True)
            await asyncio.sleep(3600)
    asyncio.run(main(sys.argv[1], sys.argv[2]))
""")


def _sigkilled_worker_takes(server, key):
    worker = subprocess.Popen(
        [sys.executable, "-c", WORKER, ws_url(server), key], stdout=subprocess.PIPE, text=True
    )
    assert worker.stdout is not None
    try:
        line = worker.stdout.readline().strip()
    finally:
        worker.send_signal(signal.SIGKILL)
        worker.wait(10)
        worker.stdout.close()
    return line


def test_sigkilled_worker_process_has_its_item_requeued_at_once(server, http, key):
    make_queue(http)
    item = post(http, "x")
    assert _sigkilled_worker_takes(server, key) == item
    deadline = time.monotonic() + 5
    while status_of(http, item)["status"] != "pending":
        assert time.monotonic() < deadline, "not re-queued when the worker died"
        time.sleep(0.05)


def test_disconnect_at_max_attempts_dies_with_worker_disconnected(server, http, key):
    make_queue(http, maxAttempts=1)
    item = post(http, "x")
    assert _sigkilled_worker_takes(server, key) == item
    deadline = time.monotonic() + 5
    while status_of(http, item)["status"] != "failed":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert status_of(http, item)["error"] == "worker disconnected"


def test_late_result_after_sweep_requeued_the_lease_is_accepted(server, http, key, manage):
    make_queue(http, leaseSeconds=0.3)
    item = post(http, "x")

    async def run():
        ws = await connect(server, key)
        await subscribe(ws, ["q"], 1)
        assert (await recv(ws))["id"] == item
        await asyncio.sleep(0.5)
        swept = manage("sweep").stdout
        assert "1 lapsed lease(s) re-queued" in swept
        assert status_of(http, item)["status"] == "pending"
        # The worker kept its socket and finishes late: accepted, the item is not terminal.
        await send(ws, {"type": "result", "id": item, "result": "late but fine"})
        assert await recv(ws) == {"type": "ack", "id": item, "accepted": True, "status": "finished"}
        await send(ws, {"type": "result", "id": item, "result": "second"})
        assert (await recv(ws))["accepted"] is False
        await ws.close()

    asyncio.run(run())
    assert status_of(http, item)["result"] == "late but fine"


def test_deleting_a_held_item_sends_cancel(server, http, key):
    make_queue(http)
    item = post(http, "x")

    async def run():
        ws = await connect(server, key)
        await subscribe(ws, ["q"], 1)
        assert (await recv(ws))["id"] == item
        assert http.delete(f"/api/items/{item}").status_code == 204
        assert await recv(ws) == {"type": "cancel", "id": item, "reason": "deleted"}
        await send(ws, {"type": "result", "id": item, "result": "too late"})
        assert await recv(ws) == {"type": "ack", "id": item, "accepted": False}
        nxt = post(http, "next")
        assert (await recv(ws))["id"] == nxt  # the cancelled slot is free again
        await ws.close()

    asyncio.run(run())


def test_timeout_of_a_held_item_sends_cancel_even_from_a_separate_sweep(server, http, key, manage):
    make_queue(http, queueSeconds=0.5, leaseSeconds=60)
    item = post(http, "x")

    async def run():
        ws = await connect(server, key)
        await subscribe(ws, ["q"], 1)
        assert (await recv(ws))["id"] == item
        await asyncio.sleep(0.7)
        manage("sweep")
        assert await recv(ws) == {"type": "cancel", "id": item, "reason": "timeout"}
        await ws.close()

    asyncio.run(run())


def test_bad_frames_get_error_frames_and_the_socket_stays_open(server, http, key):
    make_queue(http)

    async def run():
        ws = await connect(server, key)
        bad = [
            "not json",
            "[1, 2]",
            '{"no": "type"}',
            '{"type": "dance"}',
            '{"type": "subscribe", "queues": ["q"]}',
            '{"type": "subscribe", "queues": "q", "capacity": 1}',
            '{"type": "subscribe", "queues": ["q"], "capacity": -1}',
            '{"type": "subscribe", "queues": ["../etc"], "capacity": 1}',
            '{"type": "subscribe", "queues": ["nope"], "capacity": 1}',
            '{"type": "result", "id": "../../x", "result": 1}',
            '{"type": "result", "id": "unknownid", "result": 1}',
            '{"type": "result", "id": "x"}',
            '{"type": "fail", "id": "x", "retry": "yes"}',
            '{"type": "extend", "id": "x", "seconds": "soon"}',
            '{"type": "result", "id": "x", "result": 1, "extra": true}',
        ]
        await send(ws, {"type": "result", "id": "neverexisted", "result": 1})
        assert await recv(ws) == {
            "type": "error",
            "code": "item_not_found",
            "message": "item 'neverexisted' does not exist",
            "id": "neverexisted",
        }
        for frame in bad:
            await ws.send(frame)
            answer = await recv(ws)
            assert answer["type"] == "error", (frame, answer)
            assert answer["code"]
            assert answer["message"]
        await ws.send(b"\x00binary")
        assert (await recv(ws))["code"] == "text_frames_only"
        # still open and working
        await subscribe(ws, ["q"], 1)
        item = post(http, "ok")
        assert (await recv(ws))["id"] == item
        await ws.close()

    asyncio.run(run())
    deadline = time.monotonic() + 3
    while http.get("/api/queues/q").json()["counts"]["pending"] != 1:
        assert time.monotonic() < deadline, "the closed socket's item was not re-queued"
        time.sleep(0.05)
    assert http.get("/api/queues/q").json()["counts"] == {
        "pending": 1,
        "processing": 0,
        "finished": 0,
        "failed": 0,
    }


def test_a_frame_holding_a_lone_surrogate_gets_bad_json_and_changes_nothing(server, http, key):
    """A ``\\ud800`` escape is valid JSON but no text a file or a database can keep: a result,
    progress or fail holding one is refused with an error frame (not an internal error that
    closes the socket), and the item stays held until a good result."""
    make_queue(http)
    item = post(http, "x")

    async def run():
        ws = await connect(server, key)
        await subscribe(ws, ["q"], 1)
        held = await recv(ws)
        assert held["id"] == item
        lease = held["lease"]
        for frame in [
            f'{{"type": "result", "id": "{item}", "result": "\\ud800"}}',
            f'{{"type": "result", "id": "{item}", "result": {{"a": ["\\udfff"]}}}}',
            f'{{"type": "progress", "id": "{item}", "progress": "\\ud800"}}',
            f'{{"type": "fail", "id": "{item}", "lease": "{lease}", "error": "\\ud800"}}',
        ]:
            await ws.send(frame)
            answer = await recv(ws)
            assert answer["type"] == "error", (frame, answer)
            assert answer["code"] == "bad_json", (frame, answer)
            assert "lone surrogate" in answer["message"]
        assert http.get(f"/api/items/{item}").json()["status"] == "processing"
        # A pair is text: it is kept as such.
        await send(ws, {"type": "result", "id": item, "result": "\U0001f600"})
        assert await recv(ws) == {"type": "ack", "id": item, "accepted": True, "status": "finished"}
        await ws.close()

    asyncio.run(run())
    assert http.get(f"/api/items/{item}").json()["result"] == "\U0001f600"


def test_fail_and_extend_for_an_item_not_held_are_acked_false(server, http, key):
    make_queue(http)
    item = post(http, "x")

    async def run():
        ws = await connect(server, key)
        await send(ws, {"type": "fail", "id": item})
        assert await recv(ws) == {"type": "ack", "id": item, "accepted": False}
        await send(ws, {"type": "extend", "id": item})
        assert await recv(ws) == {"type": "ack", "id": item, "accepted": False}
        await ws.close()

    asyncio.run(run())
    assert status_of(http, item)["status"] == "pending"


def test_fail_over_the_socket_uses_the_held_lease_and_backs_off(server, http, key):
    make_queue(http, backoffSeconds=30)
    item = post(http, "x")

    async def run():
        ws = await connect(server, key)
        await subscribe(ws, ["q"], 1)
        assert (await recv(ws))["id"] == item
        await send(ws, {"type": "extend", "id": item, "seconds": 5})
        ack = await recv(ws)
        assert ack["accepted"] is True
        assert ack["leaseExpiresAt"].endswith("Z")
        failed_at = datetime.now(UTC)
        await send(ws, {"type": "fail", "id": item, "error": "boom"})
        assert await recv(ws) == {"type": "ack", "id": item, "accepted": True, "status": "pending"}
        due = datetime.fromisoformat(status_of(http, item)["scheduledAt"])
        assert (due - failed_at).total_seconds() >= 29.9, due  # backed off 30 s
        # So not pushed again now. The fail freed the slot and a claim for it went to the
        # committer with the fail, before the next post: had that claim found the item
        # due, it would come first (and fill the only slot).
        nxt = post(http, "next")
        await assert_nothing_before(ws, item_of(nxt))
        await ws.close()

    asyncio.run(run())


def test_delayed_item_arrives_at_its_scheduled_at_not_at_the_backstop(server_factory, key):
    # The backstop looks only every 60 s: an item that arrives well before that came from
    # the timer armed for its scheduledAt, and never before it.
    server = server_factory(TASKHOSTER_SOCKET_BACKSTOP_SECONDS="60")
    http = httpx.Client(base_url=server.url, headers={"Authorization": f"Token {key}"}, timeout=10)
    make_queue(http)

    async def run():
        ws = await connect(server, key)
        await subscribe(ws, ["q"], 1)
        await ping(ws)
        await assert_nothing_before(ws, PONG)
        started = time.monotonic()
        item = post(http, "later", delaySeconds=1.5)
        frame = await recv(ws, 30)
        waited = time.monotonic() - started
        assert frame["id"] == item
        assert 1.4 <= waited <= 20, waited
        await ws.close()

    try:
        asyncio.run(run())
    finally:
        http.close()


def test_sweep_in_another_process_wakes_a_waiting_socket_without_polling(server, http, key, manage):
    make_queue(http, leaseSeconds=0.3)
    item = post(http, "x")
    claimed = http.post("/api/queues/q/claim", json={}).json()["items"]
    assert [c["id"] for c in claimed] == [item]

    async def run():
        ws = await connect(server, key)
        await subscribe(ws, ["q"], 1)
        await ping(ws)
        await assert_nothing_before(ws, PONG)  # subscribed, and the item still held
        committed(http)  # so is the claim the subscription made: only news can wake it now
        await asyncio.sleep(0.5)  # past the 0.3 s lease
        # The sweep re-queued it: nothing had taken it again before the sweep.
        assert "1 lapsed lease(s) re-queued" in manage("sweep").stdout
        # Timed from the sweep's end, not from its start (a process that starts Django takes
        # seconds on a slow day): the backstop is 60 s here, so a push within 10 s of it came
        # by the news, not by a poll.
        swept = time.monotonic()
        frame = await recv(ws, 10)
        assert frame["id"] == item
        assert frame["attempts"] == 2
        assert time.monotonic() - swept < 10
        await ws.close()

    asyncio.run(run())


def test_one_new_item_costs_one_claim_with_fifty_idle_sockets(server, http, key):
    make_queue(http)

    async def run():
        # Each subscription is in force, and the claim it made (finding nothing) was handed to
        # the committer before its ping was answered: ``settled_metric`` counts them all.
        sockets = await subscribed(server, key, 50, ["q"], 1)
        # A subscription that came while a claim was in flight is looked at once more when
        # that claim ends: a claim made after the ping's answer, and maybe after the first
        # reading's barrier. Read until two readings agree: by the second barrier's claims
        # (handed in on the same loop after that answer came back) it was handed in too.
        before = await asyncio.to_thread(settled_metric, http, "claim_attempts")
        while (again := await asyncio.to_thread(settled_metric, http, "claim_attempts")) != before:
            before = again
        item = post(http, "one")
        receiving = [asyncio.ensure_future(recv(ws, 30)) for ws in sockets]
        done, _ = await asyncio.wait(receiving, timeout=30, return_when=asyncio.FIRST_COMPLETED)
        assert done, "the item reached no socket"
        # Then every socket answers a ping: the item is the only frame any of them got.
        for ws in sockets:
            await ping(ws)
        frames = await asyncio.gather(*receiving)
        received = [f for f in frames if f != PONG]
        assert [f["id"] for f in received] == [item]
        await assert_nothing_before(sockets[frames.index(received[0])], PONG)
        # A second claim would have been made for the post's news, before the item came.
        after = await asyncio.to_thread(settled_metric, http, "claim_attempts")
        assert after - before == 1
        for ws in sockets:
            await ws.close()

    asyncio.run(run())


def test_two_server_processes_share_the_state_root_and_wake_each_other(server_factory, key):
    first = server_factory(TASKHOSTER_SOCKET_BACKSTOP_SECONDS="60")
    second = server_factory(TASKHOSTER_SOCKET_BACKSTOP_SECONDS="60")
    headers = {"Authorization": f"Token {key}"}
    with httpx.Client(base_url=first.url, headers=headers, timeout=10) as http:
        make_queue(http)

        async def run():
            ws = await connect(second, key)
            await subscribe(ws, ["q"], 1)
            # In force before the post, and the claim it made committed (finding nothing):
            # the item can reach it only by the first process's news, or the backstop.
            await ping(ws)
            await assert_nothing_before(ws, PONG)
            with httpx.Client(base_url=second.url, headers=headers, timeout=10) as on_second:
                committed(on_second)
            item = post(http, "via the first process")
            # The second process's backstop first looks 60 s after its first socket: a push
            # within 30 s came by the news (timed generously: a loaded machine is slow, not
            # a minute slow).
            assert (await recv(ws, 30))["id"] == item
            await send(ws, {"type": "result", "id": item, "result": 1})
            assert (await recv(ws))["accepted"] is True
            await ws.close()

        asyncio.run(run())


def test_an_idle_socket_stays_open_and_served_past_seven_seconds(server, http, key):
    # With REDIS_URL set, channels-redis blocks 5 s at a time reading the layer; the socket
    # must outlive that (it once closed after ~6 s).
    make_queue(http)

    async def run():
        ws = await connect(server, key)
        await subscribe(ws, ["q"], 1)
        await asyncio.sleep(7.5)  # idle: the time is the point here (a slow machine adds to it)
        # Nothing came meanwhile (it would come first), and the socket still serves.
        item = post(http, "after a long idle")
        await assert_nothing_before(ws, item_of(item))
        await ws.close()

    asyncio.run(run())


def test_every_kind_of_frame_the_consumer_sends_matches_the_asyncapi_document(server, http, key):
    """item, ack, error and cancel, each as a real consumer sent it over a real socket, checked
    against the served document (``recv`` checks every frame; here each kind is made to
    come once). The unit tests check frames built by hand; this one checks the sender."""
    make_queue(http)
    first = post(http, {"n": 1}, threadId="t 1", key="k1")

    async def run() -> set[str]:
        seen: set[str] = set()
        async with await connect(server, key) as ws:
            await subscribe(ws, ["q"], 1)
            item = await recv(ws, timeout=10)
            assert item["type"] == "item"
            assert item["id"] == first
            seen.add(item["type"])
            await send(ws, {"type": "result", "id": first, "result": {"ok": True}})
            ack = await recv(ws, timeout=10)
            assert (ack["type"], ack["id"], ack["accepted"]) == ("ack", first, True)
            seen.add(ack["type"])
            await ws.send("not json")
            error = await recv(ws, timeout=10)
            assert error["type"] == "error"
            seen.add(error["type"])
            second = post(http, {"n": 2})
            held = await recv(ws, timeout=10)
            assert (held["type"], held["id"]) == ("item", second)
            assert http.delete(f"/api/items/{second}").status_code == 204
            cancel = await recv(ws, timeout=10)
            assert (cancel["type"], cancel["id"]) == ("cancel", second)
            seen.add(cancel["type"])
        return seen

    assert asyncio.run(run()) == {"item", "ack", "error", "cancel"}
