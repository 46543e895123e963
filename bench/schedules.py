"""Schedules under three sweeps and a kill -9: every slot posted once, none missed.

A benchmark run, not a test. One daphne (fsync on) on a fresh database and state root;
``--schedules`` (100) schedules of ``every: 1`` (catchupSeconds 60) on one queue, made over
REST; three ``manage.py sweep --every 1`` processes at once for ``--seconds`` (300). Halfway,
one of them is killed with SIGKILL (with its committer process), wherever it is, and started
again ``--restart-after`` seconds later (as a supervisor would; ``--restart-after -1``: never).

At the end (sweeps stopped) it counts, per slot from each schedule's first ``nextAt`` up to
two seconds before the stop (a later slot may not have had its sweep yet):

- ``slots``: the slots due; ``items``: the schedules' items in the index;
- ``posted twice``: slots with more than one item, by the index's rows and, separately, by the
  item files in the state directories (a file with no row is what a crash between a post's
  file and its commit leaves; repair would index it as a second item);
- ``missed``: due slots with no item (each is later than catchupSeconds by the end);
- how late each slot was posted (``postedAt - slot``): p50, p99, max;
- what a repair then finds to index (must be 0).

::

    .venv/bin/python bench/schedules.py
    .venv/bin/python bench/schedules.py --seconds 60 --schedules 20
    .venv/bin/python bench/schedules.py --database-url postgres://postgres@127.0.0.1:5432/postgres
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
import json
import signal
import subprocess
import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx

from bench.core import (
    REPO,
    BenchError,
    Daphne,
    Environment,
    destroy_environment,
    make_environment,
    migrate,
    percentile,
    say,
    setup_django,
)

QUEUE = "sched"


def parse(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


class Sweep:
    def __init__(self, env: Environment, n: int, every: float) -> None:
        self.env = env
        self.n = n
        self.every = every
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = env.tmp / f"sweep-{n}.log"

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "manage.py", "sweep", "--every", str(self.every)],
                cwd=REPO,
                env=self.env.process_env(fsync=True),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def kill(self) -> None:
        """SIGKILL to the sweep and its committer process (its process group)."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def make_key(env: Environment) -> str:
    done = subprocess.run(
        [sys.executable, "manage.py", "createkey", "--name", "bench", "--scopes", "produce,manage"],
        cwd=REPO,
        env=env.process_env(fsync=False),
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return done.stdout.strip()


def files_by_key(root: Path) -> Counter[str]:
    """Item files in the queue's state directories, by the key of their first line."""
    found: Counter[str] = Counter()
    for path in (root / QUEUE).glob("*/*.json"):
        with open(path, "rb") as handle:
            first = handle.readline()
        try:
            key = json.loads(first).get("key")
        except ValueError:
            continue
        if key:
            found[key] += 1
    return found


def run(args: argparse.Namespace) -> dict[str, Any]:
    env = make_environment(args)
    daphne: Daphne | None = None
    sweeps: list[Sweep] = []
    try:
        migrate(env)
        key = make_key(env)
        daphne = Daphne(env, fsync=True).start()
        firsts: dict[str, datetime] = {}
        with httpx.Client(
            base_url=daphne.url, headers={"Authorization": f"Token {key}"}, timeout=30
        ) as http:
            http.put(f"/api/queues/{QUEUE}", json={}).raise_for_status()
            for n in range(args.schedules):
                name = f"s{n:03d}"
                made = http.put(
                    f"/api/queues/{QUEUE}/schedules/{name}",
                    json={"every": 1, "payload": {"schedule": name}},
                )
                made.raise_for_status()
                firsts[name] = parse(made.json()["nextAt"])
        say(f"{args.schedules} schedules made; 3 sweeps for {args.seconds:g} s")
        sweeps = [Sweep(env, n, args.every) for n in range(3)]
        for sweep in sweeps:
            sweep.start()
        started = time.monotonic()
        killed_at = restarted_at = None
        while time.monotonic() - started < args.seconds:
            elapsed = time.monotonic() - started
            if killed_at is None and elapsed >= args.seconds / 2:
                sweeps[0].kill()
                killed_at = datetime.now(UTC)
                say(f"sweep 0 killed (SIGKILL) at {elapsed:.1f} s")
            if (
                killed_at is not None
                and restarted_at is None
                and args.restart_after >= 0
                and datetime.now(UTC) - killed_at >= timedelta(seconds=args.restart_after)
            ):
                sweeps[0].start()
                restarted_at = datetime.now(UTC)
                say(f"sweep 0 started again at {time.monotonic() - started:.1f} s")
            time.sleep(0.2)
        stopped_at = datetime.now(UTC)
        for sweep in sweeps:
            sweep.stop()
        horizon = stopped_at - timedelta(seconds=2)

        setup_django(env)
        from taskhoster import engine
        from taskhoster.models import Item

        rows = list(
            Item.objects.filter(queue__name=QUEUE, key__startswith="schedule:").values_list(
                "key", "posted_at"
            )
        )
        by_key = Counter(k for k, _p in rows)
        posted_at = dict(rows)
        on_disk = files_by_key(env.root)
        expected: set[str] = set()
        for name, first in firsts.items():
            slot = first
            while slot <= horizon:
                expected.add(f"schedule:{name}:{slot.strftime('%Y-%m-%dT%H:%M:%SZ')}")
                slot += timedelta(seconds=1)
        missed = sorted(expected - set(by_key))
        lateness = sorted(
            (posted_at[k] - parse(k.split(":", 2)[2])).total_seconds()
            for k in expected
            if k in posted_at
        )
        repaired = engine.repair(grace_seconds=0)
        logs = "".join(s.log.read_text(errors="replace") for s in sweeps)
        return {
            "database": env.label,
            "schedules": args.schedules,
            "seconds": args.seconds,
            "sweeps": 3,
            "killed": killed_at is not None,
            "restarted": restarted_at is not None,
            "slots due": len(expected),
            "items": len(rows),
            "item files": sum(on_disk.values()),
            "posted twice (rows)": sum(1 for n in by_key.values() if n > 1),
            "posted twice (files)": sum(1 for n in on_disk.values() if n > 1),
            "files without a row": len(set(on_disk) - set(by_key)),
            "missed": len(missed),
            "missed (first 5)": missed[:5],
            # (percentile takes a sorted list of seconds and answers milliseconds)
            "late p50 s": round(percentile(lateness, 0.50) / 1000, 3) if lateness else None,
            "late p99 s": round(percentile(lateness, 0.99) / 1000, 3) if lateness else None,
            "late max s": round(max(lateness), 3) if lateness else None,
            "repair rows added": repaired.rows_added,
            "sweep errors logged": logs.count("Traceback") + logs.count("failed"),
            "sweep error lines": [
                line[:300]
                for line in logs.splitlines()
                if "Traceback" in line or "failed" in line or "Error" in line
            ][:10],
            "load average (1, 5, 15 min)": [round(x, 2) for x in os.getloadavg()],
        }
    finally:
        for sweep in sweeps:
            try:
                sweep.stop()
            except Exception as exc:
                say(f"could not stop sweep {sweep.n}: {exc}")
        if daphne is not None:
            daphne.stop()
        destroy_environment(env, keep=args.keep)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=300)
    parser.add_argument("--schedules", type=int, default=100)
    parser.add_argument("--every", type=float, default=1.0, help="each sweep's --every")
    parser.add_argument("--restart-after", type=float, default=10.0)
    parser.add_argument("--database-url", default="")
    parser.add_argument("--tmpdir", default=None)
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    try:
        result = run(args)
    except BenchError as exc:
        say(f"bench/schedules.py: {exc}")
        sys.exit(2)
    print(json.dumps(result, indent=2, default=str))
    bad = result["posted twice (rows)"] or result["posted twice (files)"] or result["missed"]
    sys.exit(1 if bad or result["repair rows added"] else 0)


if __name__ == "__main__":
    main()
