"""A PostgreSQL restart under load, one of the first ordinary events of production.

The server reaches the database through a TCP proxy the test controls. While a producer posts
steadily and a worker (``taskhoster.client.Worker``) finishes what it is given, the database
"restarts": every server connection is terminated (``pg_terminate_backend``, what a restart
does to them) and new ones are refused for a few seconds, then let through again. Meanwhile
every post is answered at once, ``201`` or ``503`` with ``Retry-After``, never a ``500`` and
never a long wait; once the database is back the server posts again without a restart of its
own, and every post it acknowledged, before, during or after, is finished by the worker. The first
two items are answered while the database is away, one with a fail and one with a result; no
sweep runs and leases outlast the test, so a verdict that the server dropped would leave its
item in ``processing``.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from django.conf import settings
from django.db import connection
from websockets.exceptions import ConnectionClosed

from taskhoster import engine
from taskhoster.client import Job, RetryableError, Worker
from taskhoster.models import Item
from taskhoster.status import Status

from ..conftest import Server, database_url, needs_postgresql
from .tcpproxy import TcpProxy
from .test_processes import REDIS_URL
from .wsclient import connect, recv, send

pytestmark = [
    pytest.mark.slow,
    needs_postgresql("a database server to restart: PostgreSQL"),
]

POST_EVERY = 0.01
SLOW_ANSWER = 3.0  # seconds: an answer slower than this is a long wait (before: 30 s)


def proxy_to_database(listener: socket.socket | None = None) -> TcpProxy:
    """A ``TcpProxy`` in front of the tests' PostgreSQL (listening on ``listener`` if given)."""
    return TcpProxy(int(str(settings.DATABASES["default"].get("PORT") or 5432)), listener)


def env_through(proxy: TcpProxy, **extra: str) -> dict[str, str]:
    """A server's environment whose database is reached through ``proxy`` (Redis as the
    tests' own), with ``extra``."""
    db = settings.DATABASES["default"]
    host, port = str(db.get("HOST") or "127.0.0.1"), int(str(db.get("PORT") or 5432))
    proxied = database_url().replace(f"@{host}:{port}/", f"@{proxy.host}:{proxy.port}/")
    assert f"@{proxy.host}:{proxy.port}/" in proxied
    env = {"DATABASE_URL": proxied, **extra}
    if REDIS_URL:
        env["REDIS_URL"] = REDIS_URL
    return env


@dataclass
class Answers:
    acknowledged: list[str] = field(default_factory=list)
    refused: list[tuple[float, int, str, str | None]] = field(default_factory=list)
    other: list[tuple[int, str]] = field(default_factory=list)
    slowest: float = 0.0
    first_after: float | None = None  # when the first post after the restart was acknowledged


def _produce(url: str, key: str, stop: threading.Event, up_at: list[float], out: Answers) -> None:
    """Post one item every ``POST_EVERY`` until ``stop``; sort the answers into ``out``."""
    headers = {"Authorization": f"Token {key}"}
    with httpx.Client(base_url=url, headers=headers, timeout=30) as http:
        n = 0
        while not stop.is_set():
            n += 1
            began = time.monotonic()
            try:
                answer = http.post("/api/queues/q/items", json={"payload": n})
            except httpx.HTTPError as exc:
                out.other.append((0, repr(exc)))
                continue
            took = time.monotonic() - began
            out.slowest = max(out.slowest, took)
            if answer.status_code == 201:
                out.acknowledged.append(str(answer.json()["id"]))
                if up_at and out.first_after is None and began >= up_at[0]:
                    out.first_after = time.monotonic() - up_at[0]
            elif answer.status_code == 503:
                code = answer.json().get("error", {}).get("code", "")
                out.refused.append((took, n, code, answer.headers.get("retry-after")))
            else:
                out.other.append((answer.status_code, answer.text[:300]))
            time.sleep(POST_EVERY)


def _health_while(url: str, until: float) -> list[tuple[float, int, dict[str, Any]]]:
    """``/healthz`` twice a second until ``until``: (seconds it took, status, body) each."""
    seen = []
    while time.monotonic() < until:
        time.sleep(0.5)
        began = time.monotonic()
        answer = httpx.get(f"{url}/healthz", timeout=5)
        seen.append((time.monotonic() - began, answer.status_code, answer.json()))
    return seen


def server_says(server: Server, items: Iterable[str | tuple[Any, ...]], most: int = 40) -> str:
    """The server's log lines that name ``items`` (ids, or rows whose first value is one):
    what a failure's message shows of their story."""
    ids = {i if isinstance(i, str) else str(i[0]) for i in items}
    text = server.log.read_text(errors="replace") if server.log.exists() else ""
    lines = [line for line in text.splitlines() if any(i in line for i in ids)]
    return "\n".join([f"items: {sorted(ids)}", *lines[-most:]])


def _terminate(ports: list[int]) -> int:
    """What a restart does to the server's connections: those that come through the proxy
    (the test's own, and its pool's, stay)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND client_port = ANY(%s)",
            [ports],
        )
        row = cursor.fetchone()
    return int(row[0]) if row else 0


@pytest.mark.parametrize("down_seconds", [4, 12])
def test_a_database_restart_under_load_loses_nothing_acknowledged_and_answers_at_once(
    transactional_db, state_root, make_key, down_seconds: float
):
    """Down 4 s (a restart), and 12 s: longer than the pool's own retries took to come
    back (1 s, 2 s, 4 s, 8 s apart)."""
    proxy = proxy_to_database()
    env = env_through(proxy, TASKHOSTER_SOCKET_BACKSTOP_SECONDS="60")
    server = Server(state_root, **env).start()
    finished: set[str] = set()
    key = make_key()
    engine.upsert_queue(name="q", body={"leaseSeconds": 120})
    worker = Worker(server.url, key, capacity=4, reconnect_delay=0.2, reconnect_max_delay=1)

    down = threading.Event()

    @worker.handler("q")
    def handle(job: Job) -> None:
        # The first two posts are held until the database is away, then answered: a fail
        # and a result that meet the outage and must be sent again.
        if job.payload in (1, 2) and job.attempts == 1:
            assert down.wait(30)
            if job.payload == 1:
                raise RetryableError("failed while the database was away")
        finished.add(job.id)

    loop = asyncio.new_event_loop()
    serving = threading.Thread(target=loop.run_until_complete, args=(worker.serve(),))
    stop = threading.Event()
    up_at: list[float] = []
    answers = Answers()
    producing = threading.Thread(target=_produce, args=(server.url, key, stop, up_at, answers))
    try:
        serving.start()
        producing.start()
        time.sleep(2)
        before = len(answers.acknowledged)
        assert before > 20, answers
        proxy.refuse = True
        terminated = _terminate(proxy.upstream_ports())
        assert terminated > 0, "the server had connections to the database"
        down.set()
        health = _health_while(server.url, time.monotonic() + down_seconds)
        proxy.refuse = False
        up_at.append(time.monotonic())
        time.sleep(5)
        stop.set()
        producing.join(30)
        slowest_health = max(took for took, _status, _body in health)
        assert slowest_health < 2, f"/healthz took {slowest_health:.2f} s"
        _took, status, body = health[-1]
        assert status == 503, "/healthz says the database is away"
        assert body["database"]["reachable"] is False, body
        assert answers.other == [], "every answer a 201 or a 503"
        assert answers.refused, "some posts met the database away"
        for _took, n, code, retry_after in answers.refused:
            # "overloaded": a group whose COMMIT the cut met asks the database (for up to
            # OUTCOME_WAIT_SECONDS) what became of it, and the committer waits with it; a
            # post while another operation has waited past ADMISSION_WAIT_SECONDS is
            # refused at once by admission control (one run in five, on 2026-12-05).
            assert code in ("unavailable", "store_error", "overloaded"), (n, code)
            assert int(retry_after or 0) >= 1, (n, retry_after)
        # The post in flight when the connections were cut may have lost its COMMIT's answer,
        # with the database away to ask: "outcome unknown" (engine.group._commit_outcome).
        unknown = [n for _took, n, code, _r in answers.refused if code == "store_error"]
        assert len(unknown) <= 1, unknown
        assert answers.slowest < SLOW_ANSWER, f"an answer took {answers.slowest:.2f} s"
        assert answers.first_after is not None, "posts acknowledged once the database was back"
        assert answers.first_after < 5, answers.first_after
        acknowledged = set(answers.acknowledged)
        assert len(acknowledged) == len(answers.acknowledged), "no id answered twice"
        deadline = time.monotonic() + 30
        while not acknowledged <= finished and time.monotonic() < deadline:
            time.sleep(0.2)
        never = acknowledged - finished
        assert not never, f"{len(never)} never reached the worker:\n{server_says(server, never)}"

        def unfinished() -> list[tuple[str, str, int]]:
            rows = Item.objects.filter(id__in=acknowledged).exclude(status=Status.FINISHED)
            return list(rows.values_list("id", "status", "attempts"))

        deadline = time.monotonic() + 30
        while unfinished() and time.monotonic() < deadline:
            time.sleep(0.5)
        left = unfinished()
        assert left == [], f"every acknowledged post is finished:\n{server_says(server, left)}"
        assert httpx.get(f"{server.url}/healthz", timeout=5).status_code == 200
        log = server.log.read_text(errors="replace")
        assert "the committer process stopped" not in log, "the committer process never stopped"
    finally:
        stop.set()
        down.set()
        proxy.refuse = False
        worker.stop(hand_back=True)
        serving.join(15)
        loop.close()
        server.stop()
        proxy.close()


def test_a_socket_claim_that_met_the_database_away_is_made_again_once_it_is_back(
    transactional_db, state_root, make_key
):
    """A socket's claim that fails (the database away) is made again a second later, and
    again, until the database is back: nothing else would wake it here (no post, no verdict
    of the socket's, the backstop a minute away). The socket's one slot frees when its
    first item's result commits; its claim for the second item is held a second
    (``dispatch.slow_claim``), and the database goes away meanwhile."""
    proxy = proxy_to_database()
    env = env_through(
        proxy, TASKHOSTER_SOCKET_BACKSTOP_SECONDS="60", TASKHOSTER_FAULT="dispatch.slow_claim"
    )
    server = Server(state_root, **env).start()
    key = make_key()
    engine.upsert_queue(name="q", body={"leaseSeconds": 120})
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Token {key}"}) as http:
        first, second = (
            str(http.post("/api/queues/q/items", json={"payload": n}).json()["id"]) for n in (1, 2)
        )
    worker = Worker(server.url, key, capacity=1, reconnect_delay=0.2, reconnect_max_delay=1)
    given: list[tuple[float, str]] = []
    release = threading.Event()

    @worker.handler("q")
    def handle(job: Job) -> None:
        given.append((time.monotonic(), job.id))
        if job.id == first:
            assert release.wait(30)

    loop = asyncio.new_event_loop()
    serving = threading.Thread(target=loop.run_until_complete, args=(worker.serve(),))
    try:
        serving.start()
        deadline = time.monotonic() + 15
        while not given and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [i for _t, i in given] == [first]
        release.set()
        while Item.objects.get(id=first).status != Status.FINISHED:
            assert time.monotonic() < deadline, "the first item's result committed"
            time.sleep(0.01)
        proxy.refuse = True  # within the claim's held second
        assert _terminate(proxy.upstream_ports()) > 0
        time.sleep(4)
        assert [i for _t, i in given] == [first], "nothing claimed while the database was away"
        proxy.refuse = False
        back = time.monotonic()
        while len(given) < 2 and time.monotonic() < back + 30:
            time.sleep(0.05)
        assert [i for _t, i in given] == [first, second]
        waited = given[1][0] - back
        assert waited < 10, f"claimed {waited:.1f} s after the database's return"
    finally:
        release.set()
        worker.stop(hand_back=True)
        serving.join(15)
        loop.close()
        server.stop()
        proxy.close()


def test_a_subscribe_that_meets_the_database_away_hears_unavailable_and_is_closed_4503(
    transactional_db, state_root, make_key
):
    """The database goes away between a socket's connect and its subscribe: the queues
    cannot be looked up. The socket hears ``unavailable`` and is closed with 4503 (connect
    again later); before, it heard ``internal`` and was closed with 4500, the server's log
    holding a traceback as for a fault of its own. Once the database is back, a socket
    subscribes as ever."""
    proxy = proxy_to_database()
    server = Server(state_root, **env_through(proxy)).start()
    key = make_key()
    engine.upsert_queue(name="q", body={"leaseSeconds": 120})
    try:
        loop = asyncio.new_event_loop()
        try:
            ws = loop.run_until_complete(connect(server, key))  # its key judged

            async def subscribe_away() -> dict[str, Any]:
                await send(ws, {"type": "subscribe", "queues": ["q"], "capacity": 1})
                frame = await recv(ws, timeout=15)
                with pytest.raises(ConnectionClosed):
                    await recv(ws, timeout=15)
                return frame

            proxy.refuse = True
            assert _terminate(proxy.upstream_ports()) > 0
            frame = loop.run_until_complete(subscribe_away())
            code = ws.close_code
        finally:
            loop.close()
        assert (frame["type"], frame["code"]) == ("error", "unavailable"), frame
        assert code == 4503, server.log.read_text()[-3000:]
        assert "Traceback" not in server.log.read_text(), "no fault of the server's own"
        proxy.refuse = False

        with httpx.Client(base_url=server.url, headers={"Authorization": f"Token {key}"}) as http:
            deadline = time.monotonic() + 15
            while (
                answer := http.post("/api/queues/q/items", json={"payload": 1})
            ).status_code != 201:
                assert time.monotonic() < deadline, answer.text
                time.sleep(0.2)
        item_id = answer.json()["id"]

        async def back() -> dict[str, Any]:
            ws = await connect(server, key)
            try:
                await send(ws, {"type": "subscribe", "queues": ["q"], "capacity": 1})
                return await recv(ws, timeout=10)
            finally:
                await ws.close()

        pushed = asyncio.run(back())
        assert (pushed["type"], pushed["id"]) == ("item", item_id), pushed
    finally:
        server.stop()
        proxy.close()
