"""What hostile or careless clients cost a server: memory, threads, descriptors and CPU.

A benchmark, not a test (the rules are in ``tests/integration/test_security.py``). One
daphne on a fresh database and state root, as ``scripts/serve`` starts it (the WebSocket
limits included), then, each measured from ``/proc`` (daphne and its committer process):

- ``deep json``: 30 posts whose payload nests 600 levels deep with a valid key, then 20 with
  a made-up key: resident memory before and after;
- ``long-polls``: 200 ``GET /api/items/{id}?wait=6`` at once: the most threads and open
  descriptors daphne had meanwhile; then 100 idle ones (``wait=10``): the CPU they cost;
- ``wrong keys``: 300 requests at once with a made-up key: open descriptors right after,
  and 10 s later.

::

    .venv/bin/python bench/abuse.py
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
import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench.core import Daphne, destroy_environment, make_environment, migrate, say, setup_django

CLOCK = os.sysconf("SC_CLK_TCK")
WS_MAX = str((1024 * 1024 + 65536) * 2)


def family(pid: int) -> list[int]:
    pids = [pid]
    for task in Path(f"/proc/{pid}/task").iterdir():
        pids += [int(c) for c in (task / "children").read_text().split()]
    return pids


def rss_mb(pid: int) -> float:
    total = 0.0
    for one in family(pid):
        for line in Path(f"/proc/{one}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) / 1024
    return round(total, 1)


def threads(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/task").iterdir()))


def fds(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/fd").iterdir()))


def cpu(pid: int) -> float:
    total = 0.0
    for one in family(pid):
        fields = Path(f"/proc/{one}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / CLOCK
    return total


def at_once(count: int, call: Any, watch: Any = None) -> dict[str, Any]:
    """``call(n)`` from ``count`` threads at once; ``watch()`` sampled meanwhile (its maxima)."""
    peaks: dict[str, int] = {}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            for name, value in (watch() if watch else {}).items():
                peaks[name] = max(peaks.get(name, 0), value)
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    workers = [threading.Thread(target=call, args=(n,)) for n in range(count)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
    done.set()
    sampler.join(5)
    return peaks


def run(args: argparse.Namespace) -> dict[str, Any]:
    env = make_environment(args)
    server: Daphne | None = None
    try:
        migrate(env)
        setup_django(env)
        from taskhoster import engine
        from taskhoster.keys import create_key

        key = create_key(name="bench", scopes=["produce", "work", "manage"])[1]
        engine.upsert_queue(name="q", body={})
        ids = [
            p.row.id
            for p in engine.post_items(
                queue_name="q", items=[engine.NewItem(payload=n) for n in range(200)]
            )
        ]
        extra = ("--websocket-max-message-size", WS_MAX, "--websocket-max-frame-size", WS_MAX)
        server = Daphne(env, fsync=True, extra_args=("--websocket_timeout", "-1", *extra))
        server.start()
        assert server.proc is not None
        pid = server.proc.pid
        good = {"Authorization": f"Token {key}", "Content-Type": "application/json"}
        bogus = {"Authorization": "Token th_made-up", "Content-Type": "application/json"}
        url = server.url
        out: dict[str, Any] = {}

        deep = '{"payload": ' + "[" * 600 + "]" * 600 + "}"
        before = rss_mb(pid)
        with httpx.Client(timeout=30) as http:
            codes = [
                http.post(f"{url}/api/queues/q/items", content=deep, headers=good).status_code
                for _ in range(30)
            ]
            middle = rss_mb(pid)
            codes += [
                http.post(f"{url}/api/queues/q/items", content=deep, headers=bogus).status_code
                for _ in range(20)
            ]
        out["deep_json"] = {
            "rss_mb": [before, middle, rss_mb(pid)],
            "answers": {str(c): codes.count(c) for c in sorted(set(codes))},
        }
        say(json.dumps(out["deep_json"]))

        def wait(n: int) -> None:
            httpx.get(f"{url}/api/items/{ids[n % len(ids)]}?wait=6", headers=good, timeout=60)

        before_counts = {"threads": threads(pid), "fds": fds(pid)}
        peaks = at_once(200, wait, lambda: {"threads": threads(pid), "fds": fds(pid)})
        out["long_polls_200"] = {"before": before_counts, "peak": peaks}
        say(json.dumps(out["long_polls_200"]))

        idle: dict[str, float] = {}

        def idle_wait(n: int) -> None:
            httpx.get(f"{url}/api/items/{ids[n]}?wait=10", headers=good, timeout=60)

        def measure() -> None:
            time.sleep(2)
            start = cpu(pid)
            time.sleep(5)
            idle["cores"] = round((cpu(pid) - start) / 5, 3)

        meter = threading.Thread(target=measure)
        meter.start()
        at_once(100, idle_wait)
        meter.join()
        out["idle_long_polls_100_cores"] = idle.get("cores")
        say(f"100 idle long-polls: {idle.get('cores')} cores")

        def wrong(n: int) -> None:
            with contextlib.suppress(httpx.HTTPError):
                httpx.get(f"{url}/api/queues", headers=bogus, timeout=30)

        before_fds = fds(pid)
        at_once(300, wrong)
        right_after = fds(pid)
        time.sleep(10)
        out["wrong_keys_300_fds"] = [before_fds, right_after, fds(pid)]
        say(json.dumps(out["wrong_keys_300_fds"]))
        return out
    finally:
        if server is not None:
            server.stop()
        destroy_environment(env, keep=args.keep)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database-url")
    parser.add_argument("--tmpdir")
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    result = run(args)
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
