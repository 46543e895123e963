"""The live admin (issue 24) in headless Chromium against a real daphne, never reloading a page:

- the overview's count moves while items are posted from another process (on PostgreSQL +
  Redis, a second daphne: the posts, the worker's socket and its progress go there, while the
  browser's pages come from the first; on SQLite, this test's process posting over HTTP);
- a processing item's page shows its holder's name and the progress a real socket worker
  reported, and its cancel button makes that worker receive ``cancel``;
- a drained worker leaves the workers page when it closes its socket.

Each check first marks the page (``window.thMark``) and checks the mark is still there
afterwards: the page was redrawn in place, not loaded again. Screenshots go to
``var/screenshots/`` (``30-…``, ``31-…``, ``32-…``; those in ``docs/screenshots/`` were taken
from this test under load)."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from django.contrib.auth.models import User
from playwright.sync_api import Page, expect
from websockets.sync.client import connect

from taskhoster import engine
from taskhoster.keys import create_key

from ..conftest import database_url
from .test_admin_browser import chromium, shot

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

WORKER = "indexer-7 on host-a"
SHARED = bool(os.environ.get("REDIS_URL")) and not database_url().startswith("sqlite")
# Within two seconds of a change, the issue asks; the margin is for a loaded CI machine.
LIVE_MS = 4_000


def frame_of(ws: Any, kind: str) -> dict[str, Any]:
    """The next frame of type ``kind`` (acks of progress may come first)."""
    for _ in range(20):
        message = dict(json.loads(ws.recv(timeout=20)))
        if message["type"] == kind:
            return message
    raise AssertionError(f"no {kind} frame")


def mark(page: Page) -> None:
    page.evaluate("window.thMark = 1")


def still_marked(page: Page) -> None:
    assert page.evaluate("window.thMark") == 1, "the page was loaded again"


def log_in(page: Page, url: str) -> None:
    page.goto(f"{url}/admin/taskhoster/")
    page.fill("#id_username", "op")
    page.fill("#id_password", "pw-live")
    page.click('input[type="submit"]')
    expect(page.locator("#th-overview-link")).to_be_visible()


@contextmanager
def load(http: httpx.Client, queue: str) -> Iterator[None]:
    """Items posted and claimed and finished over HTTP in a thread while the block runs."""
    stop = threading.Event()

    def run() -> None:
        while not stop.is_set():
            http.post(
                f"/api/queues/{queue}/items", json={"items": [{"payload": n} for n in range(20)]}
            )
            claimed = http.post(f"/api/queues/{queue}/claim", json={"max": 12}).json()
            for item in claimed.get("items", []):
                http.post(f"/api/items/{item['id']}/result", json={"result": "ok"})
            stop.wait(0.2)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    try:
        yield
    finally:
        stop.set()
        worker.join(timeout=30)


def test_the_admin_redraws_itself_without_a_reload(
    server_factory: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    User.objects.create_user("op", password="pw-live", is_staff=True, is_superuser=True)
    engine.upsert_queue(name="live", body={})
    engine.upsert_queue(name="busy", body={})
    key = create_key(name="w", scopes=["produce", "work", "manage"])[1]
    server = server_factory(TASKHOSTER_SOCKET_BACKSTOP_SECONDS="120")
    # On PostgreSQL + Redis the changes come from a second server process: the posts, the
    # worker's socket and its progress; the browser's pages are the first one's.
    other = server_factory(TASKHOSTER_SOCKET_BACKSTOP_SECONDS="120") if SHARED else server
    ws_url = other.url.replace("http://", "ws://") + "/work"
    auth = {"Authorization": f"Token {key}"}
    with (
        httpx.Client(base_url=other.url, headers=auth, timeout=30) as http,
        chromium(monkeypatch) as browser,
    ):
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.set_default_timeout(15_000)
        log_in(page, server.url)

        # The overview: a count moves while another process posts.
        page.goto(f"{server.url}/admin/taskhoster/queue/overview/")
        pending = page.locator("#th-queues tr", has_text="live").locator(".th-count-pending")
        expect(pending).to_have_text("0")
        expect(page.locator("#th-live-status")).to_have_attribute("data-th-live-state", "live")
        mark(page)
        answer = http.post(
            "/api/queues/live/items", json={"items": [{"payload": n} for n in range(5)]}
        )
        assert answer.status_code == 201, answer.text
        expect(pending).to_have_text("5", timeout=LIVE_MS)
        still_marked(page)
        asked: list[float] = []
        page.on(
            "request",
            lambda r: (
                asked.append(time.monotonic()) if r.headers.get("x-taskhoster-live") else None
            ),
        )
        with load(http, "busy"):
            busy = page.locator("#th-queues tr", has_text="busy").locator(".th-count-finished")
            expect(busy).not_to_have_text("0", timeout=LIVE_MS)
            began = time.monotonic()
            page.wait_for_timeout(3_000)
            shot(page, "30-overview-live")
        # Coalesced: under load the tab still asks about once a second, never per change.
        during = [t for t in asked if t >= began]
        assert 1 <= len(during) <= 5, f"{len(during)} redraws in 3 s"
        still_marked(page)

        with connect(ws_url, additional_headers=auth) as ws:
            ws.send(
                json.dumps({"type": "subscribe", "queues": ["live"], "capacity": 1, "name": WORKER})
            )
            pushed = frame_of(ws, "item")
            held = pushed["id"]

            # Its page: the holder, then the progress the worker reports while it is open.
            page.goto(f"{server.url}/admin/taskhoster/item/{held}/change/")
            expect(page.locator(".field-claimed_by .readonly")).to_have_text(WORKER)
            expect(page.locator(".field-lease_remaining .readonly")).to_contain_text("left")
            mark(page)
            ws.send(json.dumps({"type": "progress", "id": held, "progress": {"done": 3, "of": 4}}))
            assert frame_of(ws, "ack")["accepted"] is True
            expect(page.locator(".field-progress_shown .th-percent")).to_have_text(
                "75%", timeout=LIVE_MS
            )
            still_marked(page)
            shot(page, "31-item-processing")

            # The workers page: the worker, holding the item.
            page.goto(f"{server.url}/admin/taskhoster/workersocket/")
            row = page.locator("tr.th-worker", has_text=WORKER)
            expect(row.locator(".th-held")).to_contain_text(held, timeout=LIVE_MS)
            expect(row.locator(".th-worker-process")).to_contain_text("pid")
            shot(page, "32-workers")

            # In flight: the item, its holder and its progress.
            page.goto(f"{server.url}/admin/taskhoster/item/processing/")
            flight = page.locator(f"#th-flight-{held}")
            expect(flight.locator(".th-holder")).to_have_text(WORKER)
            expect(flight.locator(".th-percent")).to_have_text("75%")
            shot(page, "33-in-flight")

            # Cancel from the item's page: the worker is told.
            page.goto(f"{server.url}/admin/taskhoster/item/{held}/change/")
            page.click("#th-cancel")
            page.click("#th-confirm-yes")
            expect(page.locator(".messagelist")).to_contain_text("Cancelled 1 item(s).")
            assert frame_of(ws, "cancel") == {"type": "cancel", "id": held, "reason": "cancelled"}

            # Drain it from the workers page; it closes; its row goes without a reload.
            page.goto(f"{server.url}/admin/taskhoster/workersocket/")
            row.locator("input.th-drain").click()
            expect(row.locator(".th-worker-state")).to_have_text("draining")
            assert frame_of(ws, "drain") == {"type": "drain"}
            mark(page)
        expect(row).to_have_count(0, timeout=LIVE_MS)
        expect(page.locator("#th-no-workers")).to_be_visible()
        still_marked(page)
