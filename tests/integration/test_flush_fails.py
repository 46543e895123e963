"""A flush that fails after its group committed: the disk beneath the state root refuses
the write-back itself (a thin pool or a network filesystem out of room, a failing disk),
not the ``write``: Linux marks the pages whose write failed as written, so the same file's
next flush succeeds and writes nothing, and an ext4 without a journal drops the inode's
changes too. A server that went on after such a flush answered a post sent again with its
key 200 from the row the failed group left, and the file behind it held zeros once the
filesystem was mounted again (what a power cut then leaves).

The disk is real: an ext4 without a journal, ``errors=continue`` (it stays writable, as a
thin pool's or a network filesystem's does), on a loop device whose image lives on a small
tmpfs; filling that tmpfs makes every new block the ext4 writes fail, emptying it gives
room again. After the server stops, the ext4 is unmounted and mounted again, which drops
the page cache: what is read then is what reached the disk.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from taskhoster.store import decode

from .consistency import assert_index_matches_directories
from .test_overload import small_filesystem, wait_for
from .test_processes import REDIS_URL, needs_shared
from .test_state_root_comes_back import fill, ready, serving
from .wsclient import connect, recv, send, subscribe

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("nothing_left_to_write_again")]

# Bigger than the few blocks the ext4 freed before the disk filled (a probe's file), which
# it would write into again without the disk refusing them.
BIG = "x" * 200_000


def mount_image(image: Path, root: Path) -> None:
    done = subprocess.run(
        ["mount", "-o", "loop,errors=continue", str(image), str(root)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a loop device here: {done.stderr.strip()}")


@contextlib.contextmanager
def disk_that_fails_its_writes(tmp_path: Path) -> Iterator[tuple[Path, Path, Path]]:
    """(the state root: an ext4 on a loop device; the tmpfs under its image; the image)."""
    with small_filesystem(tmp_path / "backing", "48m") as backing:
        image = backing / "disk.img"
        with open(image, "wb") as handle:  # sparse: its blocks take room as the ext4 writes them
            handle.truncate(128 << 20)
        subprocess.run(
            ["mkfs.ext4", "-q", "-F", "-O", "^has_journal", str(image)],
            check=True,
            capture_output=True,
        )
        root = tmp_path / "root"
        root.mkdir()
        mount_image(image, root)
        try:
            yield root, backing, image
        finally:
            subprocess.run(["umount", "-l", str(root)], check=False)


def logged(server: Any, text: str, what: str) -> None:
    """Wait (15 s at most) for ``text`` in the server's log."""
    wait_for(lambda: text in server.log.read_text(errors="replace"), 15, what)


def payload_on_disk(root: Path, image: Path, item_id: str) -> object:
    """The item's first line's payload as the disk holds it (the ext4 mounted again)."""
    os.sync()
    subprocess.run(["umount", str(root)], check=True)
    subprocess.run(["mount", "-o", "loop,errors=continue", str(image), str(root)], check=True)
    files = list(root.glob(f"q/*/{item_id}.json"))
    assert len(files) == 1, files
    data = files[0].read_bytes()
    if not data.strip(b"\0"):
        pytest.fail(f"{files[0].name}: {len(data)} bytes, all zero")
    return json.loads(data.splitlines()[0])["payload"]


def test_a_post_whose_flush_failed_is_acknowledged_only_once_its_file_is_on_disk(
    tmp_path, transactional_db, make_key
):
    with disk_that_fails_its_writes(tmp_path) as (root, backing, image):
        with serving(root, make_key(), TASKHOSTER_FLUSH="fsync") as (_server, http):
            assert http.put("/api/queues/q", json={}).status_code == 201
            first = http.post("/api/queues/q/items", json={"payload": "before"})
            assert first.status_code == 201, first.text

            filler = fill(backing)  # the disk refuses every new block from now on
            body = {"payload": {"kept": BIG}, "key": "k1"}
            refused = http.post("/api/queues/q/items", json=body)
            assert refused.status_code == 503, refused.text[:300]
            assert refused.json()["error"]["code"] == "store_error", refused.text
            assert refused.headers["Retry-After"]
            # While its file is not on disk, nothing is acknowledged: not the same post sent
            # again (its row stands), not another.
            again = http.post("/api/queues/q/items", json=body)
            assert again.status_code == 503, again.text[:300]
            other = http.post("/api/queues/q/items", json={"payload": "meanwhile"})
            assert other.status_code == 503, other.text
            assert "written again" in other.json()["error"]["message"], other.text
            # /healthz says so (its own probe, a small write never flushed, succeeds).
            wait_for(lambda: not ready(http), 15, "/healthz to say the process refuses changes")
            health = http.get("/healthz").json()["stateRoot"]
            assert health["unflushedItems"] == 1, health
            assert "a flush failed" in health["error"], health

            filler.unlink()  # room again
            answered: list[int] = []

            def acknowledged() -> bool:
                answer = http.post("/api/queues/q/items", json=body)
                answered.append(answer.status_code)
                return answer.status_code in (200, 201)

            wait_for(acknowledged, 15, "the post sent again to be acknowledged")
            assert answered[-1] == 200, answered  # the item the failed group left
            wait_for(lambda: ready(http), 15, "/healthz to say the process takes changes")
            kept = http.post("/api/queues/q/items", json=body).json()["id"]
            after = http.post("/api/queues/q/items", json={"payload": "after"})
            assert after.status_code == 201, after.text
        assert payload_on_disk(root, image, kept) == {"kept": BIG}
        assert payload_on_disk(root, image, first.json()["id"]) == "before"
        assert payload_on_disk(root, image, after.json()["id"]) == "after"
        assert_index_matches_directories(root)


def test_files_a_failed_flush_left_are_written_again_by_the_next_server_after_a_restart(
    tmp_path, transactional_db, make_key
):
    # The server whose flush failed stops before the disk has room again (a deploy, a
    # crash): what it waited to write again is in the database (the rows marked), so the
    # next server on the root writes the files again, unasked, and refuses the post sent
    # again until then (its own flushes have not failed: it serves the rest meanwhile).
    # Before, the next server knew nothing of them: it answered the post sent again 200,
    # and the disk's file held zeros.
    key = make_key()
    body = {"payload": {"restarted": BIG}, "key": "k3"}
    with disk_that_fails_its_writes(tmp_path) as (root, backing, image):
        with serving(root, key, TASKHOSTER_FLUSH="fsync") as (_server, http):
            assert http.put("/api/queues/q", json={}).status_code == 201
            filler = fill(backing)
            refused = http.post("/api/queues/q/items", json=body)
            assert refused.status_code == 503, refused.text[:300]
        with serving(root, key, TASKHOSTER_FLUSH="fsync") as (server, http):
            # Still no room: the next server takes them up at its start, and refuses them.
            logged(
                server, "are to be written again here", "the new server to take the marked rows up"
            )
            again = http.post("/api/queues/q/items", json=body)
            assert again.status_code == 503, again.text[:300]
            assert "written again" in again.json()["error"]["message"], again.text
            filler.unlink()
            logged(
                server,
                "written again and durable",
                "the new server to write the files again by itself",
            )
            answer = http.post("/api/queues/q/items", json=body)
            assert answer.status_code == 200, answer.text[:300]
            kept = answer.json()["id"]
        assert payload_on_disk(root, image, kept) == {"restarted": BIG}


@needs_shared
def test_another_process_refuses_an_item_whose_file_a_failed_flush_left(
    tmp_path, transactional_db, make_key
):
    # Two servers share the root (PostgreSQL + Redis). The first one's flush fails; the
    # post sent again to the second is refused too (its row is marked), and a worker of the
    # second is not handed the item, until a server has written the file again. Before, the
    # second answered the post sent again 200 from the row while the disk held zeros.
    key = make_key()
    body = {"payload": {"shared": BIG}, "key": "k4"}
    with disk_that_fails_its_writes(tmp_path) as (root, backing, image):
        with (
            serving(root, key, REDIS_URL=REDIS_URL, TASKHOSTER_FLUSH="fsync") as (_one, first),
            serving(root, key, REDIS_URL=REDIS_URL, TASKHOSTER_FLUSH="fsync") as (
                second_server,
                second,
            ),
        ):
            assert first.put("/api/queues/q", json={}).status_code == 201
            filler = fill(backing)
            refused = first.post("/api/queues/q/items", json=body)
            assert refused.status_code == 503, refused.text[:300]

            async def handed_out() -> list[Any]:
                ws = await connect(second_server, key)
                try:
                    await subscribe(ws, ["q"], 1)
                    with contextlib.suppress(TimeoutError):
                        return [await recv(ws, 2)]
                    return []
                finally:
                    await ws.close()

            # The second server's claim passes the item by (and takes it up to write it).
            assert asyncio.run(handed_out()) == []
            again = second.post("/api/queues/q/items", json=body)
            assert again.status_code == 503, again.text[:300]
            assert "written again" in again.json()["error"]["message"], again.text
            filler.unlink()
            answered: list[int] = []

            def acknowledged() -> bool:
                answer = second.post("/api/queues/q/items", json=body)
                answered.append(answer.status_code)
                return answer.status_code == 200

            wait_for(acknowledged, 15, "the post sent again to be acknowledged")
            kept = second.post("/api/queues/q/items", json=body).json()["id"]
        assert payload_on_disk(root, image, kept) == {"shared": BIG}


def test_files_a_failed_flush_left_are_written_again_with_nothing_else_asked(
    tmp_path, transactional_db, make_key
):
    # Once the disk has room, an idle server writes the files again by itself: a power cut
    # then finds them, though nobody posted anything since.
    with disk_that_fails_its_writes(tmp_path) as (root, backing, image):
        with serving(root, make_key(), TASKHOSTER_FLUSH="fsync") as (server, http):
            assert http.put("/api/queues/q", json={}).status_code == 201
            filler = fill(backing)
            body = {"payload": {"lone": BIG}, "key": "k2"}
            refused = http.post("/api/queues/q/items", json=body)
            assert refused.status_code == 503, refused.text[:300]
            filler.unlink()
            logged(
                server, "written again and durable", "the server to write the files again by itself"
            )
            # Its id read, not asked for by a change (which would write the file again too).
            listed = http.get("/api/queues/q/items").json()["items"]
            assert [i["key"] for i in listed] == ["k2"], [i["key"] for i in listed]
        assert payload_on_disk(root, image, listed[0]["id"]) == {"lone": BIG}


def test_a_result_whose_flush_failed_is_on_disk_before_anything_more_is_acknowledged(
    tmp_path, transactional_db, make_key
):
    # A worker's result appends to a file posted and acknowledged long before, and moves it
    # to done/. Its flush failing, the worker hears ``unavailable`` and sends it again;
    # nothing is answered until the file is written again, and then the disk holds the
    # result. (The answer to the result sent again is ``accepted: false``: the first one,
    # whose flush failed, committed and won.)
    key = make_key()
    with disk_that_fails_its_writes(tmp_path) as (root, backing, image):
        with serving(root, key, TASKHOSTER_FLUSH="fsync") as (server, http):
            assert http.put("/api/queues/q", json={"leaseSeconds": 300}).status_code == 201
            posted = http.post("/api/queues/q/items", json={"payload": "to finish"})
            assert posted.status_code == 201, posted.text
            item_id = posted.json()["id"]
            result = {"done": BIG}

            async def run() -> list[dict[str, Any]]:
                ws = await connect(server, key)
                try:
                    await subscribe(ws, ["q"], 1)
                    assert (await recv(ws))["id"] == item_id
                    filler = fill(backing)
                    await send(ws, {"type": "result", "id": item_id, "result": result})
                    refused = await recv(ws, 15)
                    assert (refused["type"], refused.get("code")) == ("error", "unavailable")
                    await send(ws, {"type": "result", "id": item_id, "result": result})
                    again = await recv(ws, 15)
                    assert (again["type"], again.get("code")) == ("error", "unavailable")
                    # A producer reads it meanwhile: refused too, its file not written again
                    # while the disk is full (what it would read, the result, is the cache's,
                    # which a power cut may take back).
                    read = await asyncio.to_thread(http.get, f"/api/items/{item_id}")
                    assert read.status_code == 503, read.text[:300]
                    assert read.json()["error"]["code"] == "store_error", read.text[:300]
                    filler.unlink()
                    answers = []
                    for _attempt in range(30):
                        await asyncio.sleep(0.5)
                        await send(ws, {"type": "result", "id": item_id, "result": result})
                        answers.append(await recv(ws, 15))
                        if answers[-1]["type"] == "ack":
                            return answers
                    return answers
                finally:
                    await ws.close()

            answers = asyncio.run(run())
            said = [
                line
                for line in server.log.read_text(errors="replace").splitlines()
                if "does not read as its row says" in line or "written again and" in line
            ]
            assert answers[-1]["type"] == "ack", (
                [(a["type"], a.get("code")) for a in answers],
                said[:4],
            )
            assert answers[-1]["accepted"] is False, answers[-1]
            item = http.get(f"/api/items/{item_id}").json()
            assert (item["status"], item["result"] == result) == ("finished", True), item["status"]
        files = list(root.glob(f"q/*/{item_id}.json"))
        assert [f.parent.name for f in files] == ["done"], files
        os.sync()
        subprocess.run(["umount", str(root)], check=True)
        subprocess.run(["mount", "-o", "loop,errors=continue", str(image), str(root)], check=True)
        files = list(root.glob(f"q/*/{item_id}.json"))
        assert [f.parent.name for f in files] == ["done"], files
        record, _end = decode(files[0].read_bytes(), name=files[0].name)
        assert (record["payload"], record.get("result") == result) == ("to finish", True)


def test_a_group_that_committed_while_the_flush_before_it_failed_is_not_acknowledged(
    tmp_path, transactional_db, make_key
):
    # Under load the committer commits the next group while a group's files are flushed
    # (on a thread of its own). Should that flush fail, the next group committed on top of
    # files that may never reach the disk: nothing of it is acknowledged either, even where
    # its own flush would succeed, until the files of both are written again. Here the
    # first post's group stalls between its commit and its flush (``post.slow_flush``, 5 s:
    # time enough for four more posts to come on a loaded machine), so their group commits
    # beside that flush, which the full disk refuses; then the disk has room again, before
    # their own flush would start (the second flush stalls: ``flush.slow@2``; with the rule,
    # that is the rewrite's). Before, those four were acknowledged (201).
    key = make_key()
    bodies = [{"payload": {"n": n, "big": BIG}, "key": f"o{n}"} for n in range(5)]
    with disk_that_fails_its_writes(tmp_path) as (root, backing, image):
        with serving(
            root,
            key,
            TASKHOSTER_FLUSH="fsync",
            TASKHOSTER_FAULT="post.slow_flush=1,flush.slow@2",
            TASKHOSTER_FAULT_SLOW_SECONDS="5",
        ) as (server, http):
            assert http.put("/api/queues/q", json={}).status_code == 201

            def post(body: dict[str, Any]) -> httpx.Response:
                with httpx.Client(
                    base_url=server.url, headers={"Authorization": f"Token {key}"}, timeout=60
                ) as client:
                    return client.post("/api/queues/q/items", json=body)

            filler = fill(backing)  # the disk refuses every new block from now on
            with ThreadPoolExecutor(len(bodies)) as pool:
                first = pool.submit(post, bodies[0])
                # Its group has written its file: the others cannot join that group.
                wait_for(lambda: any(root.glob("q/pending/*.json")), 15, "the first group")
                rest = [pool.submit(post, body) for body in bodies[1:]]
                logged(server, "could not flush a group's files", "the first flush to fail")
                filler.unlink()  # room again
                answers = [first.result(), *(answer.result() for answer in rest)]
            assert [a.status_code for a in answers] == [503] * len(bodies), [
                (a.status_code, a.text[:200]) for a in answers
            ]
            logged(server, "written again and durable", "the files to be written again")
            kept = []
            for body in bodies:
                answer = http.post("/api/queues/q/items", json=body)
                assert answer.status_code == 200, answer.text[:300]  # the item its group left
                kept.append(answer.json()["id"])
        for body, item_id in zip(bodies, kept, strict=True):
            assert payload_on_disk(root, image, item_id) == body["payload"]
        assert_index_matches_directories(root)
