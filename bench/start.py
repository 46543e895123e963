"""A server's start: from its launch to ``/healthz`` answering 200, and the CPU it took.

A benchmark, not a test. ``--starts`` (8) times in a row, a daphne serving the project's
ASGI app (fsync on) on a fresh database and state root is launched and ``/healthz`` asked
every 20 ms over a plain connection until it answers 200. For each start: the seconds until
daphne says it listens, until its first answer, until a 200 (the committer process ready),
and the CPU seconds daphne and its committer process had used by then (from ``/proc``). The
table gives the medians. A test suite starts hundreds of servers; an operator's restart
waits for one::

    .venv/bin/python bench/start.py
    .venv/bin/python bench/start.py --starts 8 --database-url postgres://postgres@127.0.0.1:5432/postgres
"""

# ruff: noqa: E402
from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(_HERE)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

import argparse
import contextlib
import http.client
import signal
import statistics
import subprocess
import time

from bench.core import (
    ASGI_APP,
    REPO,
    BenchError,
    destroy_environment,
    free_port,
    load_average,
    make_environment,
    migrate,
    say,
)
from bench.http_load import cpu_seconds


def healthz(port: int) -> int:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        connection.request("GET", "/healthz")
        return connection.getresponse().status
    finally:
        connection.close()


def one_start(env_vars: dict[str, str], log_path: str) -> tuple[float, float, float, float, float]:
    """(to listening, to the first answer, to 200, daphne's CPU, the committer's CPU)."""
    port = free_port()
    started = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port), ASGI_APP],
            cwd=REPO,
            env=env_vars,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    listening = first = None
    try:
        deadline = started + 60
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                with open(log_path, errors="replace") as log:
                    raise BenchError(f"daphne exited: {log.read()[-2000:]}")
            if listening is None:
                with open(log_path, "rb") as log:
                    if f"Listening on TCP address 127.0.0.1:{port}".encode() not in log.read():
                        time.sleep(0.02)
                        continue
                listening = time.monotonic() - started
            try:
                status = healthz(port)
            except (OSError, http.client.HTTPException):
                time.sleep(0.02)
                continue
            if first is None:
                first = time.monotonic() - started
            if status == 200:
                ready = time.monotonic() - started
                children = subprocess.run(
                    ["pgrep", "-P", str(proc.pid)], capture_output=True, text=True, check=False
                ).stdout.split()
                committer = sum(cpu_seconds(int(child)) for child in children)
                return listening, first, ready, cpu_seconds(proc.pid), committer
            time.sleep(0.02)
        raise BenchError("daphne did not answer /healthz 200 within 60 s")
    finally:
        # daphne and its committer process: the next start begins once both have gone.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(20)
        while subprocess.run(
            ["pgrep", "-g", str(proc.pid)], capture_output=True, check=False
        ).stdout:
            time.sleep(0.02)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--starts", type=int, default=8)
    parser.add_argument("--database-url")
    parser.add_argument("--redis-url")
    parser.add_argument("--tmpdir")
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args(argv)
    env = make_environment(args)
    try:
        migrate(env)
        env_vars = env.process_env(fsync=True)
        if args.redis_url:
            env_vars["REDIS_URL"] = args.redis_url
        rows = []
        for n in range(args.starts):
            row = one_start(env_vars, str(env.tmp / f"daphne-{n}.log"))
            rows.append(row)
            say(
                f"start {n + 1}: listening {row[0]:.3f} s, first answer {row[1]:.3f} s, "
                f"ready {row[2]:.3f} s; CPU daphne {row[3]:.2f} s, committer {row[4]:.2f} s"
            )
        say(load_average())
    finally:
        destroy_environment(env, keep=args.keep)
    names = ("listening s", "first answer s", "ready s", "daphne CPU s", "committer CPU s")
    print(f"\na server's start, {args.starts} starts on {env.label}, medians")
    for i, name in enumerate(names):
        print(f"{name:<16} {statistics.median(r[i] for r in rows):>7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
