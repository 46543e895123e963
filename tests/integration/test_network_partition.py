"""The network to PostgreSQL starts dropping packets: a connection already open is found dead
within seconds, not after TCP's own retransmissions (some 15 minutes).

A failover that moves an address, a firewall or security-group change, a NAT that forgets a
connection: the packets of the server's open connections go nowhere and nothing answers,
neither a reset nor a refusal. The server reaches PostgreSQL through a TCP proxy that listens
in a network namespace of its own, joined by a veth pair (``netpartition``); the test takes
that link down, and every packet either way is lost (a real loss, which a proxy in user space
cannot make alone: its kernel acknowledges what it receives). A post made then is answered
503 within the connection options' bound (``tcp_user_timeout``, then ``connect_timeout`` for
a new connection), later ones at once, and once the link is back posts are acknowledged
again. ``/healthz`` answers at once throughout, and says the database does not answer once
its check has waited three intervals (3 s), not when the check gives up.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest

from taskhoster import engine

from ..conftest import Server, needs_postgresql
from .netpartition import Partition
from .test_database_restart import env_through, proxy_to_database

pytestmark = [
    pytest.mark.slow,
    needs_postgresql("a network to a database server: PostgreSQL"),
]

# What the server's connection options bound (project/settings.py): data unacknowledged for
# at most ``tcp_user_timeout``, and a new connection's attempt for ``connect_timeout``.
TCP_USER_TIMEOUT = 10.0
CONNECT_TIMEOUT = 5.0


def _health(url: str, stop: threading.Event, seen: list[tuple[float, float, int, Any]]) -> None:
    """``/healthz`` every 0.2 s until ``stop``: (when sent, seconds it took, status, body)."""
    while not stop.is_set():
        sent = time.monotonic()
        answer = httpx.get(f"{url}/healthz", timeout=60)
        seen.append((sent, time.monotonic() - sent, answer.status_code, answer.json()))
        time.sleep(0.2)


def test_a_network_that_drops_packets_is_found_out_in_seconds(
    transactional_db, state_root, make_key
):
    partition = Partition()
    proxy = server = stop = None
    try:
        proxy = proxy_to_database(partition.listen())
        assert proxy.host == partition.far
        server = Server(state_root, **env_through(proxy)).start()
        engine.upsert_queue(name="q", body={"leaseSeconds": 120})
        headers = {"Authorization": f"Token {make_key()}"}
        # The post in flight: its group's connection given up, then the committer's two
        # tries on new connections (each up to ``connect_timeout``); a margin for a loaded
        # machine.
        bound = TCP_USER_TIMEOUT + 2 * CONNECT_TIMEOUT + 5
        with httpx.Client(base_url=server.url, headers=headers, timeout=60) as http:
            for n in range(3):  # every connection the post needs is open
                assert http.post("/api/queues/q/items", json={"payload": n}).status_code == 201
            stop = threading.Event()
            health: list[tuple[float, float, int, Any]] = []
            polling = threading.Thread(target=_health, args=(server.url, stop, health))
            polling.start()
            partition.cut()
            began = time.monotonic()
            took: list[float] = []
            while time.monotonic() - began < bound + 5:
                sent = time.monotonic()
                answer = http.post("/api/queues/q/items", json={"payload": "lost"})
                took.append(time.monotonic() - sent)
                assert answer.status_code == 503, answer.text
                assert answer.json()["error"]["code"] in ("unavailable", "store_error")
                assert took[-1] < bound, f"answered after {took[-1]:.1f} s (at most {bound} s)"
                time.sleep(0.2)
            assert took[-1] < 2, f"found away: answered at once ({took})"
            stop.set()
            polling.join(70)
            slowest = max(t for _s, t, _c, _b in health)
            assert slowest < 2, f"/healthz took {slowest:.1f} s"
            away = [s - began for s, _t, c, b in health if c == 503 and s > began]
            assert away, "/healthz said the database is away"
            assert away[0] < 6, f"/healthz said the database is away after {away[0]:.1f} s"
            assert all(
                c == 503 and b["database"]["reachable"] is False
                for s, _t, c, b in health
                if s - began > away[0]
            ), "and went on saying so"
            partition.heal()
            deadline = time.monotonic() + 30
            while True:
                answer = http.post("/api/queues/q/items", json={"payload": "back"})
                if answer.status_code == 201:
                    break
                assert answer.status_code == 503, answer.text
                assert time.monotonic() < deadline, "posts acknowledged once packets flow"
                time.sleep(0.5)
    finally:
        if stop is not None:
            stop.set()
        if server is not None:
            server.stop()
        if proxy is not None:
            proxy.close()
        partition.close()
