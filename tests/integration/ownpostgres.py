"""A PostgreSQL server of a test's own, to crash and start again (the tests' shared one is
not theirs to crash): made by ``initdb`` in a temporary directory and run as the
``postgres`` user (``initdb`` refuses root). Needs root and PostgreSQL's server programs;
``available()`` says whether this machine has them."""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg

from ..conftest import free_port


def _bindir() -> Path | None:
    found = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4])
    )
    return Path(found[-1]).parent if found else None


def available() -> bool:
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        return False
    return os.geteuid() == 0 and _bindir() is not None


class OwnPostgres:
    def __init__(self) -> None:
        bindir = _bindir()
        assert bindir is not None
        self.bindir = bindir
        self.dir = Path(tempfile.mkdtemp(prefix="taskhoster-pg-"))
        self.data = str(self.dir / "data")
        user = pwd.getpwnam("postgres")
        os.chown(self.dir, user.pw_uid, user.pw_gid)
        self.port = free_port()
        self.url = f"postgres://postgres@127.0.0.1:{self.port}/postgres"
        self._run("initdb", "-D", self.data, "-U", "postgres", "--auth=trust", "-N")

    def _run(self, program: str, *args: str) -> None:
        subprocess.run(
            ["runuser", "-u", "postgres", "--", str(self.bindir / program), *args],
            check=True,
            capture_output=True,
            timeout=120,
        )

    def start(self) -> None:
        # The WAL writer at its slowest (10 s): what a session wrote and did not commit stays
        # in the server's memory, for a crash to lose.
        options = (
            f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c wal_writer_delay=10000"
        )
        self._run(
            "pg_ctl", "-D", self.data, "-o", options, "-l", str(self.dir / "log"), "-w", "start"
        )

    def crash(self) -> None:
        """Stop at once, as a crash does: every process killed, nothing written first (what
        the server had in memory only, its WAL buffers among it, is gone)."""
        self._run("pg_ctl", "-D", self.data, "-m", "immediate", "stop")

    def crash_one_session(self) -> None:
        """Kill one session's process, as the kernel's out-of-memory killer might: the server
        ends every other session and recovers, without a restart of its own (its start time
        stays); returns once it takes connections again."""
        with psycopg.connect(self.url, autocommit=True) as victim:
            pid = victim.execute("SELECT pg_backend_pid()").fetchone()
            assert pid is not None
            os.kill(int(pid[0]), signal.SIGKILL)
        deadline = time.monotonic() + 60
        while True:
            try:
                with psycopg.connect(self.url, connect_timeout=5) as again:
                    again.execute("SELECT 1")
                return
            except psycopg.OperationalError:
                assert time.monotonic() < deadline, "the server did not recover"
                time.sleep(0.05)

    def remove(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):  # not running
            self.crash()
        shutil.rmtree(self.dir, ignore_errors=True)
