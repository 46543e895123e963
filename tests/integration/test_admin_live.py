"""The admin's live pages (issue 24): each page's script asks for the page again with the header
``X-Taskhoster-Live: 1`` and gets only its regions, as JSON. These tests ask as the script does
(Django's test client, the real engine and files) and check what the regions say, that a
redraw is as guarded as the page, that it costs the same few queries however many queues there
are, and that it never takes the page's messages. The browser tests
(``tests/browser/test_admin_live_browser.py``) prove the script redraws them on the screen."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.contrib.auth.models import Permission, User
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from taskhoster import engine
from taskhoster.admin.common import fraction, lease_left
from taskhoster.engine import NewItem
from taskhoster.models import Queue
from taskhoster.timeutil import now as utcnow

pytestmark = pytest.mark.django_db

LIVE = {"HTTP_X_TASKHOSTER_LIVE": "1"}
OVERVIEW = reverse("admin:taskhoster_overview")
PROCESSING = reverse("admin:taskhoster_item_processing")
WORKERS = reverse("admin:taskhoster_workersocket_changelist")


@pytest.fixture
def staff(db: None) -> Client:
    User.objects.create_user("op", password="pw", is_staff=True, is_superuser=True)
    client = Client()
    client.login(username="op", password="pw")
    return client


def regions(client: Client, url: str) -> dict[str, str]:
    answer = client.get(url, **LIVE)  # type: ignore[arg-type]
    assert answer.status_code == 200, answer.content[:300]
    assert answer["Content-Type"] == "application/json"
    assert "no-store" in answer["Cache-Control"]
    body = json.loads(answer.content)
    assert set(body) == {"at", "regions"}
    return dict(body["regions"])


def post(queue: str, n: int = 1, **spec: Any) -> list[str]:
    items = [NewItem(payload=i, **spec) for i in range(n)]
    return [a.row.id for a in engine.post_items(queue_name=queue, items=items)]


def held(queue: str, holder: str) -> Any:
    """Claim one item of ``queue`` as a socket named ``holder`` would."""
    return engine.execute(engine.Claim(queue_name=queue, max_items=1, holders=(holder,)))[0].row


def test_a_live_overview_answers_its_regions_and_they_follow_the_index(
    staff: Client, make_queue: Any
) -> None:
    make_queue("mail")
    before = regions(staff, OVERVIEW)
    assert set(before) == {"summary", "queues"}, "the chart is not redrawn"
    assert 'class="th-count-pending" href' in before["queues"]
    assert ">0</a>" in before["queues"]
    post("mail", 3)
    after = regions(staff, OVERVIEW)
    pending = after["queues"].split('class="th-count-pending"')[1]
    assert pending.split(">", 1)[1].startswith("3</a>"), "the new count, without a reload"
    assert '<span id="th-posted-1m">3</span>' in after["summary"], "posted in the last minute"
    page = staff.get(OVERVIEW).content.decode()
    assert 'data-th-region="queues"' in page
    assert "taskhoster/live.js" in page
    assert 'id="th-chart"' in page, "a visit draws the chart"


def test_a_live_redraw_costs_the_same_queries_with_ten_queues_or_a_hundred(
    staff: Client, make_queue: Any
) -> None:
    def queries() -> int:
        with CaptureQueriesContext(connection) as seen:
            regions(staff, OVERVIEW)
        return len(seen)

    for n in range(10):
        make_queue(f"q{n}")
    at_ten = queries()
    for n in range(10, 100):
        make_queue(f"q{n}")
    assert queries() == at_ten
    assert at_ten <= 12, f"a redraw of the overview takes a few queries, not {at_ten}"


def test_a_live_redraw_is_guarded_as_the_page_is(make_queue: Any, db: None) -> None:
    make_queue("q")
    anonymous = Client()
    answer = anonymous.get(OVERVIEW, **LIVE)  # type: ignore[arg-type]
    assert answer.status_code == 302, "to the login page, no region"
    User.objects.create_user("plain", password="pw", is_staff=False)
    plain = Client()
    plain.login(username="plain", password="pw")
    assert plain.get(OVERVIEW, **LIVE).status_code == 302  # type: ignore[arg-type]
    viewer = User.objects.create_user("viewer", password="pw", is_staff=True)
    viewer.user_permissions.set(Permission.objects.filter(codename="view_item"))
    client = Client()
    client.login(username="viewer", password="pw")
    assert client.get(OVERVIEW, **LIVE).status_code == 403, "items only: no queues"  # type: ignore[arg-type]
    assert client.get(PROCESSING, **LIVE).status_code == 200  # type: ignore[arg-type]


def test_a_live_redraw_leaves_the_pages_messages_for_the_next_visit(
    staff: Client, make_queue: Any
) -> None:
    queue = make_queue("q")
    page = reverse("admin:taskhoster_queue_change", args=[queue.pk])
    staff.post(reverse("admin:taskhoster_queue_pause", args=[queue.pk]))
    regions(staff, page)
    regions(staff, OVERVIEW)
    shown = [str(m) for m in staff.get(page).context["messages"]]
    assert any("paused" in m for m in shown), shown


def test_a_queue_page_redraws_its_counts_held_items_and_pause_button(
    staff: Client, make_queue: Any
) -> None:
    queue = make_queue("q")
    page = reverse("admin:taskhoster_queue_change", args=[queue.pk])
    first = regions(staff, page)
    assert {"pending", "processing", "finished", "failed", "oldest", "held"} <= set(first)
    assert 'id="th-pause"' in first["flow-button"]
    assert "th-paused-note" not in first["paused-note"]
    post("q", 2)
    engine.upsert_queue(name="q", body={"paused": True})
    then = regions(staff, page)
    assert ">2</a>" in then["pending"]
    assert 'id="th-resume"' in then["flow-button"], "paused from elsewhere: the button flips"
    assert "th-paused-note" in then["paused-note"]
    assert 'class="th-held-paused">2<' in then["held"]


def test_an_item_page_redraws_holder_lease_and_progress_and_says_when_it_is_gone(
    staff: Client, make_queue: Any
) -> None:
    make_queue("q", leaseSeconds=60)
    (item_id,) = post("q")
    page = reverse("admin:taskhoster_item_change", args=[item_id])
    first = regions(staff, page)
    assert 'id="th-cancel"' in first["tools"]
    assert set(first) == {"tools", "fieldset-1", "fieldset-2"}, "no payload in a redraw"
    claimed = held("q", "indexer-7")
    engine.report_progress(item_id=item_id, lease=claimed.lease, progress={"done": 3, "of": 4})
    then = regions(staff, page)
    assert "indexer-7" in then["fieldset-1"]
    assert 'value="0.7500"' in then["fieldset-1"], "a bar"
    assert "75%" in then["fieldset-1"]
    assert "s left" in then["fieldset-1"], "the lease's time left"
    engine.delete_items(item_ids=[item_id])
    gone = json.loads(staff.get(page, **LIVE).content)  # type: ignore[arg-type]
    assert gone["gone"] is True


def test_items_in_flight_lists_each_processing_item_with_its_holder_soonest_lease_first(
    staff: Client, make_queue: Any
) -> None:
    make_queue("a", leaseSeconds=300)
    make_queue("b", leaseSeconds=30)
    post("a")
    post("b")
    post("b")  # stays pending: not in flight
    slow = held("a", "w-slow")
    fast = held("b", "w-fast")
    engine.report_progress(item_id=fast.id, lease=fast.lease, progress=0.5)
    flight = regions(staff, PROCESSING)["flight"]
    assert flight.index(fast.id) < flight.index(slow.id), "the lease ending soonest first"
    assert "w-fast" in flight
    assert "w-slow" in flight
    assert "2 processing" in flight
    assert 'value="0.5000"' in flight
    one = regions(staff, PROCESSING + "?queue=a")["flight"]
    assert slow.id in one
    assert fast.id not in one
    assert "1 processing" in one


def test_the_workers_page_redraws_its_rows(staff: Client) -> None:
    assert "th-no-workers" in regions(staff, WORKERS)["workers"]


@pytest.mark.parametrize(
    ("value", "share"),
    [
        (0.25, 0.25),
        (1, 1.0),
        ({"done": 1, "of": 4}, 0.25),
        ({"done": 5, "of": 4}, None),
        ({"done": 1, "of": 0}, None),
        ({"done": True, "of": 2}, None),
        (True, None),
        (7, None),
        ("half", None),
        ({"stage": "upload"}, None),
    ],
)
def test_a_progress_bar_is_drawn_only_when_the_progress_says_how_far(
    value: Any, share: float | None
) -> None:
    assert fraction(value) == share


def test_a_lease_is_shown_as_time_left_or_lapsed() -> None:
    from datetime import timedelta

    now = utcnow()
    assert lease_left(now + timedelta(seconds=42.5), now) == "42 s left"
    assert lease_left(now - timedelta(seconds=3), now) == "lapsed 3 s ago"
    assert lease_left(None, now) == "-"


def test_a_progress_number_too_large_for_a_float_draws_no_bar_and_breaks_no_page(
    staff: Client, make_queue: Any
) -> None:
    make_queue("q")
    (item_id,) = post("q")
    claimed = held("q", "w")
    huge = 10**400
    engine.report_progress(
        item_id=item_id, lease=claimed.lease, progress={"done": huge, "of": huge}
    )
    for url in (reverse("admin:taskhoster_item_change", args=[item_id]), PROCESSING):
        answer = staff.get(url)
        assert answer.status_code == 200
        assert "th-progress-bar" not in answer.content.decode()


def test_saving_a_queue_form_keeps_a_pause_made_elsewhere_since_it_loaded(
    staff: Client, make_queue: Any
) -> None:
    queue = make_queue("q", leaseSeconds=60)
    page = reverse("admin:taskhoster_queue_change", args=[queue.pk])
    form = staff.get(page).context["adminform"].form
    data: dict[str, Any] = {}
    for name in form.fields:
        value = form.initial.get(name)
        shown = "" if value is None else value
        data[f"initial-{name}"] = shown  # the hidden input with what the page showed
        data[name] = shown
    data = {k: v for k, v in data.items() if v is not False}
    engine.upsert_queue(name="q", body={"paused": True})  # from the API, meanwhile
    data["lease_seconds"] = 90
    answer = staff.post(page, data)
    assert answer.status_code == 302, answer.content[:500]
    row = Queue.objects.get(name="q")
    assert row.lease_seconds == 90
    assert row.paused is True, "the save sent only what was changed on the form"
