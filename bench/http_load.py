"""HTTP load on Taskhoster with wrk: ``GET /healthz`` against single-item posts, one daphne.

A benchmark, not a test. Against a real daphne (fresh database and state root, SQLite and
fsync on by default) it runs ``wrk -t2 -c8 -d10s --latency`` on ``/healthz`` and on single
posts (``POST /api/queues/bench/items``, ~100-byte payload, from a Lua script), interleaved
``--repeat`` times, and prints the ratio post/healthz (target >= 0.5). ``--mixed`` then finds
the highest rate of single posts that two /work socket workers keep up with::

    .venv/bin/python bench/http_load.py
    .venv/bin/python bench/http_load.py --repeat 0 --mixed

See bench/README.md.
"""

# ruff: noqa: E402
from __future__ import annotations

# When a file of bench/ runs as a script, bench/ leads sys.path, where a module named like a
# standard one would shadow it. The repository's root goes there instead (for ``bench.*``).
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
import re
import shutil
import signal
import statistics
import subprocess
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from bench.core import (
    JSON_HEADERS,
    LOCAL_HOSTS,
    QUEUE,
    BenchError,
    Environment,
    _interrupt,
    destroy_environment,
    expect,
    filesystem_of,
    fsync_probe,
    load_average,
    make_client,
    make_environment,
    migrate,
    percentile,
    say,
    setup_django,
)
from bench.peer_taskhoster import GuardedDaphne, start_server
from bench.work_socket import WorkerProcess

WRK_THREADS = 2
TARGET_RATIO = 0.5
SAMPLE_EVERY = 0.5
SLOPE_LIMIT = 0.02  # a held rate leaves a backlog growing by less than 2% of the rate
ITEMS_URL = f"/api/queues/{QUEUE}/items"
# Like the peers' payload (common.make_payload): about 100 bytes of JSON.
PAYLOAD = dict(ph="http", seq=0, ts=1764518400.123456, kind="bench.noop", user="u-000000")
PAYLOAD["pad"] = "x" * 12
UNITS_MS = {"us": 0.001, "ms": 1.0, "s": 1000.0, "m": 60_000.0, "h": 3_600_000.0}


# -- wrk -------------------------------------------------------------------------------------


@dataclass
class WrkRow:
    round: int
    name: str
    requests: int
    per_second: float
    ok_per_second: float
    p50_ms: float
    p99_ms: float
    non_2xx: int
    socket_errors: int
    load_before: str
    load_after: str
    # CPU time (user + system) per request while wrk ran: the server process and its
    # committer child. Less noisy than rates on a busy machine: it is what one request costs.
    server_us: float = float("nan")
    committer_us: float = float("nan")
    # The server's CPU per request by thread (``--threads``): its event loop (the main
    # thread), its request threads together, and each other thread by its OS-level name.
    threads: dict[str, float] = field(default_factory=dict)


def post_script(tmp: Path, key: str) -> Path:
    body = json.dumps({"payload": PAYLOAD}, separators=(",", ":"))
    path = tmp / "post.lua"
    path.write_text(
        'wrk.method = "POST"\n'
        f"wrk.body = [==[{body}]==]\n"
        'wrk.headers["Content-Type"] = "application/json"\n'
        f'wrk.headers["Authorization"] = "Token {key}"\n'
    )
    return path


def _ms(number: str, unit: str) -> float:
    return float(number) * UNITS_MS[unit]


def parse_wrk(text: str) -> dict[str, Any]:
    found: dict[str, Any] = {}
    if m := re.search(r"^\s*(\d+) requests in ", text, re.M):
        found["requests"] = int(m.group(1))
    if m := re.search(r"^Requests/sec:\s+([\d.]+)", text, re.M):
        found["per_second"] = float(m.group(1))
    for q in ("50", "99"):
        if m := re.search(rf"^\s+{q}%\s+([\d.]+)(us|ms|s|m|h)\s*$", text, re.M):
            found[f"p{q}_ms"] = _ms(m.group(1), m.group(2))
    m = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", text)
    found["non_2xx"] = int(m.group(1)) if m else 0
    m = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text)
    found["socket_errors"] = sum(int(g) for g in m.groups()) if m else 0
    if not {"requests", "per_second"} <= found.keys():
        raise BenchError(f"could not read wrk's output:\n{text}")
    return found


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process so far (0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """Each thread of a process: its OS-level name and its user + system CPU seconds."""
    found: dict[int, tuple[str, float]] = {}
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError, ValueError, IndexError):
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
                name = (task / "comm").read_text().strip()
                seconds = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
                found[int(task.name)] = (name, seconds)
    return found


def cpu_by_thread(
    pid: int, before: dict[int, tuple[str, float]], requests: int
) -> dict[str, float]:
    """CPU µs per request since ``before``: the main thread (the event loop), the request
    threads (``th-http-*``) together, and every other thread by name."""
    spent: dict[str, float] = {}
    for tid, (name, seconds) in thread_cpu(pid).items():
        what = "event loop" if tid == pid else name
        if what.startswith("th-http-"):
            what = "request threads"
        used = seconds - before.get(tid, (name, 0.0))[1]
        spent[what] = spent.get(what, 0.0) + used
    return {
        what: round(seconds / max(requests, 1) * 1e6)
        for what, seconds in sorted(spent.items(), key=lambda kv: -kv[1])
        if seconds > 0
    }


def children_of(pid: int) -> list[int]:
    found: list[int] = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            found += [int(c) for c in (task / "children").read_text().split()]
    return found


def run_wrk(
    args: argparse.Namespace,
    round_: int,
    name: str,
    url: str,
    script: Path | None,
    server_pid: int | None = None,
) -> WrkRow:
    pids = [server_pid, *children_of(server_pid)] if server_pid else []
    cpu_before = [cpu_seconds(p) for p in pids]
    threads_before = thread_cpu(server_pid) if server_pid and args.threads else {}
    argv = [args.wrk, f"-t{WRK_THREADS}", f"-c{args.connections}", f"-d{args.seconds:g}s"]
    argv += ["--latency", *(["-s", str(script)] if script else []), url]
    load_before = load_average()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=args.seconds + 60)
    except BaseException:
        proc.kill()
        proc.wait(10)
        raise
    if proc.returncode != 0:
        raise BenchError(f"{' '.join(argv)} exited with {proc.returncode}:\n{out}")
    cpu = [cpu_seconds(p) - b for p, b in zip(pids, cpu_before, strict=True)]
    found = parse_wrk(out)
    ok = max(0, found["requests"] - found["non_2xx"]) / max(found["requests"], 1)
    per_request = [round(c / max(found["requests"], 1) * 1e6, 1) for c in cpu]
    return WrkRow(
        round=round_,
        name=name,
        requests=found["requests"],
        per_second=found["per_second"],
        ok_per_second=round(found["per_second"] * ok, 1),
        p50_ms=round(found.get("p50_ms", float("nan")), 2),
        p99_ms=round(found.get("p99_ms", float("nan")), 2),
        non_2xx=found["non_2xx"],
        socket_errors=found["socket_errors"],
        load_before=load_before,
        load_after=load_average(),
        server_us=per_request[0] if per_request else float("nan"),
        committer_us=sum(per_request[1:]) if per_request[1:] else float("nan"),
        threads=cpu_by_thread(server_pid, threads_before, found["requests"])
        if server_pid and args.threads
        else {},
    )


def delete_pending(client: httpx.Client) -> int:
    body = json.dumps({"status": "pending"})
    answer = client.post(f"{ITEMS_URL}/delete", content=body, headers=JSON_HEADERS)
    return int(expect(answer, 200).json()["deleted"])


def counts(client: httpx.Client) -> dict[str, int]:
    return dict(expect(client.get(f"/api/queues/{QUEUE}"), 200).json()["counts"])


# -- mixed: single posts at a paced rate while two socket workers drain --------------------


@dataclass
class Trial:
    rate: float
    posts: int
    accepted: int
    errors: int
    post_span: float
    post_rate: float
    post_p50_ms: float
    post_p99_ms: float
    drained_per_s: float
    backlog_end: int
    slope: float
    held: bool
    load_before: str
    load_after: str
    note: str = ""


def slope_of(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (t, y) points, y per second."""
    if len(points) < 3:
        return float("nan")
    mean_t = statistics.fmean(t for t, _ in points)
    mean_y = statistics.fmean(y for _, y in points)
    var = sum((t - mean_t) ** 2 for t, _ in points)
    return sum((t - mean_t) * (y - mean_y) for t, y in points) / var if var else float("nan")


def settle(client: httpx.Client) -> None:
    """Remove what a trial left waiting and let the workers finish what they hold."""
    delete_pending(client)
    deadline = time.monotonic() + 30
    while counts(client).get("processing", 0) and time.monotonic() < deadline:
        time.sleep(0.1)
    os.sync()
    time.sleep(0.5)


def run_trial(args: argparse.Namespace, url: str, key: str, rate: float) -> Trial:
    """Post single items open loop at ``rate`` for ``--seconds`` (post n is due at start +
    n/rate and is sent by whichever producer connection is free), sampling the counts."""
    total = max(1, int(rate * args.seconds))
    lock = threading.Lock()
    stop = threading.Event()
    state = {"next": 0, "errors": 0}
    post_times: list[float] = []
    samples: list[tuple[float, dict[str, int]]] = []
    notes: list[str] = []
    body = json.dumps({"payload": PAYLOAD})
    clients = [make_client(url, key) for _ in range(args.producers + 1)]
    started = time.perf_counter() + 0.1
    last_answer = [started]

    def producer(client: httpx.Client) -> None:
        while not stop.is_set():
            with lock:
                n = state["next"]
                if n >= total or state["errors"] >= 10:
                    return
                state["next"] += 1
            delay = started + n / rate - time.perf_counter()
            if delay > 0:
                stop.wait(delay)
            t0 = time.perf_counter()
            try:
                expect(client.post(ITEMS_URL, content=body, headers=JSON_HEADERS), 201)
            except Exception as exc:
                with lock:
                    state["errors"] += 1
                    if len(notes) < 2:
                        notes.append(str(exc)[:200])
                continue
            t1 = time.perf_counter()
            with lock:
                post_times.append(t1 - t0)
                last_answer[0] = max(last_answer[0], t1)

    def sampler(client: httpx.Client) -> None:
        while not stop.is_set():
            with contextlib.suppress(httpx.HTTPError, BenchError):  # a missed sample
                samples.append((time.perf_counter() - started, counts(client)))
            stop.wait(SAMPLE_EVERY)

    load_before = load_average()
    threads = [threading.Thread(target=producer, args=(c,), daemon=True) for c in clients[1:]]
    watcher = threading.Thread(target=sampler, args=(clients[0],), daemon=True)
    try:
        watcher.start()
        for t in threads:
            t.start()
        hard_stop = started + 3 * args.seconds + 10
        for t in threads:
            while t.is_alive() and time.perf_counter() < hard_stop:
                t.join(0.2)
        if any(t.is_alive() for t in threads):
            notes.append(f"stopped posting after {3 * args.seconds + 10:g} s")
        # Keep sampling to the end of the run, or as long as posting took.
        while time.perf_counter() < started + args.seconds:
            time.sleep(0.05)
    finally:
        stop.set()
        for t in [*threads, watcher]:
            t.join(10)
        for c in clients:
            c.close()
    end = time.perf_counter() - started
    load_after = load_average()
    span = last_answer[0] - started
    accepted = len(post_times)
    backlog = [(t, c.get("pending", 0) + c.get("processing", 0)) for t, c in samples]
    slope = slope_of([(t, b) for t, b in backlog if args.seconds / 2 <= t <= end])
    drained = 0.0
    if len(samples) > 1:
        finished = samples[-1][1].get("finished", 0) - samples[0][1].get("finished", 0)
        drained = finished / (samples[-1][0] - samples[0][0])
    on_pace = accepted == total and span <= 1.05 * args.seconds + 0.1
    held = on_pace and state["errors"] == 0 and slope == slope and slope < SLOPE_LIMIT * rate
    if not on_pace:
        notes.append(f"{accepted} of {total} posts accepted, the last at {span:.2f} s")
    post_times.sort()
    return Trial(
        rate=rate,
        posts=total,
        accepted=accepted,
        errors=state["errors"],
        post_span=round(span, 2),
        post_rate=round(accepted / span, 1) if span > 0 else 0.0,
        post_p50_ms=round(percentile(post_times, 0.50), 2),
        post_p99_ms=round(percentile(post_times, 0.99), 2),
        drained_per_s=round(drained, 1),
        backlog_end=backlog[-1][1] if backlog else -1,
        slope=round(slope, 2),
        held=held,
        load_before=load_before,
        load_after=load_after,
        note="; ".join(notes),
    )


TRIAL_HEADER = (
    f"{'rate/s':>7} {'posts':>6} {'ok':>6} {'err':>4} {'span s':>6} {'post/s':>7} "
    f"{'POST p50':>8} {'POST p99':>8} {'drain/s':>7} {'backlog':>7} {'slope/s':>8} "
    f"{'held':>4}  load before -> after"
)


def format_trial(t: Trial) -> str:
    text = (
        f"{t.rate:>7.0f} {t.posts:>6} {t.accepted:>6} {t.errors:>4} {t.post_span:>6.2f} "
        f"{t.post_rate:>7.1f} {t.post_p50_ms:>8.2f} {t.post_p99_ms:>8.2f} "
        f"{t.drained_per_s:>7.1f} {t.backlog_end:>7} {t.slope:>8.2f} "
        f"{'yes' if t.held else 'NO':>4}  {t.load_before} -> {t.load_after}"
    )
    return text + (f"\n{'':>7} [{t.note}]" if t.note else "")


def search_rate(args: argparse.Namespace, url: str, key: str, trials: list[Trial]) -> float:
    """Double from --mixed-start until a rate is not held, then bisect --mixed-steps times.
    Returns the highest rate held (0 if none)."""

    def trial(rate: float) -> bool:
        with make_client(url, key) as client:
            settle(client)
        t = run_trial(args, url, key, rate)
        trials.append(t)
        say("   " + format_trial(t))
        return t.held

    lo, hi, rate = 0.0, 0.0, args.mixed_start
    while rate <= args.mixed_max:
        if not trial(rate):
            hi = rate
            break
        lo, rate = rate, rate * 2
    if not hi:
        say(f"   held up to --mixed-max {args.mixed_max:g}/s; not searched higher")
        return lo
    for _ in range(args.mixed_steps):
        mid = round((lo + hi) / 2)
        if mid in (lo, hi):
            break
        if trial(mid):
            lo = mid
        else:
            hi = mid
    return lo


# -- the run ---------------------------------------------------------------------------------


WRK_HEADER = (
    f"{'round':>5} {'what':<8} {'requests':>8} {'req/s':>8} {'2xx/s':>8} "
    f"{'p50 ms':>7} {'p99 ms':>7} {'non-2xx':>7} {'sock err':>8} {'CPU µs/req':>10} "
    f"{'commit':>6}  load before -> after"
)


def format_wrk(r: WrkRow) -> str:
    text = (
        f"{r.round:>5} {r.name:<8} {r.requests:>8} {r.per_second:>8.1f} "
        f"{r.ok_per_second:>8.1f} {r.p50_ms:>7.2f} {r.p99_ms:>7.2f} {r.non_2xx:>7} "
        f"{r.socket_errors:>8} {r.server_us:>10.0f} {r.committer_us:>6.0f}  "
        f"{r.load_before} -> {r.load_after}"
    )
    if r.threads:
        by = ", ".join(f"{what} {us}" for what, us in r.threads.items())
        text += f"\n{'':>14}server CPU µs/req by thread: {by}"
    return text


def ratios(rows: list[WrkRow]) -> list[float]:
    """post/healthz per round, on successful (2xx) requests per second."""
    found = []
    for n in sorted({r.round for r in rows}):
        by = {r.name: r for r in rows if r.round == n}
        if "healthz" in by and "post" in by and by["healthz"].ok_per_second:
            found.append(round(by["post"].ok_per_second / by["healthz"].ok_per_second, 3))
    return found


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=8, help="wrk -c (with -t2)")
    parser.add_argument("--seconds", type=float, default=10.0, help="per wrk run / mixed trial")
    parser.add_argument(
        "--repeat", type=int, default=3, help="rounds of healthz+post (0: only --mixed)"
    )
    parser.add_argument(
        "--threads",
        action="store_true",
        help="also print the server's CPU per request by thread (event loop, request threads, ...)",
    )
    parser.add_argument("--mixed", action="store_true", help="then search the held post rate")
    parser.add_argument("--mixed-start", type=float, default=100.0, help="first rate, posts/s")
    parser.add_argument("--mixed-max", type=float, default=5000.0, help="stop doubling here")
    parser.add_argument("--mixed-steps", type=int, default=3, help="bisection steps")
    parser.add_argument("--producers", type=int, default=8, help="mixed: post connections")
    parser.add_argument(
        "--fsync",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="fsync in the server (default on, as in production)",
    )
    parser.add_argument(
        "--database-url",
        help="a local PostgreSQL admin URL to create (and drop) a bench database from; "
        "default: a fresh SQLite file",
    )
    parser.add_argument("--redis-url", help="give the server REDIS_URL (redis://127.0.0.1...)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--wrk", default=shutil.which("wrk") or "/usr/bin/wrk")
    parser.add_argument("--tmpdir", help="where to create the run's temp dir")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (logs, state)")
    args = parser.parse_args(argv)
    for ok, text in (
        (0 < args.seconds <= 300, "--seconds must be in (0, 300]"),
        (WRK_THREADS <= args.connections <= 1000, f"--connections must be {WRK_THREADS}..1000"),
        (0 < args.repeat <= 20 or (args.repeat == 0 and args.mixed), "--repeat: 1..20, or 0"),
        (0 < args.mixed_start <= args.mixed_max <= 20_000, "0 < --mixed-start <= --mixed-max"),
        (0 <= args.mixed_steps <= 10 and 1 <= args.producers <= 64, "--mixed-steps, --producers"),
    ):
        if not ok:
            parser.error(text)
    if args.redis_url and urlsplit(args.redis_url).hostname not in LOCAL_HOSTS:
        parser.error("this benchmark only talks to 127.0.0.1: use a local Redis")
    if args.repeat and not os.access(args.wrk, os.X_OK):
        parser.error(f"wrk not found at {args.wrk} (apt-get install wrk)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)
    rows: list[WrkRow] = []
    trials: list[Trial] = []
    held: float | None = None
    meta: dict[str, Any] = {"argv": [sys.executable, *sys.argv]}
    env: Environment | None = None
    server: GuardedDaphne | None = None
    workers: list[WorkerProcess] = []
    try:
        env = make_environment(args)
        migrate(env)
        setup_django(env)
        server, key, info = start_server(args, env)
        config = env.label + ("+redis" if args.redis_url else "")
        meta.update(
            info,
            cpus=os.cpu_count(),
            filesystem=filesystem_of(env.root),
            fsync_probe_ms=round(fsync_probe(env.root), 3),
            load_before=load_average(),
        )
        say(
            f"[{config}] daphne on {server.url}, fsync {'on' if args.fsync else 'off'}; state "
            f"root {env.root} ({meta['filesystem']}), write+fsync+dir fsync ~ "
            f"{meta['fsync_probe_ms']:.2f} ms; load average {meta['load_before']}"
        )
        script = post_script(env.tmp, key)
        with make_client(server.url, key) as client:
            for _ in range(20):  # warm up: connections, caches, the first post's directories
                expect(client.get("/healthz"), 200)
                body = json.dumps({"payload": PAYLOAD})
                expect(client.post(ITEMS_URL, content=body, headers=JSON_HEADERS), 201)
            delete_pending(client)
            os.sync()
            if args.repeat:
                say("   " + WRK_HEADER)
            for n in range(1, args.repeat + 1):
                for name, path, lua in (
                    ("healthz", "/healthz", None),
                    ("post", ITEMS_URL, script),
                ):
                    rows.append(run_wrk(args, n, name, server.url + path, lua, info["daphne_pid"]))
                    say("   " + format_wrk(rows[-1]))
                deleted = delete_pending(client)
                os.sync()
                say(f"         (deleted the {deleted} posted items)")
        if args.mixed:
            workers = [WorkerProcess(server.url, key) for _ in range(2)]
            for w in workers:
                w.wait_ready()
            say(
                f"   mixed: 2 socket workers (cap 16); {args.producers} producer connections; "
                f"{args.seconds:g} s per trial"
            )
            say("   " + TRIAL_HEADER)
            held = search_rate(args, server.url, key, trials)
            meta["worker_frames"] = [w.finish() for w in workers]
        meta["load_after"] = load_average()
    except KeyboardInterrupt:
        say("interrupted; cleaning up")
        return 130
    except BenchError as exc:
        say(f"error: {exc}")
        if env is not None:
            with contextlib.suppress(OSError):
                say((env.tmp / "daphne.log").read_text()[-3000:])
        return 1
    finally:
        for w in workers:
            w.kill()
        if server is not None:
            server.stop()
        if env is not None:
            destroy_environment(env, keep=args.keep)
    found = ratios(rows)
    median = statistics.median(found) if found else float("nan")
    print(
        f"\nTaskhoster HTTP load: {' '.join(meta['argv'])}\n{meta.get('database')}"
        f"{' + Redis' if args.redis_url else ''}, fsync {'on' if args.fsync else 'off'}, "
        f"{meta.get('cpus')} CPUs, load average {meta.get('load_before')} -> "
        f"{meta.get('load_after')}, write+fsync probe {meta.get('fsync_probe_ms')} ms"
    )
    if rows:
        print(f"wrk -t{WRK_THREADS} -c{args.connections} -d{args.seconds:g}s --latency")
        print(WRK_HEADER)
        for r in rows:
            print(format_wrk(r))
        print(
            "post/healthz (2xx/s) per round: "
            + ", ".join(f"{i}: {x:.3f}" for i, x in enumerate(found, 1))
            + f"; median {median:.3f} (target >= {TARGET_RATIO}: "
            + f"{'met' if median >= TARGET_RATIO else 'MISSED'})"
        )
    if args.mixed:
        print(f"\nmixed: single posts open loop at R/s, 2 socket workers; {args.seconds:g} s each")
        print(TRIAL_HEADER)
        for t in trials:
            print(format_trial(t))
        print(
            f"highest held rate: {held or 0:g} posts/s{'' if held else ' (none held)'} (all "
            f"posts accepted on pace, backlog slope < {SLOPE_LIMIT:.0%} of R in the second half)"
        )
    if args.json:
        mixed = {"trials": [asdict(t) for t in trials], "held_rate": held}
        wrk = {"runs": [asdict(r) for r in rows], "ratios": found, "median_ratio": median}
        args.json.write_text(json.dumps({"meta": meta, "wrk": wrk, "mixed": mixed}, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
