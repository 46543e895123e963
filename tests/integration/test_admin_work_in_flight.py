"""The admin's side of SPEC section 8.2, "Work in flight": cancelling items (an item page's
button and the list's action, both behind the confirmation page and both through
``engine.cancel``), an item's attempts and progress (on its page and behind its "History"
button), and the workers page (the registry's live sockets, each with a "Drain" button).

Most tests use Django's test client; the last one drives a real daphne with a real websocket
worker and a browser's session, to prove that the workers page shows what a server process
wrote and that its buttons reach the socket."""

from __future__ import annotations

import asyncio
import re
import time
from datetime import timedelta
from typing import Any

import httpx
import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse

from taskhoster import engine
from taskhoster.engine import ItemRow, NewItem
from taskhoster.models import Item, ServerProcess, WorkerSocket
from taskhoster.timeutil import now as utcnow
from taskhoster.work import registry

from .admin_users import staff_with
from .wsclient import admin_session, connect, make_queue, post, recv, send

pytestmark = pytest.mark.django_db

ITEMS = reverse("admin:taskhoster_item_changelist")
WORKERS = reverse("admin:taskhoster_workersocket_changelist")


def csrf(client: Client, url: str) -> str:
    client.get(url)
    return str(client.cookies["csrftoken"].value)


def new_item(queue: str = "q", payload: Any = None, **spec: Any) -> ItemRow:
    return engine.post_items(queue_name=queue, items=[NewItem(payload=payload, **spec)])[0].row


def page_of(item_id: str) -> str:
    return reverse("admin:taskhoster_item_change", args=[item_id])


def cancel_url(item_id: str) -> str:
    return reverse("admin:taskhoster_item_cancel", args=[item_id])


def said(response: Any) -> list[str]:
    """The admin's messages on a page."""
    return [str(m) for m in response.context["messages"]] if response.context else []


def three_items() -> tuple[str, str, str]:
    """A processing item, a finished one and a pending one, in queue ``q``."""
    held = new_item(payload="held")
    assert engine.claim(queue_name="q", max_items=1)[0].row.id == held.id
    done = new_item(payload="done")
    assert engine.claim(queue_name="q", max_items=1)[0].row.id == done.id
    engine.submit_result(item_id=done.id, result="ok")
    waiting = new_item(payload="waiting")
    return held.id, done.id, waiting.id


def status(item_id: str) -> tuple[str, str | None, str | None]:
    row = Item.objects.get(id=item_id)
    return row.status, row.error, row.cancel_reason


# -- cancel ------------------------------------------------------------------------------------


def test_the_cancel_button_of_an_item_page_cancels_it_after_a_confirmation(
    staff: Client, make_queue: Any
) -> None:
    make_queue("q")
    held, done, waiting = three_items()
    page = staff.get(page_of(held)).content.decode()
    assert f'href="{cancel_url(held)}"' in page, "a processing item has the button"
    assert f'href="{cancel_url(waiting)}"' in staff.get(page_of(waiting)).content.decode()
    assert 'id="th-cancel"' not in staff.get(page_of(done)).content.decode(), "not when done"

    confirm = staff.get(cancel_url(held))
    text = confirm.content.decode()
    assert 'id="th-total">1<' in text
    assert 'class="th-count-processing">1<' in text
    assert 'name="reason"' in text
    assert status(held)[0] == "processing", "the confirmation page changes nothing"
    assert staff.post(cancel_url(held), {"confirm": "yes"}).status_code == 403, "CSRF"
    token = csrf(staff, page_of(held))
    answer = staff.post(
        cancel_url(held),
        {"confirm": "yes", "reason": "operator: wrong input", "csrfmiddlewaretoken": token},
        follow=True,
    )
    assert answer.redirect_chain[-1][0] == page_of(held)
    assert "Cancelled 1 item(s)." in said(answer)
    assert status(held) == ("failed", "cancelled", "operator: wrong input")
    page = answer.content.decode()
    assert "operator: wrong input" in page, "the page shows the cancel reason"
    assert 'id="th-cancel"' not in page, "a cancelled item has no button"

    answer = staff.post(cancel_url(waiting), {"confirm": "yes", "csrfmiddlewaretoken": token})
    assert answer.status_code == 302
    assert status(waiting) == ("failed", "cancelled", None), "no reason given, none kept"
    assert engine.claim(queue_name="q", max_items=5) == [], "nothing left to hand out"

    answer = staff.post(
        cancel_url(done), {"confirm": "yes", "csrfmiddlewaretoken": token}, follow=True
    )
    assert "Cancelled 0 item(s)." in said(answer)
    assert f"Not cancelled, already finished or failed: 1 item(s): {done}." in said(answer)
    assert status(done) == ("finished", None, None)


def test_the_cancel_action_cancels_the_selected_live_items_and_names_the_terminal_ones(
    staff: Client, make_queue: Any
) -> None:
    make_queue("q")
    held, done, waiting = three_items()
    other = new_item(payload="not selected").id
    token = csrf(staff, ITEMS)
    assert "cancel_selected_items" in staff.get(ITEMS).content.decode()
    data = {
        "action": "cancel_selected_items",
        "_selected_action": [held, done, waiting],
        "csrfmiddlewaretoken": token,
    }
    confirm = staff.post(ITEMS, data)
    text = confirm.content.decode()
    assert 'id="th-total">3<' in text
    for state in ("processing", "finished", "pending"):
        assert f'class="th-count-{state}">1<' in text, state
    assert 'name="reason"' in text
    assert status(held)[0] == "processing", "the confirmation page changes nothing"
    answer = staff.post(ITEMS, {**data, "confirm": "yes", "reason": "batch aborted"}, follow=True)
    assert answer.status_code == 200
    assert "Cancelled 2 item(s)." in said(answer)
    assert f"Not cancelled, already finished or failed: 1 item(s): {done}." in said(answer)
    assert status(held) == ("failed", "cancelled", "batch aborted")
    assert status(waiting) == ("failed", "cancelled", "batch aborted")
    assert status(done) == ("finished", None, None)
    assert status(other)[0] == "pending", "only the items selected"
    # The cancelled item's worker is too late: its result is not taken.
    engine.submit_result(item_id=held, result="late")
    assert status(held)[0] == "failed"


def test_a_cancel_reason_longer_than_the_api_allows_cancels_nothing(
    staff: Client, make_queue: Any
) -> None:
    make_queue("q")
    item = new_item(payload=1)
    token = csrf(staff, ITEMS)
    answer = staff.post(
        cancel_url(item.id),
        {"confirm": "yes", "reason": "x" * 501, "csrfmiddlewaretoken": token},
        follow=True,
    )
    assert any(m.startswith("Nothing cancelled: ") for m in said(answer)), said(answer)
    assert status(item.id) == ("pending", None, None)


def test_a_view_only_staff_user_cannot_cancel(make_queue: Any) -> None:
    make_queue("q")
    item = new_item(payload=1)
    viewer = staff_with("view_item")
    assert "cancel_selected_items" not in viewer.get(ITEMS).content.decode()
    assert 'id="th-cancel"' not in viewer.get(page_of(item.id)).content.decode()
    assert viewer.get(cancel_url(item.id)).status_code == 403
    token = csrf(viewer, ITEMS)
    data = {"confirm": "yes", "csrfmiddlewaretoken": token}
    assert viewer.post(cancel_url(item.id), data).status_code == 403
    viewer.post(ITEMS, {**data, "action": "cancel_selected_items", "_selected_action": [item.id]})
    assert status(item.id)[0] == "pending", "nothing changed"
    allowed = staff_with("view_item", "change_item")
    assert 'id="th-cancel"' in allowed.get(page_of(item.id)).content.decode()
    allowed.post(cancel_url(item.id), {**data, "csrfmiddlewaretoken": csrf(allowed, ITEMS)})
    assert status(item.id)[0] == "failed", "with the permission, it works"


# -- attempts and progress ---------------------------------------------------------------------


def attempt_rows(html: str) -> list[str]:
    table = re.search(r'<table id="th-attempts">.*?</table>', html, re.S)
    assert table is not None, "no attempts table"
    return re.findall(r'<tr class="th-attempt .*?</tr>', table.group(0), re.S)


def test_an_item_page_and_its_history_button_show_its_attempts(
    staff: Client, make_queue: Any
) -> None:
    make_queue("q", backoffSeconds=0, backoffMaxSeconds=0)
    item = new_item(payload={"n": 1})
    first = engine.claim(queue_name="q", max_items=1)[0].row
    engine.fail(item_id=item.id, lease=first.lease, error="boom: disk full")
    second = engine.claim(queue_name="q", max_items=1)[0].row
    assert second.id == item.id
    engine.submit_result(item_id=item.id, result="ok")

    page = staff.get(page_of(item.id)).content.decode()
    rows = attempt_rows(page)
    assert len(rows) == 2
    assert "th-outcome-fail" in rows[0]
    assert "boom: disk full" in rows[0]
    assert '<td class="th-attempt-n">1</td>' in rows[0]
    assert "th-outcome-result" in rows[1]
    assert '<td class="th-attempt-n">2</td>' in rows[1]
    assert 'class="th-time"' in rows[1], "claimed and ended, to the second"
    assert "omitted" not in page

    # "History" (Django's button, whose log has nothing of items) shows the attempts.
    history = reverse("admin:taskhoster_item_history", args=[item.id])
    assert f'href="{history}"' in page
    shown = staff.get(history)
    assert shown.status_code == 200
    text = shown.content.decode()
    assert attempt_rows(text) == rows
    assert "change history" not in text


def test_attempts_left_out_by_the_engine_are_counted_and_a_new_item_has_none(
    staff: Client, make_queue: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_queue("q")
    item = new_item(payload=1)
    page = staff.get(page_of(item.id)).content.decode()
    assert 'id="th-attempts-none"' in page
    story = [
        {
            "attempt": n,
            "claimedAt": "2030-01-01T00:00:00.000000Z",
            "worker": "w",
            "endedAt": "2030-01-01T00:00:01.000000Z",
            "outcome": "lapsed",
            "error": "lease expired",
        }
        for n in (1, 2, 60)
    ]
    monkeypatch.setattr(engine, "attempts", lambda *, item_id: (story, 57))
    page = staff.get(page_of(item.id)).content.decode()
    assert "57 omitted" in page
    assert len(attempt_rows(page)) == 3


def test_the_item_list_and_page_show_the_progress_of_a_processing_item(
    staff: Client, make_queue: Any
) -> None:
    make_queue("q")
    item = new_item(payload=1)
    quiet = new_item(payload=2)
    lease = engine.claim(queue_name="q", max_items=1)[0].row.lease
    accepted, _row = engine.report_progress(
        item_id=item.id, lease=lease, progress={"done": 3, "of": 10}
    )
    assert accepted
    body = staff.get(ITEMS).content.decode()
    cells = dict(
        re.findall(
            r'<a href="[^"]*/item/([0-9a-f]+)/change/[^"]*">.*?'
            r'<td class="field-status_column">(.*?)</td>',
            body,
            re.S,
        )
    )
    shown = cells[item.id].replace("&quot;", '"')
    assert shown.startswith('Processing<span class="th-progress-line"'), shown
    assert '>{"done":3,"of":10}</span>' in shown, "under the status, in the status column"
    assert cells[quiet.id] == "Pending"
    page = staff.get(page_of(item.id)).content.decode()
    assert "&quot;done&quot;: 3" in page
    history = staff.get(reverse("admin:taskhoster_item_history", args=[item.id]))
    assert "&quot;done&quot;: 3" in history.content.decode()
    assert attempt_rows(page)[0].count("(running)") == 1, "the attempt under way"


# -- the workers page --------------------------------------------------------------------------


def publish_socket(socket_id: str, name: str, held: tuple[str, ...] = ()) -> None:
    """Write one socket of this process to the registry, as a server process does."""
    at = utcnow()
    entry = registry.Entry(
        id=socket_id,
        name=name,
        key_id=None,
        queues=("q", "mail"),
        capacity=4,
        held=held,
        draining=False,
        connected_at=at,
        last_seen_at=at,
    )
    registry.Publisher().publish([entry], time.monotonic())


def dead_process_socket(socket_id: str, name: str) -> None:
    """A socket of a process whose heartbeat stopped a while ago (it died)."""
    old = utcnow() - timedelta(seconds=registry.ALIVE_SECONDS + 5)
    ServerProcess.objects.create(process="gone-1", host="h", pid=1, started_at=old, seen_at=old)
    WorkerSocket.objects.create(
        id=socket_id,
        process="gone-1",
        name=name,
        queues=["q"],
        capacity=1,
        connected_at=old,
        last_seen_at=old,
    )


def test_the_workers_page_lists_the_live_sockets_only_and_drains_one(
    staff: Client, make_queue: Any
) -> None:
    make_queue("q")
    item = new_item(payload=1)
    publish_socket("0123456789abcdef", "host-a pid 7", held=(item.id,))
    dead_process_socket("fedcba9876543210", "host-dead pid 9")
    assert 'id="th-workers-link"' in staff.get("/admin/taskhoster/").content.decode()
    assert "Workers" in staff.get("/admin/").content.decode()
    assert (
        "1 worker(s) connected" in staff.get(reverse("admin:taskhoster_overview")).content.decode()
    )
    page = staff.get(WORKERS).content.decode()
    assert "host-a pid 7" in page
    assert "host-dead" not in page, "a dead process's socket is not shown"
    row = re.search(r'<tr class="th-worker" id="th-worker-0123456789abcdef">.*?</tr>', page, re.S)
    assert row is not None
    assert "q, mail" in row.group(0)
    assert '<td class="th-worker-capacity">4</td>' in row.group(0)
    assert f'href="{page_of(item.id)}"' in row.group(0), "held items link to their pages"
    drain = reverse("admin:taskhoster_workersocket_drain", args=["0123456789abcdef"])
    assert f'action="{drain}"' in row.group(0)

    assert staff.post(drain).status_code == 403, "CSRF"
    token = csrf(staff, WORKERS)
    assert staff.get(drain).status_code == 405, "only a POST drains"
    answer = staff.post(drain, {"csrfmiddlewaretoken": token}, follow=True)
    assert answer.redirect_chain[-1][0] == WORKERS
    assert any("drained" in m for m in said(answer)), said(answer)
    assert WorkerSocket.objects.get(id="0123456789abcdef").draining
    row = re.search(r'id="th-worker-0123456789abcdef">.*?</tr>', answer.content.decode(), re.S)
    assert row is not None
    assert ">draining<" in row.group(0)
    assert f'action="{drain}"' not in row.group(0), "no button for a drained worker"

    gone = reverse("admin:taskhoster_workersocket_drain", args=["fedcba9876543210"])
    answer = staff.post(gone, {"csrfmiddlewaretoken": token}, follow=True)
    assert "Worker fedcba9876543210 is no longer connected." in said(answer)
    assert not WorkerSocket.objects.get(id="fedcba9876543210").draining


def test_the_workers_page_follows_the_worker_socket_permissions(make_queue: Any) -> None:
    publish_socket("0123456789abcdef", "host-a pid 7")
    drain = reverse("admin:taskhoster_workersocket_drain", args=["0123456789abcdef"])
    nobody = staff_with("view_item")
    assert nobody.get(WORKERS).status_code == 403
    assert b"th-workers-link" not in nobody.get("/admin/taskhoster/").content
    viewer = staff_with("view_workersocket")
    page = viewer.get(WORKERS).content.decode()
    assert "host-a pid 7" in page
    assert 'class="th-drain"' not in page, "no drain button without the change permission"
    assert viewer.post(drain, {"csrfmiddlewaretoken": csrf(viewer, WORKERS)}).status_code == 403
    assert not WorkerSocket.objects.get(id="0123456789abcdef").draining
    drainer = staff_with("change_workersocket")
    assert 'class="th-drain"' in drainer.get(WORKERS).content.decode()
    answer = drainer.post(drain, {"csrfmiddlewaretoken": csrf(drainer, WORKERS)})
    assert answer.status_code == 302
    assert WorkerSocket.objects.get(id="0123456789abcdef").draining


# -- against a real daphne and a real websocket worker ----------------------------------------


def wait_for_worker(browser: httpx.Client, name: str, held: str, within: float = 20) -> str:
    """The workers page's row of the socket named ``name`` once it shows ``held`` (its
    process writes the registry about once a second)."""
    deadline = time.monotonic() + within
    while True:
        page = browser.get(WORKERS)
        assert page.status_code == 200, page.text[:500]
        for row in re.findall(r'<tr class="th-worker".*?</tr>', page.text, re.S):
            if name in row and held in row:
                return str(row)
        assert time.monotonic() < deadline, f"{name} holding {held} never listed: {page.text}"
        time.sleep(0.2)


@pytest.mark.slow
def test_a_connected_worker_is_listed_and_its_drain_and_cancel_buttons_reach_its_socket(
    server_factory: Any, make_key: Any
) -> None:
    server = server_factory(TASKHOSTER_SOCKET_BACKSTOP_SECONDS="120")
    key = make_key()
    User.objects.create_user("op", password="pw", is_staff=True, is_superuser=True)
    browser = admin_session(server, "op")
    http = httpx.Client(base_url=server.url, headers={"Authorization": f"Token {key}"}, timeout=30)

    async def run() -> str:
        await asyncio.to_thread(make_queue, http)
        ws = await connect(server, key)
        await send(
            ws, {"type": "subscribe", "queues": ["q"], "capacity": 2, "name": "host-b pid 42"}
        )
        held = await asyncio.to_thread(post, http, "held")
        frame = await recv(ws, 20)
        assert (frame["type"], frame["id"]) == ("item", held)

        row = await asyncio.to_thread(wait_for_worker, browser, "host-b pid 42", held)
        assert '<td class="th-worker-capacity">2</td>' in row
        assert f'href="{page_of(held)}"' in row
        socket_id = re.search(r'id="th-worker-([0-9a-f]{16})"', row)
        assert socket_id is not None
        drain = reverse("admin:taskhoster_workersocket_drain", args=[socket_id.group(1)])
        token = browser.cookies["csrftoken"]
        answer = await asyncio.to_thread(browser.post, drain, data={"csrfmiddlewaretoken": token})
        assert answer.status_code == 302, answer.text[:500]
        assert await recv(ws, 20) == {"type": "drain"}

        # Drained, it still holds its item: the item page's cancel reaches it too.
        answer = await asyncio.to_thread(
            browser.post,
            cancel_url(held),
            data={"confirm": "yes", "reason": "stop it", "csrfmiddlewaretoken": token},
        )
        assert answer.status_code == 302, answer.text[:500]
        assert await recv(ws, 20) == {"type": "cancel", "id": held, "reason": "cancelled"}
        await send(ws, {"type": "result", "id": held, "result": "too late"})
        ack = await recv(ws, 20)
        assert (ack["type"], ack["id"], ack["accepted"]) == ("ack", held, False)
        await ws.close()
        return str(held)

    try:
        held = asyncio.run(run())
    finally:
        browser.close()
        http.close()
    assert status(held) == ("failed", "cancelled", "stop it")
