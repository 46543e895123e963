"""Several server processes over one database, one Redis and one state root (issue 10).

- ``scripts/serve-many`` serves one address with N daphne processes under supervisord, plus
  one sweep: every process answers, an item posted through any of them reaches a socket on
  any other, a process killed with SIGKILL is started again while the others keep serving,
  and SIGTERM to the script stops every process it started.
- The chaos of the crash and socket tests across two processes: producers on one, misbehaving
  workers on both (dropped sockets, fails, extends, late results), and one process killed
  with SIGKILL in the middle and started again. Afterwards nothing acknowledged is lost, no
  item has two accepted verdicts, no two members of a thread were ever processing at once
  (sampled from the index throughout), every item is terminal and the index matches the
  directories.

Several processes need PostgreSQL and Redis (the embedded default keeps its socket wake-ups
and cancels in one process): these tests run on that configuration and are skipped on the
embedded default, except the one proving ``serve-many`` refuses it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.db import connection

from taskhoster.models import Item
from taskhoster.status import Status

from ..conftest import REPO, Server, database_url, free_port, server_env, stop_process
from . import wsclient
from .consistency import assert_index_matches_directories, assert_threads_consistent

pytestmark = pytest.mark.slow

CHAOS_WORKER = Path(__file__).with_name("chaos_worker.py")
REDIS_URL = os.environ.get("REDIS_URL", "")
needs_shared = pytest.mark.skipif(
    not REDIS_URL or database_url().startswith("sqlite"),
    reason="several server processes need PostgreSQL and Redis (DATABASE_URL, REDIS_URL)",
)


def wait_for(predicate: Any, timeout: float, what: str, every: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purpose.
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def health(url: str, key: str | None = None) -> dict[str, Any] | None:
    """``/healthz`` over a new connection (so the kernel may hand it to any process); with a
    key, its whole body (the process's pid among it)."""
    headers = {"Authorization": f"Token {key}"} if key else {}
    try:
        answer = httpx.get(f"{url}/healthz", timeout=2, headers=headers)
    except httpx.HTTPError:
        return None
    return dict(answer.json()) if answer.status_code == 200 else None


def pids_answering(url: str, key: str, tries: int = 20) -> set[int]:
    return {h["pid"] for h in (health(url, key) for _ in range(tries)) if h}


# -- scripts/serve-many ----------------------------------------------------------------------


def test_serve_many_refuses_a_configuration_its_processes_could_not_share(tmp_path):
    env = {**os.environ, "TASKHOSTER_VAR": str(tmp_path / "var")}
    env.pop("DATABASE_URL", None)
    answer = subprocess.run(
        ["scripts/serve-many"], cwd=REPO, env=env, capture_output=True, text=True, timeout=30
    )
    assert answer.returncode == 2
    assert "set DATABASE_URL to PostgreSQL" in answer.stderr
    env["DATABASE_URL"] = "postgres://postgres@127.0.0.1:5432/nothing"
    env.pop("REDIS_URL", None)
    answer = subprocess.run(
        ["scripts/serve-many"], cwd=REPO, env=env, capture_output=True, text=True, timeout=30
    )
    assert answer.returncode == 2
    assert "set REDIS_URL" in answer.stderr
    assert not (tmp_path / "var").exists(), "it refused before doing anything"


@pytest.fixture
def serve_many(transactional_db: None, state_root: Path, tmp_path: Path) -> Iterator[Any]:
    procs: list[subprocess.Popen[bytes]] = []

    def start(processes: int) -> tuple[subprocess.Popen[bytes], str]:
        port = free_port()
        env = server_env(
            state_root,
            REDIS_URL=REDIS_URL,
            TASKHOSTER_VAR=str(tmp_path / "var"),
            TASKHOSTER_PROCESSES=str(processes),
            PORT=str(port),
            TASKHOSTER_SWEEP_EVERY="0.5",
        )
        log = open(tmp_path / "serve-many.log", "ab")  # noqa: SIM115 (closed below)
        proc = subprocess.Popen(
            ["scripts/serve-many"], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT
        )
        log.close()
        procs.append(proc)
        return proc, f"http://127.0.0.1:{port}"

    yield start
    for proc in procs:
        stop_process(proc, within=30)


def supervised_pids(var: Path) -> dict[str, int]:
    """Process name -> pid, as supervisorctl reports them."""
    env = {**os.environ, "TASKHOSTER_VAR": str(var)}
    out = subprocess.run(
        [str(REPO / ".venv/bin/supervisorctl"), "-c", "deploy/supervisord.conf", "status"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    pids = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[1] == "RUNNING" and parts[2] == "pid":
            pids[parts[0]] = int(parts[3].rstrip(","))
    return pids


@needs_shared
def test_serve_many_serves_one_address_with_n_processes_that_share_the_work(
    serve_many, make_key, tmp_path
):
    proc, url = serve_many(2)
    key = make_key()
    wait_for(lambda: health(url), 90, "serve-many to answer", every=0.5)
    pids = wait_for(
        lambda: (lambda seen: seen if len(seen) == 2 else None)(pids_answering(url, key)),
        60,
        "both processes to answer on the one address",
    )

    def all_running() -> dict[str, int] | None:
        # supervisord counts a program RUNNING only once it has stayed up for its startsecs:
        # the daphnes answer before they are listed so.
        seen = supervised_pids(tmp_path / "var")
        daphnes = [name for name in seen if name.startswith("taskhoster:")]
        return seen if len(daphnes) == 2 and "sweep" in seen else None

    supervised = wait_for(all_running, 30, "supervisorctl to list both daphnes and the sweep")
    daphnes = {pid for name, pid in supervised.items() if name.startswith("taskhoster:")}
    assert set(pids) <= daphnes
    assert len(daphnes) == 2
    assert "sweep" in supervised

    # Sockets land on either process; items posted through either reach them all.
    headers = {"Authorization": f"Token {key}"}
    assert httpx.put(f"{url}/api/queues/q", json={}, headers=headers).status_code == 201

    async def workers_receive_everything() -> set[str]:
        server = type("S", (), {"url": url})()
        sockets = [await wsclient.connect(server, key) for _ in range(6)]
        for ws in sockets:
            await wsclient.subscribe(ws, ["q"], 100)
        await asyncio.sleep(0.5)
        posted = set()
        for n in range(30):
            # A new connection each time, so posts arrive through both processes.
            answer = httpx.post(f"{url}/api/queues/q/items", json={"payload": n}, headers=headers)
            assert answer.status_code == 201
            posted.add(answer.json()["id"])
        received: set[str] = set()

        async def drain(ws: Any) -> None:
            while True:
                frame = await wsclient.recv(ws, timeout=5)
                if frame["type"] == "item":
                    received.add(frame["id"])
                    await wsclient.send(ws, {"type": "result", "id": frame["id"], "result": 1})

        tasks = [asyncio.create_task(drain(ws)) for ws in sockets]
        deadline = time.monotonic() + 20
        while received != posted and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for task in tasks:
            task.cancel()
        for ws in sockets:
            await ws.close()
        assert received == posted
        return received

    asyncio.run(workers_receive_everything())

    # SIGKILL one server process: supervisord starts it again; the address keeps answering.
    victim = next(iter(daphnes))
    os.kill(victim, signal.SIGKILL)
    for _ in range(20):
        # A connection the victim accepted as it died may be reset, and its successor
        # answers 503 until its committer is ready: a new connection may reach either, so
        # a few tries (each lands on the other process about every other time).
        assert any(health(url) for _ in range(10)), "the other process answers meanwhile"

    def restarted() -> set[int] | None:
        now = supervised_pids(tmp_path / "var")
        daphnes = {pid for name, pid in now.items() if name.startswith("taskhoster:")}
        return daphnes if len(daphnes) == 2 and victim not in daphnes else None

    restarted_pids = wait_for(restarted, 60, "supervisord to start the killed process again")
    assert pids_answering(url, key) - {victim}
    everything = set(restarted_pids) | {supervised_pids(tmp_path / "var")["sweep"]}

    # SIGTERM to the script stops supervisord and every process it started.
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    wait_for(lambda: not any(alive(pid) for pid in everything), 30, "every process to stop")


# -- the chaos across two processes ----------------------------------------------------------

LEASE_SECONDS = 2
THREADS = 12
MEMBERS = 6
SINGLES = 200
WORKERS = 4


class ThreadSampler(threading.Thread):
    """Reads the index every 50 ms: any thread with two members processing at once."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.stop = threading.Event()
        self.samples = 0
        self.overlaps: list[tuple[Any, ...]] = []

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                with connection.cursor() as cursor:
                    cursor.execute(
                        "SELECT thread_id, count(*) FROM taskhoster_item "
                        "WHERE status = %s AND thread_id IS NOT NULL "
                        "GROUP BY thread_id HAVING count(*) > 1",
                        [Status.PROCESSING.value],
                    )
                    self.overlaps += cursor.fetchall()
                self.samples += 1
                time.sleep(0.05)
        finally:
            connection.close()


def produce(url: str, key: str, acknowledged: list[str], seed: int) -> None:
    """Post every item through one process: threads in batches, the rest singly with keys,
    each retried with its key until answered (a retry must not post twice)."""
    rng = random.Random(seed)
    bodies: list[dict[str, Any]] = []
    for member in range(MEMBERS):
        bodies.append(
            {
                "items": [
                    {"payload": [t, member], "threadId": f"t{t}", "key": f"t{t}-{member}"}
                    for t in range(THREADS)
                ]
            }
        )
    bodies += [{"payload": n, "key": f"single-{n}"} for n in range(SINGLES)]
    with httpx.Client(base_url=url, headers={"Authorization": f"Token {key}"}, timeout=10) as http:
        for body in bodies:
            for _attempt in range(20):
                try:
                    answer = http.post("/api/queues/chaos/items", json=body)
                except httpx.HTTPError:
                    time.sleep(0.2)
                    continue
                assert answer.status_code in (200, 201), answer.text
                data = answer.json()
                acknowledged += (
                    [i["id"] for i in data["items"]] if "items" in data else [data["id"]]
                )
                break
            else:
                raise AssertionError(f"could not post {body}")
            time.sleep(rng.random() * 0.03)


def read_log(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    entries = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):  # a line cut by the SIGTERM
            entries.append(json.loads(line))
    return entries


@needs_shared
def test_chaos_across_two_processes_with_one_killed_loses_nothing_and_decides_once(
    transactional_db, state_root, make_key, tmp_path, manage
):
    env = {"REDIS_URL": REDIS_URL, "TASKHOSTER_SOCKET_BACKSTOP_SECONDS": "1"}
    a = Server(state_root, **env).start()
    b = Server(state_root, **env).start()
    servers = [a, b]
    key = make_key()
    headers = {"Authorization": f"Token {key}"}
    assert (
        httpx.put(
            f"{a.url}/api/queues/chaos",
            json={"leaseSeconds": LEASE_SECONDS, "backoffSeconds": 0.1, "backoffMaxSeconds": 0.5},
            headers=headers,
        ).status_code
        == 201
    )
    sweep = subprocess.Popen(
        [sys.executable, "manage.py", "sweep", "--every", "0.3"],
        cwd=REPO,
        env=server_env(state_root),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    sampler = ThreadSampler()
    sampler.start()
    logs = [tmp_path / f"worker-{n}.jsonl" for n in range(WORKERS)]
    ws = [wsclient.ws_url(s) for s in servers]
    workers = [
        subprocess.Popen(
            [sys.executable, str(CHAOS_WORKER), f"w{n}", key, str(log), str(n)]
            + (ws if n % 2 == 0 else ws[::-1]),
            cwd=REPO,
            env=server_env(state_root),
        )
        for n, log in enumerate(logs)
    ]
    acknowledged: list[str] = []
    try:
        producer = threading.Thread(target=produce, args=(a.url, key, acknowledged, 7))
        producer.start()
        # Mid-load: SIGKILL the second process (its committer goes with it), start it again
        # on the same port a moment later, as a process manager would.
        wait_for(lambda: len(acknowledged) >= 150, 60, "the load to be under way")
        b.kill()
        time.sleep(1.5)
        restarted = Server(state_root, **env)
        restarted.port, restarted.url = b.port, b.url
        servers.append(restarted.start())
        producer.join(120)
        assert not producer.is_alive()

        def settled() -> bool:
            return not Item.objects.filter(
                status__in=[Status.PENDING, Status.PROCESSING], queue__name="chaos"
            ).exists()

        wait_for(settled, 120, "every item to reach a verdict", every=0.5)
    finally:
        sampler.stop.set()
        sampler.join(10)
        for worker in workers:
            worker.send_signal(signal.SIGTERM)
        for worker in workers:
            try:
                worker.wait(20)
            except subprocess.TimeoutExpired:
                worker.kill()
        sweep.terminate()
        sweep.wait(20)
        for server in servers:
            server.stop()

    # Nothing acknowledged is lost, and every item is terminal.
    expected = THREADS * MEMBERS + SINGLES
    assert len(set(acknowledged)) == expected
    rows = dict(Item.objects.filter(queue__name="chaos").values_list("id", "status"))
    assert set(rows) == set(acknowledged)
    assert set(rows.values()) == {Status.FINISHED}, "results only; retried fails come back"

    # One accepted verdict per item, and it is the result the item keeps.
    entries = [entry for log in logs for entry in read_log(log)]
    accepted: dict[str, list[Any]] = defaultdict(list)
    sent: dict[str, list[Any]] = defaultdict(list)
    for entry in entries:
        if entry["ev"] == "send" and entry["type"] == "result":
            sent[entry["id"]].append(entry["result"])
        if entry["ev"] == "ack" and entry["kind"] == "result" and entry["accepted"]:
            accepted[entry["id"]].append(entry["result"])
    twice = {i: v for i, v in accepted.items() if len(v) > 1}
    assert not twice, f"items with two accepted verdicts: {twice}"
    restarted_server = Server(state_root, **env).start()
    servers.append(restarted_server)
    with httpx.Client(base_url=restarted_server.url, headers=headers, timeout=10) as http:
        for item_id in acknowledged:
            item = http.get(f"/api/items/{item_id}").json()
            assert item["result"] in sent[item_id], f"{item_id}: a result nobody sent"
            if accepted.get(item_id):
                assert item["result"] == accepted[item_id][0], f"{item_id}: not the accepted one"
    restarted_server.stop()

    # No two members of a thread were ever processing at once.
    assert sampler.samples > 50
    assert not sampler.overlaps, sampler.overlaps

    # The chaos happened: sockets dropped, late results sent, a process killed mid-load.
    events: dict[str, int] = defaultdict(int)
    for entry in entries:
        events[entry["ev"]] += 1
    assert events["drop"], events
    assert events["late"], events
    assert b.proc is not None
    assert b.proc.returncode == -signal.SIGKILL
    assert Item.objects.filter(queue__name="chaos", attempts__gt=1).exists()

    # And the state it leaves is whole.
    manage("sweep", "--repair", "--grace", "0")
    assert_index_matches_directories(state_root)
    assert_threads_consistent()


@needs_shared
def test_metrics_are_the_same_whichever_process_answers(server_factory, make_key):
    a = server_factory(REDIS_URL=REDIS_URL)
    b = server_factory(REDIS_URL=REDIS_URL)
    headers = {"Authorization": f"Token {make_key()}"}
    with (
        httpx.Client(base_url=a.url, headers=headers, timeout=10) as on_a,
        httpx.Client(base_url=b.url, headers=headers, timeout=10) as on_b,
    ):
        assert on_a.put("/api/queues/m", json={}).status_code == 201
        posted = on_a.post(
            "/api/queues/m/items", json={"items": [{"payload": n} for n in range(5)]}
        )
        assert posted.status_code == 201
        claimed = on_b.post("/api/queues/m/claim", json={"max": 2}).json()["items"]
        assert len(claimed) == 2
        assert on_a.post(f"/api/items/{claimed[0]['id']}/result", json={"result": 1}).json()[
            "accepted"
        ]

        expected = [
            'taskhoster_posts_total{queue="m"} 5',
            'taskhoster_claims_total{queue="m"} 2',
            'taskhoster_results_total{queue="m"} 1',
            'taskhoster_items{queue="m",status="pending"} 3',
            'taskhoster_items{queue="m",status="processing"} 1',
            'taskhoster_items{queue="m",status="finished"} 1',
        ]

        def same() -> bool:
            # Counters reach the shared rows within a second of being counted.
            text_a, text_b = on_a.get("/metrics").text, on_b.get("/metrics").text
            return text_a == text_b and all(line in text_a.splitlines() for line in expected)

        wait_for(same, 15, "both processes to show the same, complete metrics", every=0.3)
