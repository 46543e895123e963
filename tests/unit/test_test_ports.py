"""The ports the tests' servers listen on (``tests.conftest.free_port``): a port handed
out is never one the kernel could give an outgoing connection as its source port, and
never one another test process holds (CI runs two suites side by side)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ..conftest import REPO, TEST_PORTS, free_port

OTHER_PROCESS = """
import json, django
django.setup()
from tests.conftest import free_port
print(json.dumps([free_port() for _ in range(60)]))
"""


def test_a_test_servers_port_is_below_the_kernels_ephemeral_ports() -> None:
    low, _high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    ports = [free_port() for _ in range(60)]
    assert all(p in TEST_PORTS and p < low for p in ports), ports


def test_two_processes_never_hold_one_port_at_once() -> None:
    mine = {free_port() for _ in range(60)}
    answer = subprocess.run(
        [sys.executable, "-c", OTHER_PROCESS],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={"DJANGO_SETTINGS_MODULE": "project.settings", "PATH": "/usr/bin:/bin"},
    )
    assert answer.returncode == 0, answer.stderr
    theirs = set(json.loads(answer.stdout.strip().splitlines()[-1]))
    assert len(theirs) == 60
    assert not mine & theirs
