"""The committer in a process of its own, beside each server process.

CPython runs one thread of Python at a time in a process. A server process is busy with its
event loop and its request threads; a committer thread among them waits for that lock after
every database call and every file operation, so a group commit took several times its own
CPU time and the process could never use more than one core. Here the same committer
(``runner.Committer``, the same groups) runs in a child process with a core and a lock of
its own; the server process hands it operations and takes back answers and news:

- server to committer: one frame per operation, ``[(wire_id, operation)]``, written by the
  thread that submits it;
- committer to server: ``("answers", [(wire_id, ok, value), ...])`` after each group's flush
  (a claim's at its commit), and ``("news", [...])`` at each commit, which the server
  delivers to its sockets' dispatcher and its long-polls (the committer also publishes it
  to the other processes, in the server's name, so the server does not hear it twice), and
  ``("unflushed", n)`` whenever the number of items whose files a failed flush left changes
  (``runner``: the server's /healthz says so).

Frames are pickles with a length before them, over the child's stdin and stdout; a reader
takes every frame that has arrived with one read. In the child that reader is the committer
itself (``PipeCommitter``), between groups; the server's writes never wait for it
(``ChildCommitter._send``). The child
ends when its server does (the pipe closes; on Linux it is also killed with it). If it dies,
every operation it held is answered with a ``StoreError`` (503: its outcome is unknown, so a
client may try again) and the next operation starts a new one. A crash point armed in the
child kills the server as well: the two are one server.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import logging
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from typing import Any

from django.conf import settings

from .. import bus, events, metrics
from ..errors import StoreError, TaskhosterError
from ..faults import fault, slow_seconds
from ..libc import libc
from ..osthread import name_os_thread
from . import admission, runner
from .common import store
from .ops import Op

log = logging.getLogger(__name__)
HEADER = struct.Struct("<I")
CHILD_ENV = "TASKHOSTER_COMMITTER_CHILD"


# How long a server process's exit waits for its committer process to finish and go.
STOP_SECONDS = 5.0
# What the pipe to a committer process holds (Linux's default is 64 KiB; 1 MiB is its
# usual most for an unprivileged process, /proc/sys/fs/pipe-max-size).
PIPE_BYTES = 1 << 20
# The longest a committer process's start is taken for a start: past it, the server process
# says it is ready without it (its /healthz names the parts that do not answer), and work
# waiting for it counts as a backlog (admission control refuses new posts).
START_SECONDS = 30.0


def _frame(value: Any) -> bytes:
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(data)) + data


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class FrameReader:
    """Frames from a pipe, as many per read as have arrived."""

    def __init__(self, fd: int, chunk: int = 1 << 16) -> None:
        self.fd = fd
        self.buffer = bytearray()
        self.chunk = bytearray(chunk)

    def frames(self) -> list[Any]:
        """The next frames (at least one); ``EOFError`` when the pipe closes."""
        while True:
            found = self._whole()
            if found:
                return found
            if not self._read():
                raise EOFError

    def available(self) -> list[Any]:
        """The frames that have arrived whole, without waiting (the pipe is non-blocking);
        ``EOFError`` once the pipe has closed and every frame before that was returned."""
        closed = False
        with contextlib.suppress(BlockingIOError):
            while True:
                n = self._read()
                if not n:
                    closed = True
                    break
                if n < len(self.chunk):
                    break  # all there was (a read more would only say so)
        found = self._whole()
        if closed and not found:
            raise EOFError
        return found

    def _read(self) -> int:
        # Into a buffer kept from read to read: os.read would allocate a new one each time.
        n = os.readv(self.fd, [self.chunk])
        self.buffer += memoryview(self.chunk)[:n]
        return n

    def _whole(self) -> list[Any]:
        found = []
        while len(self.buffer) >= HEADER.size:
            size = HEADER.unpack_from(self.buffer)[0]
            if len(self.buffer) < HEADER.size + size:
                break
            found.append(pickle.loads(self.buffer[HEADER.size : HEADER.size + size]))
            del self.buffer[: HEADER.size + size]
        return found


# -- in the server process ----------------------------------------------------------------------


class ChildCommitter:
    """Stands for the committer in the server process: ``submit`` as ``Committer.submit``.

    The caller's thread writes its operation to the pipe itself, without ever waiting for
    the committer: the committer process reads the pipe between its groups, and what the
    pipe cannot take while a group runs waits in an outbox, in order, which a thread of its
    own writes on (``_send``). So an event loop that hands in a big post while a group
    stalls is not held. One thread reads the answers and news back.
    """

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.write_lock = threading.Lock()
        # Bytes for the committer process ``outbox_for`` that its pipe could not take yet.
        self.outbox = bytearray()
        self.outbox_for: subprocess.Popen[bytes] | None = None
        self.sender: threading.Thread | None = None
        self.sent = threading.Condition(self.write_lock)  # the outbox was emptied
        self.pending: dict[int, Op[Any]] = {}
        self.pending_items = 0
        self.next_id = 0
        self.proc: subprocess.Popen[bytes] | None = None
        # When the running committer process said it was ready (None: none runs, or it is
        # still starting: importing Django takes a second, more on a loaded machine), and
        # when it was started.
        self.ready_at: float | None = None
        self.started_at = 0.0
        # The server process is not ready (/healthz) until its first committer process is,
        # when it started that one ahead of any work (``start``: ``taskhoster.asgi`` does).
        # A committer started at first use, or again after one died, waits for no readiness:
        # the process was ready before it, and its work waits for it.
        self.gates_readiness = False
        # What the running committer process last said of the files a failed flush left
        # (``Committer.unflushed``).
        self.unflushed_count = 0
        self.pid = os.getpid()
        self.closing = False
        atexit.register(self.close)

    def submit(self, op: Op[Any]) -> None:
        self.submit_many([op])

    def submit_many(self, ops: list[Op[Any]]) -> None:
        """Hand ``ops`` to the committer process in one frame (one write)."""
        with self.cond:
            if self.proc is None:
                self._start()
            proc = self.proc
            assert proc is not None
            assert proc.stdin is not None
            for op in ops:
                op.wire_id = self.next_id
                self.next_id += 1
        # Made before the operations are registered: one that cannot be sent (it cannot be
        # pickled) must not wait for an answer forever (its memory with it).
        try:
            data = _frame([(op.wire_id, op) for op in ops])
        except (pickle.PicklingError, TypeError, AttributeError, RecursionError) as exc:
            raise StoreError(f"the operation could not be handed to the committer: {exc}") from None
        with self.cond:
            if self.proc is not proc:  # it stopped meanwhile, and answered what it held
                raise StoreError("the committer process stopped; try again")
            now = time.monotonic()
            for op in ops:
                assert op.wire_id is not None
                op.submitted = now
                self.pending[op.wire_id] = op
                self.pending_items += op.size
        self._send(proc, data)

    def _send(self, proc: subprocess.Popen[bytes], data: bytes) -> None:
        """Write ``data`` to ``proc``'s pipe as far as it takes it now; the rest goes to the
        outbox, behind what waits there already. If the process died, its reader answers
        what it held, these operations included."""
        with self.write_lock:
            if self.outbox_for is not proc:
                self.outbox.clear()  # an earlier committer process's: it is gone
                self.outbox_for = proc
            rest = memoryview(data)
            if not self.outbox:
                try:
                    rest = rest[os.write(self._fd(proc), rest) :]
                except BlockingIOError:
                    pass
                except (OSError, ValueError):
                    return
                if not rest:
                    return
            self.outbox += rest
            if self.sender is None:
                self._start_sender(proc)

    def _start_sender(self, proc: subprocess.Popen[bytes]) -> None:
        """A thread that writes the outbox to ``proc`` (``write_lock`` held)."""
        self.sender = threading.Thread(
            target=self._write_outbox, args=(proc,), name="taskhoster-to-committer", daemon=True
        )
        self.sender.start()

    @staticmethod
    def _fd(proc: subprocess.Popen[bytes]) -> int:
        assert proc.stdin is not None
        return proc.stdin.fileno()

    def _write_outbox(self, proc: subprocess.Popen[bytes]) -> None:
        """Write the outbox to ``proc`` as its pipe takes it, until it is empty. The bytes
        written leave the outbox only once written: meanwhile ``_send`` adds behind them."""
        name_os_thread()
        while True:
            with self.write_lock:
                if self.outbox_for is not proc or not self.outbox:
                    self.sender = None
                    if self.outbox and self.outbox_for is not None:
                        # The next committer process's, handed in while this thread still
                        # wrote for the one that died: written by a thread of its own.
                        self._start_sender(self.outbox_for)
                    else:
                        self.sent.notify_all()
                    return
                chunk = bytes(self.outbox[: 1 << 20])
            try:
                select.select([], [self._fd(proc)], [], 1.0)
                written = os.write(self._fd(proc), chunk)
            except BlockingIOError:
                continue
            except (OSError, ValueError):  # it died: its reader answers what it held
                with self.write_lock:
                    if self.outbox_for is proc:
                        self.outbox.clear()
                continue
            with self.write_lock:
                if self.outbox_for is proc:
                    del self.outbox[:written]

    def waiting(self) -> int:
        """Operations handed to the committer process and not yet answered."""
        return len(self.pending)

    def backlog(self) -> tuple[int, float]:
        """(items handed to the committer process and not yet answered, seconds the oldest
        of them has waited since the process was ready to take them). Its start is no
        overload: work handed in while it starts waits for it, and is not a backlog."""
        with self.cond:
            oldest = next(iter(self.pending.values())).submitted if self.pending else None
            items = self.pending_items
            # A start that takes longer than START_SECONDS is no longer a start: work
            # waiting for it counts from then, and new posts are refused as they would be.
            since = self.ready_at or self.started_at + START_SECONDS
        if oldest is None:
            return items, 0.0
        return items, max(0.0, time.monotonic() - max(oldest, since))

    def unflushed(self) -> int:
        # (and this process's own: a group run in an embedding caller's transaction)
        return self.unflushed_count + len(store().unflushed)

    def starting(self) -> bool:
        """The first committer process this process started ahead of any work (``start``)
        runs and has not said it is ready (for at most START_SECONDS)."""
        with self.cond:
            return (
                self.gates_readiness
                and self.proc is not None
                and self.ready_at is None
                and time.monotonic() < self.started_at + START_SECONDS
            )

    def start(self) -> None:
        """Start the committer process now, unless it runs already: the process is ready
        (``/healthz``) once it is."""
        with self.cond:
            if self.proc is None:
                self._start()
                self.gates_readiness = True

    def _start(self) -> None:
        """Start the committer process from the thread that will read its answers.

        That thread lives as long as the child does; the caller's may not (Django's own ASGI
        handler runs each request in a thread of its own). Linux sends the child its
        parent-death signal (``_die_with_parent``) when the *thread* that started it ends.
        """
        env = dict(os.environ)
        env.update(
            {
                CHILD_ENV: str(os.getpid()),
                "DJANGO_SETTINGS_MODULE": settings.SETTINGS_MODULE,
                "TASKHOSTER_NEWS_ORIGIN": bus.ORIGIN,
            }
        )
        started: Future[subprocess.Popen[bytes]] = Future()
        self.ready_at = None
        self.started_at = time.monotonic()
        threading.Thread(
            target=self._spawn_and_read,
            args=(env, started),
            name="taskhoster-from-committer",
            daemon=True,
        ).start()
        self.proc = started.result()

    def close(self, timeout: float = STOP_SECONDS) -> None:
        """Let the committer process end as it would go idle, at this process's exit: its
        input closed, it finishes what it holds and writes the metrics it counted since its
        last flush (a one-shot sweep's counts were lost when it was killed with its parent),
        then exits; after ``timeout`` it is killed."""
        with self.cond:
            proc = self.proc
            if proc is None or proc.stdin is None or os.getpid() != self.pid:
                return
            self.closing = True
        deadline = time.monotonic() + timeout
        with self.write_lock:
            # What the outbox still holds was handed in: it goes before the end of input.
            while self.outbox and self.outbox_for is proc:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.sent.wait(left)
            with contextlib.suppress(OSError):
                proc.stdin.close()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()

    def _spawn_and_read(
        self, env: dict[str, str], started: Future[subprocess.Popen[bytes]]
    ) -> None:
        name_os_thread()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "taskhoster.committer_process"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=env,
            )
        except BaseException as exc:
            started.set_exception(exc)
            return
        assert proc.stdin is not None
        os.set_blocking(proc.stdin.fileno(), False)  # see ``_send``
        with contextlib.suppress(OSError, AttributeError):
            # A pipe that holds a batch's frame while a group runs: handed over in one write
            # and one read, not piece by piece through the outbox (Linux; where the
            # system's limit is lower, the pipe stays as it is).
            fcntl.fcntl(proc.stdin.fileno(), fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        started.set_result(proc)
        self._read(proc)

    def _read(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        reader = FrameReader(proc.stdout.fileno())
        try:
            while True:
                for kind, body in reader.frames():
                    if kind == "answers":
                        with self.cond:
                            outcomes = [(self.pending.pop(i), ok, v) for i, ok, v in body]
                            self.pending_items -= sum(op.size for op, _ok, _v in outcomes)
                        runner.answer(outcomes)
                    elif kind == "news":
                        events.deliver(body)
                    elif kind == "unflushed":
                        self.unflushed_count = int(body)
                    elif kind == "ready":
                        with self.cond:
                            if self.proc is proc:
                                self.ready_at = time.monotonic()
                                self.gates_readiness = False  # from now on, never again
        except (EOFError, OSError, pickle.UnpicklingError) as exc:
            if not self.closing:
                log.error("the committer process stopped (%s)", exc or "its pipe closed")
        except Exception:
            log.exception("the committer process sent something unreadable")
        with self.cond:
            if self.proc is proc:
                self.proc = None
                self.ready_at = None
                if self.unflushed_count:
                    log.error(
                        "the committer process stopped with %d items' files that a failed "
                        "flush left not written again: their rows are marked, and the next "
                        "committer to start writes them again first",
                        self.unflushed_count,
                    )
                self.unflushed_count = 0
            lost, self.pending = self.pending, {}
            self.pending_items = 0
        with contextlib.suppress(OSError):
            proc.kill()
        proc.wait()
        failure = StoreError("the committer process stopped; the outcome is unknown")
        runner.answer([(op, False, failure) for op in lost.values()])


# -- in the committer process ---------------------------------------------------------------------


def _die_with_parent() -> None:
    """Linux: be killed when the server process dies, however it dies."""
    found = libc()
    if found is None:
        return
    with contextlib.suppress(OSError, AttributeError):
        pr_set_pdeathsig = 1
        found.prctl(pr_set_pdeathsig, signal.SIGKILL)


class PipeCommitter(runner.Committer):
    """The committer process's committer: the same groups as ``runner.Committer``, run by
    the process's one thread, which reads the server's operations from the pipe itself
    between groups (every frame that has arrived) and waits on the pipe when it has nothing
    to do. No second thread hands them over: an operation wakes the committer directly,
    and the committer never waits for another thread of its own process to let it run."""

    def __init__(self, reader: FrameReader) -> None:
        super().__init__()
        self.reader = reader
        os.set_blocking(reader.fd, False)
        # Operations handed in by another thread of this process ring here.
        self.ring_r, self.ring_w = os.pipe()
        os.set_blocking(self.ring_r, False)
        os.set_blocking(self.ring_w, False)
        self.closed = False  # the server closed the pipe
        self.thread = threading.current_thread()

    def submit_many(self, ops: list[Op[Any]]) -> None:
        super().submit_many(ops)
        with contextlib.suppress(BlockingIOError):
            os.write(self.ring_w, b"\0")

    def run(self) -> None:
        """Run groups until the server closes the pipe and all it handed in is answered."""
        self._loop()

    def _take(self) -> list[Op[Any]] | None:
        self._pull(0.0)
        return super()._take()

    def _ended(self) -> bool:
        return self.closed and not self.queue

    def _more_waiting(self) -> bool:
        self._pull(0.0)
        return bool(self.queue)

    def _flush_ended(self, _future: Future[TaskhosterError | None]) -> None:
        """Ring: the committer waits on the pipe, not on ``cond``."""
        with contextlib.suppress(BlockingIOError):
            os.write(self.ring_w, b"\0")

    def _wait(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        had = len(self.queue)
        self.cond.release()
        try:
            while len(self.queue) == had and not self.closed and not self._flush_done():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._pull(left)
        finally:
            self.cond.acquire()

    def _pull(self, seconds: float) -> None:
        """Take every operation that has arrived on the pipe into the queue, first waiting
        up to ``seconds`` for one (or for a ring of this process's own)."""
        if seconds > 0:
            ready, _, _ = select.select([self.reader.fd, self.ring_r], [], [], seconds)
            if self.ring_r in ready:
                with contextlib.suppress(BlockingIOError):
                    while os.read(self.ring_r, 512):
                        pass
            if self.reader.fd not in ready:
                return
        try:
            batches = self.reader.available()
        except EOFError:
            self.closed = True
            return
        if not batches:
            return
        with self.cond:
            self._enqueue(_stamped(batches))


def _stamped(batches: list[Any]) -> Iterator[Op[Any]]:
    """The operations of frames from the server, each with the number it was sent under
    (its answer goes back under it)."""
    for batch in batches:
        for wire_id, op in batch:
            op.wire_id = wire_id
            yield op


def run_child() -> None:
    """The committer process's main loop (Django is set up already)."""
    parent = int(os.environ[CHILD_ENV])
    _die_with_parent()
    threading.current_thread().name = "taskhoster-committer"
    if os.getppid() != parent:
        return
    bus.ORIGIN = os.environ.get("TASKHOSTER_NEWS_ORIGIN", bus.ORIGIN)
    reader = FrameReader(sys.stdin.fileno(), chunk=PIPE_BYTES)
    out = os.dup(sys.stdout.fileno())
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # nothing else may write into the frames
    lock = threading.Lock()

    def send(kind: str, body: Any) -> None:
        try:
            data = _frame((kind, body))
        except (pickle.PicklingError, TypeError, AttributeError):
            if kind != "answers":
                raise
            data = _frame((kind, [_picklable(o) for o in body]))
        with lock:
            _write_all(out, data)

    def answers(outcomes: Sequence[tuple[Op[Any], bool, Any]]) -> None:
        # The server's operations are answered to it; those a thread of this process handed
        # in (no wire id: ``giveback``'s releases), here.
        theirs = [(op.wire_id, ok, value) for op, ok, value in outcomes if op.wire_id is not None]
        if theirs:
            send("answers", theirs)
        ours = [outcome for outcome in outcomes if outcome[0].wire_id is None]
        if ours:
            runner.answer_here(ours)

    runner.answer_hook = answers
    events.forward = lambda news: send("news", list(news))
    store().on_unflushed = lambda left: send("unflushed", left)
    committer = PipeCommitter(reader)
    admission.register(committer)  # this process's committer (``foreground_waiting``)
    if fault("committer.slow_start"):  # tests: a start as slow as on a loaded machine
        time.sleep(slow_seconds())
    runner.measure_flush_ahead()  # not in the way of the first post
    send("ready", os.getpid())  # the server's /healthz: ready from now on
    # Until the server closes the pipe (it is exiting; if it died, so do we) and what it
    # handed in is answered; then write the metrics counted since the last flush, and go.
    committer.run()
    with contextlib.suppress(Exception):
        metrics.maybe_flush(force=True)


def _picklable(outcome: tuple[int | None, bool, Any]) -> tuple[int | None, bool, Any]:
    wire_id, ok, value = outcome
    try:
        pickle.dumps(value)
    except Exception:
        message = f"{type(value).__name__}: {value}"
        value = value if isinstance(value, TaskhosterError) else StoreError(message)
        if ok:
            ok, value = False, StoreError(f"an answer could not be sent back: {message}")
    return wire_id, ok, value
