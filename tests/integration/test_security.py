"""The security review's findings, each reproduced against a real daphne (and, where a
process boundary matters, two daphnes on PostgreSQL + Redis).

- a key limited to some queues could finish another queue's item over the socket;
- JSON nested hundreds of levels deep left an operation registered for ever (memory that
  never came back, even for a made-up key);
- a revoked key's open socket kept working;
- a key limited to a queue could make another queue its dead-letter queue.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets

from taskhoster import engine
from taskhoster.keys import create_key, revoke
from taskhoster.models import ApiKey, Item

from ..conftest import Server
from .test_processes import needs_shared
from .wsclient import connect, recv, recv_none, send, subscribe

pytestmark = pytest.mark.slow
REDIS_URL = os.environ.get("REDIS_URL", "")


def rss_mb(pid: int) -> float:
    """Resident memory of a process and its children (the committer), in MiB."""
    total = 0.0
    pids = [pid]
    for task in Path(f"/proc/{pid}/task").iterdir():
        pids += [int(c) for c in (task / "children").read_text().split()]
    for one in pids:
        for line in Path(f"/proc/{one}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) / 1024
    return total


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


# -- 1. queue limits hold for every socket frame that names an item -------------------------


def test_a_queue_limited_key_cannot_finish_another_queues_item_over_the_socket(
    server_factory, make_key
):
    engine.upsert_queue(name="qa", body={})
    engine.upsert_queue(name="qb", body={})
    theirs = engine.post_items(queue_name="qb", items=[engine.NewItem(payload="b")])[0].row.id
    server = server_factory()
    limited = make_key("work", ["qa"])

    async def run() -> list[dict[str, Any]]:
        ws = await connect(server, limited)
        frames = []
        for kind, body in (
            ("result", {"result": {"forged": True}}),
            ("fail", {"retry": False}),
            ("extend", {}),
        ):
            await send(ws, {"type": kind, "id": theirs, **body})
            frames.append(await recv(ws))
        await send(ws, {"type": "result", "id": "0661" + "0" * 16, "result": 1})
        frames.append(await recv(ws))  # a missing item, for comparison
        await ws.close()
        return frames

    result, fail, extend, missing = asyncio.run(run())
    assert result["type"] == "error"
    assert result["code"] == "item_not_found", "as a missing item: nothing to learn"
    assert missing["code"] == result["code"]
    assert fail == {"type": "ack", "id": theirs, "accepted": False}
    assert extend["accepted"] is False
    item = Item.objects.get(id=theirs)
    assert item.status == "pending", "the other queue's item is untouched"
    assert item.finished_at is None


# -- 2. deep JSON: refused in the parser, nothing left behind -------------------------------


def test_deeply_nested_json_is_refused_and_memory_stays_flat(server_factory, make_key):
    engine.upsert_queue(name="q", body={})
    server = server_factory()
    assert server.proc is not None
    good = {"Authorization": f"Token {make_key()}", "Content-Type": "application/json"}
    bogus = {"Authorization": "Token th_made-up", "Content-Type": "application/json"}
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for headers in (good, bogus):  # warm up both paths
            http.post(
                "/api/queues/q/items", content=f'{{"payload": {nested(600)}}}', headers=headers
            )
        before = rss_mb(server.proc.pid)
        for n in range(1000):
            body = f'{{"payload": {nested(480 + n % 500)}}}'
            answer = http.post(
                "/api/queues/q/items", content=body, headers=good if n % 2 else bogus
            )
            if n % 2:
                assert answer.status_code == 400, answer.text
                assert answer.json()["error"]["code"] == "too_deep"
            else:
                assert answer.status_code == 401, answer.text
        after = rss_mb(server.proc.pid)
        assert http.get("/healthz").status_code == 200
    assert not Item.objects.exists(), "nothing was posted"
    assert after - before < 25, f"memory grew from {before:.0f} to {after:.0f} MiB"


def test_a_socket_frame_nested_too_deeply_is_refused_and_the_socket_stays_open(
    server_factory, make_key
):
    engine.upsert_queue(name="q", body={})
    item = engine.post_items(queue_name="q", items=[engine.NewItem(payload=1)])[0].row.id
    server = server_factory()
    key = make_key()

    async def run() -> tuple[dict[str, Any], dict[str, Any]]:
        ws = await connect(server, key)
        await ws.send(f'{{"type": "result", "id": "{item}", "result": {nested(600)}}}')
        refused = await recv(ws)
        await subscribe(ws, ["q"], 1)
        pushed = await recv(ws)
        await ws.close()
        return refused, pushed

    refused, pushed = asyncio.run(run())
    assert refused["type"] == "error"
    assert refused["code"] == "too_deep"
    assert pushed["type"] == "item", "the socket still works"
    assert pushed["id"] == item


# -- 4. a revoked key's sockets close, in every process --------------------------------------


async def wait_closed(ws: Any, timeout: float) -> int | None:
    """The close code the server sent, once it closes the socket (within ``timeout``)."""
    try:
        while True:
            await asyncio.wait_for(ws.recv(), timeout)
    except websockets.ConnectionClosed as closed:
        return closed.rcvd.code if closed.rcvd else None
    finally:
        await ws.close()


def test_revoking_a_key_closes_its_open_sockets(server_factory, make_key):
    engine.upsert_queue(name="q", body={})
    server = server_factory(TASKHOSTER_SOCKET_BACKSTOP_SECONDS="60")  # by the news, not a poll
    key_row, secret = create_key(name="to-revoke", scopes=["work"])
    other = make_key("work")

    async def run() -> tuple[int | None, dict[str, Any]]:
        doomed = await connect(server, secret)
        await subscribe(doomed, ["q"], 5)
        kept = await connect(server, other)
        await subscribe(kept, ["q"], 5)
        await recv_none(doomed, 0.3)
        await asyncio.to_thread(revoke, [key_row.pk])  # as the admin's action does
        code = await wait_closed(doomed, 10)
        posted = await asyncio.to_thread(
            engine.post_items, queue_name="q", items=[engine.NewItem(payload=1)]
        )
        item = posted[0].row.id
        frame = await recv(kept, 10)
        assert frame["id"] == item
        await kept.close()
        return code, frame

    code, frame = asyncio.run(run())
    assert code == 4401
    assert frame["type"] == "item", "the other key's socket got the work"


def test_a_key_revoked_behind_the_servers_back_loses_its_socket_at_the_backstop(
    server_factory,
):
    engine.upsert_queue(name="q", body={})
    server = server_factory(TASKHOSTER_SOCKET_BACKSTOP_SECONDS="0.5")
    key_row, secret = create_key(name="to-revoke", scopes=["work"])

    async def run() -> int | None:
        ws = await connect(server, secret)
        await subscribe(ws, ["q"], 1)
        await recv_none(ws, 0.3)
        # No news: the row changed by hand (another tool, a restored backup...).
        await asyncio.to_thread(
            ApiKey.objects.filter(pk=key_row.pk).update, revoked_at="2026-01-01T00:00:00Z"
        )
        return await wait_closed(ws, 15)

    assert asyncio.run(run()) == 4401


@needs_shared
def test_revoking_a_key_closes_its_sockets_on_every_server_process(
    transactional_db, state_root, make_key
):
    env = {"REDIS_URL": REDIS_URL, "TASKHOSTER_SOCKET_BACKSTOP_SECONDS": "60"}
    a, b = Server(state_root, **env).start(), Server(state_root, **env).start()
    try:
        engine.upsert_queue(name="q", body={})
        key_row, secret = create_key(name="to-revoke", scopes=["work"])

        async def run() -> list[int | None]:
            sockets = [await connect(s, secret) for s in (a, b)]
            for ws in sockets:
                await subscribe(ws, ["q"], 1)
                await recv_none(ws, 0.2)
            await asyncio.to_thread(revoke, [key_row.pk])
            return list(await asyncio.gather(*(wait_closed(ws, 10) for ws in sockets)))

        assert asyncio.run(run()) == [4401, 4401]
    finally:
        a.stop()
        b.stop()


# -- 5. the dead-letter queue needs the right to use it ---------------------------------------


def test_a_key_limited_to_a_queue_cannot_make_another_its_dead_letter_queue(
    server_factory, make_key
):
    engine.upsert_queue(name="qa", body={})
    engine.upsert_queue(name="qb", body={})
    server = server_factory()
    limited = {"Authorization": f"Token {make_key('manage', ['qa'])}"}
    with httpx.Client(base_url=server.url, headers=limited, timeout=10) as http:
        answer = http.put("/api/queues/qa", json={"deadLetterQueue": "qb", "maxAttempts": 3})
        assert answer.status_code == 403
        assert answer.json()["error"]["code"] == "forbidden"
        assert "qb" in answer.json()["error"]["message"]
        queue = http.get("/api/queues/qa").json()
        assert queue["deadLetterQueue"] is None, "nothing changed"
        assert queue["maxAttempts"] is None
    allowed = {"Authorization": f"Token {make_key('manage', ['qa', 'qb'])}"}
    answer = httpx.put(
        f"{server.url}/api/queues/qa", json={"deadLetterQueue": "qb"}, headers=allowed
    )
    assert answer.status_code == 200


def _loop_seconds(pid: int) -> float:
    """CPU seconds of a server's main thread (daphne's event loop)."""
    fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_made_up_key_is_judged_before_its_body_is_read_on_the_loop(server_factory, make_key):
    """Posts are answered on the event loop without looking their key up; a key not seen
    accepted lately goes to a thread first, where it is judged before the body is parsed.
    Parsing 400 KB of JSON costs the loop milliseconds a request: 40 of them, well over the
    bound here, if a made-up key's body were read there."""
    engine.upsert_queue(name="q", body={})
    server = server_factory()
    assert server.proc is not None
    body = b'{"payload": [' + b",".join(b'{"a": 1, "b": [1, 2, 3]}' for _ in range(16000)) + b"]}"
    assert len(body) > 350_000
    headers = {"Authorization": "Token th_made-up", "Content-Type": "application/json"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=30) as http:
        http.post("/api/queues/q/items", content=b"{}")  # warm up
        before = _loop_seconds(server.proc.pid)
        for _ in range(40):
            assert http.post("/api/queues/q/items", content=body).status_code == 401
        spent = _loop_seconds(server.proc.pid) - before
    good = {"Authorization": f"Token {make_key()}", "Content-Type": "application/json"}
    with httpx.Client(base_url=server.url, headers=good, timeout=30) as http:
        before = _loop_seconds(server.proc.pid)
        for _ in range(5):  # a key accepted once stays on the loop: its bodies are parsed there
            assert http.post("/api/queues/q/items", content=body).status_code == 201
        parsed = (_loop_seconds(server.proc.pid) - before) / 5
    assert spent < 40 * parsed / 2, (spent, parsed)
