"""A connection lost during a group's ``COMMIT``: the server learns whether it committed.

The server reaches PostgreSQL through a TCP proxy the test controls. The proxy cuts the
committing connection at the ``COMMIT`` of the operation under test: after the server received
it (the transaction committed; its answer is lost) or before (it was rolled back). Either
way the operation takes effect once, is answered as it took effect, and its file is where its
row says: nothing is done twice (a post's retry meeting its own committed row, a claim taking
a second item), and no committed change loses its file's move. A server's session left open
by a network that dropped the COMMIT is ended, which settles it; and when the database cannot
be asked at all, nothing is acknowledged and the files are left as written (as a crash
before the commit leaves them) until the database answers: put back then if it rolled back.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import psycopg
import pytest
from django.db import DatabaseError

from taskhoster import engine
from taskhoster.engine.common import store
from taskhoster.engine.group import LOST_SESSION_SECONDS, OUTCOME_WAIT_SECONDS
from taskhoster.engine.repair import repair
from taskhoster.models import Item
from taskhoster.status import State, Status

from ..conftest import REPO, Server, needs_postgresql, server_env
from . import ownpostgres
from .ownpostgres import OwnPostgres
from .tcpproxy import TcpProxy
from .test_database_restart import env_through, proxy_to_database, server_says
from .wsclient import connect, recv, send, subscribe

pytestmark = [
    pytest.mark.slow,
    needs_postgresql("a connection to lose: PostgreSQL"),
]

# What marks the connection to cut: a post's insert (the first one of a server, which
# psycopg sends as text: later ones go by a prepared statement's name), or an item's id
# (in the values of every statement that reads or changes its row).
INSERT = b"INSERT INTO taskhoster_item "
# Transactions a test runs on a crashed server started again, to give again the ids the
# crash lost (the server's own since the crash take some too).
REUSED = 100


@pytest.fixture
def serving(transactional_db, state_root, make_key) -> Iterator[tuple[TcpProxy, Server, str]]:
    """A server reaching the database through a proxy, a queue ``q``, and a key."""
    proxy = proxy_to_database()
    engine.upsert_queue(name="q", body={"leaseSeconds": 300})
    server = Server(state_root, **env_through(proxy)).start()
    try:
        yield proxy, server, make_key()
        assert_committer_kept(server)
    finally:
        server.stop()
        proxy.close()


def assert_committer_kept(server: Server) -> None:
    """The server's committer process never stopped: every operation it was handed was
    answered by it (a stop answers those in flight ``store_error``, and the test may not
    notice)."""
    log = server.log.read_text(errors="replace")
    for sign in ("the committer process stopped", "the committer process sent something"):
        assert sign not in log, [line for line in log.splitlines() if sign in line]


@pytest.fixture
def served(serving_logged) -> tuple[TcpProxy, httpx.Client]:
    proxy, _server, http = serving_logged
    return proxy, http


@pytest.fixture
def serving_logged(serving) -> Iterator[tuple[TcpProxy, Server, httpx.Client]]:
    """``served``, and the server (its log)."""
    proxy, server, key = serving
    headers = {"Authorization": f"Token {key}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=30) as http:
        yield proxy, server, http


def _state_of_file(item_id: str) -> State | None:
    return store().locate("q", item_id, State.PENDING)


def _post(http: httpx.Client, payload: object) -> str:
    answer = http.post("/api/queues/q/items", json={"payload": payload})
    assert answer.status_code == 201, answer.text
    return str(answer.json()["id"])


def _claim(http: httpx.Client) -> list[str]:
    answer = http.post("/api/queues/q/claim", json={"max": 1})
    assert answer.status_code == 200, answer.text
    return [str(item["id"]) for item in answer.json()["items"]]


@pytest.mark.parametrize("reaches_server", [True, False], ids=["answer-lost", "commit-lost"])
def test_a_post_whose_commit_is_cut_is_made_once_with_its_file(served, reaches_server):
    proxy, http = served
    proxy.cut_at_commit(INSERT, reaches_server=reaches_server)
    item_id = _post(http, "cut")
    assert proxy.commits_cut == 1, "the proxy cut the post's COMMIT"
    rows = list(Item.objects.values_list("id", "status"))
    assert rows == [(item_id, Status.PENDING)], "one item, the one answered"
    assert _state_of_file(item_id) is State.PENDING


@pytest.mark.parametrize("reaches_server", [True, False], ids=["answer-lost", "commit-lost"])
def test_a_claim_whose_commit_is_cut_takes_one_item_with_its_file(served, reaches_server):
    proxy, http = served
    first, second = _post(http, 1), _post(http, 2)
    proxy.cut_at_commit(first.encode(), reaches_server=reaches_server)
    claimed = _claim(http)
    assert proxy.commits_cut == 1, "the proxy cut the claim's COMMIT"
    assert claimed == [first], "the claim took the first item, and only it"
    statuses = dict(Item.objects.values_list("id", "status"))
    assert statuses == {first: Status.PROCESSING, second: Status.PENDING}
    assert _state_of_file(first) is State.PROCESSING
    assert _state_of_file(second) is State.PENDING


@pytest.mark.parametrize("reaches_server", [True, False], ids=["answer-lost", "commit-lost"])
def test_a_result_whose_commit_is_cut_is_accepted_once_with_its_file_done(served, reaches_server):
    proxy, http = served
    item_id = _post(http, 1)
    assert _claim(http) == [item_id]
    proxy.cut_at_commit(item_id.encode(), reaches_server=reaches_server)
    answer = http.post(f"/api/items/{item_id}/result", json={"result": "ok"})
    assert proxy.commits_cut == 1, "the proxy cut the result's COMMIT"
    assert answer.status_code == 200, answer.text
    assert answer.json()["accepted"] is True, answer.json()
    assert Item.objects.get(id=item_id).status == Status.FINISHED
    assert _state_of_file(item_id) is State.DONE


def test_a_commit_a_network_dropped_ends_the_waiting_session_and_posts_once(served):
    """The COMMIT never reaches the server, whose session waits in its transaction (holding
    its locks) for a client it does not know is gone: the group ends that session, learns
    that it was rolled back, and runs again."""
    proxy, http = served
    proxy.cut_at_commit(INSERT, reaches_server=False, holds_server=True)
    began = time.monotonic()
    item_id = _post(http, "held")
    took = time.monotonic() - began
    assert proxy.commits_cut == 1, "the proxy cut the post's COMMIT"
    assert took >= LOST_SESSION_SECONDS, "the group waited for the session, then ended it"
    assert list(Item.objects.values_list("id", "status")) == [(item_id, Status.PENDING)]
    assert _state_of_file(item_id) is State.PENDING


def test_a_commit_whose_outcome_cannot_be_learned_acknowledges_nothing(served):
    """The COMMIT reached the server (it committed) and the database is away from then on:
    after ``OUTCOME_WAIT_SECONDS`` the post is answered 503 ``store_error``, and its file is
    left as written (here, where its committed row says: nothing for repair to do). The
    same post sent again with a key finds it, as after any answer lost."""
    proxy, http = served
    proxy.cut_at_commit(INSERT, reaches_server=True, then_refuse=True)
    began = time.monotonic()
    body = {"payload": "unknown", "key": "k1"}
    answer = http.post("/api/queues/q/items", json=body)
    took = time.monotonic() - began
    assert proxy.commits_cut == 1, "the proxy cut the post's COMMIT"
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["code"] == "store_error", answer.text
    assert answer.headers["retry-after"] == "1"
    assert OUTCOME_WAIT_SECONDS <= took < OUTCOME_WAIT_SECONDS + 3, took
    rows = dict(Item.objects.values_list("id", "status"))
    assert list(rows.values()) == [Status.PENDING], "the post committed, unheard"
    (item_id,) = rows
    assert _state_of_file(item_id) is State.PENDING, "its file left as written"
    proxy.refuse = False
    report = repair(grace_seconds=0)
    assert (report.rows_removed, report.rows_added, report.rows_corrected) == (0, 0, 0)
    deadline = time.monotonic() + 10
    while (again := http.post("/api/queues/q/items", json=body)).status_code == 503:
        assert time.monotonic() < deadline, again.text
        time.sleep(0.2)
    assert again.status_code == 200, again.text
    assert again.json()["id"] == item_id, "the key finds the post that committed"


def test_a_post_whose_outcome_was_unknown_and_did_commit_reaches_a_waiting_worker_once_settled(
    transactional_db, state_root, make_key
):
    """A post whose ``COMMIT`` reached the server, the database away from then on: its
    producer hears 503 ``store_error``, and no news of it went out. Once the database
    answers, the give-back thread learns that it committed, flushes its files and announces
    it as its commit would have: a worker waiting on the queue gets it then, not at the next
    backstop (here two minutes away: before, it waited for that)."""
    proxy = proxy_to_database()
    engine.upsert_queue(name="q", body={"leaseSeconds": 300})
    server = Server(
        state_root, **env_through(proxy, TASKHOSTER_SOCKET_BACKSTOP_SECONDS="120")
    ).start()
    # A key this server has not seen: its post is answered in a thread, with no hint to the
    # socket to claim in the post's own group. (With one, the claim would share the unknown
    # outcome, and its item would come back by the give-back's release, announce or not.)
    key = make_key()
    headers = {"Authorization": f"Token {key}"}

    async def run() -> dict[str, Any]:
        ws = await connect(server, key)
        try:
            await subscribe(ws, ["q"], 1)
            async with httpx.AsyncClient(base_url=server.url, headers=headers) as http:
                proxy.cut_at_commit(INSERT, reaches_server=True, then_refuse=True)
                answer = await http.post(
                    "/api/queues/q/items", json={"payload": "unheard"}, timeout=30
                )
            assert proxy.commits_cut == 1, "the proxy cut the post's COMMIT"
            assert answer.status_code == 503, answer.text
            assert answer.json()["error"]["code"] == "store_error", answer.text
            proxy.refuse = False
            return await recv(ws, timeout=20)
        finally:
            await ws.close()

    try:
        pushed = asyncio.run(run())
        (item_id,) = Item.objects.values_list("id", flat=True)
        assert (pushed["type"], pushed["id"]) == ("item", item_id), pushed
        assert "committed (its answers were lost)" in server.log.read_text(), "settled later"
        assert_committer_kept(server)
    finally:
        server.stop()
        proxy.close()


@pytest.mark.parametrize("reaches_server", [True, False], ids=["answer-lost", "commit-lost"])
def test_a_claim_whose_outcome_cannot_be_learned_gives_its_items_back_once_the_database_answers(
    served, reaches_server
):
    """A claim whose ``COMMIT`` is cut with the database away from then on is answered 503
    ``store_error``: no one heard of what it took. If it committed, its item would be
    ``processing`` under a lease no worker holds until that lease ends (300 s here); it is
    given back (no attempt counted) once the database answers, and claimed again at once.
    If it did not commit, its item is pending, its file left where the claim moved it, and
    the next claim takes it as well."""
    proxy, http = served
    item_id = _post(http, 1)
    proxy.cut_at_commit(item_id.encode(), reaches_server=reaches_server, then_refuse=True)
    answer = http.post("/api/queues/q/claim", json={"max": 1})
    assert proxy.commits_cut == 1, "the proxy cut the claim's COMMIT"
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["code"] == "store_error", answer.text
    proxy.refuse = False
    deadline = time.monotonic() + 15
    while True:
        again = http.post("/api/queues/q/claim", json={"max": 1})
        if again.status_code == 200 and again.json()["items"]:
            break
        assert time.monotonic() < deadline, (again.status_code, again.text)
        time.sleep(0.2)
    (claimed,) = again.json()["items"]
    assert claimed["id"] == item_id
    assert claimed["attempts"] == 1, "the claim given back counted no attempt"
    assert _state_of_file(item_id) is State.PROCESSING


def _files(state: State) -> set[str]:
    return {path.stem for path in store().state_dir("q", state).glob("*.json")}


def _until(what: str, done: Any, seconds: float = 20) -> None:
    deadline = time.monotonic() + seconds
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


@pytest.mark.parametrize(
    ("op", "holds_server"),
    [("post", False), ("post", True), ("claim", False), ("result", False)],
    ids=["post", "post-session-held", "claim", "result"],
)
def test_a_commit_whose_outcome_was_unknown_and_did_not_commit_has_its_files_put_back(
    serving_logged, op, holds_server
):
    """A group's ``COMMIT`` never reaches the database, which is away from then on: the
    caller hears 503 ``store_error`` (outcome unknown) and the group's files stay as it
    wrote them, ahead of its rows. Once the database answers, the server asks again, learns
    it rolled back (ending the session first where the network left it waiting in its
    transaction), and puts the files back: a post's file goes (before, it stayed with no
    row, and ``sweep --repair`` made a second item of a post its producer had sent again
    with its key), a claim's item is back in ``pending/``, a result's back in
    ``processing/``. Then repair finds nothing to do."""
    proxy, server, http = serving_logged
    body: dict[str, Any]
    if op == "post":
        marker, url, body = INSERT, "/api/queues/q/items", {"payload": "lost", "key": "k1"}
    else:
        item_id = _post(http, 1)
        if op == "result":
            assert _claim(http) == [item_id]
        marker = item_id.encode()
        if op == "claim":
            url, body = "/api/queues/q/claim", {"max": 1}
        else:
            url, body = f"/api/items/{item_id}/result", {"result": "ok"}
    before = {state: _files(state) for state in (State.PENDING, State.PROCESSING, State.DONE)}
    proxy.cut_at_commit(marker, reaches_server=False, holds_server=holds_server, then_refuse=True)
    answer = http.post(url, json=body)
    assert proxy.commits_cut == 1, "the proxy cut the COMMIT"
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["code"] == "store_error", answer.text
    ahead = {state: _files(state) for state in before}
    assert ahead != before, "the group's files are left as it wrote them, ahead of its rows"
    proxy.refuse = False
    now = lambda: {state: _files(state) for state in before}  # noqa: E731
    try:
        _until("the files put back", lambda: now() == before)
    except AssertionError:
        log = server.log.read_text(errors="replace").splitlines()
        raise AssertionError("\n".join([f"{before} -> {ahead} -> {now()}", *log[-40:]])) from None
    if op == "post":
        # Sent again with its key: made now, once (the first never committed).
        again = http.post(url, json=body)
        assert again.status_code == 201, again.text
        made = again.json()["id"]
        assert _files(State.PENDING) == {made}
    report = repair(grace_seconds=0)
    changed = (
        report.rows_removed,
        report.rows_added,
        report.rows_corrected,
        report.files_moved,
        report.torn_lines_cut,
    )
    assert changed == (0, 0, 0, 0, 0), f"repair found the files and rows apart: {report}"
    if op == "post":
        assert list(Item.objects.values_list("id", flat=True)) == [made], "one item"
    else:
        want = Status.PENDING if op == "claim" else Status.PROCESSING
        row = Item.objects.get(id=item_id)
        assert row.status == want
        assert row.attempts == (0 if op == "claim" else 1)


def test_a_group_settled_later_spares_the_files_of_items_another_group_changed_meanwhile(
    transactional_db, state_root, make_key
):
    """A claim's ``COMMIT`` never reaches the database, which is away from then on: its
    outcome unknown, its file is left in ``processing/`` under a ``pending`` row. Once the
    database is back, and before the server has settled the claim (its put-back held by
    ``group.slow_put_back``), another group (the test's own claim) finds the file ahead of
    its row, puts it back and takes the item. The settling learns the claim rolled back and
    must leave that file where the other group's row says (``processing/``), not move it
    back to ``pending/``."""
    proxy = proxy_to_database()
    engine.upsert_queue(name="q", body={"leaseSeconds": 300})
    env = env_through(
        proxy, TASKHOSTER_FAULT="group.slow_put_back", TASKHOSTER_FAULT_SLOW_SECONDS="4"
    )
    server = Server(state_root, **env).start()
    headers = {"Authorization": f"Token {make_key()}"}
    try:
        with httpx.Client(base_url=server.url, headers=headers, timeout=30) as http:
            item_id = _post(http, 1)
            proxy.cut_at_commit(item_id.encode(), reaches_server=False, then_refuse=True)
            answer = http.post("/api/queues/q/claim", json={"max": 1})
            assert proxy.commits_cut == 1, "the proxy cut the claim's COMMIT"
            assert answer.status_code == 503, answer.text
            assert answer.json()["error"]["code"] == "store_error", answer.text
        assert _files(State.PROCESSING) == {item_id}, "the claim's file left as it moved it"
        proxy.refuse = False
        taken: list[engine.Claimed] = []
        deadline = time.monotonic() + 10
        while not taken:
            assert time.monotonic() < deadline, "the test's claim never took the item"
            with contextlib.suppress(DatabaseError):
                taken = engine.execute(engine.Claim(queue_name="q", max_items=1))
            time.sleep(0.05)
        (ours,) = taken
        assert ours.row.id == item_id
        _until(
            "the server settled the claim",
            lambda: "rolled back: its files were put back" in server.log.read_text(),
        )
        row = Item.objects.get(id=item_id)
        assert (row.status, row.lease) == (Status.PROCESSING, ours.row.lease)
        assert _state_of_file(item_id) is State.PROCESSING, "the file where its row says"
        assert "which another group changed since" in server.log.read_text()
        assert_committer_kept(server)
    finally:
        server.stop()
        proxy.close()


def test_a_failed_commit_puts_back_only_the_files_no_other_group_changed_since(
    transactional_db, state_root, make_key
):
    """A claim's ``COMMIT`` is lost and it did not commit: its transaction's locks went with
    it, while its file's move (``pending/`` to ``processing/``) is still to be undone. Another
    group comes in between (here the test's own claims, held a window by
    ``group.slow_put_back``): it finds the file ahead of its row, puts it back, and takes the
    item (its row ``processing`` under its lease, its file in ``processing/``). The lost
    claim's undo must not move that file back to ``pending/`` (before, it did: a row
    ``processing`` with its file in ``pending/``); it locks the rows again and spares the
    items another group changed. The lost claim, run again, finds nothing to take."""
    proxy = proxy_to_database()
    engine.upsert_queue(name="q", body={"leaseSeconds": 300})
    env = env_through(
        proxy, TASKHOSTER_FAULT="group.slow_put_back", TASKHOSTER_FAULT_SLOW_SECONDS="4"
    )
    server = Server(state_root, **env).start()
    headers = {"Authorization": f"Token {make_key()}"}
    try:
        with httpx.Client(base_url=server.url, headers=headers, timeout=30) as http:
            item_id = _post(http, 1)
            proxy.cut_at_commit(item_id.encode(), reaches_server=False)
            answers: list[httpx.Response] = []
            claiming = threading.Thread(
                target=lambda: answers.append(http.post("/api/queues/q/claim", json={"max": 1}))
            )
            claiming.start()
            deadline = time.monotonic() + 10
            while proxy.commits_cut == 0:
                assert time.monotonic() < deadline, "the claim's COMMIT never came"
                time.sleep(0.005)
            # The lost claim learns it did not commit (at most LOST_SESSION_SECONDS), then
            # waits 4 s before it puts its files back: the test's claims take the item now.
            taken: list[engine.Claimed] = []
            deadline = time.monotonic() + LOST_SESSION_SECONDS + 2.5
            while not taken:
                assert time.monotonic() < deadline, "the test's claim never took the item"
                taken = engine.execute(engine.Claim(queue_name="q", max_items=1))
                time.sleep(0.05)
            (ours,) = taken
            assert ours.row.id == item_id
            claiming.join(30)
        (answer,) = answers
        assert answer.status_code == 200, answer.text
        assert answer.json()["items"] == [], "run again, the lost claim found nothing to take"
        row = Item.objects.get(id=item_id)
        assert (row.status, row.lease) == (Status.PROCESSING, ours.row.lease)
        assert _state_of_file(item_id) is State.PROCESSING, "the file where its row says"
        assert_committer_kept(server)
    finally:
        server.stop()
        proxy.close()


@pytest.mark.parametrize("then", ["sent-again", "socket-closed"])
@pytest.mark.parametrize("frame", ["result", "results"])
@pytest.mark.parametrize("reaches_server", [True, False], ids=["answer-lost", "commit-lost"])
def test_a_socket_result_whose_outcome_cannot_be_learned_is_unavailable_and_taken_when_sent_again(
    serving, reaches_server, frame, then
):
    """A worker's result whose ``COMMIT`` is cut with the database away from then on: its
    outcome cannot be learned, so the worker hears ``unavailable`` (the frame is to be sent
    again; the Python worker does so), not ``store_error`` (which it takes as final, leaving
    the item ``processing`` until its lease ends: what a database restart test met). Sent
    again once the database is back, it is taken once: accepted if the cut one did not
    commit, refused harmlessly if it did; the item is finished and its file done. Or the
    socket closes instead, once the database is back: the attempt is still the socket's,
    so the item is re-queued at once if the result did not commit (before, the socket had
    let go of it with the result, and it stayed ``processing`` until its lease ended)."""
    proxy, server, key = serving
    headers = {"Authorization": f"Token {key}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=30) as http:
        item_id = _post(http, 1)

    def result() -> dict[str, Any]:
        if frame == "result":
            return {"type": "result", "id": item_id, "result": "ok"}
        return {"type": "results", "results": [{"id": item_id, "result": "ok"}]}

    def ack_of(answer: dict[str, Any]) -> dict[str, Any]:
        """The answer's ack (or error) for the item: the frame, or its ``acks`` entry."""
        if answer["type"] == "acks":
            (ack,) = answer["acks"]
            return dict(ack)
        return answer

    def error_code(answer: dict[str, Any]) -> str | None:
        ack = ack_of(answer)
        if ack.get("type") == "error":
            return str(ack["code"])
        return str(ack["error"]["code"]) if "error" in ack else None

    async def run() -> tuple[dict[str, Any], list[dict[str, Any]]]:
        ws = await connect(server, key)
        try:
            await subscribe(ws, ["q"], 1)
            pushed = await recv(ws)
            assert (pushed["type"], pushed["id"]) == ("item", item_id), pushed
            proxy.cut_at_commit(item_id.encode(), reaches_server=reaches_server, then_refuse=True)
            await send(ws, result())
            first = await recv(ws, timeout=OUTCOME_WAIT_SECONDS + 10)
            assert proxy.commits_cut == 1, "the proxy cut the result's COMMIT"
            proxy.refuse = False
            again: list[dict[str, Any]] = []
            if then == "socket-closed":
                return first, again
            deadline = time.monotonic() + 15
            while True:
                await send(ws, result())
                again.append(await recv(ws, timeout=10))
                if error_code(again[-1]) != "unavailable":
                    return first, again
                assert time.monotonic() < deadline, again
                await asyncio.sleep(0.2)
        finally:
            await ws.close()

    first, again = asyncio.run(run())
    assert error_code(first) == "unavailable", (first, server_says(server, [item_id]))
    if then == "socket-closed":
        done, requeued = (Status.FINISHED, State.DONE), (Status.PENDING, State.PENDING)
        expected = done if reaches_server else requeued
        deadline = time.monotonic() + 10
        while (Item.objects.get(id=item_id).status, _state_of_file(item_id)) != expected:
            assert time.monotonic() < deadline, Item.objects.get(id=item_id).status
            time.sleep(0.1)
        return
    last = again[-1]
    assert error_code(last) is None, last
    assert ack_of(last)["accepted"] is (not reaches_server), last
    assert Item.objects.get(id=item_id).status == Status.FINISHED
    assert _state_of_file(item_id) is State.DONE


@pytest.mark.skipif(
    not ownpostgres.available(),
    reason="a PostgreSQL of the test's own to crash: root and PostgreSQL's server programs",
)
@pytest.mark.parametrize("reuse", ["committed", "running"])
@pytest.mark.parametrize("crash", ["server", "one-session"])
def test_a_commit_lost_in_a_database_crash_is_not_taken_for_another_that_reused_its_id(
    state_root, crash, reuse
):
    """The database crashes while a post's ``COMMIT`` is on its way: the transaction is lost
    (its records were in the server's memory), and the server, started again, gives its id
    to new transactions, which commit. Asked about that id, it says "committed": of another
    transaction. The post must not be answered as made (201 for an item with no row), and
    is not: the server's start time, read with the id, says the id was given again, and
    "committed" then proves nothing (503 ``store_error``; or, where the transaction's
    records had been written before the crash and the id not given again, "aborted" and the
    post made anew). Before, the post was answered 201 and its item did not exist.

    The crash is of the whole server (stopped at once, started again: a new start time) or
    of one session's process (the server ends the others and recovers without a restart:
    its recovery's checkpoint says which ids it gives again). The id is given again to
    transactions that commit, or to one still running when the post asks: that one is
    another's (the post's session died in the crash), so the post did not commit, and the
    session running it is not ended (a session "in progress" is ended only when it can be
    the post's own: before, it was, after half a second: checked in the runs where the id
    is given again). Where the post's records reached the database's log before the crash
    after all (some runs here, even with the log's writer at its slowest: the server's own
    commits wake it), its id is not given again, and the post is made anew."""
    pg = OwnPostgres()
    try:
        pg.start()
        env = server_env(state_root, DATABASE_URL=pg.url)
        manage = [sys.executable, "manage.py"]
        subprocess.run(
            [*manage, "migrate", "--noinput"], cwd=REPO, env=env, check=True, capture_output=True
        )
        made = subprocess.run(
            [*manage, "createkey", "--name", "t", "--scopes", "produce,manage"],
            cwd=REPO,
            env=env,
            check=True,
            capture_output=True,
            text=True,
        )
        proxy = TcpProxy(pg.port)
        proxied = pg.url.replace(f":{pg.port}/", f":{proxy.port}/")
        server = Server(state_root, DATABASE_URL=proxied).start()
        headers = {"Authorization": f"Token {made.stdout.strip()}"}
        try:
            with httpx.Client(base_url=server.url, headers=headers, timeout=60) as http:
                assert http.put("/api/queues/q", json={}).status_code == 201
                # The server commits without waiting for the database's flush (the files
                # are the truth: repair puts back what a crash of the database took): a
                # checkpoint makes the queue's row durable before the crash.
                with psycopg.connect(pg.url, autocommit=True) as direct:
                    direct.execute("CHECKPOINT")
                proxy.cut_at_commit(INSERT, reaches_server=False, holds_client=True)
                answers: list[httpx.Response] = []
                poster = threading.Thread(
                    target=lambda: answers.append(
                        http.post("/api/queues/q/items", json={"payload": "lost"})
                    )
                )
                poster.start()
                deadline = time.monotonic() + 30
                while proxy.commits_cut == 0:
                    assert time.monotonic() < deadline, "the post's COMMIT never came"
                    time.sleep(0.005)
                lost = _held_transaction_id(pg.url)
                if crash == "server":
                    pg.crash()
                    pg.start()
                else:
                    pg.crash_one_session()
                running = _give_ids_again(pg.url, lost, keep_it_running=reuse == "running")
                proxy.release_held()  # the post's connection is lost now: it asks
                poster.join(60)
            (answer,) = answers
            with psycopg.connect(pg.url) as direct:
                rows = direct.execute("SELECT id FROM taskhoster_item").fetchall()
            if answer.status_code == 201:
                assert rows == [(answer.json()["id"],)], "answered 201: the item exists"
            else:
                assert answer.status_code == 503, answer.text
                assert answer.json()["error"]["code"] == "store_error", answer.text
                assert rows == []
            if running is not None:
                assert answer.status_code == 201, "the post did not commit: made anew"
                running.execute("SELECT 1")  # its session was not ended
                running.close()
        finally:
            server.stop()
            proxy.close()
    finally:
        pg.remove()


def _held_transaction_id(url: str) -> int:
    """The id of the transaction whose COMMIT the proxy holds (its session waits in it: the
    only one with an id)."""
    with psycopg.connect(url, autocommit=True) as direct:
        found = direct.execute(
            "SELECT backend_xid::text FROM pg_stat_activity "
            "WHERE backend_xid IS NOT NULL AND pid <> pg_backend_pid()"
        ).fetchall()
    assert len(found) == 1, found
    return int(found[0][0])


def _give_ids_again(url: str, lost: int, *, keep_it_running: bool) -> psycopg.Connection | None:
    """Transactions on the database started again, up to the lost transaction's id (and
    more: ``REUSED`` in all), each committed; with ``keep_it_running`` the one given that id
    is left running, its connection returned (None if no transaction was given it: the lost
    one's records were written before the crash)."""
    for _ in range(REUSED):
        holder = psycopg.connect(url)
        given = holder.execute("SELECT xid(pg_current_xact_id())::text").fetchone()
        assert given is not None
        if keep_it_running and int(given[0]) == lost:
            return holder
        holder.commit()
        holder.close()
        if keep_it_running and int(given[0]) > lost:
            return None
    return None
