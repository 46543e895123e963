"""taskhoster.client.Worker against a real daphne over /work: verdicts from return values and
exceptions, capacity, keepalive, cancel, reconnect with backoff, kills and graceful stops."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from taskhoster.client import (
    AsyncProducer,
    Forbidden,
    Job,
    NotFound,
    PermanentError,
    RetryableError,
    Unauthorized,
    Worker,
)
from taskhoster.client import worker as worker_module

from .tcpproxy import TcpProxy

pytestmark = pytest.mark.slow

MAX_PAYLOAD = 64 * 1024
WORKER_SCRIPT = Path(__file__).with_name("client_worker_proc.py")


@pytest.fixture
def server(server_factory):
    return server_factory(TASKHOSTER_MAX_PAYLOAD_BYTES=str(MAX_PAYLOAD))


@contextlib.asynccontextmanager
async def serving(worker, connections=1):
    """Run the worker while the block runs (once it has subscribed), then stop it."""
    task = asyncio.create_task(worker.serve())
    deadline = time.monotonic() + 10
    while worker.connected < connections:
        if task.done():
            task.result()
        assert time.monotonic() < deadline, "the worker did not connect"
        await asyncio.sleep(0.02)
    try:
        yield task
    finally:
        worker.stop(hand_back=True)
        await asyncio.wait_for(task, 10)


async def until(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def run_with_producer(server, key, body, **queue_settings):
    """asyncio.run ``body(producer)`` with queue q set up."""

    async def main():
        async with AsyncProducer(server.url, key) as producer:
            await producer.put_queue("q", **queue_settings)
            await body(producer)

    asyncio.run(main())


# -- verdicts --------------------------------------------------------------------------------


def test_a_handlers_return_value_becomes_the_items_result(server, key):
    worker = Worker(server.url, key)

    @worker.handler("q")
    async def double(job: Job):
        return {"double": job.payload * 2, "attempts": job.attempts, "queue": job.queue}

    async def body(producer):
        async with serving(worker):
            item = await producer.post("q", 21)
            assert await producer.result(item.id, timeout=10) == {
                "double": 42,
                "attempts": 1,
                "queue": "q",
            }

    run_with_producer(server, key, body)


def test_a_plain_function_handler_runs_in_a_thread(server, key):
    worker = Worker(server.url, key)
    threads = []

    @worker.handler("q")
    def upper(job: Job):
        threads.append(threading.current_thread())
        time.sleep(0.1)  # blocking is fine: not on the event loop
        return job.payload.upper()

    async def body(producer):
        async with serving(worker):
            item = await producer.post("q", "shout")
            assert await producer.result(item.id, timeout=10) == "SHOUT"
        assert threads
        assert threads[0] is not threading.main_thread()

    run_with_producer(server, key, body)


def test_retryable_error_is_retried_after_backoff_then_fails_with_its_message(server, key):
    worker = Worker(server.url, key)
    calls = []

    @worker.handler("q")
    async def flaky(job: Job):
        calls.append((job.attempts, time.monotonic()))
        raise RetryableError("flaky downstream")

    async def body(producer):
        async with serving(worker):
            item = await producer.post("q", 1)
            done = await producer.wait(item.id, timeout=10)
        assert (done.status, done.error, done.attempts) == ("failed", "flaky downstream", 2)
        assert [a for a, _ in calls] == [1, 2]
        assert calls[1][1] - calls[0][1] >= 0.5  # the queue's backoff was applied

    run_with_producer(server, key, body, max_attempts=2, backoff_seconds=0.6)


def test_permanent_error_fails_the_item_at_once_with_attempts_left(server, key):
    worker = Worker(server.url, key)
    calls = []

    @worker.handler("q")
    async def reject(job: Job):
        calls.append(job.id)
        raise PermanentError("no such customer")

    async def body(producer):
        async with serving(worker):
            item = await producer.post("q", 1)
            done = await producer.wait(item.id, timeout=10)
        assert (done.status, done.error, done.attempts) == ("failed", "no such customer", 1)
        assert calls == [item.id]

    run_with_producer(server, key, body, max_attempts=None, backoff_seconds=0.1)


def test_an_unexpected_exception_is_a_retryable_failure_naming_its_type(server, key):
    worker = Worker(server.url, key)
    calls = []

    @worker.handler("q")
    async def broken(job: Job):
        calls.append(job.attempts)
        raise ValueError("bad value")

    async def body(producer):
        async with serving(worker):
            item = await producer.post("q", 1)
            done = await producer.wait(item.id, timeout=10)
        assert (done.status, done.error) == ("failed", "ValueError: bad value")
        assert calls == [1, 2]

    run_with_producer(server, key, body, max_attempts=2, backoff_seconds=0.1)


def test_a_result_the_server_refuses_as_too_large_fails_the_item_for_good(server, key):
    worker = Worker(server.url, key)

    @worker.handler("q")
    async def huge(job: Job):
        return "x" * (MAX_PAYLOAD + 1) if job.payload == "huge" else object()

    async def body(producer):
        async with serving(worker):
            big = await producer.post("q", "huge")
            odd = await producer.post("q", "not json")
            big_done = await producer.wait(big.id, timeout=10)
            odd_done = await producer.wait(odd.id, timeout=10)
        assert big_done.status == "failed"
        assert "too large" in big_done.error
        assert odd_done.status == "failed"
        assert "not JSON" in odd_done.error
        assert (big_done.attempts, odd_done.attempts) == (1, 1)

    run_with_producer(server, key, body)


def _frames_sent(monkeypatch) -> list[str]:
    """The types of the frames every worker of this process sends, in order (recorded on the
    way out; each frame still goes out as it would)."""
    from taskhoster.client import worker as worker_module

    sent: list[str] = []
    encode = worker_module._encode

    def recording(frame):
        sent.append(frame["type"])
        return encode(frame)

    monkeypatch.setattr(worker_module, "_encode", recording)
    return sent


def test_with_a_batch_items_come_several_to_a_frame_and_results_go_back_together(
    server, key, monkeypatch
):
    """``batch=8``: 24 items waiting, a worker of capacity 8; every item gets its own result,
    and the results went back in results frames, not one result frame each."""
    sent = _frames_sent(monkeypatch)
    worker = Worker(server.url, key, capacity=8, batch=8)
    seen: list[int] = []

    @worker.handler("q")
    async def square(job: Job):
        seen.append(job.payload)
        return {"square": job.payload**2}

    async def body(producer):
        items = [await producer.post("q", n) for n in range(24)]
        async with serving(worker):
            for n, item in enumerate(items):
                assert await producer.result(item.id, timeout=20) == {"square": n * n}
        assert sorted(seen) == list(range(24))

    run_with_producer(server, key, body)
    assert sent[0] == "subscribe"
    assert "results" in sent
    assert sent.count("result") < 24


def test_with_a_batch_a_results_frame_refused_whole_is_sent_again_one_by_one(
    server_factory, key, monkeypatch
):
    """A server whose results are at most 64 bytes refuses a results frame holding one of 100
    bytes as a whole (too_large, changing nothing); the worker sends each result again alone:
    the small ones finish, the large one fails for good as too large, as it would alone."""
    server = server_factory(TASKHOSTER_MAX_PAYLOAD_BYTES="64")
    sent = _frames_sent(monkeypatch)
    worker = Worker(server.url, key, capacity=4, batch=4)

    @worker.handler("q")
    async def answer(job: Job):
        return "x" * 100 if job.payload == "big" else job.payload

    async def body(producer):
        items = [await producer.post("q", p) for p in ("a", "big", "b", "c")]
        async with serving(worker):
            done = [await producer.wait(item.id, timeout=20) for item in items]
        assert [d.status for d in done] == ["finished", "failed", "finished", "finished"]
        assert [d.result for d in done if d.status == "finished"] == ["a", "b", "c"]
        assert "too large" in done[1].error
        assert done[1].attempts == 1

    run_with_producer(server, key, body)
    assert "results" in sent


def test_a_batch_the_server_refuses_stops_the_worker_with_its_error(server, key):
    """A subscribe the server refuses for its batch (over the largest capacity here; a server
    older than the extension says unknown_field) stops the worker with that error, as a
    refused capacity does, instead of leaving it subscribed to nothing."""
    from taskhoster.client import SocketError

    worker = Worker(server.url, key, batch=10**6)
    worker.add_handler("q", lambda job: None)

    async def body(producer):
        with pytest.raises(SocketError) as refused:
            await asyncio.wait_for(worker.serve(), 10)
        assert refused.value.code == "invalid_batch"

    run_with_producer(server, key, body)


# -- capacity, keepalive, cancel -------------------------------------------------------------


def test_capacity_bounds_the_handlers_running_at_once(server, key):
    worker = Worker(server.url, key, capacity=2)
    running, most = 0, 0

    @worker.handler("q")
    async def slow(job: Job):
        nonlocal running, most
        running += 1
        most = max(most, running)
        await asyncio.sleep(0.3)
        running -= 1
        return job.payload

    async def body(producer):
        async with serving(worker):
            items = await producer.post_many("q", range(6))
            results = [await producer.result(i.id, timeout=10) for i in items]
        assert results == list(range(6))
        assert most == 2

    run_with_producer(server, key, body)


def test_keepalive_extends_the_lease_while_a_handler_outlives_it(server, key, manage):
    worker = Worker(server.url, key)
    jobs: list[Job] = []
    release = asyncio.Event()

    @worker.handler("q")
    async def slow(job: Job):
        jobs.append(job)
        await asyncio.wait_for(release.wait(), 60)
        return "slow but fine"

    async def body(producer):
        async with serving(worker):
            item = await producer.post("q", 1)
            await until(lambda: jobs)
            await asyncio.sleep(3.6)  # well past the 3 s lease it was pushed with
            # The sweep's process takes seconds to start, on a busy machine; the keepalive
            # extends every 1.5 s meanwhile (a 1 s lease left it half a second to spare).
            swept = (await asyncio.to_thread(manage, "sweep")).stdout
            during = await producer.get(item.id)
            assert during.status == "processing", swept
            assert during.attempts == 1
            assert during.lease_expires_at > jobs[0].lease_expires_at
            release.set()
            done = await producer.wait(item.id, timeout=10)
        assert (done.status, done.result, done.attempts) == ("finished", "slow but fine", 1)

    run_with_producer(server, key, body, lease_seconds=3)


def test_a_cancel_from_the_server_stops_the_handler_and_frees_its_slot(server, key):
    worker = Worker(server.url, key, capacity=1)
    events: list[str] = []

    @worker.handler("q")
    async def handle(job: Job):
        if job.payload == "forever":
            events.append("started")
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                events.append("cancelled")
                raise
        return "quick"

    async def body(producer):
        async with serving(worker):
            stuck = await producer.post("q", "forever")
            await until(lambda: "started" in events)
            await producer.delete(stuck.id)
            await until(lambda: "cancelled" in events, timeout=3)
            nxt = await producer.post("q", "next")
            assert await producer.result(nxt.id, timeout=5) == "quick"

    run_with_producer(server, key, body)


# -- reconnect -------------------------------------------------------------------------------


def test_a_dropped_socket_cancels_the_handler_and_the_worker_reconnects_for_the_item(server, key):
    proxy = TcpProxy(server.port)
    worker = Worker(proxy.url, key, reconnect_delay=0.1)
    seen: list[tuple[int, str]] = []

    @worker.handler("q")
    async def handle(job: Job):
        if job.attempts == 1:
            seen.append((job.attempts, "started"))
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                seen.append((job.attempts, "cancelled"))
                raise
        return f"done on attempt {job.attempts}"

    async def body(producer):
        async with serving(worker):
            item = await producer.post("q", 1)
            await until(lambda: seen)
            proxy.drop_all()
            done = await producer.wait(item.id, timeout=10)
            assert (done.status, done.result) == ("finished", "done on attempt 2")
            assert seen == [(1, "started"), (1, "cancelled")]
            assert worker.connected >= 2

    try:
        run_with_producer(server, key, body)
    finally:
        proxy.close()


def test_reconnects_back_off_while_the_server_is_unreachable(server, key):
    proxy = TcpProxy(server.port)
    proxy.refuse = True
    worker = Worker(proxy.url, key, reconnect_delay=0.2, reconnect_max_delay=2)

    @worker.handler("q")
    async def handle(job: Job):
        return "after the outage"

    async def body(producer):
        task = asyncio.create_task(worker.serve())
        try:
            await until(lambda: proxy.accepted >= 5, timeout=30)
            proxy.refuse = False
            # 0.1-0.2, 0.2-0.4, 0.4-0.8, 0.8-1.6 s apart, not a tight loop: each try waits for
            # the proxy to close the last one, then its backoff. (At least that: a slow
            # machine only adds to the gaps. 5% for a timer that fires a hair early.)
            gaps = [b - a for a, b in itertools.pairwise(proxy.accepted_at[:5])]
            assert all(gap >= 0.095 * 2**n for n, gap in enumerate(gaps)), gaps
            await until(lambda: worker.connected >= 1, timeout=30)
            item = await producer.post("q", 1)
            assert await producer.result(item.id, timeout=30) == "after the outage"
        finally:
            worker.stop()
            await asyncio.wait_for(task, 10)

    try:
        run_with_producer(server, key, body)
    finally:
        proxy.close()


def idle_worker(url, key, **options):
    """A worker of queue q whose handler does nothing."""
    worker = Worker(url, key, **options)
    worker.add_handler("q", lambda job: None)
    return worker


async def session_starts(worker, count, timeout=30.0):
    """When each of the worker's first ``count`` sockets subscribed (polled every 5 ms)."""
    starts: list[float] = []
    deadline = time.monotonic() + timeout
    while len(starts) < count:
        assert time.monotonic() < deadline, f"only {len(starts)} sockets in {timeout} s"
        while len(starts) < worker.connected:
            starts.append(time.monotonic())
        await asyncio.sleep(0.005)
    return starts


def test_sockets_the_server_closes_at_once_are_reconnected_with_a_growing_backoff(
    server_factory, key
):
    """A server that accepts the handshake and closes the socket at once (its database away:
    4503; here an internal error at every subscribe: 4500) is a failed connect: the next
    delay doubles. Before, a handshake reset the backoff, and every worker connected again
    every ``reconnect_delay`` for as long as it lasted."""
    server = server_factory(TASKHOSTER_FAULT="socket.subscribe")
    worker = idle_worker(server.url, key, reconnect_delay=0.2, reconnect_max_delay=5)

    async def body(producer):
        async with serving(worker, connections=0):
            starts = await session_starts(worker, 6)
        # Delays of 0.1-0.2, 0.2-0.4, 0.4-0.8, 0.8-1.6, 1.6-3.2 s (a slow machine only adds
        # to the gaps; 10 ms for the polling).
        gaps = [b - a for a, b in itertools.pairwise(starts)]
        assert all(gap >= 0.1 * 2**n - 0.01 for n, gap in enumerate(gaps)), gaps

    run_with_producer(server, key, body)


def test_a_socket_that_stayed_open_starts_the_reconnect_backoff_again(server, key, monkeypatch):
    """After failed connects have grown the backoff, a socket that then stayed open
    ``STABLE_SOCKET_SECONDS`` and dropped is reconnected after the first delay again."""
    monkeypatch.setattr(worker_module, "STABLE_SOCKET_SECONDS", 1.0)
    proxy = TcpProxy(server.port)
    proxy.refuse = True
    worker = idle_worker(proxy.url, key, reconnect_delay=0.2, reconnect_max_delay=30)

    async def body(producer):
        async with serving(worker, connections=0):
            # Five refused tries: the next delay would be 3.2-6.4 s.
            await until(lambda: proxy.accepted >= 5, timeout=30)
            proxy.refuse = False
            await until(lambda: worker.connected >= 1, timeout=30)
            await asyncio.sleep(1.5)  # open longer than STABLE_SOCKET_SECONDS
            dropped = time.monotonic()
            proxy.drop_all()
            await until(lambda: worker.connected >= 2, timeout=30)
            assert time.monotonic() - dropped < 1.5, "reconnected after the first delay"

    try:
        run_with_producer(server, key, body)
    finally:
        proxy.close()


def test_a_refused_key_or_unknown_queue_stops_the_worker_with_a_typed_error(server, key, make_key):
    producer_only = make_key("produce")

    async def serve(url_key, queue_name):
        worker = Worker(server.url, url_key)
        worker.add_handler(queue_name, lambda job: None)
        await asyncio.wait_for(worker.serve(), 10)

    async def body(producer):
        with pytest.raises(Unauthorized):
            await serve("wrong-key", "q")
        with pytest.raises(NotFound) as missing:
            await serve(key, "nope")
        assert missing.value.code == "queue_not_found"
        with pytest.raises(Forbidden):  # may read the queue, but lacks the work scope
            await serve(producer_only, "q")

    run_with_producer(server, key, body)


# -- killed and stopped worker processes -----------------------------------------------------


class WorkerProcess:
    def __init__(self, server, key, seconds, stop_timeout):
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER_SCRIPT), server.url, key, str(seconds), str(stop_timeout)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.strip())
        self.lines.put("<eof>")

    def expect(self, prefix, timeout=10.0):
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"no {prefix!r} in {self.seen}"
            try:
                line = self.lines.get(timeout=remaining)
            except queue.Empty:
                continue
            self.seen.append(line)
            if line.startswith(prefix):
                return line

    def finish(self, timeout=10.0):
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.expect("<eof>")
            assert self.proc.stdout is not None
            self.proc.stdout.close()


def test_a_worker_killed_mid_item_hands_it_to_a_second_worker(server, key):
    async def body(producer):
        item = await producer.post("q", "x")
        first = WorkerProcess(server, key, seconds=60, stop_timeout=10)
        assert first.expect("started") == f"started {item.id}"
        first.proc.send_signal(signal.SIGKILL)
        first.finish()

        second = Worker(server.url, key)

        @second.handler("q")
        async def handle(job: Job):
            return {"by": "second", "attempts": job.attempts}

        async with serving(second):
            done = await producer.wait(item.id, timeout=10)
        assert (done.status, done.result) == ("finished", {"by": "second", "attempts": 2})

    run_with_producer(server, key, body)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stop_signal_lets_the_item_in_hand_finish_and_takes_no_more(server, key, signum):
    async def body(producer):
        first = await producer.post("q", 1)
        second = await producer.post("q", 2)
        worker = WorkerProcess(server, key, seconds=1.5, stop_timeout=10)
        assert worker.expect("started") == f"started {first.id}"
        worker.proc.send_signal(signum)
        assert await asyncio.to_thread(worker.finish) == 0
        assert f"finished {first.id}" in worker.seen
        assert "stopped" in worker.seen
        assert not any(line.startswith("cancelled") for line in worker.seen)
        done = await producer.get(first.id)
        assert (done.status, done.result) == ("finished", {"slept": 1.5})
        untouched = await producer.get(second.id)
        assert (untouched.status, untouched.attempts) == ("pending", 0)

    run_with_producer(server, key, body)


def test_a_stop_hands_back_what_is_still_running_after_the_stop_timeout(server, key):
    async def body(producer):
        item = await producer.post("q", 1)
        worker = WorkerProcess(server, key, seconds=60, stop_timeout=0.5)
        worker.expect("started")
        stopped_at = time.monotonic()
        worker.proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(worker.finish) == 0
        assert time.monotonic() - stopped_at < 5
        assert f"cancelled {item.id}" in worker.seen
        back = await producer.get(item.id)
        assert (back.status, back.attempts) == ("pending", 1)  # re-queued at once

    run_with_producer(server, key, body)


def test_a_second_signal_hands_back_at_once(server, key):
    async def body(producer):
        item = await producer.post("q", 1)
        worker = WorkerProcess(server, key, seconds=60, stop_timeout=60)
        worker.expect("started")
        worker.proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.5)
        assert worker.proc.poll() is None  # still finishing the item
        worker.proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(worker.finish, 5) == 0
        assert f"cancelled {item.id}" in worker.seen
        back = await producer.get(item.id)
        assert (back.status, back.attempts) == ("pending", 1)

    run_with_producer(server, key, body)
