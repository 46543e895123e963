"""The admin in headless Chromium (Debian's ``chromium``, driven by Playwright) against a real
daphne: log in, filter, open an item, delete a processing thread head, restart a failed item,
edit a queue. Screenshots go to ``var/screenshots/``."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.db import connections
from playwright.sync_api import Browser, Page, expect, sync_playwright

from taskhoster import engine
from taskhoster.engine import ItemRow, NewItem
from taskhoster.models import Item, Queue, Thread

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SCREENSHOTS = Path(__file__).resolve().parents[2] / "var" / "screenshots"
CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


@contextmanager
def chromium(monkeypatch: pytest.MonkeyPatch) -> Iterator[Browser]:
    """Debian's Chromium under Playwright. Playwright's sync API runs an event loop in this
    thread, so the test's own ORM checks need Django's async-safety check relaxed; the server,
    started before this, does not inherit that."""
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "1")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        try:
            yield browser
        finally:
            browser.close()
            # The ORM opened its own connection in Playwright's context: close it here, or
            # PostgreSQL refuses to drop the test database.
            connections.close_all()


def post(queue: str, payload: Any, **spec: Any) -> ItemRow:
    return engine.post_items(queue_name=queue, items=[NewItem(payload=payload, **spec)])[0].row


def shot(page: Page, name: str) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)


def select_and_run(page: Page, item_id: str, action: str) -> None:
    page.check(f'input[name="_selected_action"][value="{item_id}"]')
    page.select_option('select[name="action"]', action)
    page.click('button[name="index"]')


def test_operator_session(
    server_factory: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    User.objects.create_user("op", password="pw-browser", is_staff=True, is_superuser=True)
    engine.upsert_queue(name="q", body={"maxAttempts": 1})
    failed = post("q", {"job": "will fail"})
    claimed = engine.claim(queue_name="q", max_items=1)[0].row
    engine.fail(item_id=failed.id, lease=claimed.lease, error="boom", retry=False)
    head = post("q", {"job": "head"}, thread_id="t")
    second = post("q", {"job": "second"}, thread_id="t")
    assert [c.row.id for c in engine.claim(queue_name="q", max_items=5)] == [head.id]
    server = server_factory()
    with chromium(monkeypatch) as browser:
        session(browser, server.url, head=head, second=second, failed=failed)


def session(browser: Browser, url: str, *, head: ItemRow, second: ItemRow, failed: ItemRow) -> None:
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.set_default_timeout(15_000)
    # Log in.
    page.goto(f"{url}/admin/")
    page.fill("#id_username", "op")
    page.fill("#id_password", "pw-browser")
    page.click('input[type="submit"]')
    expect(page.locator("#th-overview-link")).to_be_visible()
    shot(page, "01-index")
    page.click("#th-overview-link a")
    expect(page.locator("#th-chart")).to_be_visible()
    shot(page, "02-overview")

    # Filter items by status.
    page.goto(f"{url}/admin/taskhoster/item/")
    page.click('#changelist-filter a:text-is("Processing")')
    expect(page.locator("#result_list")).to_contain_text(head.id)
    expect(page.locator("#result_list")).not_to_contain_text(second.id)
    shot(page, "03-items-processing")

    # Open an item: payload pretty-printed, and no producer fetch recorded.
    page.click(f'#result_list a:text-is("{head.id}")')
    expect(page.locator("pre.th-json").first).to_contain_text('"job": "head"')
    shot(page, "04-item-detail")
    page.go_back()

    # Delete the processing thread head: the next head is promoted at once.
    select_and_run(page, head.id, "delete_selected_items")
    expect(page.locator("#th-total")).to_have_text("1")
    shot(page, "05-delete-confirm")
    page.click("#th-confirm-yes")
    expect(page.locator(".messagelist")).to_contain_text("Deleted 1 item")
    assert not Item.objects.filter(id=head.id).exists()
    assert Item.objects.get(id=second.id).eligible
    thread = Thread.objects.get(thread_id="t")
    page.goto(f"{url}/admin/taskhoster/thread/{thread.pk}/change/")
    expect(page.locator("#th-members")).to_contain_text(second.id)
    shot(page, "06-thread-next-head")
    assert [c.row.id for c in engine.claim(queue_name="q", max_items=5)] == [second.id]

    # Restart a failed item.
    page.goto(f"{url}/admin/taskhoster/item/?status__exact=failed")
    select_and_run(page, failed.id, "restart_selected_items")
    expect(page.locator(".th-count-failed")).to_have_text("1")
    page.click("#th-confirm-yes")
    expect(page.locator(".messagelist")).to_contain_text("Restarted 1 item")
    shot(page, "07-restarted")
    restarted = Item.objects.get(id=failed.id)
    assert restarted.status == "pending"
    assert restarted.attempts == 0

    # Edit a queue setting (validated as the API validates it).
    queue = Queue.objects.get(name="q")
    page.goto(f"{url}/admin/taskhoster/queue/{queue.pk}/change/")
    page.fill("#id_lease_seconds", "0")
    page.click('input[name="_save"]')
    expect(page.locator(".errornote, .errorlist").first).to_be_visible()
    expect(page.locator("body")).to_contain_text("leaseSeconds must be greater than 0")
    shot(page, "08-queue-invalid")
    page.fill("#id_lease_seconds", "45")
    page.click('input[name="_save"]')
    expect(page.locator(".messagelist")).to_contain_text("changed successfully")
    shot(page, "09-queues")
    assert Queue.objects.get(name="q").lease_seconds == 45
