"""Taskhoster's admin pages in headless Chromium at 1280x800: every column of the item list
is visible (nothing clipped or scrolled away, even with a 64-character queue name and a
200-character threadId), and every time is shown to the second."""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import User
from playwright.sync_api import Page, expect

from taskhoster import engine
from taskhoster.keys import create_key
from taskhoster.timeutil import now as utcnow

from .test_admin_browser import chromium, post, shot

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

LONG_QUEUE = "Q" * 64
LONG_THREAD = "customer-" + "x" * 191
SECONDS = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d$")
COLUMNS = [
    "id",
    "queue",
    "status",
    "priority",
    "thread id",
    "attempts",
    "scheduled at",
    "posted at",
    "finished at",
]


def log_in(page: Page, url: str) -> None:
    page.goto(f"{url}/admin/login/")
    page.fill("#id_username", "op")
    page.fill("#id_password", "pw-layout")
    page.click('input[type="submit"]')
    expect(page.locator("#user-tools")).to_be_visible()


@pytest.fixture
def staff(db: None) -> None:
    User.objects.create_user("op", password="pw-layout", is_staff=True, is_superuser=True)


def test_every_column_of_the_item_list_is_visible_at_1280_px(
    staff: None, server_factory: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine.upsert_queue(name=LONG_QUEUE, body={})
    engine.upsert_queue(name="q", body={})
    post(LONG_QUEUE, {"n": 1}, thread_id=LONG_THREAD)
    done = post("q", {"n": 2}, thread_id=LONG_THREAD[:150])
    held = engine.claim(queue_name="q", max_items=1)[0]
    assert held.row.id == done.id
    engine.submit_result(item_id=done.id, result="ok")
    for n in range(5):
        post("q", n)
    # A worker's progress (SPEC section 8.2), long: a line under the status, cut to it.
    busy = engine.claim(queue_name="q", max_items=1)[0].row
    progress = {"step": "resizing the images of the catalogue", "done": 1234, "of": 99999}
    assert engine.report_progress(item_id=busy.id, lease=busy.lease, progress=progress)[0]
    server = server_factory()
    with chromium(monkeypatch) as browser:
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        page.set_default_timeout(15_000)
        log_in(page, server.url)
        page.goto(f"{server.url}/admin/taskhoster/item/")
        expect(page.locator("#result_list")).to_be_visible()
        shot(page, "10-items-1280")

        headers = [
            text.strip().lower()
            for text in page.locator("#result_list thead th").all_inner_texts()
            if text.strip()
        ]
        assert headers == COLUMNS
        # The table fits its container: nothing to scroll sideways, nothing cut off.
        sizes = page.evaluate(
            """() => {
                const table = document.querySelector('#result_list');
                const box = document.querySelector('#changelist-form .results');
                return {table: table.scrollWidth, box: box.clientWidth,
                        page: document.documentElement.scrollWidth,
                        right: box.getBoundingClientRect().right};
            }"""
        )
        assert sizes["table"] <= sizes["box"], sizes
        assert sizes["page"] <= 1280, sizes
        for cell in page.locator("#result_list thead th, #result_list tbody tr td").all():
            box = cell.bounding_box()
            assert box is not None
            assert box["x"] >= 0
            assert box["x"] + box["width"] <= sizes["right"] + 0.5, (cell.inner_text(), box)
        # A long name is cut to its column and whole in its tooltip.
        queue = page.locator(f'#result_list td.field-queue_name .th-cut[title="{LONG_QUEUE}"]')
        expect(queue).to_have_count(1)
        thread = page.locator(f'#result_list .th-cut[title="{LONG_THREAD}"]')
        expect(thread).to_have_count(1)
        # The progress takes its status cell's width, never more.
        line = page.locator("#result_list td.field-status_column .th-progress-line")
        expect(line).to_have_count(1)
        assert (line.get_attribute("title") or "").startswith('progress: {"done":1234')
        status_cell = page.locator(
            "#result_list td.field-status_column:has(.th-progress-line)"
        ).bounding_box()
        inside = line.bounding_box()
        assert status_cell is not None
        assert inside is not None
        right = status_cell["x"] + status_cell["width"]
        assert inside["x"] + inside["width"] <= right + 0.5, (inside, status_cell)


def test_the_admin_shows_times_to_the_second(
    staff: None, server_factory: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine.upsert_queue(name="q", body={})
    at = (utcnow() - timedelta(hours=1)).replace(second=7, microsecond=250_000)
    item = post("q", {"n": 1}, scheduled_at=at)
    claimed = engine.claim(queue_name="q", max_items=1)[0].row
    assert claimed.lease_expires_at is not None
    expires = claimed.lease_expires_at.strftime("%Y-%m-%d %H:%M:%S")
    create_key(name="k", scopes=["produce"])
    server = server_factory()
    with chromium(monkeypatch) as browser:
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        page.set_default_timeout(15_000)
        log_in(page, server.url)

        page.goto(f"{server.url}/admin/taskhoster/item/")
        scheduled = page.locator("#result_list td.field-scheduled time").first
        assert scheduled.inner_text().split() == [at.strftime("%Y-%m-%d"), at.strftime("%H:%M:%S")]
        assert scheduled.get_attribute("datetime") == at.isoformat()
        for cell in page.locator("#result_list td.field-posted time").all_inner_texts():
            assert SECONDS.match(" ".join(cell.split())), cell

        page.goto(f"{server.url}/admin/taskhoster/item/{item.id}/change/")
        shot(page, "11-item-seconds")
        texts = {
            name: page.locator(f".field-{name} .readonly").inner_text().strip()
            for name in ("scheduled", "posted", "lease_expires", "claimed")
        }
        assert texts["scheduled"] == at.strftime("%Y-%m-%d %H:%M:%S")
        assert texts["lease_expires"] == expires
        assert all(SECONDS.match(text) for text in texts.values()), texts
        expect(page.locator("body")).not_to_contain_text(re.compile(r"[ap]\.m\."))

        page.goto(f"{server.url}/admin/taskhoster/apikey/")
        created = page.locator("#result_list td.field-created").first.inner_text()
        assert SECONDS.match(created.strip()), created
