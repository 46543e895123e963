"""Workers that quit while their results are in flight, then posts that must reach a fresh one.

A benchmark of a failure mode, not of speed (issue 13). Each round against one real daphne
(fresh database and state root, fsync on):

1. two worker processes (``bench/work_socket.py --worker``: one socket each, capacity 16,
   answering every item with a result at once) serve the queue ``bench``;
2. a producer posts single items at ``--rate`` per second for ``--seconds``;
3. both workers are told to quit at once: each stops reading and closes its socket, with
   its last results (and their acks) still in flight;
4. one second later the queue must hold nothing ``processing``: every item the closed
   sockets held is back in ``pending`` (or finished by a result that arrived);
5. a fresh worker socket connects and ``--probe`` new items are posted: every one must
   reach it and finish within ``--probe-timeout`` seconds, and the queue must drain.

The table gives, per round, the items left ``processing`` with no worker connected (must be
0), the probe items that never reached the fresh worker (must be 0), and at the end the
number of "Exception inside application" lines in daphne's log (must be 0)::

    .venv/bin/python bench/worker_quit.py --rounds 6
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
import signal
import threading
import time
from dataclasses import dataclass

import httpx

from bench.core import (
    JSON_HEADERS,
    QUEUE,
    BenchError,
    Daphne,
    _interrupt,
    destroy_environment,
    load_average,
    make_environment,
    migrate,
    say,
    setup_django,
)
from bench.work_socket import InProcessWorker, WorkerProcess, wait_for


@dataclass
class Round:
    number: int
    posted: int
    finished_by_quitters: int
    stuck_processing: int
    probe_missed: int
    probe_ms: float


def counts(client: httpx.Client) -> dict[str, int]:
    return dict(client.get(f"/api/queues/{QUEUE}").json()["counts"])


def post_paced(client: httpx.Client, rate: float, seconds: float) -> int:
    """Single posts, open loop at ``rate`` per second, from a few threads."""
    total = int(rate * seconds)
    start = time.monotonic()
    lock = threading.Lock()
    state = {"next": 0, "posted": 0}

    def producer() -> None:
        while True:
            with lock:
                n = state["next"]
                if n >= total:
                    return
                state["next"] += 1
            delay = start + n / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            response = client.post(
                f"/api/queues/{QUEUE}/items", json={"payload": {"seq": n}}, headers=JSON_HEADERS
            )
            if response.status_code == 201:
                with lock:
                    state["posted"] += 1

    threads = [threading.Thread(target=producer) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return state["posted"]


def one_round(number: int, args: argparse.Namespace, url: str, key: str) -> Round:
    headers = {"Authorization": f"Token {key}"}
    with httpx.Client(base_url=url, headers=headers, timeout=30, trust_env=False) as client:
        before = counts(client)
        workers = [WorkerProcess(url, key) for _ in range(2)]
        for worker in workers:
            worker.wait_ready()
        posted = post_paced(client, args.rate, args.seconds)
        # Both told at once: each stops and closes with its last results in flight.
        for worker in workers:
            worker.proc.send_signal(signal.SIGTERM)
        for worker in workers:
            worker.finish()
        time.sleep(1.0)
        after = counts(client)
        stuck = after["processing"]
        finished = after["finished"] - before["finished"]
        fresh = InProcessWorker(url, key, QUEUE).start()
        try:
            started = time.monotonic()
            ids = []
            for n in range(args.probe):
                response = client.post(
                    f"/api/queues/{QUEUE}/items",
                    json={"payload": {"probe": n}},
                    headers=JSON_HEADERS,
                )
                ids.append(response.json()["id"])

            def all_finished() -> bool:
                return all(
                    client.get(f"/api/items/{i}").json()["status"] == "finished" for i in ids
                )

            wait_for(all_finished, args.probe_timeout, step=0.05)
            probe_ms = (time.monotonic() - started) * 1000
            missed = sum(client.get(f"/api/items/{i}").json()["status"] != "finished" for i in ids)
            # The fresh worker drains whatever the quitters left pending.
            wait_for(lambda: counts(client)["pending"] == 0, 30, step=0.1)
        finally:
            fresh.close()
        return Round(number, posted, finished, stuck, missed, probe_ms)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--rate", type=float, default=200.0)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--probe", type=int, default=20)
    parser.add_argument("--probe-timeout", type=float, default=5.0)
    parser.add_argument("--database-url", default="")
    parser.add_argument("--redis-url", default="")
    parser.add_argument("--tmpdir", default=None)
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--no-fsync", dest="fsync", action="store_false")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)
    env = None
    server = None
    rounds: list[Round] = []
    try:
        env = make_environment(args)
        migrate(env)
        setup_django(env)
        from taskhoster import engine
        from taskhoster.keys import create_key

        engine.upsert_queue(name=QUEUE, body={"leaseSeconds": 30})
        key = create_key(name="bench", scopes=["produce", "work", "manage"])[1]
        server = Daphne(env, fsync=args.fsync, extra_args=("--websocket_timeout", "-1"))
        if args.redis_url:
            server.env["REDIS_URL"] = args.redis_url
        server.start()
        say(f"daphne on {server.url}; load average {load_average()}")
        for number in range(1, args.rounds + 1):
            result = one_round(number, args, server.url, key)
            say(f"round {number}: {result}")
            rounds.append(result)
        log_text = env.tmp.joinpath("daphne.log").read_text(errors="replace")
    except KeyboardInterrupt:
        say("interrupted")
        return 130
    except BenchError as exc:
        say(f"error: {exc}")
        return 1
    finally:
        if server is not None:
            server.stop()
        if env is not None:
            destroy_environment(env, keep=args.keep)
    exceptions = log_text.count("Exception inside application")
    print(
        f"\nWorkers quitting with results in flight: {env.label if env else ''}, "
        f"fsync {'on' if args.fsync else 'off'}, {args.rate:g} posts/s for {args.seconds:g} s "
        f"per round, two workers of capacity 16; load average {load_average()}"
    )
    print("| round | posted | finished | left processing, no worker | probe missed | probe ms |")
    print("|---|---|---|---|---|---|")
    for r in rounds:
        print(
            f"| {r.number} | {r.posted} | {r.finished_by_quitters} | {r.stuck_processing} "
            f"| {r.probe_missed}/{args.probe} | {r.probe_ms:.0f} |"
        )
    stuck = sum(r.stuck_processing for r in rounds)
    missed = sum(r.probe_missed for r in rounds)
    print(
        f"\nleft processing: {stuck}; probe items that missed the fresh worker: {missed}; "
        f"'Exception inside application' in daphne's log: {exceptions}"
    )
    return 0 if stuck == 0 and missed == 0 and exceptions == 0 else 2


if __name__ == "__main__":
    sys.exit(main())
