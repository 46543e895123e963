"""``scripts/serve`` under a supervisor: SIGTERM (or SIGINT, SIGHUP) to the script's pid alone
stops daphne, its committer process and the sweep, and the script exits 0; a server process
that ends by itself takes the rest down and the script exits non-zero.

Each run uses the embedded default in a temporary ``TASKHOSTER_VAR`` (its own SQLite file,
state root, secret and credentials), never the repository's ``var/``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from ..conftest import REPO, free_port

pytestmark = pytest.mark.slow


def descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (children, grandchildren...), from /proc."""
    found: set[int] = set()
    todo = [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = list(Path(f"/proc/{parent}/task").iterdir())
        except FileNotFoundError:
            continue
        for task in tasks:
            try:
                children = {int(c) for c in (task / "children").read_text().split()}
            except FileNotFoundError:
                continue
            todo += children - found
            found |= children
    return found


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except FileNotFoundError:
        return ""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def process_states(pids: list[int]) -> str:
    """Each process's command, state and kernel wait channel, for a failure's message."""
    lines = []
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            state = next(line for line in status.splitlines() if line.startswith("State:"))
            wchan = Path(f"/proc/{pid}/wchan").read_text()
        except (FileNotFoundError, StopIteration):
            lines.append(f"{pid}: gone")
            continue
        lines.append(f"{pid} {command_line(pid)[:80]!r}: {state} wchan={wchan}")
    return "; ".join(lines)


def wait_until(predicate: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _default_signals() -> None:
    """In the script's process, before it starts: the stop signals at their defaults. A
    signal ignored when a shell starts cannot be trapped, and under ``nohup`` (as CI may run)
    SIGHUP is ignored, so the script never heard it."""
    for signum in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_DFL)


class Serve:
    def __init__(self, var: Path, port: int) -> None:
        self.var = var
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "TASKHOSTER_VAR": str(var), "PORT": str(port)}
        # The embedded default, as a new user runs it (not the test database).
        for name in ("DATABASE_URL", "REDIS_URL", "TASKHOSTER_ROOT", "DJANGO_SETTINGS_MODULE"):
            env.pop(name, None)
        self.log_path = var / f"serve-{port}.log"
        self.seen: set[int] = set()
        var.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [str(REPO / "scripts" / "serve")],
                cwd=REPO,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                # Its own process group, as under a supervisor: a signal to the group would
                # prove nothing.
                start_new_session=True,
                preexec_fn=_default_signals,
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def wait_serving(self) -> dict[str, int]:
        """Wait until it answers; then its processes by role (daphne, committer, sweep)."""

        def answers() -> bool:
            assert self.proc.poll() is None, f"scripts/serve exited early:\n{self.log()}"
            try:
                return httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(answers, 60, "scripts/serve to answer")
        # The committer process starts with daphne's first use of the engine.
        httpx.get(f"{self.url}/metrics", timeout=5)

        def roles() -> dict[str, int] | None:
            found: dict[str, int] = {}
            for pid in descendants(self.proc.pid):
                line = command_line(pid)
                if "daphne" in line:
                    found["daphne"] = pid
                elif "sweep --every" in line:
                    found["sweep"] = pid
                elif "taskhoster.committer_process" in line:
                    found["committer"] = pid
            return found if {"daphne", "sweep", "committer"} <= set(found) else None

        found: dict[str, int] = wait_until(roles, 10, "daphne, its committer and the sweep")
        self.seen |= set(found.values())
        return found

    def kill_all(self) -> None:
        # Those seen too: a script that fails this test leaves them orphaned, no descendants.
        for pid in descendants(self.proc.pid) | {self.proc.pid} | self.seen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(10)


@pytest.fixture(scope="module")
def var(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One var/ for the module: the first run sets it up, later runs reuse it (as a user's
    second ``scripts/serve`` does)."""
    return tmp_path_factory.mktemp("serve") / "var"


@pytest.fixture
def serve(var: Path) -> Iterator[Any]:
    started: list[Serve] = []

    def start(port: int | None = None) -> Serve:
        run = Serve(var, port or free_port())
        started.append(run)
        return run

    yield start
    for run in started:
        if run.proc.poll() is None or descendants(run.proc.pid) or any(map(alive, run.seen)):
            run.kill_all()


@pytest.mark.parametrize(
    "signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=["TERM", "INT", "HUP"]
)
def test_a_signal_to_the_script_alone_stops_daphne_and_the_sweep(serve: Any, signum: int):
    run = serve()
    processes = run.wait_serving()
    assert httpx.get(f"{run.url}/", timeout=5).json()["name"] == "Taskhoster"

    os.kill(run.proc.pid, signum)  # the script's pid only, as a supervisor does
    # The script promises to be done within its grace (TASKHOSTER_STOP_SECONDS, 20 s: then it
    # kills what is left and still exits); on a loaded machine daphne may take much of it.
    try:
        status = run.proc.wait(20 + 30)
    except subprocess.TimeoutExpired:
        raise AssertionError(
            f"scripts/serve still runs 50 s after SIG{signal.Signals(signum).name[3:]}: "
            f"{process_states([run.proc.pid, *processes.values()])}\n{run.log()}"
        ) from None
    assert status == 0, run.log()
    wait_until(
        lambda: not any(alive(pid) for pid in processes.values()),
        5,
        f"{processes} to stop",
    )
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{run.url}/healthz", timeout=2)


def test_a_server_that_cannot_start_stops_the_sweep_and_fails_the_script(serve: Any):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        run = serve(port=taken.getsockname()[1])
        status = run.proc.wait(60)
        assert status != 0
        assert "stopping the rest" in run.log()
    # No sweep of this run is left anywhere: once the script is gone, a sweep it left behind
    # is an orphan, no descendant of anything of ours, so every process is looked at.
    assert not [
        pid
        for pid in map(int, filter(str.isdigit, os.listdir("/proc")))
        if "sweep --every" in command_line(pid) and str(run.var) in _environ(pid)
    ]


def _environ(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    except (FileNotFoundError, PermissionError):
        return ""
