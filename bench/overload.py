"""Overload: hundreds of connections posting as fast as they can, while workers drain.

A benchmark, not a test. One daphne on a fresh database and state root (fsync on unless
``--no-fsync``), two socket workers (``work_socket.py --worker``, capacity 16) answering every
item at once, and for ``--seconds`` (15):

- ``wrk -t2 -c<connections>`` (512) posting single items (``post.lua`` of ``http_load.py``),
  as fast as the server answers;
- a producer posting one item every 50 ms on a connection of its own, timing each accepted
  post (201) and counting refusals (503 ``overloaded``): what an accepted post waits;
- a prober sending ``GET /healthz`` every 100 ms on a new connection each time, as a load
  balancer does, with a 5 s timeout.

The table gives wrk's requests, how many were 201 and how many 503, its latency (of every
answer), the accepted posts' p50/p99, the 503s the producer met, ``/healthz``'s p50/p99/max
and how many of its checks failed or took over a second, and the server's memory::

    .venv/bin/python bench/overload.py                          # 512 connections, 15 s
    .venv/bin/python bench/overload.py --connections 256 --seconds 10
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
import resource
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench.core import (
    QUEUE,
    BenchError,
    _interrupt,
    destroy_environment,
    fsync_probe,
    load_average,
    make_client,
    make_environment,
    migrate,
    percentile,
    say,
    setup_django,
)
from bench.http_load import ITEMS_URL, PAYLOAD, children_of, parse_wrk, post_script
from bench.peer_taskhoster import start_server
from bench.work_socket import WorkerProcess


def rss_mb(pid: int) -> float:
    total = 0.0
    for one in [pid, *children_of(pid)]:
        try:
            for line in Path(f"/proc/{one}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) / 1024
        except OSError:
            continue
    return round(total, 1)


class Prober(threading.Thread):
    """Something done every ``every`` seconds until stopped, each timed."""

    def __init__(self, every: float, act: Any) -> None:
        super().__init__(daemon=True)
        self.every = every
        self.act = act
        self.stop = threading.Event()
        self.times: list[float] = []
        self.outcomes: dict[str, int] = {}

    def run(self) -> None:
        while not self.stop.is_set():
            started = time.perf_counter()
            try:
                outcome = self.act()
            except httpx.HTTPError as exc:
                outcome = type(exc).__name__
            took = time.perf_counter() - started
            self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
            if outcome in ("200", "201"):
                self.times.append(took)
            self.stop.wait(max(0.0, self.every - took))


def run(args: argparse.Namespace) -> dict[str, Any]:
    env = make_environment(args)
    server = None
    workers: list[WorkerProcess] = []
    try:
        migrate(env)
        setup_django(env)
        if args.health_port:
            os.environ["TASKHOSTER_HEALTH_LISTEN"] = f"127.0.0.1:{args.health_port}"
        server, key, info = start_server(args, env)
        pid = info["daphne_pid"]
        result: dict[str, Any] = {
            "connections": args.connections,
            "seconds": args.seconds,
            "fsync_probe_ms": round(fsync_probe(env.root), 3),
        }
        workers = [WorkerProcess(server.url, key) for _ in range(2)]
        for w in workers:
            w.wait_ready()
        script = post_script(env.tmp, key)
        producer_client = make_client(server.url, key)
        body = json.dumps({"payload": PAYLOAD})

        def post() -> str:
            answer = producer_client.post(
                ITEMS_URL,
                content=body,
                headers={"Content-Type": "application/json"},
                timeout=30,
            )
            return str(answer.status_code)

        def check() -> str:
            return str(httpx.get(f"{server.url}/healthz", timeout=5).status_code)

        def check_own_port() -> str:
            return raw_get("127.0.0.1", args.health_port, "/healthz")

        producer = Prober(0.05, post)
        health = Prober(0.1, check)
        own = Prober(0.1, check_own_port) if args.health_port else None
        port = int(server.url.rsplit(":", 1)[1])
        raw = Prober(0.1, lambda: raw_get("127.0.0.1", port, "/healthz"))
        result["rss_before_mb"] = rss_mb(pid)
        say(f"{args.connections} connections for {args.seconds:g} s; {load_average()}")
        producer.start()
        health.start()
        raw.start()
        if own is not None:
            own.start()
        argv = [args.wrk, "-t2", f"-c{args.connections}", f"-d{args.seconds:g}s", "--latency"]
        argv += ["--timeout", "10s", "-s", str(script), server.url + ITEMS_URL]
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=args.seconds + 120, check=False
        )
        producer.stop.set()
        health.stop.set()
        producer.join(40)
        health.join(40)
        raw.stop.set()
        raw.join(40)
        if own is not None:
            own.stop.set()
            own.join(40)
        producer_client.close()
        if done.returncode != 0:
            raise BenchError(f"wrk failed: {done.stdout}{done.stderr}")
        found = parse_wrk(done.stdout)
        result["rss_after_mb"] = rss_mb(pid)
        with make_client(server.url, key) as client:
            counts = client.get(f"/api/queues/{QUEUE}").json()["counts"]
        accepted = sorted(producer.times)
        checks = sorted(health.times)
        result.update(
            {
                "wrk_requests": found["requests"],
                "wrk_non_2xx": found["non_2xx"],
                "wrk_2xx": found["requests"] - found["non_2xx"],
                "wrk_p50_ms": round(found.get("p50_ms", float("nan")), 1),
                "wrk_p99_ms": round(found.get("p99_ms", float("nan")), 1),
                "wrk_socket_errors": found["socket_errors"],
                "accepted_p50_ms": round(percentile(accepted, 0.5), 1),
                "accepted_p99_ms": round(percentile(accepted, 0.99), 1),
                "producer": producer.outcomes,
                "healthz_p50_ms": round(percentile(checks, 0.5), 1),
                "healthz_p99_ms": round(percentile(checks, 0.99), 1),
                "healthz_max_ms": round(checks[-1] * 1000, 1) if checks else float("nan"),
                "healthz": health.outcomes,
                "healthz_over_1s": sum(1 for t in checks if t > 1),
                **_raw(raw),
                **(_own_port(own) if own is not None else {}),
                "counts": counts,
                "load_after": load_average(),
            }
        )
        return result
    finally:
        for w in workers:
            w.kill()
        if server is not None:
            server.stop()
        destroy_environment(env, keep=args.keep)


def raw_get(host: str, port: int, path: str, timeout: float = 5.0) -> str:
    """The status of ``GET path`` on a new connection, as a load balancer's check sends it:
    a socket, one request, read to the close (httpx builds a client and an SSL context per
    call, which on two busy cores cost the prober more than the server's answer)."""
    request = f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n"
    try:
        with socket.create_connection((host, port), timeout=timeout) as conn:
            conn.sendall(request.encode())
            answer = b""
            while chunk := conn.recv(65536):
                answer += chunk
    except TimeoutError:
        return "Timeout"
    except OSError as exc:
        return type(exc).__name__
    parts = answer.split(b" ", 2)
    return parts[1].decode() if len(parts) > 1 else "NoAnswer"


def _raw(raw: Prober) -> dict[str, Any]:
    checks = sorted(raw.times)
    return {
        "healthz_raw_p50_ms": round(percentile(checks, 0.5), 1),
        "healthz_raw_p99_ms": round(percentile(checks, 0.99), 1),
        "healthz_raw": raw.outcomes,
    }


def _own_port(own: Prober) -> dict[str, Any]:
    checks = sorted(own.times)
    return {
        "own_port_p50_ms": round(percentile(checks, 0.5), 1),
        "own_port_p99_ms": round(percentile(checks, 0.99), 1),
        "own_port_max_ms": round(checks[-1] * 1000, 1) if checks else float("nan"),
        "own_port": own.outcomes,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=512)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--fsync", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--database-url")
    parser.add_argument("--redis-url")
    parser.add_argument("--wrk", default=shutil.which("wrk") or "/usr/bin/wrk")
    parser.add_argument(
        "--health-port",
        type=int,
        default=0,
        help="also serve /healthz on this port (HEALTH_LISTEN) and probe it",
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument("--tmpdir")
    parser.add_argument("--keep", action="store_true")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not os.access(args.wrk, os.X_OK):
        print(f"overload.py: wrk not found at {args.wrk}: apt-get install wrk, or --wrk PATH")
        return 2
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 65536)), hard))
    result = run(args)
    print(json.dumps(result, indent=2))
    print(
        f"\nwrk -c{result['connections']}: {result['wrk_requests']} answers "
        f"({result['wrk_2xx']} 2xx, {result['wrk_non_2xx']} not), p50/p99 "
        f"{result['wrk_p50_ms']}/{result['wrk_p99_ms']} ms; accepted posts p50/p99 "
        f"{result['accepted_p50_ms']}/{result['accepted_p99_ms']} ms {result['producer']}; "
        f"/healthz p50/p99/max {result['healthz_p50_ms']}/{result['healthz_p99_ms']}/"
        f"{result['healthz_max_ms']} ms {result['healthz']} (by a bare socket: "
        f"{result['healthz_raw_p50_ms']}/{result['healthz_raw_p99_ms']} ms); "
        + (
            f"/healthz on its own port p50/p99/max {result['own_port_p50_ms']}/"
            f"{result['own_port_p99_ms']}/{result['own_port_max_ms']} ms {result['own_port']}; "
            if "own_port" in result
            else ""
        )
        + "memory "
        f"{result['rss_before_mb']} -> {result['rss_after_mb']} MB"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
