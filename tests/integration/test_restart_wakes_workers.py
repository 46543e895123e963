"""Invariant I6 for restarts: "A claimable item reaches a waiting socket worker with free
capacity without waiting for a sweep or a poll interval, whichever process made it claimable
(a post, a result that freed a thread, the sweep, the admin)" (SPEC section 4). A restart
(rule 10) makes a failed item claimable; here it is made by ``POST /api/items/{id}/restart``
and by the admin's restart action (a browser's session logged in through the login form),
each against a real daphne, and the item must reach

- a worker socket that waits subscribed with a free slot, and
- a REST claim that waits (``wait: 60``),

at once. The server's socket backstop and long-poll interval are set to 300 s, and the
claim's own wait to 60 s, so an item that arrives within the test's 30 s came by the
restart's news, not by a timer: no timing is asserted beyond that deadline.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import httpx
import pytest

from .wsclient import (
    admin_session,
    connect,
    make_queue,
    post,
    recv,
    send,
    subscribe,
    wait_for_metric,
)

pytestmark = pytest.mark.slow

DEADLINE = 30  # seconds; the timers that could also deliver the item are 60 s and longer


@pytest.fixture
def server(server_factory):
    return server_factory(
        TASKHOSTER_SOCKET_BACKSTOP_SECONDS="300", TASKHOSTER_LONG_POLL_INTERVAL="300"
    )


@pytest.fixture
def http(server, key):
    with httpx.Client(
        base_url=server.url, headers={"Authorization": f"Token {key}"}, timeout=90
    ) as client:
        yield client


@pytest.fixture
def browser(server):
    """A superuser's browser session with the real daphne's admin, logged in through the
    login form."""
    from django.contrib.auth.models import User

    User.objects.create_user("op", password="pw", is_staff=True, is_superuser=True)
    client = admin_session(server, "op")
    try:
        yield client
    finally:
        client.close()


def restart(how: str, http: httpx.Client, browser: httpx.Client | None, item: str) -> None:
    if how == "rest":
        answer = http.post(f"/api/items/{item}/restart")
        assert answer.status_code == 200, answer.text
        # Read back after the restart: the waiting worker may have taken it already.
        assert answer.json()["status"] in ("pending", "processing"), answer.text
        return
    assert browser is not None
    answer = browser.post(
        "/admin/taskhoster/item/",
        data={
            "action": "restart_selected_items",
            "_selected_action": [item],
            "confirm": "yes",
            "csrfmiddlewaretoken": browser.cookies["csrftoken"],
        },
    )
    assert answer.status_code == 302, answer.text[:500]


def failed_item(http: httpx.Client) -> str:
    """An item of ``q`` failed for good through REST (one claim attempt)."""
    item = post(http, "to restart")
    claimed = http.post("/api/queues/q/claim", json={"max": 1}).json()["items"]
    assert [c["id"] for c in claimed] == [item]
    answer = http.post(
        f"/api/items/{item}/fail",
        json={"lease": claimed[0]["lease"], "error": "boom", "retry": False},
    ).json()
    assert answer == {"accepted": True, "status": "failed"}
    return item


@pytest.mark.parametrize("thread_id", [None, "t"], ids=["unthreaded", "threaded"])
@pytest.mark.parametrize("how", ["rest", "admin"])
def test_restart_pushes_the_item_to_a_waiting_socket_at_once(
    request, server, http, key, how, thread_id
):
    make_queue(http)
    browser = request.getfixturevalue("browser") if how == "admin" else None
    extra = {} if thread_id is None else {"threadId": thread_id}

    async def run() -> None:
        async with await connect(server, key) as ws:
            await subscribe(ws, ["q"], 1)
            # The worker takes the item and fails it for good: it waits with its slot free.
            item = await asyncio.to_thread(post, http, "x", **extra)
            frame = await recv(ws, DEADLINE)
            assert (frame["type"], frame["id"], frame["attempts"]) == ("item", item, 1)
            await send(ws, {"type": "fail", "id": item, "error": "boom", "retry": False})
            ack = await recv(ws, DEADLINE)
            assert ack == {"type": "ack", "id": item, "accepted": True, "status": "failed"}

            await asyncio.to_thread(restart, how, http, browser, item)
            frame = await recv(ws, DEADLINE)
            assert (frame["type"], frame["id"]) == ("item", item)
            assert frame["attempts"] == 1, "a restarted item is a new arrival"
            assert frame["threadId"] == thread_id

    asyncio.run(run())


@pytest.mark.parametrize("how", ["rest", "admin"])
def test_restart_answers_a_waiting_claim_long_poll_at_once(request, server, http, key, how):
    make_queue(http)
    browser = request.getfixturevalue("browser") if how == "admin" else None
    item = failed_item(http)
    wait_for_metric(http, "claim_attempts", 1)

    answers: dict[str, Any] = {}

    def long_poll() -> None:
        headers = {"Authorization": f"Token {key}"}
        try:
            answers["claim"] = httpx.post(
                f"{server.url}/api/queues/q/claim",
                json={"max": 1, "wait": 60},
                headers=headers,
                timeout=90,
            )
        except httpx.HTTPError as exc:  # the server stopped under it (a failed test)
            answers["error"] = exc

    poller = threading.Thread(target=long_poll, daemon=True)
    poller.start()
    # Its first claim found nothing: it is waiting now.
    wait_for_metric(http, "claim_attempts", 2)
    assert poller.is_alive()

    restart(how, http, browser, item)
    poller.join(DEADLINE)
    assert not poller.is_alive(), "the waiting claim did not get the restarted item at once"
    assert answers["claim"].status_code == 200, answers["claim"].text
    claimed = answers["claim"].json()["items"]
    assert [(c["id"], c["attempts"]) for c in claimed] == [(item, 1)]
