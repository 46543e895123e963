"""Socket frames that name their lease (issue 11): a ``fail`` or ``extend`` from an attempt
whose lease lapsed cannot be applied to a later attempt of the same item pushed to the same
socket; a ``result`` from it still counts (rule 3), and ends the later attempt cleanly."""

from __future__ import annotations

import asyncio

import pytest

from taskhoster.client import AsyncProducer, Job, PermanentError, Worker
from taskhoster.client import worker as worker_module

from .wsclient import (
    COMMITTER_PONG,
    PONG,
    assert_nothing_before,
    connect,
    make_queue,
    ping,
    ping_committer,
    post,
    recv,
    send,
    status_of,
    subscribe,
)

pytestmark = pytest.mark.slow

LEASE_SECONDS = 1


@pytest.fixture
def server(server_factory):
    # A long backstop: nothing is pushed by the periodic re-check, only by news.
    return server_factory(TASKHOSTER_SOCKET_BACKSTOP_SECONDS="60")


async def frames(ws, n):
    return [await recv(ws) for _ in range(n)]


async def pushed_again(ws, http, manage, item, first, capacity):
    """Let the first attempt's lease lapse and the sweep re-queue it, and have the item pushed
    to this same socket again; the item frame of the second attempt.

    With capacity 1 the socket's only slot is still taken by the first attempt: the old
    handler's keepalive (an ``extend`` without a lease, as before leases on frames) is
    refused and frees it. With capacity 2 the spare slot takes the item back at once."""
    await asyncio.sleep(LEASE_SECONDS + 0.3)
    swept = (await asyncio.to_thread(manage, "sweep")).stdout
    assert "1 lapsed lease(s) re-queued" in swept
    if capacity == 1:
        await send(ws, {"type": "extend", "id": item})
        answers = sorted(await frames(ws, 2), key=lambda f: f["type"])
        assert (answers[0]["type"], answers[0]["accepted"]) == ("ack", False)
        second = answers[1]
    else:
        second = await recv(ws)
    assert (second["type"], second["id"]) == ("item", item)
    assert second["lease"] != first["lease"]
    assert second["attempts"] == first["attempts"] + 1 == 2
    now = status_of(http, item)
    assert (now["status"], now["attempts"]) == ("processing", 2)
    return second


@pytest.mark.parametrize("capacity", [1, 2])
def test_a_stale_fail_or_extend_is_refused_and_leaves_the_new_attempt_running(
    server, http, key, manage, capacity
):
    make_queue(http, leaseSeconds=LEASE_SECONDS, backoffSeconds=30)
    a = post(http, "A", threadId="t")
    b = post(http, "B", threadId="t")

    async def run():
        async with await connect(server, key) as ws:
            await subscribe(ws, ["q"], capacity)
            first = await recv(ws)
            assert (first["type"], first["id"]) == ("item", a)
            second = await pushed_again(ws, http, manage, a, first, capacity)
            before = status_of(http, a)

            # The first attempt's handler gives up, naming its own (lapsed) lease.
            await send(
                ws, {"type": "fail", "id": a, "lease": first["lease"], "error": "old handler"}
            )
            assert await recv(ws) == {"type": "ack", "id": a, "accepted": False}
            # B is not started: A still holds the thread. (Had the fail ended A's attempt,
            # a claim for B would have gone to the committer before this ping, and B would
            # be pushed before its answer.)
            await ping_committer(ws)
            await assert_nothing_before(ws, COMMITTER_PONG)
            assert status_of(http, a) == before  # still processing, attempts 2, same lease
            assert status_of(http, b)["status"] == "pending"

            # Its keepalive is refused too, and does not extend the new attempt's lease.
            await send(ws, {"type": "extend", "id": a, "lease": first["lease"]})
            assert await recv(ws) == {"type": "ack", "id": a, "accepted": False}
            assert status_of(http, a) == before

            # The socket still holds the second attempt: its own frames are applied.
            await send(ws, {"type": "extend", "id": a, "lease": second["lease"]})
            ack = await recv(ws)
            assert (ack["accepted"], ack["id"]) == (True, a)
            assert status_of(http, a)["leaseExpiresAt"] == ack["leaseExpiresAt"]
            await send(
                ws,
                {
                    "type": "fail",
                    "id": a,
                    "lease": second["lease"],
                    "error": "new handler",
                    "retry": False,
                },
            )
            answers = sorted(await frames(ws, 2), key=lambda f: f["type"])
            assert answers[0] == {"type": "ack", "id": a, "accepted": True, "status": "failed"}
            assert (answers[1]["type"], answers[1]["id"]) == ("item", b)  # the thread moved on

    asyncio.run(run())
    dead = status_of(http, a)
    assert (dead["status"], dead["error"], dead["attempts"]) == ("failed", "new handler", 2)
    assert status_of(http, b)["attempts"] == 1


def _verdict_frame(batched: bool, entry: dict) -> dict:
    """A verdict as a lone ``result`` frame, or as the one entry of a ``results`` frame."""
    if batched:
        return {"type": "results", "results": [entry]}
    return {"type": "result", **entry}


def _answer_frame(batched: bool, ack: dict) -> dict:
    """Its answer: an ``ack`` frame, or an ``acks`` frame of that one entry."""
    if batched:
        return {"type": "acks", "acks": [ack]}
    return {"type": "ack", **ack}


@pytest.mark.parametrize("batched", [False, True], ids=["result", "results-frame"])
def test_a_stale_result_is_accepted_and_cancels_the_new_attempt(server, http, key, manage, batched):
    """Rule 3 whatever the lease, as a lone ``result`` and as an entry of a ``results``
    frame (the extension): the first verdict wins, the attempt the socket now holds is
    cancelled before the answer says so, and only then is its slot given to other work."""
    make_queue(http, leaseSeconds=LEASE_SECONDS)
    a = post(http, "A", threadId="t")
    b = post(http, "B", threadId="t")

    async def run():
        async with await connect(server, key) as ws:
            await subscribe(ws, ["q"], 1)
            first = await recv(ws)
            assert first["id"] == a
            second = await pushed_again(ws, http, manage, a, first, 1)

            # The first attempt finishes late: rule 3, the first result wins whatever its lease.
            old = {"id": a, "lease": first["lease"], "result": "old"}
            await send(ws, _verdict_frame(batched, old))
            got = await frames(ws, 3)
            kinds = [f["type"] for f in got]
            cancel = {"type": "cancel", "id": a, "reason": "finished", "lease": second["lease"]}
            ack = _answer_frame(batched, {"id": a, "accepted": True, "status": "finished"})
            assert cancel in got, got
            assert ack in got, got
            assert got.index(cancel) < got.index(ack)  # told to stop before the ack
            # The second attempt's slot is free: the thread's next member comes to it.
            assert kinds.count("item") == 1
            assert got[kinds.index("item")]["id"] == b

            # The second attempt's own verdict comes too late and changes nothing.
            new = {"id": a, "lease": second["lease"], "result": "new"}
            await send(ws, _verdict_frame(batched, new))
            assert await recv(ws) == _answer_frame(
                batched, {"id": a, "accepted": False, "status": "finished"}
            )
            await send(ws, {"type": "fail", "id": a, "lease": second["lease"]})
            assert await recv(ws) == {"type": "ack", "id": a, "accepted": False}
            # Nothing more: every item is accounted for, and whatever these frames caused
            # (a cancel, say) would have been sent before the ping was answered.
            await ping(ws)
            await assert_nothing_before(ws, PONG)

    asyncio.run(run())
    done = status_of(http, a)
    assert (done["status"], done["result"], done["attempts"]) == ("finished", "old", 2)
    assert status_of(http, b)["attempts"] == 1  # pushed once (re-queued as the socket closed)


def test_a_result_with_the_held_lease_is_taken_as_before(server, http, key, manage):
    make_queue(http, leaseSeconds=LEASE_SECONDS)
    a = post(http, "A", threadId="t")
    b = post(http, "B", threadId="t")

    async def run():
        async with await connect(server, key) as ws:
            await subscribe(ws, ["q"], 1)
            first = await recv(ws)
            second = await pushed_again(ws, http, manage, a, first, 1)
            await send(ws, {"type": "result", "id": a, "lease": second["lease"], "result": 2})
            answers = sorted(await frames(ws, 2), key=lambda f: f["type"])
            assert answers[0] == {"type": "ack", "id": a, "accepted": True, "status": "finished"}
            assert (answers[1]["type"], answers[1]["id"]) == ("item", b)  # no cancel
            # The first attempt's result is now the later one: refused, and nothing cancelled.
            await send(ws, {"type": "result", "id": a, "lease": first["lease"], "result": 1})
            assert (await recv(ws))["accepted"] is False
            await ping(ws)
            await assert_nothing_before(ws, PONG)  # nothing cancelled, before or after

    asyncio.run(run())
    assert status_of(http, a)["result"] == 2


def test_frames_without_a_lease_answer_the_held_attempt_as_before(server, http, key):
    make_queue(http, backoffSeconds=30)
    one = post(http, 1)
    two = post(http, 2)

    async def run():
        async with await connect(server, key) as ws:
            await subscribe(ws, ["q"], 2)
            held = {f["id"]: f for f in await frames(ws, 2)}
            assert set(held) == {one, two}
            await send(ws, {"type": "extend", "id": one, "seconds": 5})
            assert (await recv(ws))["accepted"] is True
            await send(ws, {"type": "fail", "id": one, "error": "boom"})
            assert await recv(ws) == {
                "type": "ack",
                "id": one,
                "accepted": True,
                "status": "pending",
            }
            await send(ws, {"type": "result", "id": two, "result": "ok"})
            assert await recv(ws) == {
                "type": "ack",
                "id": two,
                "accepted": True,
                "status": "finished",
            }
            # With the lease of the item frame they answer, the same frames are accepted too;
            # for an item the socket does not hold, any lease is refused.
            three = post(http, 3)
            pushed = await recv(ws)
            assert pushed["id"] == three
            await send(ws, {"type": "extend", "id": three, "lease": pushed["lease"]})
            assert (await recv(ws))["accepted"] is True
            await send(ws, {"type": "fail", "id": one, "lease": held[one]["lease"]})
            assert await recv(ws) == {"type": "ack", "id": one, "accepted": False}
            await send(ws, {"type": "result", "id": three, "lease": pushed["lease"], "result": 3})
            assert (await recv(ws))["accepted"] is True
            return three

    three = asyncio.run(run())
    assert status_of(http, one)["status"] == "pending"
    assert status_of(http, two)["result"] == "ok"
    assert status_of(http, three)["result"] == 3


@pytest.mark.parametrize(
    "lease", ["x" * 1000, "", 42, None, ["l"]], ids=["long", "empty", "number", "null", "list"]
)
def test_a_malformed_lease_gets_an_invalid_lease_error_and_changes_nothing(
    server, http, key, lease
):
    make_queue(http)
    item = post(http, "x")

    async def run():
        async with await connect(server, key) as ws:
            await subscribe(ws, ["q"], 1)
            pushed = await recv(ws)
            before = status_of(http, item)
            for frame in (
                {"type": "fail", "id": item, "retry": False},
                {"type": "extend", "id": item},
                {"type": "result", "id": item, "result": "r"},
            ):
                await send(ws, {**frame, "lease": lease})
                error = await recv(ws)
                assert (error["type"], error["code"]) == ("error", "invalid_lease")
                assert f"{frame['type']}.lease" in error["message"]
            assert status_of(http, item) == before
            # The socket still holds the item under its lease.
            await send(ws, {"type": "fail", "id": item, "lease": pushed["lease"], "retry": False})
            assert (await recv(ws))["accepted"] is True

    asyncio.run(run())
    assert status_of(http, item)["status"] == "failed"


def test_the_client_worker_names_its_lease_on_every_frame(server, key, monkeypatch):
    sent: list[dict] = []
    acks: list[dict] = []
    request = worker_module._Session.request

    async def recording(self, frame):
        sent.append(dict(frame))
        ack = await request(self, frame)
        acks.append(ack)
        return ack

    monkeypatch.setattr(worker_module._Session, "request", recording)
    worker = Worker(server.url, key, capacity=1)
    jobs: dict[str, Job] = {}

    @worker.handler("q")
    async def handle(job: Job):
        jobs[job.id] = job
        if job.payload == "fail":
            raise PermanentError("no")
        await asyncio.sleep(LEASE_SECONDS * 0.8)  # past half the lease: one keepalive
        return "ok"

    async def main():
        async with AsyncProducer(server.url, key) as producer:
            await producer.put_queue("q", lease_seconds=LEASE_SECONDS)
            task = asyncio.create_task(worker.serve())
            try:
                fine = await producer.post("q", "ok")
                bad = await producer.post("q", "fail")
                assert (await producer.wait(fine.id, timeout=10)).status == "finished"
                assert (await producer.wait(bad.id, timeout=10)).status == "failed"
            finally:
                worker.stop(hand_back=True)
                await asyncio.wait_for(task, 10)
            return fine.id, bad.id

    fine, bad = asyncio.run(main())
    kinds = [(f["type"], f["id"]) for f in sent]
    assert ("extend", fine) in kinds
    assert ("result", fine) in kinds
    assert ("fail", bad) in kinds
    for frame in sent:
        assert frame["lease"] == jobs[frame["id"]].lease, frame
    assert all(ack["accepted"] for ack in acks), acks


def test_the_client_worker_ignores_a_cancel_for_another_lease(server, key, monkeypatch):
    """A ``cancel`` naming another lease than the one the handler answers for is not for it."""
    sessions: list = []
    init = worker_module._Session.__init__

    def remember(self, *args, **kwargs):
        init(self, *args, **kwargs)
        sessions.append(self)

    monkeypatch.setattr(worker_module._Session, "__init__", remember)
    worker = Worker(server.url, key, capacity=1)
    started = asyncio.Event()
    release = asyncio.Event()

    @worker.handler("q")
    async def handle(job: Job):
        started.set()
        await asyncio.wait_for(release.wait(), 10)
        return "kept"

    async def main():
        async with AsyncProducer(server.url, key) as producer:
            await producer.put_queue("q")
            task = asyncio.create_task(worker.serve())
            try:
                item = await producer.post("q", 1)
                await asyncio.wait_for(started.wait(), 10)
                running = sessions[-1].running[item.id]
                sessions[-1].on_cancel({"type": "cancel", "id": item.id, "lease": "another"})
                await asyncio.sleep(0.2)
                assert not running.task.done()
                release.set()
                return await producer.wait(item.id, timeout=10)
            finally:
                worker.stop(hand_back=True)
                await asyncio.wait_for(task, 10)

    done = asyncio.run(main())
    assert (done.status, done.result) == ("finished", "kept")


def test_the_client_worker_answers_an_item_that_came_back_with_its_new_lease(
    server, key, manage, monkeypatch
):
    """Its lease lapsed (no keepalive here) and the item came back to the same worker while
    the handler still ran: the handler answers for the new attempt, under the new lease."""
    sessions: list = []
    sent: list[dict] = []
    init, request = worker_module._Session.__init__, worker_module._Session.request

    def remember(self, *args, **kwargs):
        init(self, *args, **kwargs)
        sessions.append(self)

    async def recording(self, frame):
        sent.append(dict(frame))
        return await request(self, frame)

    async def no_keepalive(self, entry):
        return None

    monkeypatch.setattr(worker_module._Session, "__init__", remember)
    monkeypatch.setattr(worker_module._Session, "request", recording)
    monkeypatch.setattr(worker_module._Session, "keepalive", no_keepalive)
    worker = Worker(server.url, key, capacity=2)
    jobs: list[Job] = []
    release = asyncio.Event()

    @worker.handler("q")
    async def handle(job: Job):
        jobs.append(job)
        await asyncio.wait_for(release.wait(), 20)
        raise PermanentError("late")

    async def main():
        async with AsyncProducer(server.url, key) as producer:
            await producer.put_queue("q", lease_seconds=LEASE_SECONDS)
            task = asyncio.create_task(worker.serve())
            try:
                item = await producer.post("q", 1)
                while not jobs:
                    await asyncio.sleep(0.02)
                await asyncio.sleep(LEASE_SECONDS + 0.3)
                swept = (await asyncio.to_thread(manage, "sweep")).stdout
                assert "1 lapsed lease(s) re-queued" in swept
                running = sessions[-1].running[item.id]
                for _ in range(250):
                    if running.job.lease != jobs[0].lease:
                        break
                    await asyncio.sleep(0.02)
                assert running.job.lease != jobs[0].lease, "not pushed back to this worker"
                release.set()
                return await producer.wait(item.id, timeout=10), running.job.lease
            finally:
                worker.stop(hand_back=True)
                await asyncio.wait_for(task, 10)

    done, lease = asyncio.run(main())
    assert len(jobs) == 1  # one handler for both attempts
    assert (done.status, done.error, done.attempts) == ("failed", "late", 2)
    assert [(f["type"], f["lease"]) for f in sent] == [("fail", lease)]
