"""Scaling out: single posts and socket drain with 1, 2 and 4 server processes on one address.

A benchmark, not a test. PostgreSQL and Redis are required (several processes share them).
One fresh database and state root (fsync on); for each process count N, in turn and round
after round, the production setup is started as ``scripts/serve-many`` starts it
(supervisord with ``deploy/supervisord.conf``: N daphne processes on one listening socket,
one sweep), and measured:

- ``posts/s``: ``wrk -t2 -c16 -d<seconds>s`` single posts of a ~100-byte payload (2xx only);
- ``drain/s``: ``--items`` (20,000) posted in batches of 500, then ``--workers`` (4) worker
  processes (``bench/work_socket.py --worker``: one socket each, capacity 16, a result at
  once) drain them; items per second from the first subscribe to the last finish.

During each measurement the script reads ``/proc``: the machine's CPU use (of all cores),
the CPU seconds of each kind of process (daphne, its committer, PostgreSQL, Redis, the load:
wrk or the workers) per second of wall time, and the disk's busy time (``/proc/diskstats``),
so the table says which is the limit at each step::

    .venv/bin/python bench/scale.py --database-url postgres://postgres@127.0.0.1:5432/postgres \\
        --redis-url redis://127.0.0.1:6379/0
    .venv/bin/python bench/scale.py ... --processes 1,2 --rounds 2 --seconds 5 --items 5000
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
import shutil
import signal
import statistics
import subprocess
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.core import (
    QUEUE,
    REPO,
    BenchError,
    _interrupt,
    destroy_environment,
    free_port,
    load_average,
    make_environment,
    migrate,
    say,
    setup_django,
)
from bench.drain import counts, post_backlog
from bench.http_load import delete_pending, parse_wrk, post_script
from bench.work_socket import WorkerProcess, wait_for

CLK_TCK = os.sysconf("SC_CLK_TCK")
CORES = os.cpu_count() or 1


# -- reading /proc -----------------------------------------------------------------------------


def _cpu_busy() -> tuple[float, float]:
    """(busy, total) jiffies of all cores."""
    with open("/proc/stat") as stat:
        fields = [float(x) for x in stat.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def _disk_busy_ms() -> float:
    """Milliseconds the busiest whole disk spent doing I/O (field 13 of /proc/diskstats)."""
    best = 0.0
    with open("/proc/diskstats") as stats:
        for line in stats:
            parts = line.split()
            name = parts[2]
            partition = name[-1].isdigit() and "nvme" not in name
            if name.startswith(("loop", "ram", "dm-")) or partition:
                continue
            best = max(best, float(parts[12]))
    return best


def _processes() -> dict[int, tuple[int, str, str]]:
    """pid -> (parent pid, comm, command line) of every process."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                text = stat.read()
            with open(f"/proc/{entry}/cmdline", "rb") as cmd:
                cmdline = cmd.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        comm = text[text.index("(") + 1 : text.rindex(")")]
        rest = text[text.rindex(")") + 2 :].split()
        found[int(entry)] = (int(rest[1]), comm, cmdline)
    return found


def _cpu_seconds(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            rest = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (float(rest[11]) + float(rest[12])) / CLK_TCK  # utime + stime


def _kind(pid: int, procs: dict[int, tuple[int, str, str]]) -> str | None:
    _parent, comm, cmdline = procs[pid]
    if comm.startswith("postgres"):
        return "postgres"
    if comm.startswith("redis-server"):
        return "redis"
    if comm == "wrk" or "work_socket.py --worker" in cmdline:
        return "load"
    if "taskhoster.committer_process" in cmdline:
        return "committer"
    if "-m daphne" in cmdline:
        return "daphne"
    return None


@dataclass
class Usage:
    """CPU and disk use over one measurement."""

    seconds: float = 0.0
    machine_busy: float = 0.0  # share of all cores
    cores: dict[str, float] = field(default_factory=dict)  # kind -> cores used
    disk_busy: float = 0.0  # share of the time the disk was busy


class Meter:
    """Samples every process's CPU time every 0.2 s (processes come and go during a run)."""

    def __init__(self) -> None:
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self.kinds: dict[int, str] = {}

    def start(self) -> None:
        self.t0 = time.monotonic()
        self.cpu0 = _cpu_busy()
        self.disk0 = _disk_busy_ms()
        self.sample(started=True)

    def sample(self, started: bool = False) -> None:
        procs = _processes()
        for pid in procs:
            kind = self.kinds.get(pid) or _kind(pid, procs)
            if kind is None:
                continue
            self.kinds[pid] = kind
            seconds = _cpu_seconds(pid)
            # A process running when the meter started counts from then; one started since,
            # from its start.
            self.first.setdefault(pid, seconds if started else 0.0)
            self.last[pid] = seconds

    def stop(self) -> Usage:
        self.sample()
        elapsed = time.monotonic() - self.t0
        busy, total = _cpu_busy()
        cores: dict[str, float] = defaultdict(float)
        for pid, seconds in self.last.items():
            used = (seconds - self.first.get(pid, 0.0)) / elapsed
            cores[self.kinds[pid]] += used
            if self.kinds[pid] == "daphne":
                cores["busiest daphne"] = max(cores["busiest daphne"], used)
        return Usage(
            seconds=elapsed,
            machine_busy=(busy - self.cpu0[0]) / max(total - self.cpu0[1], 1.0),
            cores=dict(cores),
            disk_busy=(_disk_busy_ms() - self.disk0) / 1000 / elapsed,
        )


def metered(work: Any) -> tuple[Any, Usage]:
    meter = Meter()
    meter.start()
    done = False
    result: Any = None

    def run() -> None:
        nonlocal result, done
        try:
            result = work()
        finally:
            done = True

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    while not done:
        time.sleep(0.2)
        meter.sample()
    thread.join()
    return result, meter.stop()


# -- the served setup --------------------------------------------------------------------------


class ServeMany:
    """deploy/supervisord.conf with N daphne processes, as scripts/serve-many runs it."""

    def __init__(self, env: Any, processes: int, redis_url: str) -> None:
        self.processes = processes
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.var = env.tmp / f"var-{processes}"
        self.var.mkdir(exist_ok=True)
        self.env = env.process_env(fsync=True)
        self.env.update(
            {
                "REDIS_URL": redis_url,
                "TASKHOSTER_HOME": str(REPO),
                "TASKHOSTER_VAR": str(self.var),
                "TASKHOSTER_PYTHON": sys.executable,
                "TASKHOSTER_PROCESSES": str(processes),
                "TASKHOSTER_SWEEP_EVERY": "1",
                "TASKHOSTER_WS_MAX": str((1024 * 1024 + 65536) * 2),
                "HOST": "127.0.0.1",
                "PORT": str(self.port),
            }
        )
        self.log = env.tmp / f"supervisord-{processes}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ServeMany:
        supervisord = Path(sys.executable).with_name("supervisord")
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [str(supervisord), "-c", "deploy/supervisord.conf"],
                cwd=REPO,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + 90
        seen: set[int] = set()
        while time.monotonic() < deadline and len(seen) < self.processes:
            if self.proc.poll() is not None:
                raise BenchError(f"supervisord exited: {self.log.read_text()[-2000:]}")
            try:
                answer = httpx.get(f"{self.url}/healthz", timeout=2, trust_env=False)
                if answer.status_code == 200:
                    seen.add(answer.json()["pid"])
            except httpx.HTTPError:
                time.sleep(0.2)
        if len(seen) < self.processes:
            raise BenchError(f"only {len(seen)} of {self.processes} processes answered")
        return self

    def stop(self) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


# -- measurements ------------------------------------------------------------------------------


@dataclass
class Row:
    processes: int
    what: str
    rate: float
    usage: Usage
    note: str = ""


def measure_posts(args: argparse.Namespace, served: ServeMany, key: str) -> Row:
    script = post_script(served.var, key)
    argv = [args.wrk, "-t2", f"-c{args.connections}", f"-d{args.seconds:g}s", "--latency"]
    argv += ["-s", str(script), f"{served.url}/api/queues/{QUEUE}/items"]

    def run() -> str:
        return subprocess.run(
            argv, capture_output=True, text=True, timeout=args.seconds + 60, check=True
        ).stdout

    out, usage = metered(run)
    found = parse_wrk(out)
    ok = max(0, found["requests"] - found["non_2xx"]) / max(found["requests"], 1)
    note = f"p50 {found.get('p50_ms', float('nan')):.1f} ms, p99 {found.get('p99_ms', 0):.1f} ms"
    if found["non_2xx"] or found["socket_errors"]:
        note += f", non-2xx {found['non_2xx']}, socket errors {found['socket_errors']}"
    return Row(served.processes, "posts/s", found["per_second"] * ok, usage, note)


def measure_drain(args: argparse.Namespace, served: ServeMany, key: str) -> Row:
    headers = {"Authorization": f"Token {key}"}
    with httpx.Client(base_url=served.url, headers=headers, timeout=60, trust_env=False) as c:
        post_backlog(c, args.items)
        os.sync()
        workers: list[WorkerProcess] = []

        def run() -> tuple[float, list[dict[str, int]]]:
            workers.extend(WorkerProcess(served.url, key) for _ in range(args.workers))
            for worker in workers:
                worker.wait_ready()
            started = time.monotonic()
            if not wait_for(lambda: counts(c)["finished"] >= args.items, args.timeout, step=0.05):
                raise BenchError(f"drain did not finish in {args.timeout} s: {counts(c)}")
            return time.monotonic() - started, [w.finish() for w in workers]

        try:
            (elapsed, shares), usage = metered(run)
        finally:
            for worker in workers:
                worker.kill()
        delete = c.post(f"/api/queues/{QUEUE}/items/delete", json={"status": "finished"})
        if delete.status_code != 200:
            raise BenchError(f"delete finished: {delete.status_code} {delete.text[:200]}")
    note = f"per worker {[s.get('item', 0) for s in shares]}"
    return Row(served.processes, "drain/s", args.items / elapsed, usage, note)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database-url", required=True, help="a PostgreSQL admin URL")
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--processes", default="1,2,4")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--items", type=int, default=20000)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--wrk", default=shutil.which("wrk") or "wrk")
    parser.add_argument("--tmpdir", default=None)
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)
    counts_of = [int(n) for n in args.processes.split(",")]
    env = None
    served: ServeMany | None = None
    rows: list[Row] = []
    try:
        env = make_environment(args)
        migrate(env)
        setup_django(env)
        from taskhoster import engine
        from taskhoster.keys import create_key

        engine.upsert_queue(name=QUEUE, body={})
        key = create_key(name="bench", scopes=["produce", "work", "manage"])[1]
        for round_ in range(1, args.rounds + 1):
            for n in counts_of:
                served = ServeMany(env, n, args.redis_url).start()
                say(f"round {round_}: {n} process(es) up; load average {load_average()}")
                rows.append(measure_posts(args, served, key))
                say(f"  {rows[-1].rate:,.0f} posts/s")
                with httpx.Client(
                    base_url=served.url,
                    headers={"Authorization": f"Token {key}"},
                    timeout=120,
                    trust_env=False,
                ) as client:
                    delete_pending(client)
                os.sync()
                rows.append(measure_drain(args, served, key))
                say(f"  {rows[-1].rate:,.0f} drained/s")
                served.stop()
                served = None
        print_table(args, env, rows)
        return 0
    except KeyboardInterrupt:
        say("interrupted")
        print_table(args, env, rows)
        return 130
    except (BenchError, subprocess.CalledProcessError) as exc:
        say(f"error: {exc}")
        print_table(args, env, rows)
        return 1
    finally:
        if served is not None:
            served.stop()
        if env is not None:
            destroy_environment(env, keep=args.keep)


def print_table(args: argparse.Namespace, env: Any, rows: list[Row]) -> None:
    if not rows:
        return
    print(
        f"\nScaling on one host: {env.label if env else '?'} + Redis, fsync on, {CORES} cores, "
        f"wrk -c{args.connections}, {args.items:,} items drained by {args.workers} workers of "
        f"capacity 16; load average {load_average()}"
    )
    print(
        "| processes | what | rate (median) | machine CPU | cores: daphnes (busiest) | "
        "committers | postgres | redis | load | disk busy | note |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    grouped: dict[tuple[int, str], list[Row]] = defaultdict(list)
    for row in rows:
        grouped[(row.processes, row.what)].append(row)
    for (processes, what), found in grouped.items():
        rates = [r.rate for r in found]
        middle = sorted(found, key=lambda r: r.rate)[len(found) // 2]
        use = middle.usage
        c = use.cores
        print(
            f"| {processes} | {what} | {statistics.median(rates):,.0f}"
            f"{' (' + ', '.join(f'{r:,.0f}' for r in rates) + ')' if len(rates) > 1 else ''} | "
            f"{use.machine_busy:.0%} | {c.get('daphne', 0):.2f} ({c.get('busiest daphne', 0):.2f})"
            f" | {c.get('committer', 0):.2f} | "
            f"{c.get('postgres', 0):.2f} | {c.get('redis', 0):.2f} | {c.get('load', 0):.2f} | "
            f"{use.disk_busy:.0%} | {middle.note} |"
        )


if __name__ == "__main__":
    sys.exit(main())
