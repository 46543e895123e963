"""A state root that fills up, or turns read-only, under a running server: changes answer
503 ``store_error`` and nothing acknowledged is lost; once room (or writes) come back, the
same server serves again without a restart: new posts land, and a worker takes every item,
those acknowledged before the fault and those posted after, and the index still says what
the directories say.

The state root is a real filesystem of its own (a small tmpfs, mounted here): it is made
bigger (``remount,size=``) or read-only and writable again (``remount,ro`` / ``rw``), as an
operator's fix or a disk's error would.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from ..conftest import Server
from .consistency import assert_index_matches_directories
from .test_overload import small_filesystem, wait_for
from .test_state_root_identity import run_manage
from .wsclient import connect, recv, send, subscribe

pytestmark = pytest.mark.slow

PAD = "x" * 20000  # a post's payload: a 2 MiB filesystem holds some ninety


def remount(path: Path, options: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{options}", str(path)], check=True)


def post_until_refused(http: httpx.Client, most: int) -> tuple[list[str], httpx.Response]:
    """Post until a post is refused; the ids acknowledged, and the refusal."""
    posted: list[str] = []
    for n in range(most):
        answer = http.post("/api/queues/q/items", json={"payload": {"n": n, "pad": PAD}})
        if answer.status_code != 201:
            return posted, answer
        posted.append(answer.json()["id"])
    raise AssertionError(f"{most} posts were all taken")


def fill(directory: Path) -> Path:
    """Take what room is left on ``directory``'s filesystem (as the disk's other writers
    would): a refused post of 20 KiB may leave a few pages free, where /healthz's probe of a
    few bytes still succeeds. The file that took it."""
    path = directory / "filler"
    with open(path, "ab", buffering=0) as filler:
        for size in (1 << 16, 1 << 12, 1):
            try:
                while True:
                    filler.write(b"\0" * size)
            except OSError:
                continue
    return path


def ready(http: httpx.Client) -> bool:
    return http.get("/healthz").status_code == 200


def take_all(server: Server, key: str, ids: set[str]) -> None:
    """A socket worker takes every item of ``ids`` and finishes it."""

    async def run() -> None:
        ws = await connect(server, key)
        try:
            await subscribe(ws, ["q"], 16)
            left, unacked = set(ids), set(ids)
            while unacked:
                frame = await recv(ws, 15)
                if frame["type"] == "ack":
                    assert frame["accepted"] is True, frame
                    unacked.discard(frame["id"])
                    continue
                assert frame["type"] == "item", frame
                assert frame["id"] in left, frame
                left.discard(frame["id"])
                await send(ws, {"type": "result", "id": frame["id"], "result": "ok"})
        finally:
            await ws.close()

    asyncio.run(run())


def finished(http: httpx.Client, ids: set[str]) -> bool:
    return all(http.get(f"/api/items/{i}").json()["status"] == "finished" for i in ids)


@pytest.fixture
def small_root(tmp_path: Path) -> Any:
    with small_filesystem(tmp_path / "small", "2m") as root:
        yield root


@contextlib.contextmanager
def serving(
    root: Path, key: str, *, logs: Path | None = None, **env: str
) -> Iterator[tuple[Server, httpx.Client]]:
    """A server on ``root`` (no free-space floor: the disk's own refusals are tested), with
    ``env``, logging into ``logs`` (default: beside ``root``), and a client with ``key``;
    stopped, and the disk synced, after."""
    server = Server(root, TASKHOSTER_MIN_FREE_BYTES="0", TASKHOSTER_MIN_FREE_INODES="0", **env)
    if logs is not None:
        server.log = logs / server.log.name
    server.start()
    try:
        with httpx.Client(
            base_url=server.url, headers={"Authorization": f"Token {key}"}, timeout=30
        ) as http:
            yield server, http
    finally:
        server.stop()
        os.sync()


def fill_then_give_room(
    server: Server, http: httpx.Client, key: str, disk: Path, size: str, refused_as: set[str]
) -> None:
    """Post until a post is refused (503, one of ``refused_as``, with ``Retry-After``), take
    the disk's last pages, and /healthz says the disk is full; give it room (``size``), and
    /healthz says it takes writes, new posts land, and a worker takes every item, those
    acknowledged before and those posted after, and finishes it."""
    assert http.put("/api/queues/q", json={}).status_code == 201
    before, refused = post_until_refused(http, 400)
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["code"] in refused_as, refused.text
    assert refused.headers["Retry-After"]
    assert before
    fill(disk)
    wait_for(lambda: not ready(http), 15, "/healthz to say the disk is full")

    remount(disk, f"size={size}")  # the operator gives it room
    wait_for(lambda: ready(http), 15, "/healthz to say the disk takes writes")
    after = []
    for n in range(5):
        answer = http.post("/api/queues/q/items", json={"payload": {"after": n}})
        assert answer.status_code == 201, answer.text
        after.append(answer.json()["id"])
    everything = set(before) | set(after)
    take_all(server, key, everything)
    wait_for(lambda: finished(http, everything), 15, "every item finished")


def test_a_server_whose_full_state_root_is_given_room_serves_again_and_loses_nothing(
    small_root, transactional_db, make_key
):
    key = make_key()
    with serving(small_root, key) as (server, http):
        fill_then_give_room(server, http, key, small_root, "16m", {"store_error"})
    assert_index_matches_directories(small_root)


def test_a_batch_post_that_meets_a_full_disk_part_way_posts_none_of_its_items(
    small_root, transactional_db, make_key
):
    # All or none (SPEC: a batch post): room for two small items' files and not for the
    # third's, the batch is refused and leaves no row and no file. Before, the failing
    # member alone was answered, and the group committed the two files already written.
    with serving(small_root, make_key()) as (_server, http):
        assert http.put("/api/queues/q", json={}).status_code == 201
        kept = http.post("/api/queues/q/items", json={"payload": "before"})
        assert kept.status_code == 201, kept.text
        filler = fill(small_root)
        os.truncate(filler, filler.stat().st_size - 3 * 4096)  # three pages free
        batch = [{"payload": "small"}, {"payload": "small"}, {"payload": PAD}]
        refused = http.post("/api/queues/q/items", json={"items": batch})
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "store_error"
        listed = http.get("/api/queues/q/items").json()
        assert [item["id"] for item in listed["items"]] == [kept.json()["id"]], listed
    assert_index_matches_directories(small_root)


def test_a_server_whose_state_root_turned_read_only_serves_again_once_it_is_writable(
    small_root, transactional_db, make_key
):
    # A worker holds items as the state root turns read-only: its result then changed
    # nothing and is answered ``unavailable`` (send it again), not an error that ends the
    # verdict; sent again once the root is writable, it is taken. An item coming due while
    # the root is read-only (its claim fails), and one whose socket closed meanwhile (its
    # re-queue fails), reach the worker once it is writable, not at the lease's end.
    key = make_key()
    with serving(small_root, key) as (server, http):
        assert http.put("/api/queues/q", json={"leaseSeconds": 300}).status_code == 201
        answer = http.post("/api/queues/q/items", json={"payload": "its socket closes"})
        assert answer.status_code == 201, answer.text
        closing = answer.json()["id"]
        before = []
        for n in range(3):
            answer = http.post("/api/queues/q/items", json={"payload": {"before": n}})
            assert answer.status_code == 201, answer.text
            before.append(answer.json()["id"])
        at = datetime.now(UTC) + timedelta(seconds=5)  # after the root turns read-only
        answer = http.post(
            "/api/queues/q/items",
            json={"payload": "due", "scheduledAt": at.isoformat().replace("+00:00", "Z")},
        )
        assert answer.status_code == 201, answer.text
        due = answer.json()["id"]

        async def run() -> list[str]:
            other = await connect(server, key)
            await subscribe(other, ["q"], 1)
            assert (await recv(other))["id"] == closing
            ws = await connect(server, key)
            try:
                await subscribe(ws, ["q"], 16)
                held = {(await recv(ws))["id"] for _ in before}
                assert held == set(before)
                remount(small_root, "ro")  # a disk's error, or an operator's mistake
                await other.close()  # what it held cannot be re-queued now
                first = before[0]
                await send(ws, {"type": "result", "id": first, "result": "ok"})
                frame = await recv(ws)
                assert (frame["type"], frame["code"], frame["id"]) == (
                    "error",
                    "unavailable",
                    first,
                ), frame
                refused = await asyncio.to_thread(
                    http.post, "/api/queues/q/items", json={"payload": "while read-only"}
                )
                assert refused.status_code == 503, refused.text
                assert refused.json()["error"]["code"] == "store_error"
                # A queue's settings are kept in its directory too: refused, not a 500.
                made = await asyncio.to_thread(http.put, "/api/queues/other", json={})
                assert made.status_code == 503, made.text
                assert made.json()["error"]["code"] == "store_error"
                await asyncio.to_thread(
                    wait_for, lambda: not ready(http), 15, "/healthz to say it is read-only"
                )
                # The delayed item comes due while read-only; its claim fails.
                await asyncio.sleep(max(0.0, (at - datetime.now(UTC)).total_seconds()) + 1)
                remount(small_root, "rw")
                await asyncio.to_thread(
                    wait_for, lambda: ready(http), 15, "/healthz to say it takes writes"
                )
                for item_id in before:  # the first sent again
                    await send(ws, {"type": "result", "id": item_id, "result": "ok"})
                # The acks, and the items pushed between them, in any order.
                acked: set[str] = set()
                pushed: set[str] = set()
                while len(acked) < len(before) or len(pushed) < 2:
                    frame = await recv(ws, 15)
                    if frame["type"] == "item":
                        pushed.add(frame["id"])
                        continue
                    assert (frame["type"], frame["accepted"]) == ("ack", True), frame
                    acked.add(frame["id"])
                assert acked == set(before)
                assert pushed == {due, closing}
                for item_id in pushed:
                    await send(ws, {"type": "result", "id": item_id, "result": "ok"})
                    ack = await recv(ws)
                    assert (ack["type"], ack["id"], ack["accepted"]) == ("ack", item_id, True)
                after = []
                for n in range(3):
                    answer = await asyncio.to_thread(
                        http.post, "/api/queues/q/items", json={"payload": {"after": n}}
                    )
                    assert answer.status_code == 201, answer.text
                    after.append(answer.json()["id"])
                return after
            finally:
                await ws.close()

        after = asyncio.run(run())
        assert http.get("/api/queues/other").status_code == 404  # its row rolled back
        take_all(server, key, set(after))
        everything = set(before) | set(after) | {due, closing}
        wait_for(lambda: finished(http, everything), 15, "every item finished")
    assert_index_matches_directories(small_root)
    log = server.log.read_text()
    # A claim that met the read-only root is told as one line, not a traceback a second.
    assert "Traceback" not in log, log


def manage(root: Path, url: str, *args: str) -> str:
    done = run_manage(root, url, *args)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_embedded_layout_on_a_full_disk_serves_again_once_given_room(tmp_path):
    # The default layout: the SQLite database beside the state root, on one filesystem, so
    # a full disk refuses the database's writes too (SQLite's "database or disk is full").
    with small_filesystem(tmp_path / "small", "4m") as disk:
        url = f"sqlite:///{disk / 'taskhoster.sqlite3'}"
        root = disk / "state"
        manage(root, url, "migrate", "--noinput", "-v0")
        key = manage(root, url, "createkey", "--name", "k", "--scopes", "produce,work,manage")
        key = key.strip()
        with serving(root, key, logs=tmp_path, DATABASE_URL=url) as (server, http):
            # (The log is not on the disk that fills.) SQLite may be refused first.
            fill_then_give_room(server, http, key, disk, "32m", {"store_error", "unavailable"})
        # The index says what the directories say: repair finds nothing to do.
        report = manage(root, url, "sweep", "--repair", "--grace", "0")
        assert "0 row(s) added, 0 corrected, 0 removed, 0 stale file(s) removed" in report, report
        assert "quarantined" not in report, report


def test_an_item_whose_socket_closed_while_its_result_met_a_read_only_root_is_queued_again(
    small_root, transactional_db, make_key
):
    # The worker sends its result and closes at once: the socket ends while the result is in
    # flight, and the result, refused by the read-only root, changed nothing. The item must
    # be re-queued once the root takes writes (to the other socket here), not left
    # ``processing`` until its lease ends (five minutes).
    key = make_key()
    with serving(small_root, key) as (server, http):
        assert http.put("/api/queues/q", json={"leaseSeconds": 300}).status_code == 201
        answer = http.post("/api/queues/q/items", json={"payload": "in flight"})
        assert answer.status_code == 201, answer.text
        item_id = answer.json()["id"]

        async def run() -> None:
            leaving = await connect(server, key)
            await subscribe(leaving, ["q"], 1)
            assert (await recv(leaving))["id"] == item_id
            remount(small_root, "ro")
            await send(leaving, {"type": "result", "id": item_id, "result": "ok"})
            await leaving.close()
            await asyncio.sleep(1)
            remount(small_root, "rw")
            ws = await connect(server, key)
            try:
                await subscribe(ws, ["q"], 1)
                frame = await recv(ws, 15)
                assert (frame["type"], frame["id"]) == ("item", item_id), frame
                await send(ws, {"type": "result", "id": item_id, "result": "ok"})
                ack = await recv(ws)
                assert (ack["type"], ack["accepted"]) == ("ack", True), ack
            finally:
                await ws.close()

        asyncio.run(run())
    assert_index_matches_directories(small_root)
