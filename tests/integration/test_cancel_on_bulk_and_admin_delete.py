"""Rule 9, for every way of deleting many items: "a socket worker holding it is told
``cancel``" (SPEC section 3, rule 9; the frame of section 6). The single ``DELETE
/api/items/{id}`` is proved in ``test_socket.py``; here the same rule is held to the REST
bulk delete (by ids and by status) and to the Django admin (its delete action and its
"delete all matching the filter" view), each against a real daphne, a real websocket worker
and, for the admin, a browser's session logged in through the login form.

After the cancel, each test also checks what the cancel promises: the deleted item's late
result is acked ``accepted: false``, and the slot it took is free again.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from taskhoster.models import Item, Queue

from .wsclient import admin_session, connect, make_queue, post, recv, send, subscribe

pytestmark = pytest.mark.slow


@pytest.fixture
def server(server_factory):
    # A long backstop: whatever reaches the socket comes by news, not by a periodic re-check.
    return server_factory(TASKHOSTER_SOCKET_BACKSTOP_SECONDS="120")


def superuser_session(server: Any) -> httpx.Client:
    """A superuser's browser session with the real daphne's admin, logged in through the
    login form (CSRF cookie and token, as a browser sends them)."""
    from django.contrib.auth.models import User

    User.objects.create_user("op", password="pw", is_staff=True, is_superuser=True)
    return admin_session(server, "op")


def remaining(ids: list[str]) -> set[str]:
    """Which of ``ids`` are still in the index."""
    return set(Item.objects.filter(id__in=ids).values_list("id", flat=True))


async def held_item(server: Any, key: str, http: httpx.Client, capacity: int = 1) -> Any:
    """A worker socket subscribed to ``q`` holding the item it was pushed; (socket, id)."""
    ws = await connect(server, key)
    await subscribe(ws, ["q"], capacity)
    item = await asyncio.to_thread(post, http, "held")
    frame = await recv(ws, 20)
    assert (frame["type"], frame["id"]) == ("item", item)
    return ws, item


async def cancel_is_kept(ws: Any, http: httpx.Client, item: str) -> None:
    """The cancelled item's late result is refused, and its slot takes the next item."""
    await send(ws, {"type": "result", "id": item, "result": "too late"})
    assert await recv(ws, 20) == {"type": "ack", "id": item, "accepted": False}
    nxt = await asyncio.to_thread(post, http, "next")
    frame = await recv(ws, 20)
    assert (frame["type"], frame["id"]) == ("item", nxt), "the cancelled slot is not free"


def test_bulk_delete_by_ids_sends_cancel_to_the_socket_holding_a_deleted_item(server, http, key):
    make_queue(http)

    async def run() -> None:
        ws, held = await held_item(server, key, http)
        waiting = await asyncio.to_thread(post, http, "waiting")  # capacity 1: not pushed
        answer = await asyncio.to_thread(
            http.post, "/api/queues/q/items/delete", json={"ids": [waiting, held]}
        )
        assert answer.status_code == 200, answer.text
        assert answer.json() == {"deleted": 2}
        assert await recv(ws, 20) == {"type": "cancel", "id": held, "reason": "deleted"}
        await cancel_is_kept(ws, http, held)
        await ws.close()

    asyncio.run(run())


def test_bulk_delete_by_status_sends_cancel_to_the_socket_holding_a_deleted_item(server, http, key):
    make_queue(http)

    async def run() -> None:
        ws, held = await held_item(server, key, http)
        await asyncio.to_thread(post, http, "waiting")
        # Deleting the pending items leaves the held one alone: no cancel for it.
        answer = await asyncio.to_thread(
            http.post, "/api/queues/q/items/delete", json={"status": "pending"}
        )
        assert answer.json() == {"deleted": 1}, answer.text
        answer = await asyncio.to_thread(
            http.post, "/api/queues/q/items/delete", json={"status": "processing"}
        )
        assert answer.json() == {"deleted": 1}, answer.text
        # The first frame after both deletes is the held item's cancel.
        assert await recv(ws, 20) == {"type": "cancel", "id": held, "reason": "deleted"}
        await cancel_is_kept(ws, http, held)
        await ws.close()

    asyncio.run(run())


def test_admin_delete_action_sends_cancel_to_the_socket_holding_a_deleted_item(server, http, key):
    make_queue(http)
    browser = superuser_session(server)

    async def run() -> None:
        ws, held = await held_item(server, key, http)
        waiting = await asyncio.to_thread(post, http, "waiting")
        answer = await asyncio.to_thread(
            browser.post,
            "/admin/taskhoster/item/",
            data={
                "action": "delete_selected_items",
                "_selected_action": [held, waiting],
                "confirm": "yes",
                "csrfmiddlewaretoken": browser.cookies["csrftoken"],
            },
        )
        assert answer.status_code == 302, answer.text[:500]
        assert await asyncio.to_thread(remaining, [held, waiting]) == set()
        assert await recv(ws, 20) == {"type": "cancel", "id": held, "reason": "deleted"}
        await cancel_is_kept(ws, http, held)
        await ws.close()

    try:
        asyncio.run(run())
    finally:
        browser.close()


def test_admin_delete_matching_view_sends_cancel_to_the_socket_holding_a_deleted_item(
    server, http, key
):
    make_queue(http)
    make_queue(http, "other")
    browser = superuser_session(server)
    queue = Queue.objects.get(name="q", deleting=False).pk

    async def run() -> None:
        ws, held = await held_item(server, key, http)
        waiting = await asyncio.to_thread(post, http, "waiting")
        elsewhere = await asyncio.to_thread(post, http, "elsewhere", queue="other")
        url = f"/admin/taskhoster/item/delete-matching/?queue__id__exact={queue}"
        page = await asyncio.to_thread(browser.get, url)
        assert page.status_code == 200, page.text[:500]
        answer = await asyncio.to_thread(
            browser.post,
            url,
            data={"confirm": "yes", "csrfmiddlewaretoken": browser.cookies["csrftoken"]},
        )
        assert answer.status_code == 302, answer.text[:500]
        assert await asyncio.to_thread(remaining, [held, waiting, elsewhere]) == {elsewhere}
        assert await recv(ws, 20) == {"type": "cancel", "id": held, "reason": "deleted"}
        await cancel_is_kept(ws, http, held)
        await ws.close()

    try:
        asyncio.run(run())
    finally:
        browser.close()
