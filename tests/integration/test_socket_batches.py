"""Several items and several results per frame on the /work socket: the optional extension
(the AsyncAPI document's ``batch``, ``items``, ``results`` and ``acks``), against a real
daphne and a real websocket client. Every frame received is checked against the document."""

from __future__ import annotations

import asyncio
import json

import pytest
import websockets

from .wsclient import (
    PONG,
    assert_nothing_before,
    check_frame,
    connect,
    make_queue,
    ping,
    post,
    recv,
    send,
    status_of,
    subscribe,
)

pytestmark = pytest.mark.slow


@pytest.fixture
def server(server_factory):
    # A long backstop: every push below comes from a claim, not from the periodic re-check.
    return server_factory(TASKHOSTER_SOCKET_BACKSTOP_SECONDS="60")


async def _items(ws, count: int) -> list[dict]:
    """The next ``count`` items, whichever frames carry them, and the frames' sizes."""
    got: list[dict] = []
    while len(got) < count:
        frame = await recv(ws, timeout=10)
        if frame["type"] == "item":
            got.append({k: v for k, v in frame.items() if k != "type"})
        else:
            assert frame["type"] == "items", frame
            got.extend(frame["items"])
    return got


def test_a_socket_subscribed_with_a_batch_gets_items_frames_of_at_most_that_many(server, http, key):
    make_queue(http)
    ids = [post(http, n) for n in range(5)]

    async def run():
        async with await connect(server, key) as ws:
            await send(ws, {"type": "subscribe", "queues": ["q"], "capacity": 5, "batch": 2})
            sizes: list[int] = []
            got: list[dict] = []
            while len(got) < 5:
                frame = await recv(ws, timeout=10)
                entries = frame["items"] if frame["type"] == "items" else [frame]
                sizes.append(len(entries))
                got.extend(entries)
            assert [i["id"] for i in got] == ids  # claim order
            assert max(sizes) == 2
            assert all(1 <= s <= 2 for s in sizes)
            assert all(i["status"] == "processing" and i["lease"] for i in got)
            # Each entry is held under its own lease: a fail naming it is taken.
            await send(ws, {"type": "fail", "id": ids[0], "lease": got[0]["lease"], "retry": False})
            ack = await recv(ws, timeout=10)
            assert (ack["type"], ack["id"], ack["accepted"]) == ("ack", ids[0], True)

    asyncio.run(run())
    assert status_of(http, ids[0])["status"] == "failed"


def test_an_items_frame_stays_within_the_frame_limit(server, http, key):
    """Items of 400,000 characters each, a batch of 3: three do not fit in one frame (the
    limit is the largest payload, 1 MiB, and 64 KiB), so they come as two and one."""
    make_queue(http)
    big = "x" * 400_000
    ids = [post(http, big) for _ in range(3)]
    limit = 1024 * 1024 + 64 * 1024

    async def run():
        async with await connect(server, key) as ws:
            await send(ws, {"type": "subscribe", "queues": ["q"], "capacity": 3, "batch": 3})
            sizes: list[int] = []
            got: list[dict] = []
            while len(got) < 3:
                text = await asyncio.wait_for(ws.recv(), 10)
                assert len(text.encode()) <= limit
                frame = json.loads(text)
                check_frame(frame)
                entries = frame["items"] if frame["type"] == "items" else [frame]
                sizes.append(len(entries))
                got.extend(entries)
            assert [i["id"] for i in got] == ids
            assert all(i["payload"] == big for i in got)
            assert sorted(sizes) == [1, 2]

    asyncio.run(run())


def test_two_items_that_fit_a_frame_only_without_its_envelope_come_in_two(server, http, key):
    """The frame limit counts the whole frame: two entries that add up to just under the
    limit, but over it with the items frame around them, come as two item frames."""
    make_queue(http)
    limit = 1024 * 1024 + 64 * 1024
    probes = [post(http, "x") for _ in range(2)]

    async def run():
        async with await connect(server, key) as ws:
            await send(ws, {"type": "subscribe", "queues": ["q"], "capacity": 2, "batch": 2})
            held = await _items(ws, 2)
            assert [i["id"] for i in held] == probes
            overhead = len(json.dumps(held[0], separators=(",", ":")).encode()) - len('"x"')
            # Full: these two wait, and one claim takes both when the probes' slots free up.
            # Two entries and their comma: 11 bytes under the limit; the envelope is 27.
            length = (limit - 11) // 2 - overhead - 2
            ids = [post(http, "y" * length) for _ in range(2)]
            await send(ws, {"type": "results", "results": [{"id": i, "result": 1} for i in probes]})
            kinds: list[tuple[str, str]] = []
            while len(kinds) < 2:
                text = await asyncio.wait_for(ws.recv(), 10)
                assert len(text.encode()) <= limit
                frame = json.loads(text)
                check_frame(frame)
                if frame["type"] != "acks":
                    kinds.append((frame["type"], frame["id"]))
            assert kinds == [("item", i) for i in ids]

    asyncio.run(run())


def test_without_a_batch_every_item_comes_in_an_item_frame_of_its_own(server, http, key):
    make_queue(http)
    ids = [post(http, n) for n in range(4)]

    async def run():
        async with await connect(server, key) as ws:
            await subscribe(ws, ["q"], 4)
            frames = [await recv(ws, timeout=10) for _ in ids]
            assert [(f["type"], f["id"]) for f in frames] == [("item", i) for i in ids]
            await ping(ws)
            await assert_nothing_before(ws, PONG)

    asyncio.run(run())


def test_a_results_frame_is_answered_by_one_acks_frame_in_its_order(server, http, key):
    make_queue(http)
    ids = [post(http, n) for n in range(3)]
    unknown = "nosuchitem0000000000"

    async def run():
        async with await connect(server, key) as ws:
            await subscribe(ws, ["q"], 3)
            held = await _items(ws, 3)
            assert [i["id"] for i in held] == ids
            results = [
                {"id": ids[2], "result": "c"},
                {"id": unknown, "result": "x"},
                {"id": ids[0], "result": "a", "lease": held[0]["lease"]},
                {"id": ids[1], "result": "b"},
            ]
            await send(ws, {"type": "results", "results": results})
            answer = await recv(ws, timeout=10)
            assert answer["type"] == "acks"
            assert answer["acks"][0] == {"id": ids[2], "accepted": True, "status": "finished"}
            assert answer["acks"][1]["id"] == unknown
            assert answer["acks"][1]["accepted"] is False
            assert answer["acks"][1]["error"]["code"] == "item_not_found"
            assert answer["acks"][2:] == [
                {"id": ids[0], "accepted": True, "status": "finished"},
                {"id": ids[1], "accepted": True, "status": "finished"},
            ]
            # A second result for a finished item: refused (rule 3), in an acks entry.
            await send(ws, {"type": "results", "results": [{"id": ids[0], "result": "again"}]})
            again = await recv(ws, timeout=10)
            assert again == {
                "type": "acks",
                "acks": [{"id": ids[0], "accepted": False, "status": "finished"}],
            }
            # The three slots are free again: three new items come.
            more = [post(http, n) for n in range(3, 6)]
            assert [i["id"] for i in await _items(ws, 3)] == more

    asyncio.run(run())
    assert [status_of(http, i)["result"] for i in ids] == ["a", "b", "c"]


def test_a_results_frame_with_one_bad_entry_is_refused_whole_and_changes_nothing(server, http, key):
    make_queue(http)
    ids = [post(http, n) for n in range(2)]

    async def run():
        async with await connect(server, key) as ws:
            await subscribe(ws, ["q"], 2)
            await _items(ws, 2)
            bad_frames: list[dict] = [
                {"type": "results", "results": [{"id": ids[0], "result": 1}, {"id": ids[1]}]},
                {"type": "results", "results": [{"id": ids[0], "result": 1}, "no"]},
                {"type": "results", "results": []},
                {"type": "results", "results": {"id": ids[0], "result": 1}},
                {"type": "results", "results": [{"id": ids[0], "result": 1, "extra": 2}]},
                {"type": "results", "results": [{"id": "../x", "result": 1}]},
            ]
            codes = []
            for frame in bad_frames:
                await send(ws, frame)
                error = await recv(ws, timeout=10)
                assert error["type"] == "error", error
                codes.append(error["code"])
            assert codes == [
                "missing_field",
                "invalid_body",
                "invalid_results",
                "invalid_results",
                "unknown_field",
                "invalid_id",
            ]
            # Nothing changed: both still held by this socket, which is still open.
            assert [status_of(http, i)["status"] for i in ids] == ["processing"] * 2
            await send(ws, {"type": "results", "results": [{"id": i, "result": i} for i in ids]})
            answer = await recv(ws, timeout=10)
            assert [a["accepted"] for a in answer["acks"]] == [True, True]

    asyncio.run(run())
    assert [status_of(http, i)["status"] for i in ids] == ["finished", "finished"]


def test_a_batch_over_the_largest_capacity_is_refused(server, http, key):
    make_queue(http)

    async def run():
        async with await connect(server, key) as ws:
            await send(ws, {"type": "subscribe", "queues": ["q"], "capacity": 1, "batch": 10**9})
            assert (await recv(ws))["code"] == "invalid_batch"
            await send(ws, {"type": "subscribe", "queues": ["q"], "capacity": 1, "batch": 0})
            assert (await recv(ws))["code"] == "invalid_batch"

    asyncio.run(run())


def test_error_entries_in_acks_count_toward_the_abuse_limit(server, http, key):
    """More than 100 errors within 10 s close a socket (4429), whether they come as error
    frames or as entries of acks frames: 2 results frames of 60 unknown items each."""
    make_queue(http)

    async def run():
        ws = await connect(server, key)
        await subscribe(ws, ["q"], 1)
        unknown = [{"id": f"nosuchitem{n:010d}", "result": None} for n in range(60)]
        await send(ws, {"type": "results", "results": unknown})
        first = await recv(ws, timeout=10)
        assert [a["error"]["code"] for a in first["acks"]] == ["item_not_found"] * 60
        await send(ws, {"type": "results", "results": unknown})
        second = await recv(ws, timeout=10)
        assert len(second["acks"]) == 60
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await recv(ws, timeout=10)
        assert closed.value.rcvd is not None
        assert closed.value.rcvd.code == 4429

    asyncio.run(run())
