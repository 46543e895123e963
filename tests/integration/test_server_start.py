"""A server process's start: what it does first."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import urllib.request

import pytest

from taskhoster.health import PROBE_LEFT_AFTER, PROBE_PREFIX

from ..conftest import REPO, server_env

pytestmark = pytest.mark.slow

# Run in a process of its own: the project's ASGI module imported as daphne imports it, and
# for every process it starts, whether the server's handler (``taskhoster.asgi``, with the
# REST framework and the views) had been imported by then. Python's audit hook sees the
# start as it happens; nothing of the server is replaced.
_WATCH_THE_START = textwrap.dedent(
    """
    import json, sys

    started = []

    def hook(event, args):
        if event == "subprocess.Popen" and "taskhoster.committer_process" in list(args[1]):
            started.append("taskhoster.asgi" in sys.modules)

    sys.addaudithook(hook)
    import project.asgi  # noqa: F401

    print(json.dumps(started))
    """
)


def test_the_committer_process_starts_before_the_server_imports_its_handler(
    transactional_db, state_root
):
    """``project/asgi.py`` starts the committer process (``taskhoster.startup``) as soon as
    Django is set up, so that its start (a process of its own, which ``/healthz`` waits for)
    goes on beside the rest of the server's imports rather than after them; ``asgi.start()``
    finds it started, and no second one is started."""
    done = subprocess.run(
        [sys.executable, "-c", _WATCH_THE_START],
        cwd=REPO,
        env=server_env(state_root, TASKHOSTER_COMMITTER="process"),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    started = json.loads(done.stdout.strip().splitlines()[-1])
    assert started == [False], "one committer process, started before the handler's imports"


def test_a_server_started_removes_the_old_write_probes_a_kill_left_in_its_state_root(
    server_factory, state_root
):
    """A kill between the health probe's write and its unlink leaves the probe's file in the
    state root; a server's health monitor removes it after its first report, once an hour old."""
    state_root.mkdir(parents=True, exist_ok=True)
    left = state_root / f"{PROBE_PREFIX}00112233aabbccdd"
    left.write_bytes(b"ok\n")
    then = time.time() - PROBE_LEFT_AFTER - 60
    os.utime(left, (then, then))
    server_factory()  # started, /healthz answering 200
    deadline = time.monotonic() + 10
    while left.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left.exists(), "the old probe's file is still in the state root"


def test_a_test_server_started_again_while_its_daphne_runs_is_refused_and_keeps_serving(
    server_factory,
):
    """The tests' ``Server.start`` on a server whose daphne runs is refused: starting another
    would lose the running one to ``stop``, and it would outlive the test."""
    server = server_factory()
    running = server.proc
    assert running is not None
    with pytest.raises(RuntimeError, match="is running"):
        server.start()
    assert server.proc is running, "the running daphne is still the one the server stops"
    assert running.poll() is None
    with urllib.request.urlopen(f"{server.url}/healthz", timeout=10) as answer:
        assert answer.status == 200
