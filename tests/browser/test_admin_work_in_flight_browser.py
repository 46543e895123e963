"""Work in flight (SPEC section 8.2) in headless Chromium against a real daphne, with a real
websocket worker: the workers page lists it and drains it, an item page cancels the item it
holds, and an item's page and its "History" button show its attempts. Screenshots go to
``var/screenshots/``."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from django.contrib.auth.models import User
from playwright.sync_api import Page, expect
from websockets.sync.client import connect

from taskhoster import engine
from taskhoster.keys import create_key
from taskhoster.models import Item

from .test_admin_browser import chromium, post, shot

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

WORKER = "browser-host pid 4242"


def frame(ws: Any) -> dict[str, Any]:
    return dict(json.loads(ws.recv(timeout=20)))


def listed(page: Page, url: str, within_ms: int = 20_000) -> None:
    """The workers page, once it lists the worker (its process writes the registry about
    once a second)."""
    row = page.locator("tr.th-worker", has_text=WORKER)
    for _ in range(within_ms // 500):
        page.goto(f"{url}/admin/taskhoster/workersocket/")
        if row.count() and row.locator(".th-held a").count():
            return
        page.wait_for_timeout(500)
    expect(row).to_have_count(1)


def test_work_in_flight_session(
    server_factory: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    User.objects.create_user("op", password="pw-flight", is_staff=True, is_superuser=True)
    engine.upsert_queue(name="q", body={"backoffSeconds": 0, "backoffMaxSeconds": 0})
    told = post("q", {"job": "fails once"})
    first = engine.claim(queue_name="q", max_items=1)[0].row
    engine.fail(item_id=told.id, lease=first.lease, error="boom: disk full")
    engine.claim(queue_name="q", max_items=1)
    engine.submit_result(item_id=told.id, result="ok")
    key = create_key(name="w", scopes=["produce", "work", "manage"])[1]
    server = server_factory(TASKHOSTER_SOCKET_BACKSTOP_SECONDS="120")
    ws_url = server.url.replace("http://", "ws://") + "/work"
    with (
        connect(ws_url, additional_headers={"Authorization": f"Token {key}"}) as ws,
        httpx.Client(base_url=server.url, headers={"Authorization": f"Token {key}"}) as http,
        chromium(monkeypatch) as browser,
    ):
        ws.send(json.dumps({"type": "subscribe", "queues": ["q"], "capacity": 1, "name": WORKER}))
        answer = http.post("/api/queues/q/items", json={"payload": {"job": "long"}})
        assert answer.status_code == 201, answer.text
        held = answer.json()["id"]
        pushed = frame(ws)
        assert (pushed["type"], pushed["id"]) == ("item", held)

        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.set_default_timeout(15_000)
        page.goto(f"{server.url}/admin/taskhoster/")
        page.fill("#id_username", "op")
        page.fill("#id_password", "pw-flight")
        page.click('input[type="submit"]')
        expect(page.locator("#th-workers-link")).to_be_visible()

        # The workers page: the worker, the item it holds (linked); drain it.
        listed(page, server.url)
        row = page.locator("tr.th-worker", has_text=WORKER)
        expect(row.locator(".th-held")).to_contain_text(held)
        expect(row.locator(".th-worker-queues")).to_have_text("q")
        shot(page, "20-workers")
        row.locator("input.th-drain").click()
        expect(page.locator(".messagelist")).to_contain_text("drained")
        expect(row.locator(".th-worker-state")).to_have_text("draining")
        shot(page, "21-worker-drained")
        assert frame(ws) == {"type": "drain"}

        # The held item's page: cancel it, with a reason; the worker is told.
        row.locator(".th-held a").first.click()
        expect(page.locator("#th-cancel")).to_be_visible()
        page.click("#th-cancel")
        expect(page.locator(".th-count-processing")).to_have_text("1")
        page.fill("#th-reason", "the customer withdrew")
        shot(page, "22-cancel-confirm")
        page.click("#th-confirm-yes")
        expect(page.locator(".messagelist")).to_contain_text("Cancelled 1 item(s).")
        expect(page.locator(".field-cancel_reason")).to_contain_text("the customer withdrew")
        expect(page.locator("#th-cancel")).to_have_count(0)
        shot(page, "23-cancelled")
        assert frame(ws) == {"type": "cancel", "id": held, "reason": "cancelled"}
        stored = Item.objects.get(id=held)
        assert (stored.status, stored.error) == ("failed", "cancelled")

        # An item that failed once and then finished: its attempts, on its page and behind
        # its History button.
        page.goto(f"{server.url}/admin/taskhoster/item/{told.id}/change/")
        attempts = page.locator("#th-attempts tbody tr")
        expect(attempts).to_have_count(2)
        expect(attempts.nth(0).locator(".th-attempt-outcome")).to_have_text("fail")
        expect(attempts.nth(0).locator(".th-attempt-error")).to_have_text("boom: disk full")
        expect(attempts.nth(1).locator(".th-attempt-outcome")).to_have_text("result")
        shot(page, "24-item-attempts")
        page.click("a.historylink")
        expect(page.locator("#th-history #th-attempts tbody tr")).to_have_count(2)
        shot(page, "25-item-history")
