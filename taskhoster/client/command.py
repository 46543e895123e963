"""``taskhoster work ... -- COMMAND``: the handler that runs a command per item.

The payload goes to the command's standard input as one line of JSON; the item's id, queue,
attempts and thread go in its environment. Exit 0: its standard output is the result (JSON if
it is JSON, else the text). Another exit status: the item fails with the command's standard
error as the error. A line of standard error that starts with ``PROGRESS_PREFIX`` and goes on
with JSON is sent as the item's progress instead (SPEC section 8.2). The command runs in its
own process group; when its item is stopped (cancelled, deleted, timed out, handed back) the
group gets SIGTERM, and SIGKILL ``kill_grace`` seconds later.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
from collections.abc import Sequence
from typing import Any

from .errors import PermanentError, RetryableError
from .models import PROGRESS_MAX_BYTES
from .worker import Handler, Job

log = logging.getLogger("taskhoster.client.command")

#: Seconds a command has between SIGTERM and SIGKILL once its item is stopped.
KILL_GRACE_SECONDS = 10.0
#: A line of a command's standard error that starts with this is a progress report: JSON
#: after the prefix.
PROGRESS_PREFIX = "TASKHOSTER_PROGRESS "


def parse_output(data: bytes) -> Any:
    """A command's standard output as a result: JSON if it is JSON, else the text without
    its final newline; nothing at all is null."""
    text = data.decode("utf-8", errors="replace")
    if not text.strip():
        return None
    try:
        return json.loads(text)
    except ValueError:
        return text[:-1] if text.endswith("\n") else text


def command_handler(
    command: Sequence[str], *, retry: bool = True, kill_grace: float = KILL_GRACE_SECONDS
) -> Handler:
    """A handler that runs ``command`` per item (see the module's text)."""
    argv = ["/bin/sh", "-c", command[0]] if len(command) == 1 else list(command)
    failure: type[Exception] = RetryableError if retry else PermanentError

    async def run(job: Job) -> Any:
        env = {
            **os.environ,
            "TASKHOSTER_ITEM_ID": job.id,
            "TASKHOSTER_QUEUE": job.queue,
            "TASKHOSTER_ATTEMPTS": str(job.attempts),
            "TASKHOSTER_THREAD_ID": job.thread_id or "",
        }
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
        try:
            out, err = await _communicate(proc, json.dumps(job.payload).encode() + b"\n", job)
        except asyncio.CancelledError:
            await _terminate(proc, kill_grace)
            raise
        if proc.returncode != 0:
            code = proc.returncode
            status = (
                f"killed by signal {-code}"
                if code is not None and code < 0
                else f"exited with status {code}"
            )
            message = err.decode("utf-8", errors="replace").strip()
            raise failure(message or status)
        return parse_output(out)

    return run


async def _communicate(
    proc: asyncio.subprocess.Process, data: bytes, job: Job
) -> tuple[bytes, bytes]:
    """``proc.communicate(data)``, with standard error read line by line as it comes: the
    progress lines are reported (and left out of what is returned)."""
    assert proc.stdin is not None
    assert proc.stdout is not None
    assert proc.stderr is not None
    stdin, stdout, stderr = proc.stdin, proc.stdout, proc.stderr

    async def feed() -> None:
        # A command that exits without reading its input is no error of the item's.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            stdin.write(data)
            await stdin.drain()
        stdin.close()

    async def errors() -> bytes:
        kept = bytearray()
        pending = bytearray()
        while chunk := await stderr.read(65536):
            searched = len(pending)
            pending += chunk
            end = pending.find(b"\n", searched)
            while end != -1:
                _stderr_line(bytes(pending[:end]), kept, job)
                del pending[: end + 1]
                end = pending.find(b"\n")
        if pending:
            _stderr_line(bytes(pending), kept, job)
        return bytes(kept)

    _fed, out, err = await asyncio.gather(feed(), stdout.read(), errors())
    await proc.wait()
    return out, err


def _stderr_line(line: bytes, kept: bytearray, job: Job) -> None:
    """One line of a command's standard error: a progress report is sent, anything else kept
    (as the error text, should the command fail)."""
    prefix = PROGRESS_PREFIX.encode()
    if line.startswith(prefix):
        try:
            job.progress(json.loads(line[len(prefix) :]))
            return
        except (ValueError, TypeError) as exc:
            log.warning(
                "item %s: a %sline that is not JSON of at most %d bytes (%s); kept as an "
                "error line",
                job.id,
                PROGRESS_PREFIX,
                PROGRESS_MAX_BYTES,
                exc,
            )
    kept += line + b"\n"


def _signal_group(proc: asyncio.subprocess.Process, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


async def _terminate(proc: asyncio.subprocess.Process, kill_grace: float) -> None:
    """SIGTERM to the command's process group; SIGKILL if it lingers ``kill_grace`` seconds,
    or at once if this is cancelled meanwhile (the worker stops for good)."""
    _signal_group(proc, signal.SIGTERM)
    try:
        await asyncio.wait_for(proc.wait(), kill_grace)
        return
    except TimeoutError:
        log.warning("the command of a stopped item outlived SIGTERM by %gs: SIGKILL", kill_grace)
    except asyncio.CancelledError:
        _signal_group(proc, signal.SIGKILL)
        raise
    _signal_group(proc, signal.SIGKILL)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(proc.wait(), 10)
