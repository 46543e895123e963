"""taskhoster.client and work in flight (SPEC section 8.2), against a real daphne: cancel,
attempts, workers and drain from a producer; a Worker's name, its handlers stopped by a
cancel (an async one cancelled, a plain one seeing ``job.cancelled``), progress from either
kind, and a drain that lets the held item finish and then closes the worker."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time
import uuid

import httpx
import pytest

from taskhoster.client import (
    AsyncProducer,
    Conflict,
    Job,
    NotFound,
    Producer,
    Worker,
)
from taskhoster.client import worker as worker_module

pytestmark = pytest.mark.slow


@pytest.fixture
def server(server_factory):
    return server_factory()


@contextlib.asynccontextmanager
async def serving(worker):
    """Run the worker while the block runs (once it has subscribed), then stop it."""
    task = asyncio.create_task(worker.serve())
    deadline = time.monotonic() + 10
    while worker.connected < 1:
        if task.done():
            task.result()
        assert time.monotonic() < deadline, "the worker did not connect"
        await asyncio.sleep(0.02)
    try:
        yield task
    finally:
        worker.stop(hand_back=True)
        await asyncio.wait_for(task, 10)


async def until(condition, timeout=10.0, what="the condition"):
    """Await ``condition()`` (a coroutine function or a plain one) until it is truthy."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def run_with_producer(server, key, body, **queue_settings):
    async def main():
        async with AsyncProducer(server.url, key) as producer:
            await producer.put_queue("q", **queue_settings)
            await body(producer)

    asyncio.run(main())


@pytest.fixture
def verdicts_sent(monkeypatch):
    """The (type, id) of every frame a Worker's session sends and waits on (passed through
    unchanged): results, fails, extends and progress."""
    sent: list[tuple[str, str]] = []
    request = worker_module._Session.request

    async def recording(self, frame):
        sent.append((frame["type"], frame["id"]))
        return await request(self, frame)

    monkeypatch.setattr(worker_module._Session, "request", recording)
    return sent


async def named(producer, name, held=None):
    """The connected worker of that name, once the server lists it (holding ``held``, if
    given: the listing is published about once a second)."""

    async def find():
        found = next((w for w in await producer.workers() if w.name == name), None)
        return found if found is not None and held in (None, found.held) else None

    return await until(find, what=f"worker {name!r} to be listed")


# -- producer calls --------------------------------------------------------------------------


def test_cancel_attempts_and_rest_progress_from_a_producer(server, key):
    with (
        Producer(server.url, key) as producer,
        httpx.Client(
            base_url=server.url, headers={"Authorization": f"Token {key}"}, timeout=10
        ) as http,
    ):
        producer.put_queue("q")
        item = producer.post("q", {"n": 1})
        claimed = http.post("/api/queues/q/claim", json={"max": 1, "wait": 0}).json()["items"]
        assert [c["id"] for c in claimed] == [item.id]
        lease = claimed[0]["lease"]

        assert producer.report_progress(item.id, lease, {"done": 3, "of": 10}) is True
        assert producer.get(item.id).progress == {"done": 3, "of": 10}
        assert producer.report_progress(item.id, "not-the-lease", {"done": 4}) is False
        assert producer.get(item.id).progress == {"done": 3, "of": 10}

        running = producer.attempts(item.id)
        assert (len(running), running.omitted) == (1, 0)
        (first,) = running
        assert (first.attempt, first.worker, first.outcome, first.ended_at) == (
            1,
            "http",
            None,
            None,
        )
        assert first.claimed_at is not None

        cancelled = producer.cancel(item.id, reason="posted twice")
        assert (cancelled.status, cancelled.error, cancelled.cancel_reason) == (
            "failed",
            "cancelled",
            "posted twice",
        )
        assert cancelled.cancelled
        assert producer.get(item.id).cancelled
        (ended,) = producer.attempts(item.id)
        assert ended.outcome == "cancelled"
        assert ended.ended_at is not None
        assert producer.report_progress(item.id, lease, {"done": 5}) is False

        with pytest.raises(Conflict) as again:
            producer.cancel(item.id)
        assert again.value.code == "terminal"

        pending = producer.post("q", 2)
        plain = producer.cancel(pending.id)
        assert (plain.status, plain.error, plain.cancel_reason) == ("failed", "cancelled", None)
        assert len(producer.attempts(pending.id)) == 0

        with pytest.raises(NotFound):
            producer.attempts("nosuchitem")
        with pytest.raises(NotFound):
            producer.drain_worker("0123456789abcdef")
        assert producer.workers() == []
        assert producer.drain_workers("nobody-") == []


# -- a worker's name -------------------------------------------------------------------------


def test_a_worker_subscribes_with_its_name_host_and_pid_by_default(server, key):
    default = Worker(server.url, key)
    chosen = Worker(server.url, key, name="billing-7")
    for worker in (default, chosen):
        worker.add_handler("q", lambda job: None)
    with pytest.raises(ValueError, match="printable"):
        Worker(server.url, key, name="tab\there")

    async def body(producer):
        async with serving(default), serving(chosen):
            mine = await named(producer, f"{socket.gethostname()}:{os.getpid()}")
            other = await named(producer, "billing-7")
            assert (mine.queues, mine.capacity, mine.draining) == (["q"], 1, False)
            assert other.id != mine.id

    run_with_producer(server, key, body)


# -- cancel ----------------------------------------------------------------------------------


def test_a_cancel_cancels_an_async_handlers_task_and_nothing_is_sent_for_the_item(
    server, key, verdicts_sent
):
    worker = Worker(server.url, key, capacity=1)
    seen: dict[str, Job] = {}
    events: list[str] = []

    @worker.handler("q")
    async def handle(job: Job):
        if job.payload != "forever":
            return "quick"
        seen[job.id] = job
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            events.append("cancelled")
            raise
        return "too late"

    async def body(producer):
        async with serving(worker):
            stuck = await producer.post("q", "forever")
            await until(lambda: stuck.id in seen, what="the handler to start")
            cancelled = await producer.cancel(stuck.id, reason="changed my mind")
            assert (cancelled.status, cancelled.error) == ("failed", "cancelled")
            await until(lambda: events == ["cancelled"], what="the handler to be cancelled")
            job = seen[stuck.id]
            assert (job.cancelled, job.cancel_reason) == (True, "cancelled")
            nxt = await producer.post("q", "next")  # its slot was freed
            assert await producer.result(nxt.id, timeout=10) == "quick"
            done = await producer.get(stuck.id)
            assert (done.status, done.error, done.cancel_reason, done.result) == (
                "failed",
                "cancelled",
                "changed my mind",
                None,
            )
            assert [a.outcome for a in await producer.attempts(stuck.id)] == ["cancelled"]
        assert not [sent for sent in verdicts_sent if sent[1] == stuck.id]

    run_with_producer(server, key, body)


def test_a_cancel_turns_a_plain_handlers_job_cancelled_and_what_it_returns_is_dropped(
    server, key, verdicts_sent
):
    worker = Worker(server.url, key, capacity=1)
    started: list[str] = []
    saw: list[tuple[bool, str | None]] = []

    @worker.handler("q")
    def handle(job: Job):  # runs in a thread: it can only look at the flag
        started.append(job.id)
        stopped = job.wait_cancelled(30)  # one step of real work, say
        saw.append((stopped, job.cancel_reason))
        return "returned after the cancel"

    async def body(producer):
        async with serving(worker):
            item = await producer.post("q", 1)
            await until(lambda: started, what="the handler to start")
            await producer.cancel(item.id)
            await until(lambda: saw, what="the handler to see the cancel")
            assert saw == [(True, "cancelled")]
            done = await producer.get(item.id)
            assert (done.status, done.error, done.result) == ("failed", "cancelled", None)
        assert not [sent for sent in verdicts_sent if sent[1] == item.id]

    run_with_producer(server, key, body)


# -- progress --------------------------------------------------------------------------------


def test_job_progress_from_an_async_and_a_plain_handler_reaches_the_item(server, key):
    worker = Worker(server.url, key, capacity=2)
    release = asyncio.Event()
    plain_release = threading.Event()
    refused: list[str] = []

    @worker.handler("q")
    async def handle(job: Job):
        for step in range(1, 4):
            job.progress({"step": step, "of": 3})
        try:
            job.progress("x" * 5000)
        except ValueError as exc:
            refused.append(str(exc))
        await asyncio.wait_for(release.wait(), 30)
        return "done"

    @worker.handler("plain")
    def handle_plain(job: Job):
        job.progress({"thread": "yes"})
        plain_release.wait(30)
        return "plain done"

    async def body(producer):
        await producer.put_queue("plain")
        async with serving(worker):
            item = await producer.post("q", 1)
            other = await producer.post("plain", 2)

            async def progressed(item_id, value):
                return (await producer.get(item_id)).progress == value

            await until(
                lambda: progressed(item.id, {"step": 3, "of": 3}), what="the latest progress"
            )
            await until(lambda: progressed(other.id, {"thread": "yes"}), what="thread progress")
            assert refused
            assert "4096" in refused[0]
            release.set()
            plain_release.set()
            assert await producer.result(item.id, timeout=10) == "done"
            assert await producer.result(other.id, timeout=10) == "plain done"

    run_with_producer(server, key, body)


# -- drain -----------------------------------------------------------------------------------


def test_a_drain_lets_the_held_item_finish_takes_no_more_and_closes_the_worker(server, key):
    name = f"drain-{uuid.uuid4().hex[:8]}"
    worker = Worker(server.url, key, capacity=1, name=name, grace=30)
    started: list[str] = []
    release = asyncio.Event()

    @worker.handler("q")
    async def handle(job: Job):
        started.append(job.id)
        await asyncio.wait_for(release.wait(), 30)
        return {"finished": job.payload}

    async def body(producer):
        task = asyncio.create_task(worker.serve())
        try:
            held = await producer.post("q", "held")
            await until(lambda: started, what="the handler to start")
            me = await named(producer, name, held=[held.id])
            drained = await producer.drain_worker(me.id)
            assert (drained.id, drained.draining) == (me.id, True)
            later = await producer.post("q", "later")
            # The worker is now stopping: it keeps its socket while the item runs.
            await until(lambda: worker.stopping, what="the worker to take the drain")
            assert not task.done()
            release.set()
            await asyncio.wait_for(task, 10)  # it closes by itself, once the item is done
        finally:
            if not task.done():
                worker.stop(hand_back=True)
                await asyncio.wait_for(task, 10)
        done = await producer.get(held.id)
        assert (done.status, done.result) == ("finished", {"finished": "held"})
        untouched = await producer.get(later.id)
        assert (untouched.status, untouched.attempts) == ("pending", 0)
        assert started == [held.id]
        await until(lambda: _gone(producer, name), what="the drained worker to leave the listing")

    run_with_producer(server, key, body)


async def _gone(producer, name):
    return all(w.name != name for w in await producer.workers())
