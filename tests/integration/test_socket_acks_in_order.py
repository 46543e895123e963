"""The ``/work`` socket's acks: "one per result, fail or extend, in order" (SPEC section 6).

A worker sends a burst of frames without waiting for any answer: some the server answers
at once (a ``fail`` or ``extend`` for an item the socket does not hold), some only when the
engine has applied them (results, fails and extends of held items, and a result for an item
of another queue). Each gets exactly one ack, and the acks come in the order the frames were
sent, each naming its frame's item: against a real daphne and a real websocket client.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from .wsclient import connect, make_queue, post, recv, send, status_of, subscribe

pytestmark = pytest.mark.slow


@pytest.fixture
def server(server_factory):
    return server_factory()


def test_each_result_fail_and_extend_gets_one_ack_in_the_order_sent(server, http, key):
    make_queue(http)
    make_queue(http, "other")
    a, b, c = (post(http, name) for name in ("a", "b", "c"))
    elsewhere = post(http, "not held: of a queue the socket does not serve", queue="other")

    # (frame, the ack it must get), in the order sent. "leaseExpiresAt" is checked apart.
    burst: list[tuple[dict[str, Any], dict[str, Any]]] = [
        ({"type": "extend", "id": a}, {"accepted": True}),
        ({"type": "fail", "id": elsewhere}, {"accepted": False}),
        ({"type": "extend", "id": b, "seconds": 30}, {"accepted": True}),
        ({"type": "result", "id": a, "result": "a"}, {"accepted": True, "status": "finished"}),
        ({"type": "extend", "id": elsewhere}, {"accepted": False}),
        (
            {"type": "fail", "id": b, "error": "no", "retry": False},
            {"accepted": True, "status": "failed"},
        ),
        ({"type": "result", "id": c, "result": "c"}, {"accepted": True, "status": "finished"}),
        ({"type": "extend", "id": a}, {"accepted": False}),  # a is no longer held
        ({"type": "fail", "id": c}, {"accepted": False}),  # nor is c
        (
            {"type": "result", "id": elsewhere, "result": "e"},
            {"accepted": True, "status": "finished"},
        ),
        ({"type": "result", "id": a, "result": "again"}, {"accepted": False}),
    ]

    async def run() -> list[dict]:
        async with await connect(server, key) as ws:
            await subscribe(ws, ["q"], 3)
            pushed = {(await recv(ws, 30))["id"] for _ in range(3)}
            assert pushed == {a, b, c}
            for frame, _ack in burst:
                await send(ws, frame)
            acks: list[dict[str, Any]] = []
            while len(acks) < len(burst):
                answer = await recv(ws, 30)
                assert answer["type"] == "ack", f"not an ack: {answer} (acks so far: {acks})"
                acks.append(answer)
            # And no more: the next frame is the ack of one more frame, sent now.
            await send(ws, {"type": "extend", "id": elsewhere})
            assert await recv(ws, 30) == {"type": "ack", "id": elsewhere, "accepted": False}
            return acks

    acks = asyncio.run(run())
    assert [ack["id"] for ack in acks] == [frame["id"] for frame, _ack in burst]
    for (frame, expected), ack in zip(burst, acks, strict=True):
        assert {k: ack[k] for k in expected} == expected, (frame, ack)
        if frame["type"] == "extend":
            assert (ack.get("leaseExpiresAt") is not None) == expected["accepted"], (frame, ack)
    assert [status_of(http, i)["status"] for i in (a, b, c, elsewhere)] == [
        "finished",
        "failed",
        "finished",
        "finished",
    ]
