"""The ``taskhoster`` command and work in flight (SPEC section 8.2), against a real daphne:
``work`` finishing its command on SIGTERM and on a drain, stopping it (SIGTERM, then SIGKILL)
on a cancel, and sending its progress lines; ``cancel``, ``attempts``, ``workers`` and
``drain`` with their output and exit codes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from taskhoster.client import Producer

from ..conftest import REPO

pytestmark = pytest.mark.slow

COMMAND = Path(sys.executable).with_name("taskhoster")
# The command runs this checkout's code, wherever the package was installed from.
CODE = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


@pytest.fixture
def server(server_factory):
    return server_factory()


@pytest.fixture
def producer(server, key):
    with Producer(server.url, key) as producer:
        producer.put_queue("q")
        yield producer


@pytest.fixture
def cli(server, key, tmp_path):
    """Run ``taskhoster ARGS`` with the server and key in the environment."""

    def run(*args, timeout=30):
        env = {**os.environ, "TASKHOSTER_URL": server.url, "TASKHOSTER_KEY": key, **CODE}
        return subprocess.run(
            [str(COMMAND), *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=tmp_path,
        )

    return run


class Work:
    """``taskhoster work ARGS`` in the background, its log (standard error) in a file."""

    def __init__(self, server, key, log: Path, *args: str, env=None) -> None:
        self.log = log
        self._handle = open(log, "w")  # noqa: SIM115 (closed by finish)
        self.proc = subprocess.Popen(
            [str(COMMAND), "work", *args],
            env={
                **os.environ,
                "TASKHOSTER_URL": server.url,
                "TASKHOSTER_KEY": key,
                **CODE,
                **(env or {}),
            },
            stdout=subprocess.DEVNULL,
            stderr=self._handle,
        )

    def logged(self, text: str, timeout: float = 15.0) -> None:
        """Wait until its log says ``text``."""
        deadline = time.monotonic() + timeout
        while text not in self.log.read_text():
            assert time.monotonic() < deadline, f"no {text!r} in: {self.log.read_text()}"
            time.sleep(0.05)

    def finish(self, timeout: float = 20.0) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self._handle.close()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.finish()


def wait_for(condition, timeout: float = 15.0, what: str = "the condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def until_file(path: Path, what: str | None = None) -> str:
    """The (stripped) text of ``path`` once it has some."""
    return wait_for(
        lambda: path.exists() and path.read_text().strip(), what=what or f"{path.name} written"
    )


def wait_until_exists(path: Path) -> str:
    """Shell: wait (at most 30 s, so a failed test leaves no command behind) for ``path``."""
    return f"i=0; while [ ! -e {path} ] && [ $i -lt 600 ]; do sleep 0.05; i=$((i+1)); done"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# -- SIGTERM and drain: the running command finishes -----------------------------------------


def test_sigterm_lets_the_running_command_finish_and_its_result_count_before_work_exits(
    server, key, producer, tmp_path
):
    started, go = tmp_path / "started", tmp_path / "go"
    script = f'echo "$TASKHOSTER_ITEM_ID" > {started}; {wait_until_exists(go)}; cat'
    first = producer.post("q", {"n": 1})
    second = producer.post("q", {"n": 2})
    work = Work(server, key, tmp_path / "work.log", "q", "--grace", "30", "--", script)
    try:
        assert until_file(started) == first.id
        work.proc.send_signal(signal.SIGTERM)
        work.logged("SIGTERM: finishing the items in hand")
        assert work.proc.poll() is None  # waiting for the command
        go.touch()
        assert work.finish() == 0, work.log.read_text()
    finally:
        work.stop()
    done = producer.get(first.id)
    assert (done.status, done.result, done.attempts) == ("finished", {"n": 1}, 1)
    untouched = producer.get(second.id)
    assert (untouched.status, untouched.attempts) == ("pending", 0)
    assert [a.outcome for a in producer.attempts(first.id)] == ["result"]


# -- cancel: the command gets SIGTERM, then SIGKILL ------------------------------------------

COMMAND_SCRIPT = textwrap.dedent("""
    import json, os, pathlib, signal, sys, time
    payload = json.load(sys.stdin)
    marks = pathlib.Path(os.environ["MARKS"])
    item = os.environ["TASKHOSTER_ITEM_ID"]
    if payload == "quick":
        print(json.dumps("quick"))
        sys.exit(0)

    def on_term(signum, frame):
        (marks / (item + ".term")).write_text("TERM")
        sys.exit(143)

    signal.signal(signal.SIGTERM, on_term if payload == "trap" else signal.SIG_IGN)
    (marks / (item + ".tmp")).write_text(str(os.getpid()))
    (marks / (item + ".tmp")).rename(marks / (item + ".pid"))
    for _ in range(600):  # at most 30 s, so a failed test leaves nothing behind
        time.sleep(0.05)
    print(json.dumps("finished anyway"))
""")


def test_a_cancel_sends_the_command_sigterm_then_sigkill_and_sends_no_verdict(
    server, key, producer, tmp_path
):
    marks = tmp_path / "marks"
    marks.mkdir()
    script = tmp_path / "handler.py"
    script.write_text(COMMAND_SCRIPT)
    trap = producer.post("q", "trap")
    ignore = producer.post("q", "ignore")
    work = Work(
        server,
        key,
        tmp_path / "work.log",
        "q",
        "--capacity",
        "2",
        "--kill-grace",
        "1",
        "--",
        sys.executable,
        str(script),
        env={"MARKS": str(marks)},
    )
    try:
        trap_pid = int(until_file(marks / f"{trap.id}.pid"))
        ignore_pid = int(until_file(marks / f"{ignore.id}.pid"))

        cancelled = producer.cancel(trap.id, reason="no longer wanted")
        assert (cancelled.status, cancelled.error) == ("failed", "cancelled")
        assert until_file(marks / f"{trap.id}.term", "the command to get SIGTERM") == "TERM"
        wait_for(lambda: not alive(trap_pid), what="the trapping command to exit")

        producer.cancel(ignore.id)
        wait_for(lambda: not alive(ignore_pid), what="SIGKILL for the command ignoring TERM")
        assert not (marks / f"{ignore.id}.term").exists()

        quick = producer.post("q", "quick")  # the worker serves on
        assert producer.result(quick.id, timeout=15) == "quick"
        assert work.stop() == 0, work.log.read_text()
    finally:
        work.stop()
    for item, reason in ((trap, "no longer wanted"), (ignore, None)):
        done = producer.get(item.id)
        assert (done.status, done.error, done.cancel_reason) == ("failed", "cancelled", reason)
        assert [a.outcome for a in producer.attempts(item.id)] == ["cancelled"]
    assert "not accepted" not in work.log.read_text()  # no result or fail was sent for them


# -- progress --------------------------------------------------------------------------------


def test_progress_lines_on_stderr_reach_the_item_and_are_not_error_text(
    server, key, producer, tmp_path
):
    go = tmp_path / "go"
    script = "; ".join(
        [
            """echo 'TASKHOSTER_PROGRESS {"done": 1}' >&2""",
            "echo working >&2",
            """echo 'TASKHOSTER_PROGRESS {"done": 2, "of": 2}' >&2""",
            "echo 'TASKHOSTER_PROGRESS {bad' >&2",
            wait_until_exists(go),
            "exit 3",
        ]
    )
    work = Work(server, key, tmp_path / "work.log", "q", "--no-retry", "--", script)
    try:
        item = producer.post("q", 1)
        wait_for(
            lambda: producer.get(item.id).progress == {"done": 2, "of": 2},
            what="the latest progress on the item",
        )
        assert producer.get(item.id).status == "processing"
        go.touch()
        done = producer.wait(item.id, timeout=15)
        assert (done.status, done.error) == ("failed", "working\nTASKHOSTER_PROGRESS {bad")
        assert work.stop() == 0, work.log.read_text()
    finally:
        work.stop()
    assert "not JSON" in work.log.read_text()  # the bad line was told, and kept as error text


# -- cancel, attempts, workers and drain from the shell --------------------------------------


def test_cancel_attempts_workers_and_drain_commands(server, key, producer, cli, tmp_path):
    first = Work(server, key, tmp_path / "w1.log", "q", "--name", "cli-worker-1", "--", "cat")
    second = Work(server, key, tmp_path / "w2.log", "q", "--name", "cli-worker-2", "--", "cat")
    try:

        def listed():
            shown = cli("workers", "--json")
            assert shown.returncode == 0, shown.stderr
            by_name = {w["name"]: w for w in json.loads(shown.stdout)}
            return by_name if {"cli-worker-1", "cli-worker-2"} <= set(by_name) else None

        workers = wait_for(listed, what="both workers to be listed")
        table = cli("workers")
        assert table.returncode == 0, table.stderr
        lines = table.stdout.splitlines()
        assert lines[0].split() == [
            "ID",
            "NAME",
            "QUEUES",
            "CAPACITY",
            "HELD",
            "STATE",
            "CONNECTED",
            "LAST",
            "SEEN",
        ]
        row = next(line.split() for line in lines if "cli-worker-1" in line)
        assert row[:6] == [workers["cli-worker-1"]["id"], "cli-worker-1", "q", "1", "0", "serving"]

        item = producer.post("q", {"n": 1})
        assert producer.result(item.id, timeout=15) == {"n": 1}
        shown = cli("attempts", item.id)
        assert shown.returncode == 0, shown.stderr
        header, entry = shown.stdout.splitlines()
        assert header.split() == ["ATTEMPT", "CLAIMED", "WORKER", "ENDED", "OUTCOME", "ERROR"]
        fields = entry.split()
        assert (fields[0], fields[4]) == ("1", "result")
        assert fields[2] in ("cli-worker-1", "cli-worker-2")
        as_json = json.loads(cli("attempts", item.id, "--json").stdout)
        assert as_json["omitted"] == 0
        assert [(a["attempt"], a["outcome"]) for a in as_json["attempts"]] == [(1, "result")]

        producer.put_queue("idle")
        pending = producer.post("idle", 1)
        cancelled = cli("cancel", pending.id, "--reason", "not needed")
        assert cancelled.returncode == 0, cancelled.stderr
        shown_item = json.loads(cancelled.stdout)
        assert (shown_item["status"], shown_item["error"], shown_item["cancelReason"]) == (
            "failed",
            "cancelled",
            "not needed",
        )
        again = cli("cancel", pending.id)
        assert again.returncode == 1
        assert "409 terminal" in again.stderr
        missing = cli("attempts", "nosuchitem")
        assert missing.returncode == 1
        assert "item_not_found" in missing.stderr

        nobody = cli("drain", "--prefix", "nobody-")
        assert (nobody.returncode, nobody.stdout) == (0, "")
        assert "no connected worker's name starts with 'nobody-'" in nobody.stderr
        unknown = cli("drain", "0123456789abcdef")
        assert unknown.returncode == 1
        assert "404" in unknown.stderr
        assert cli("drain").returncode == 2  # a worker id or --prefix is needed

        by_id = cli("drain", workers["cli-worker-1"]["id"])
        assert by_id.returncode == 0, by_id.stderr
        drained_row = by_id.stdout.splitlines()[1].split()
        assert drained_row[1:2] + drained_row[5:6] == ["cli-worker-1", "draining"]
        assert first.finish() == 0, first.log.read_text()
        assert "drained by the server" in first.log.read_text()

        by_prefix = cli("drain", "--prefix", "cli-worker-", "--json")
        assert by_prefix.returncode == 0, by_prefix.stderr
        names = {w["name"] for w in json.loads(by_prefix.stdout)}
        assert "cli-worker-2" in names
        assert all(w["draining"] for w in json.loads(by_prefix.stdout))
        assert second.finish() == 0, second.log.read_text()
    finally:
        first.stop()
        second.stop()
