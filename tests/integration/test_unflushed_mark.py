"""An item whose row is marked ``unflushed`` (its file left by a flush that failed after its
group committed, in this process or another, perhaps one gone since) is neither changed nor
acknowledged by any process until its file is written again: a post sent again with its key,
a worker's result and a claim all pass it by, and the process that meets it writes the file
again (a new file, renamed over) and clears the mark.

Here the mark is what another process's failed flush leaves in the database, set on the row;
the disk itself is sound, so the file is written again at once. The failing disk itself, and
two server processes, are ``test_flush_fails.py``'s.
"""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.db import transaction
from rest_framework.test import APIClient

from taskhoster import engine, local
from taskhoster.conf import get_conf
from taskhoster.engine import runner
from taskhoster.engine.common import store
from taskhoster.errors import NotYetDurable
from taskhoster.models import Item
from taskhoster.store import FileBatch

from .wsclient import connect, recv, subscribe

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("nothing_left_to_write_again"),
]


def _file(item_id: str) -> Path:
    found = list(get_conf().root.glob(f"q/*/{item_id}.json"))
    assert len(found) == 1, found
    return found[0]


def _mark(item_id: str) -> int:
    """Mark the row as a failed flush in another process does; the file's inode now."""
    Item.objects.filter(id=item_id).update(unflushed=True)
    return _file(item_id).stat().st_ino


def _zeros(item_id: str) -> None:
    """Its file as the disk's zeros (what a read finds once the cache let its pages go)."""
    path = _file(item_id)
    path.write_bytes(b"\0" * path.stat().st_size)


def _served_item(
    server_factory: Any, make_queue: Any, monkeypatch: pytest.MonkeyPatch, **env: str
) -> tuple[Any, str]:
    """A server started with ``env`` and an item of its queue ``q`` (not yet marked).

    This process's own committer looks at marked rows every 30 s: not during the test, so
    that the server is the one that takes them up."""
    monkeypatch.setattr(runner, "ADOPT_EVERY_SECONDS", 3600.0)
    make_queue("q")
    server = server_factory(**env)
    return server, engine.post_items(queue_name="q", items=[engine.NewItem(payload=1)])[0].row.id


def _posted(api: APIClient, **body: Any) -> str:
    """A new item's id (its payload 1 unless given)."""
    answer = api.post("/api/queues/q/items", {"payload": 1, **body}, format="json")
    assert answer.status_code == 201, answer.content[:300]
    return str(answer.json()["id"])


def _until(answer: Any, status: int, what: str, done: Any = lambda _got: True) -> Any:
    """Ask ``answer`` again (10 s at most) until it gives ``status`` and ``done`` of it."""
    deadline = time.monotonic() + 10
    while True:
        got = answer()
        if (got.status_code == status and done(got)) or time.monotonic() > deadline:
            assert got.status_code == status, (what, got.status_code, got.content[:300])
            return got
        time.sleep(0.1)


def _refused_as_not_durable(response: Any) -> None:
    assert response.status_code == 503, response.content[:300]
    error = response.json()["error"]
    assert error["code"] == "store_error", error
    assert "written again" in error["message"], error
    assert response["Retry-After"]


def _written_again(item_id: str, inode: int) -> None:
    assert Item.objects.get(id=item_id).unflushed is False
    assert _file(item_id).stat().st_ino != inode  # a new file took the name


def test_a_post_sent_again_whose_item_is_marked_unflushed_is_refused_until_written_again(
    api: APIClient, make_queue: Any
) -> None:
    make_queue("q")
    body = {"payload": {"keep": "me"}, "key": "k"}
    first = api.post("/api/queues/q/items", body, format="json")
    assert first.status_code == 201, first.content
    item_id = first.json()["id"]
    inode = _mark(item_id)
    _refused_as_not_durable(api.post("/api/queues/q/items", body, format="json"))
    again = _until(
        lambda: api.post("/api/queues/q/items", body, format="json"), 200, "acknowledged"
    )
    assert again.json()["id"] == item_id
    assert again.json()["payload"] == {"keep": "me"}
    _written_again(item_id, inode)


def test_a_result_for_an_item_marked_unflushed_is_refused_until_written_again(
    api: APIClient, make_queue: Any
) -> None:
    make_queue("q")
    item_id = _posted(api)
    claimed = api.post("/api/queues/q/claim", {}, format="json").json()["items"]
    assert [i["id"] for i in claimed] == [item_id]
    inode = _mark(item_id)
    result = {"result": "done"}
    _refused_as_not_durable(api.post(f"/api/items/{item_id}/result", result, format="json"))
    assert Item.objects.get(id=item_id).status == "processing"  # nothing changed
    accepted = _until(
        lambda: api.post(f"/api/items/{item_id}/result", result, format="json"), 200, "taken"
    )
    assert accepted.json()["accepted"] is True
    _written_again(item_id, inode)
    assert api.get(f"/api/items/{item_id}").json()["result"] == "done"


def test_a_claim_passes_an_item_marked_unflushed_by_until_written_again(
    api: APIClient, make_queue: Any
) -> None:
    make_queue("q")
    item_id = _posted(api)
    inode = _mark(item_id)
    first = api.post("/api/queues/q/claim", {}, format="json")
    assert first.status_code == 200, first.content[:300]
    assert first.json()["items"] == []
    claimed = _until(
        lambda: api.post("/api/queues/q/claim", {}, format="json"),
        200,
        "a claim that takes it",
        lambda got: got.json()["items"],
    )
    assert [i["id"] for i in claimed.json()["items"]] == [item_id]
    _written_again(item_id, inode)


@pytest.mark.parametrize("found", ["zeros", "an older copy"])
def test_a_marked_file_that_does_not_read_as_its_row_says_is_left_for_repair_and_the_rest_goes_on(
    api: APIClient, make_queue: Any, found: str
) -> None:
    # What the disk holds once the cache has let the file's pages go: zeros, or a whole
    # copy from before the failed change. Neither is written again (that would make the
    # wrong bytes durable and clear the mark); the item stays refused, for repair. This
    # process's own flushes never failed, so everything else goes on meanwhile.
    make_queue("q")
    item_id = _posted(api)
    claimed = api.post("/api/queues/q/claim", {}, format="json").json()["items"]
    assert [i["id"] for i in claimed] == [item_id]
    before = _file(item_id).read_bytes()
    finished = api.post(f"/api/items/{item_id}/result", {"result": "r"}, format="json")
    assert finished.json()["accepted"] is True
    path = _file(item_id)
    path.write_bytes(b"\0" * path.stat().st_size if found == "zeros" else before)
    inode = _mark(item_id)
    _refused_as_not_durable(api.post(f"/api/items/{item_id}/restart", {}, format="json"))
    deadline = time.monotonic() + 2.5  # past two tries to write it again
    while time.monotonic() < deadline:
        other = api.post("/api/queues/q/items", {"payload": 2}, format="json")
        assert other.status_code == 201, other.content[:300]
        time.sleep(0.2)
    assert api.get("/healthz").status_code == 200
    _refused_as_not_durable(api.delete(f"/api/items/{item_id}"))
    assert Item.objects.get(id=item_id).unflushed is True
    assert _file(item_id).stat().st_ino == inode


def test_a_marked_item_whose_file_this_process_does_not_find_stays_marked_and_kept(
    api: APIClient, make_queue: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Taken up from another process, a marked item whose file is not found here (a root
    # this process sees otherwise, a network filesystem's stale lookup: here, the file
    # moved out of the root a while) is not taken for gone: its mark stays, the item is
    # refused and passed by, and its row is kept, until a process finds the file and writes
    # it again. Before, the mark was cleared (CI: a process on another root did so while two
    # servers on the real one waited), and the next claim, meeting no file, dropped the row.
    make_queue("q")
    item_id = _posted(api, payload={"kept": True})
    inode = _mark(item_id)
    path = _file(item_id)
    away = tmp_path / "away.json"
    path.rename(away)
    first = api.post("/api/queues/q/claim", {}, format="json")
    assert first.status_code == 200, first.content[:300]
    assert first.json()["items"] == []  # passed by, and taken up
    deadline = time.monotonic() + 10
    while not (item_id in caplog.text and "failed flush left" in caplog.text):
        assert time.monotonic() < deadline, "no try to write the file again"
        time.sleep(0.05)
    assert Item.objects.get(id=item_id).unflushed is True
    again = api.post("/api/queues/q/claim", {}, format="json")
    assert again.status_code == 200, again.content[:300]
    assert again.json()["items"] == []
    assert Item.objects.filter(id=item_id, unflushed=True).exists()
    away.rename(path)
    claimed = _until(
        lambda: api.post("/api/queues/q/claim", {}, format="json"),
        200,
        "a claim that takes it once its file is found",
        lambda got: got.json()["items"],
    )
    assert [i["id"] for i in claimed.json()["items"]] == [item_id]
    assert claimed.json()["items"][0]["payload"] == {"kept": True}
    _written_again(item_id, inode)


def test_marked_rows_that_cannot_be_written_again_never_hide_those_behind_them(
    api: APIClient, make_queue: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A committer's look takes up at most ADOPT_MOST marked rows (here 2). Two whose files
    # read as zeros are set aside, still marked; the next look goes on past them and finds
    # the third, which nothing else touches, and writes it again. Before, every look took
    # the same first page, and the third waited for ever.
    monkeypatch.setattr(runner, "ADOPT_MOST", 2)
    monkeypatch.setattr(runner, "_adopted_up_to", "")
    make_queue("q")
    ids = [_posted(api) for _ in range(3)]
    assert ids == sorted(ids)
    for item_id in ids[:2]:
        _zeros(item_id)
    inodes = [_mark(item_id) for item_id in ids]
    deadline = time.monotonic() + 10
    while Item.objects.get(id=ids[2]).unflushed:
        assert time.monotonic() < deadline, "the third marked row was never written again"
        runner.adopt_unflushed()  # a look, as every 30 s
        time.sleep(0.3)
    _written_again(ids[2], inodes[2])
    assert list(Item.objects.filter(id__in=ids[:2]).values_list("unflushed", flat=True)) == [
        True,
        True,
    ]


def test_a_waiting_worker_is_handed_a_marked_item_once_its_file_is_written_again(
    server_factory: Any, make_key: Any, make_queue: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A server's worker subscribes; its claim passes the marked item by and takes it up.
    # The rewrite's news wakes the worker's claim: the item comes within seconds, not at the
    # sockets' backstop (a minute here).
    server, item_id = _served_item(
        server_factory, make_queue, monkeypatch, TASKHOSTER_SOCKET_BACKSTOP_SECONDS="60"
    )
    key = make_key("work")
    inode = _mark(item_id)

    async def handed() -> tuple[dict[str, Any], float, int]:
        ws = await connect(server, key)
        try:
            await subscribe(ws, ["q"], 1)
            started = time.monotonic()
            frame = await recv(ws, 20)
            waited = time.monotonic() - started
            # Its file while the worker holds it (once the socket closes, it is moved back).
            return frame, waited, _file(item_id).stat().st_ino
        finally:
            await ws.close()

    frame, waited, held_inode = asyncio.run(handed())
    assert frame["type"] == "item", frame
    assert frame["id"] == item_id, frame
    assert waited < 10, waited
    assert held_inode != inode  # a new file took the name
    assert Item.objects.get(id=item_id).unflushed is False


def test_a_marked_item_left_for_repair_does_not_keep_waiting_workers_claiming(
    server_factory: Any, make_key: Any, make_queue: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A marked item whose file reads as zeros stays marked (for repair) as long as it
    # takes. It is not claimable meanwhile, so a waiting worker's claim does not look again
    # and again: it waits for news. Before, the dispatcher saw a due item its claim had
    # passed by and looked again every 50 ms: some 20 group commits a second, for ever, on
    # every process with a worker of the queue.
    server, item_id, key = _served_item_left_for_repair(
        server_factory, make_queue, make_key, monkeypatch, TASKHOSTER_SOCKET_BACKSTOP_SECONDS="60"
    )

    async def waiting() -> tuple[float, float]:
        ws = await connect(server, key)
        try:
            await subscribe(ws, ["q"], 1)
            await asyncio.sleep(1.5)  # its first claim, and the try to write the file again
            before = await asyncio.to_thread(_group_commits, server, key)
            await asyncio.sleep(3)
            return before, await asyncio.to_thread(_group_commits, server, key)
        finally:
            await ws.close()

    before, after = asyncio.run(waiting())
    assert after - before <= 6, (before, after)
    assert Item.objects.get(id=item_id).unflushed is True


def test_a_marked_item_left_for_repair_does_not_keep_a_long_poll_claiming(
    server_factory: Any, make_key: Any, make_queue: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The long-poll's share of the rule above: a claim that waits asks when the queue's
    # next item comes due, and a marked one is not due. Before, it was, in the past: the
    # long-poll claimed again every 10 ms (some 300 group commits in 3 s).
    server, item_id, key = _served_item_left_for_repair(
        server_factory, make_queue, make_key, monkeypatch, TASKHOSTER_LONG_POLL_INTERVAL="60"
    )
    headers = {"Authorization": f"Token {key}"}
    # Its first claim takes the item up and finds its file zeros: set aside from then on.
    first = httpx.post(f"{server.url}/api/queues/q/claim", json={}, headers=headers, timeout=10)
    assert first.status_code == 200, first.text[:300]
    assert first.json()["items"] == []
    before = _group_commits(server, key)
    started = time.monotonic()
    waited = httpx.post(
        f"{server.url}/api/queues/q/claim", json={"wait": 3}, headers=headers, timeout=20
    )
    took = time.monotonic() - started
    after = _group_commits(server, key)
    assert waited.status_code == 200, waited.text[:300]
    assert waited.json()["items"] == []
    assert took >= 2.9, took  # it waited (the rule under test is what it did meanwhile)
    assert after - before <= 6, (before, after)
    assert Item.objects.get(id=item_id).unflushed is True


def _served_item_left_for_repair(
    server_factory: Any, make_queue: Any, make_key: Any, monkeypatch: pytest.MonkeyPatch, **env: str
) -> tuple[Any, str, str]:
    """``_served_item`` with its file made zeros and its row marked (it stays marked, for
    repair, once met), and a key."""
    server, item_id = _served_item(server_factory, make_queue, monkeypatch, **env)
    _zeros(item_id)
    _mark(item_id)
    return server, item_id, make_key()


def _group_commits(server: Any, key: str) -> float:
    answer = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Token {key}"})
    found = re.search(r"^taskhoster_group_commits_total (\S+)$", answer.text, re.M)
    assert found, answer.text[:300]
    return float(found.group(1))


def test_a_mark_is_cleared_only_once_the_file_written_again_is_durable(
    server_factory: Any, make_key: Any, make_queue: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A server takes a marked item up and writes its file again; its flush is held for
    # 5 s (``rewrite.slow_flush``: a disk that stalls, or fails, there). The row stays
    # marked until that flush is done, so no claim anywhere hands the item out before its
    # file is durable. Before, the mark was cleared at the rewrite's commit, before its
    # flush: a claim in that window took the item, even if the flush then failed.
    server, item_id = _served_item(
        server_factory,
        make_queue,
        monkeypatch,
        TASKHOSTER_FAULT="rewrite.slow_flush",
        TASKHOSTER_FAULT_SLOW_SECONDS="5",
    )
    key = make_key()
    inode = _mark(item_id)
    claim = httpx.post(
        f"{server.url}/api/queues/q/claim", json={}, headers={"Authorization": f"Token {key}"}
    )
    assert claim.status_code == 200, claim.text[:300]
    assert claim.json()["items"] == []  # passed by, and taken up (or at the server's start)
    # The file is replaced within the rewrite's group, just before its commit; its flush
    # waits 5 s after that: the mark must stand for (the first 2 s of) that wait.
    deadline = time.monotonic() + 10
    while _file(item_id).stat().st_ino == inode:
        assert time.monotonic() < deadline, "not written again"
        time.sleep(0.01)
    watched = time.monotonic()
    while time.monotonic() - watched < 2:
        assert Item.objects.get(id=item_id).unflushed is True, "cleared before its flush"
        time.sleep(0.02)
    deadline = time.monotonic() + 10
    while Item.objects.get(id=item_id).unflushed:
        assert time.monotonic() < deadline, "never cleared"
        time.sleep(0.05)
    _written_again(item_id, inode)


def test_a_marked_item_of_a_queue_the_key_may_not_use_is_answered_as_a_missing_one(
    api: APIClient, make_queue: Any, make_key: Any
) -> None:
    # A key limited to other queues hears what it hears for an item that does not exist:
    # a 503 would tell it the item exists (and is waiting for its file).
    make_queue("q")
    make_queue("other")
    item_id = _posted(api)
    assert api.post("/api/queues/q/claim", {}, format="json").json()["items"]
    _mark(item_id)
    limited = APIClient()
    limited.credentials(HTTP_AUTHORIZATION=f"Token {make_key(queues=['other'])}")
    answer = limited.post(f"/api/items/{item_id}/result", {"result": "x"}, format="json")
    missing = limited.post("/api/items/0661f0000000000000ff/result", {"result": "x"}, format="json")
    assert (answer.status_code, answer.json()) == (missing.status_code, missing.json())
    assert answer.status_code != 503


def test_a_marked_item_asked_for_by_name_is_refused_and_among_many_passed_by(
    api: APIClient, make_queue: Any
) -> None:
    # A delete of many answers how many went, and a marked one is not among them (nor is
    # it gone); a delete of that one item answers for it (503: try again). (Its file reads
    # as zeros, so that it stays marked: a sound one would be written again meanwhile.)
    make_queue("q")
    ids = [_posted(api, payload=n) for n in (1, 2)]
    _zeros(ids[0])
    _mark(ids[0])
    bulk = api.post("/api/queues/q/items/delete", {"ids": ids}, format="json")
    assert bulk.status_code == 200, bulk.content[:300]
    assert bulk.json() == {"deleted": 1}
    assert list(Item.objects.filter(id__in=ids).values_list("id", flat=True)) == [ids[0]]
    time.sleep(1.2)  # (a try to write it again passes)
    _refused_as_not_durable(api.delete(f"/api/items/{ids[0]}"))


def test_every_refusal_of_a_marked_item_is_a_503_its_operation_documents(
    api: APIClient, make_queue: Any
) -> None:
    # Each operation on an item left marked (its file zeros: set aside for repair) is
    # refused with 503 ``store_error``, and /api/schema names that code among the 503s of
    # that operation (it named ``unavailable`` alone before: a generated client had no
    # word for the rest).
    schema = api.get("/api/schema", HTTP_ACCEPT="application/json").json()
    listed = {
        op["operationId"]: op["responses"]["503"]["description"].split("`error.code`: ")[1]
        for path in schema["paths"].values()
        for op in path.values()
        if "`error.code`" in op["responses"].get("503", {}).get("description", "")
    }
    make_queue("q")
    item_id = _posted(api, key="k")
    lease = api.post("/api/queues/q/claim", {}, format="json").json()["items"][0]["lease"]
    _zeros(item_id)
    _mark(item_id)
    asked = {
        "postItems": ("post", "/api/queues/q/items", {"payload": 1, "key": "k"}),
        "submitResult": ("post", f"/api/items/{item_id}/result", {"result": 1}),
        "failItem": ("post", f"/api/items/{item_id}/fail", {"lease": lease}),
        "extendLease": ("post", f"/api/items/{item_id}/extend", {"lease": lease}),
        "reportProgress": (
            "post",
            f"/api/items/{item_id}/progress",
            {"lease": lease, "progress": 1},
        ),
        "cancelItem": ("post", f"/api/items/{item_id}/cancel", {}),
        "deleteItem": ("delete", f"/api/items/{item_id}", None),
        "getItem": ("get", f"/api/items/{item_id}", None),
        "getAttempts": ("get", f"/api/items/{item_id}/attempts", None),
    }
    for op_id, (method, path, body) in asked.items():
        answer = getattr(api, method)(path, body, format="json")
        assert answer.status_code == 503, (op_id, answer.content[:300])
        code = answer.json()["error"]["code"]
        assert code in listed[op_id].rstrip(".").split(", "), (op_id, code, listed[op_id])
    assert Item.objects.get(id=item_id).status == "processing"  # nothing changed


def _finished(api: APIClient) -> str:
    """An item posted, claimed and finished with the result "done"."""
    item_id = _posted(api)
    assert [i["id"] for i in api.post("/api/queues/q/claim", {}, format="json").json()["items"]]
    taken = api.post(f"/api/items/{item_id}/result", {"result": "done"}, format="json")
    assert taken.json()["accepted"] is True, taken.content[:300]
    return item_id


@pytest.mark.parametrize("read", ["item", "attempts"])
def test_a_producers_read_of_a_marked_item_writes_its_file_again_before_it_answers(
    api: APIClient, make_queue: Any, read: str
) -> None:
    # What the producer would read (a result, an attempt's story) is the cache's until the
    # file is durable: a power cut may take it back after the producer acted on it. So the
    # file is written again, and durable, before the answer. Before, the read answered
    # from the cache and left the mark standing.
    make_queue("q")
    item_id = _finished(api)
    inode = _mark(item_id)
    path = f"/api/items/{item_id}" + ("/attempts" if read == "attempts" else "")
    answer = api.get(path)
    assert answer.status_code == 200, answer.content[:300]
    _written_again(item_id, inode)  # already: not by a later look
    if read == "item":
        assert answer.json()["result"] == "done"


@pytest.mark.parametrize("read", ["item", "attempts"])
@pytest.mark.parametrize("found", ["zeros", "an older copy"])
def test_a_producers_read_of_a_marked_item_that_cannot_be_written_again_is_refused(
    api: APIClient, make_queue: Any, read: str, found: str
) -> None:
    # Its file reads as zeros, or as the copy from before its result (left for repair):
    # the read is refused, 503 ``store_error``, nothing shown from the cache nor from the
    # file. Before, the older copy was shown: the item unfinished, no result.
    make_queue("q")
    item_id = _posted(api)
    assert [i["id"] for i in api.post("/api/queues/q/claim", {}, format="json").json()["items"]]
    before = _file(item_id).read_bytes()
    taken = api.post(f"/api/items/{item_id}/result", {"result": "done"}, format="json")
    assert taken.json()["accepted"] is True, taken.content[:300]
    if found == "zeros":
        _zeros(item_id)
    else:
        _file(item_id).write_bytes(before)
    _mark(item_id)
    path = f"/api/items/{item_id}" + ("/attempts" if read == "attempts" else "")
    _refused_as_not_durable(api.get(path))
    assert Item.objects.get(id=item_id).unflushed is True


def test_a_producers_read_over_a_server_writes_the_marked_file_again_before_it_answers(
    server_factory: Any, make_key: Any, make_queue: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # In a server the read runs outside the committer process (by default): the file is
    # written again there, not where the read runs (where nothing would write it).
    server, item_id = _served_item(server_factory, make_queue, monkeypatch)
    inode = _mark(item_id)
    headers = {"Authorization": f"Token {make_key('produce')}"}
    answer = httpx.get(f"{server.url}/api/items/{item_id}", headers=headers, timeout=10)
    assert answer.status_code == 200, answer.text[:300]
    assert answer.json()["payload"] == 1
    _written_again(item_id, inode)


def test_a_producers_read_inside_a_transaction_is_refused_and_writes_nothing(
    make_queue: Any, api: APIClient
) -> None:
    # Inside a caller's own transaction (an embedding's) the rewrite would run there: its
    # clearing of the mark and its locks the caller's, its wake-up of the claims before
    # the caller commits. Refused instead, the file left as it is; outside one, answered.
    make_queue("q")
    item_id = _finished(api)
    inode = _mark(item_id)
    with pytest.raises(NotYetDurable), transaction.atomic():
        local.get(item_id)
    assert Item.objects.get(id=item_id).unflushed is True
    assert _file(item_id).stat().st_ino == inode
    assert local.get(item_id)["result"] == "done"
    _written_again(item_id, inode)


def test_reads_of_a_marked_item_in_a_flood_write_its_file_once(
    make_queue: Any, api: APIClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each read hands a rewrite to the committer; one that this committer already writes
    # again at its pace, or has set aside (here: its file reads as zeros), is left to that.
    # Before, every read tried the file again (twenty reads, twenty tries).
    make_queue("q")
    item_id = _finished(api)
    _zeros(item_id)
    _mark(item_id)
    tries: list[str] = []
    real = FileBatch.rewrite

    def counted(self: FileBatch, queue: str, item: str, *args: Any) -> Any:
        tries.append(item)
        return real(self, queue, item, *args)

    monkeypatch.setattr(FileBatch, "rewrite", counted)
    monkeypatch.setattr(runner, "ADOPT_EVERY_SECONDS", 3600.0)  # (a look would try it again)
    for _ in range(20):
        _refused_as_not_durable(api.get(f"/api/items/{item_id}"))
    assert tries == [item_id], len(tries)


def test_reads_in_a_flood_do_not_keep_a_process_from_writing_its_own_files_again(
    make_queue: Any, api: APIClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An item whose file this process's own flush failed to make durable: a read leaves it
    # to the committer's pace (once a second). The reads pass the gate and keep the
    # committer busy; before, it tried its own files only at the gate (to which nothing
    # else came) and when idle (never, under the reads), and every read was refused for
    # as long as they came.
    monkeypatch.setattr(runner, "ADOPT_EVERY_SECONDS", 3600.0)
    make_queue("q")
    item_id = _finished(api)
    inode = _mark(item_id)
    store().add_unflushed([item_id])  # as this process's own failed flush leaves it
    deadline = time.monotonic() + 6
    while (answer := api.get(f"/api/items/{item_id}")).status_code != 200:
        assert time.monotonic() < deadline, answer.content[:300]
        time.sleep(0.05)
    assert answer.json()["result"] == "done"
    _written_again(item_id, inode)
