"""The admin: staff only, CSRF-protected, and every change goes through the engine."""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse

from taskhoster import engine
from taskhoster.admin import items as item_admin
from taskhoster.engine import ItemRow, NewItem
from taskhoster.keys import authenticate, hash_key
from taskhoster.models import ApiKey, Item, Queue, Thread

from .admin_users import staff_with

pytestmark = pytest.mark.django_db

ITEMS = reverse("admin:taskhoster_item_changelist")


@pytest.fixture
def staff(db: None) -> Client:
    User.objects.create_user("op", password="pw", is_staff=True, is_superuser=True)
    client = Client(enforce_csrf_checks=True)
    client.login(username="op", password="pw")
    return client


def post(queue: str = "q", payload: Any = None, **spec: Any) -> ItemRow:
    return engine.post_items(queue_name=queue, items=[NewItem(payload=payload, **spec)])[0].row


def csrf(client: Client, url: str) -> str:
    client.get(url)
    return str(client.cookies["csrftoken"].value)


def failed_item(make_queue: Any) -> Item:
    make_queue("q", maxAttempts=1)
    item = post(payload={"n": 1})
    claimed = engine.claim(queue_name="q", max_items=1)[0].row
    engine.fail(item_id=claimed.id, lease=claimed.lease, error="boom", retry=False)
    return Item.objects.get(id=item.id)


@pytest.mark.parametrize(
    "url",
    [
        "/admin/",
        ITEMS,
        "/admin/taskhoster/queue/",
        "/admin/taskhoster/thread/",
        "/admin/taskhoster/apikey/",
        "/admin/taskhoster/queue/overview/",
        "/admin/taskhoster/item/delete-matching/",
        "/admin/taskhoster/item/0661a6f9bee88bdba995/cancel/",
        "/admin/taskhoster/item/0661a6f9bee88bdba995/history/",
        "/admin/taskhoster/workersocket/",
        "/admin/taskhoster/workersocket/0123456789abcdef/drain/",
    ],
)
def test_anonymous_and_non_staff_see_nothing(url: str) -> None:
    anonymous = Client()
    response = anonymous.get(url)
    assert response.status_code == 302
    assert "/admin/login/" in response["Location"]
    User.objects.create_user("u", password="pw", is_staff=False)
    user = Client()
    user.login(username="u", password="pw")
    response = user.get(url)
    assert response.status_code == 302
    assert "/admin/login/" in response["Location"]


def test_item_list_filters_and_search(staff: Client, make_queue: Any) -> None:
    make_queue("q")
    a = post(payload=1, key="k-a", thread_id="t1")
    b = post(payload=2)
    body = staff.get(ITEMS, {"status__exact": "pending"}).content.decode()
    assert "item/delete-matching/?status__exact=pending" in body
    assert a.id in body
    assert b.id in body
    assert b.id not in staff.get(ITEMS, {"q": "t1"}).content.decode()
    assert a.id in staff.get(ITEMS, {"q": "k-a"}).content.decode()
    assert a.id not in staff.get(ITEMS, {"q": b.id}).content.decode()
    for params in ({"attempts": "0"}, {"age": "5m"}, {"threaded": "yes"}, {"o": "6"}):
        assert staff.get(ITEMS, params).status_code == 200


def test_item_detail_shows_payload_and_does_not_count_as_a_fetch(
    staff: Client, make_queue: Any
) -> None:
    make_queue("q", retainFrom="fetched")
    item = post(payload={"hello": "world"})
    engine.claim(queue_name="q", max_items=1)
    engine.submit_result(item_id=item.id, result={"answer": 42})
    body = staff.get(reverse("admin:taskhoster_item_change", args=[item.id])).content.decode()
    assert "&quot;hello&quot;: &quot;world&quot;" in body
    assert "&quot;answer&quot;: 42" in body
    assert Item.objects.get(id=item.id).fetched_at is None


def test_dead_letter_links_both_ways(staff: Client, make_queue: Any) -> None:
    make_queue("dlq")
    make_queue("q", maxAttempts=1, deadLetterQueue="dlq")
    item = post(payload=1)
    claimed = engine.claim(queue_name="q", max_items=1)[0].row
    engine.fail(item_id=item.id, lease=claimed.lease, error="boom", retry=False)
    dead = Item.objects.get(id=item.id)
    assert dead.dead_letter
    body = staff.get(reverse("admin:taskhoster_item_change", args=[item.id])).content.decode()
    assert reverse("admin:taskhoster_item_change", args=[dead.dead_letter]) in body
    body = staff.get(
        reverse("admin:taskhoster_item_change", args=[dead.dead_letter])
    ).content.decode()
    assert reverse("admin:taskhoster_item_change", args=[item.id]) in body


def test_actions_need_csrf(staff: Client, make_queue: Any) -> None:
    make_queue("q")
    item = post(payload=1)
    response = staff.post(
        ITEMS,
        {"action": "delete_selected_items", "_selected_action": [item.id], "confirm": "yes"},
    )
    assert response.status_code == 403
    assert Item.objects.filter(id=item.id).exists()


def test_delete_processing_thread_head_promotes_the_next(staff: Client, make_queue: Any) -> None:
    make_queue("q")
    head = post(payload=1, thread_id="t")
    second = post(payload=2, thread_id="t")
    assert engine.claim(queue_name="q", max_items=5)[0].row.id == head.id
    token = csrf(staff, ITEMS)
    data = {"action": "delete_selected_items", "_selected_action": [head.id]}
    confirm = staff.post(ITEMS, {**data, "csrfmiddlewaretoken": token})
    assert confirm.status_code == 200
    text = confirm.content.decode()
    assert 'id="th-total">1<' in text
    assert "processing" in text
    assert Item.objects.filter(id=head.id).exists()
    done = staff.post(ITEMS, {**data, "confirm": "yes", "csrfmiddlewaretoken": token})
    assert done.status_code == 302
    assert not Item.objects.filter(id=head.id).exists()
    thread = Thread.objects.get(thread_id="t")
    assert thread.processing_item is None
    assert Item.objects.get(id=second.id).eligible
    assert [c.row.id for c in engine.claim(queue_name="q", max_items=5)] == [second.id]


def test_restart_failed_item(staff: Client, make_queue: Any) -> None:
    item = failed_item(make_queue)
    pending = post(payload=2)
    token = csrf(staff, ITEMS)
    data = {
        "action": "restart_selected_items",
        "_selected_action": [item.id, pending.id],
        "csrfmiddlewaretoken": token,
    }
    text = staff.post(ITEMS, data).content.decode()
    assert 'class="th-count-failed">1<' in text
    assert 'class="th-count-pending">1<' in text
    assert staff.post(ITEMS, {**data, "confirm": "yes"}).status_code == 302
    row = Item.objects.get(id=item.id)
    assert row.status == "pending"
    assert row.attempts == 0
    assert row.error is None


def test_delete_matching_filter_in_chunks(
    staff: Client, make_queue: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_queue("q")
    make_queue("other")
    keep = post("other", payload=0)
    gone = [
        r.row.id
        for r in engine.post_items(queue_name="q", items=[NewItem(payload=n) for n in range(7)])
    ]
    calls: list[int] = []
    real = engine.delete_items

    def spy(**kw: Any) -> int:
        ids = list(kw["item_ids"])
        calls.append(len(ids))
        return real(**{**kw, "item_ids": ids})

    monkeypatch.setattr(item_admin, "DELETE_CHUNK", 3)
    monkeypatch.setattr(item_admin.engine, "delete_items", spy)
    queue = Queue.objects.get(name="q")
    url = reverse("admin:taskhoster_item_delete_matching") + f"?queue__id__exact={queue.pk}"
    token = csrf(staff, url)
    text = staff.get(url).content.decode()
    assert 'id="th-total">7<' in text
    response = staff.post(url, {"confirm": "yes", "csrfmiddlewaretoken": token})
    assert response.status_code == 302
    assert calls == [3, 3, 1]
    assert not Item.objects.filter(id__in=gone).exists()
    assert Item.objects.filter(id=keep.id).exists()


def test_queue_create_and_edit_go_through_the_engine(
    staff: Client, make_queue: Any, state_root: Any
) -> None:
    add = reverse("admin:taskhoster_queue_add")
    token = csrf(staff, add)
    fields = {
        "lease_seconds": "30",
        "queue_seconds": "600",
        "retain_seconds": "60",
        "retain_from": "finished",
        "max_attempts": "",
        "backoff_seconds": "1",
        "backoff_max_seconds": "10",
        "dead_letter_queue": "",
        "thread_limit": "1",
        "csrfmiddlewaretoken": token,
    }
    response = staff.post(add, {**fields, "name": "emails"})
    assert response.status_code == 302, response.content.decode()[:2000]
    queue = Queue.objects.get(name="emails")
    assert queue.lease_seconds == 30
    assert (state_root / "emails" / "queue.json").exists()
    change = reverse("admin:taskhoster_queue_change", args=[queue.pk])
    bad = staff.post(change, {**fields, "lease_seconds": "0"})
    assert bad.status_code == 200
    assert "leaseSeconds must be greater than 0" in bad.content.decode()
    bad = staff.post(change, {**fields, "dead_letter_queue": "nope"})
    assert "deadLetterQueue &#x27;nope&#x27; does not exist" in bad.content.decode()
    bad = staff.post(change, {**fields, "backoff_seconds": "20"})
    assert "backoffMaxSeconds must be at least backoffSeconds" in bad.content.decode()
    assert staff.post(change, {**fields, "lease_seconds": "45"}).status_code == 302
    assert Queue.objects.get(name="emails").lease_seconds == 45
    assert '"lease_seconds": 45' in (state_root / "emails" / "queue.json").read_text()


def test_queue_list_counts_link_to_the_filtered_items(staff: Client, make_queue: Any) -> None:
    queue = make_queue("q")
    post(payload=1)
    post(payload=2)
    body = staff.get("/admin/taskhoster/queue/").content.decode()
    assert re.search(r'class="th-count-pending" href="[^"]*status__exact=pending[^"]*">2<', body)
    assert f"queue__id__exact={queue.pk}" in body
    overview = staff.get(reverse("admin:taskhoster_overview")).content.decode()
    assert "<svg" in overview
    assert 'id="th-queues"' in overview
    assert "2 posted" in overview
    assert "Overview" in staff.get("/admin/").content.decode()


def test_thread_pages(staff: Client, make_queue: Any) -> None:
    make_queue("q")
    a = post(payload=1, thread_id="t")
    b = post(payload=2, thread_id="t")
    engine.claim(queue_name="q", max_items=1)
    body = staff.get("/admin/taskhoster/thread/").content.decode()
    assert a.id in body
    thread = Thread.objects.get(thread_id="t")
    detail = staff.get(reverse("admin:taskhoster_thread_change", args=[thread.pk])).content
    text = detail.decode()
    members = text[text.index('id="th-members"') :]
    assert members.index(a.id) < members.index(b.id)


def test_key_created_shown_once_stored_hashed_and_revoked(staff: Client) -> None:
    add = reverse("admin:taskhoster_apikey_add")
    token = csrf(staff, add)
    response = staff.post(
        add,
        {
            "name": "ci",
            "scope_choices": ["produce", "work"],
            "queue_names": "a, b",
            "csrfmiddlewaretoken": token,
        },
        follow=True,
    )
    text = response.content.decode()
    secret = re.search(r"th_[A-Za-z0-9_-]{20,}", text)
    assert secret is not None
    key = ApiKey.objects.get(name="ci")
    assert key.key_hash == hash_key(secret.group(0))
    assert key.scopes == ["produce", "work"]
    assert key.queues == ["a", "b"]
    assert secret.group(0) not in staff.get("/admin/taskhoster/apikey/").content.decode()
    assert (
        secret.group(0)
        not in staff.get(reverse("admin:taskhoster_apikey_change", args=[key.pk])).content.decode()
    )
    assert authenticate(secret.group(0)) is not None
    staff.post(
        "/admin/taskhoster/apikey/",
        {"action": "revoke_keys", "_selected_action": [key.pk], "csrfmiddlewaretoken": token},
    )
    assert authenticate(secret.group(0)) is None


# -- flow control (SPEC section 8.1): pause, resume, limits, priority -----------------------

QUEUES = "/admin/taskhoster/queue/"


def queue_fields(token: str, **changes: str) -> dict[str, str]:
    """A queue's change form as a browser submits it: every setting at its default."""
    return {
        "lease_seconds": "60",
        "queue_seconds": "86400",
        "retain_seconds": "3600",
        "retain_from": "finished",
        "max_attempts": "",
        "backoff_seconds": "1",
        "backoff_max_seconds": "300",
        "dead_letter_queue": "",
        "max_processing": "",
        "rate_count": "",
        "rate_seconds": "",
        "thread_limit": "1",
        "csrfmiddlewaretoken": token,
        **changes,
    }


def test_pausing_a_queue_by_the_admin_action_stops_its_claims_and_resuming_hands_them_out(
    staff: Client, make_queue: Any
) -> None:
    queue = make_queue("q")
    other = make_queue("other")
    item = post(payload=1)
    post("other", payload=2)
    token = csrf(staff, QUEUES)
    response = staff.post(
        QUEUES,
        {"action": "pause_queues", "_selected_action": [queue.pk], "csrfmiddlewaretoken": token},
        follow=True,
    )
    assert response.status_code == 200
    assert "Paused 1 queue(s)" in response.content.decode()
    assert Queue.objects.get(pk=queue.pk).paused
    assert not Queue.objects.get(pk=other.pk).paused, "only the queue selected"
    assert engine.claim(queue_name="q", max_items=5) == [], "a paused queue hands out nothing"
    assert Item.objects.get(id=item.id).status == "pending"
    assert len(engine.claim(queue_name="other", max_items=5)) == 1
    staff.post(
        QUEUES,
        {"action": "resume_queues", "_selected_action": [queue.pk], "csrfmiddlewaretoken": token},
    )
    assert not Queue.objects.get(pk=queue.pk).paused
    assert [c.row.id for c in engine.claim(queue_name="q", max_items=5)] == [item.id]


def test_a_queues_page_pauses_and_resumes_it_by_post_with_csrf_and_shows_what_is_held(
    staff: Client, make_queue: Any, state_root: Any
) -> None:
    queue = make_queue("q")
    post(payload=1)
    post(payload=2)
    change = reverse("admin:taskhoster_queue_change", args=[queue.pk])
    pause = reverse("admin:taskhoster_queue_pause", args=[queue.pk])
    resume = reverse("admin:taskhoster_queue_resume", args=[queue.pk])
    page = staff.get(change).content.decode()
    assert f'action="{pause}"' in page
    assert 'id="th-pause"' in page
    assert 'id="th-paused-note"' not in page
    assert staff.post(pause).status_code == 403, "no CSRF token, no change"
    assert not Queue.objects.get(pk=queue.pk).paused
    token = csrf(staff, change)
    assert staff.get(pause).status_code == 405, "only a POST changes anything"
    answer = staff.post(pause, {"csrfmiddlewaretoken": token})
    assert answer.status_code == 302
    assert answer["Location"] == change
    assert Queue.objects.get(pk=queue.pk).paused
    assert '"paused": true' in (state_root / "q" / "queue.json").read_text()
    page = staff.get(change).content.decode()
    assert 'id="th-resume"' in page
    assert 'id="th-paused-note"' in page
    assert 'id="th-held"' in page
    assert 'class="th-held-paused">2<' in page, "both due items wait for the pause"
    assert engine.claim(queue_name="q", max_items=5) == []
    assert staff.post(resume, {"csrfmiddlewaretoken": token}).status_code == 302
    assert not Queue.objects.get(pk=queue.pk).paused
    assert len(engine.claim(queue_name="q", max_items=5)) == 2
    missing = reverse("admin:taskhoster_queue_pause", args=[queue.pk + 1000])
    assert staff.post(missing, {"csrfmiddlewaretoken": token}).status_code == 404


def test_a_view_only_staff_user_cannot_pause_a_queue(make_queue: Any) -> None:
    queue = make_queue("q")
    viewer = staff_with("view_queue")
    page = viewer.get(QUEUES).content.decode()
    assert "pause_queues" not in page, "the action is not offered"
    change = reverse("admin:taskhoster_queue_change", args=[queue.pk])
    assert 'id="th-pause"' not in viewer.get(change).content.decode()
    token = csrf(viewer, QUEUES)
    viewer.post(
        QUEUES,
        {"action": "pause_queues", "_selected_action": [queue.pk], "csrfmiddlewaretoken": token},
    )
    pause = reverse("admin:taskhoster_queue_pause", args=[queue.pk])
    assert viewer.post(pause, {"csrfmiddlewaretoken": token}).status_code == 403
    assert not Queue.objects.get(pk=queue.pk).paused, "nothing changed"
    allowed = staff_with("view_queue", "change_queue")
    assert "pause_queues" in allowed.get(QUEUES).content.decode()
    assert allowed.post(pause, {"csrfmiddlewaretoken": csrf(allowed, QUEUES)}).status_code == 302
    assert Queue.objects.get(pk=queue.pk).paused


def test_the_queue_form_saves_the_flow_limits_and_refuses_a_bad_rate_limit_with_a_message(
    staff: Client, make_queue: Any, state_root: Any
) -> None:
    queue = make_queue("q")
    change = reverse("admin:taskhoster_queue_change", args=[queue.pk])
    token = csrf(staff, change)
    page = staff.get(change).content.decode()
    for name in ("paused", "max_processing", "rate_count", "rate_seconds", "thread_limit"):
        assert f'name="{name}"' in page, name
    limits = {
        "max_processing": "5",
        "rate_count": "10",
        "rate_seconds": "60",
        "thread_limit": "3",
    }
    answer = staff.post(change, queue_fields(token, **limits))
    assert answer.status_code == 302, answer.content.decode()[:3000]
    saved = Queue.objects.get(pk=queue.pk)
    assert (saved.max_processing, saved.thread_limit, saved.paused) == (5, 3, False)
    assert saved.rate_limit == {"count": 10, "seconds": 60}
    stored = (state_root / "q" / "queue.json").read_text()
    assert '"rate_limit": {"count": 10, "seconds": 60}' in stored
    page = staff.get(change).content.decode()
    assert 'name="rate_count" value="10"' in page, "the form shows the rate limit it holds"
    refused = {
        "rate_count": ("0", "rateLimit.count must be an integer from 1 to 1000000"),
        "rate_seconds": ("0", "rateLimit.seconds must be a number greater than 0"),
        "max_processing": ("0", "maxProcessing must be at least 1"),
        "thread_limit": ("0", "threadLimit must be at least 1"),
    }
    for field, (value, message) in refused.items():
        bad = staff.post(change, queue_fields(token, **{**limits, field: value}))
        assert bad.status_code == 200, field
        assert message in bad.content.decode(), field
    half = staff.post(change, queue_fields(token, **{**limits, "rate_seconds": ""}))
    assert "rateLimit needs both a count and seconds" in half.content.decode()
    assert Queue.objects.get(pk=queue.pk).rate_limit == {"count": 10, "seconds": 60}
    # Empty fields: no limits (null), and the queue is as before.
    assert staff.post(change, queue_fields(token)).status_code == 302
    cleared = Queue.objects.get(pk=queue.pk)
    assert (cleared.max_processing, cleared.rate_limit, cleared.thread_limit) == (None, None, 1)
    # The paused box of the form pauses it too.
    assert staff.post(change, queue_fields(token, paused="on")).status_code == 302
    assert Queue.objects.get(pk=queue.pk).paused


def test_the_overview_and_the_queue_list_show_a_paused_queue_as_paused(
    staff: Client, make_queue: Any
) -> None:
    make_queue(
        "stopped",
        paused=True,
        maxProcessing=5,
        rateLimit={"count": 10, "seconds": 60},
        threadLimit=2,
    )
    make_queue("running")
    for url in (reverse("admin:taskhoster_overview"), QUEUES):
        body = staff.get(url).content.decode()
        rows = {
            name: row
            for row in re.findall(r"<tr.*?</tr>", body, re.S)
            for name in ("stopped", "running")
            if f">{name}<" in row
        }
        assert 'class="th-paused"' in rows["stopped"], url
        assert ">paused<" in rows["stopped"], url
        for limit in ("maxProcessing 5", "rateLimit 10 per 60 s", "threadLimit 2"):
            assert limit in rows["stopped"], (url, limit)
        assert "th-paused" not in rows["running"], url
        assert "maxProcessing" not in rows["running"], url


def test_the_item_list_shows_and_filters_priority(staff: Client, make_queue: Any) -> None:
    make_queue("q")
    urgent = post(payload=1, priority=7)
    plain = post(payload=2)
    body = staff.get(ITEMS).content.decode()
    assert "column-priority" in body
    assert re.search(r'<td class="field-priority">7</td>', body)
    for value in ("7", "1+"):
        body = staff.get(ITEMS, {"priority": value}).content.decode()
        assert urgent.id in body, value
        assert plain.id not in body, value
    body = staff.get(ITEMS, {"priority": "0"}).content.decode()
    assert plain.id in body
    assert urgent.id not in body
    detail = staff.get(reverse("admin:taskhoster_item_change", args=[urgent.id])).content
    assert b"field-priority" in detail


def test_a_threads_page_shows_its_processing_members_under_a_thread_limit(
    staff: Client, make_queue: Any
) -> None:
    make_queue("q", threadLimit=2)
    first = post(payload=1, thread_id="t")
    post(payload=2, thread_id="t")
    post(payload=3, thread_id="t")
    assert len(engine.claim(queue_name="q", max_items=5)) == 2, "two at once under threadLimit 2"
    body = staff.get("/admin/taskhoster/thread/").content.decode()
    cell = re.search(r'<td class="field-processing_members">(.*?)</td>', body)
    assert cell is not None
    assert first.id in cell.group(1)
    assert "and 1 more" in cell.group(1)


# -- Django's model permissions: a staff user may do what its permissions say, no more -------


@pytest.mark.parametrize(
    ("action", "needs"),
    [("delete_selected_items", "delete_item"), ("restart_selected_items", "change_item")],
)
def test_a_view_only_staff_user_cannot_use_an_item_action(
    make_queue: Any, action: str, needs: str
) -> None:
    item = failed_item(make_queue)
    viewer = staff_with("view_item", "view_queue")
    page = viewer.get(ITEMS)
    assert page.status_code == 200
    assert action not in page.content.decode(), "the action is not offered"
    token = csrf(viewer, ITEMS)
    data = {"action": action, "_selected_action": [item.id], "confirm": "yes"}
    viewer.post(ITEMS, {**data, "csrfmiddlewaretoken": token})
    stored = Item.objects.get(id=item.id)
    assert (stored.status, stored.attempts) == ("failed", item.attempts), "nothing changed"
    allowed = staff_with("view_item", needs)
    assert action in allowed.get(ITEMS).content.decode()
    allowed.post(ITEMS, {**data, "csrfmiddlewaretoken": csrf(allowed, ITEMS)})
    changed = Item.objects.filter(id=item.id).first()
    assert changed is None or changed.status == "pending", "with the permission, it works"


def test_a_view_only_staff_user_cannot_delete_matching(make_queue: Any) -> None:
    make_queue("q")
    item = post(payload=1)
    viewer = staff_with("view_item")
    url = reverse("admin:taskhoster_item_delete_matching")
    assert "th-delete-matching" not in viewer.get(ITEMS).content.decode()
    assert viewer.get(url).status_code == 403
    token = csrf(viewer, ITEMS)
    assert viewer.post(url, {"confirm": "yes", "csrfmiddlewaretoken": token}).status_code == 403
    assert Item.objects.filter(id=item.id).exists()


def test_a_staff_user_without_view_queue_does_not_see_the_overview(make_queue: Any) -> None:
    make_queue("secret-queue-name")
    nobody = staff_with()
    answer = nobody.get("/admin/taskhoster/queue/overview/")
    assert answer.status_code == 403
    assert b"secret-queue-name" not in answer.content
    assert b"th-overview-link" not in nobody.get("/admin/").content
    viewer = staff_with("view_queue")
    assert b"secret-queue-name" in viewer.get("/admin/taskhoster/queue/overview/").content


def test_a_view_only_staff_user_cannot_revoke_a_key() -> None:
    from taskhoster.keys import create_key

    key, secret = create_key(name="k", scopes=["work"])
    url = "/admin/taskhoster/apikey/"
    viewer = staff_with("view_apikey")
    assert "revoke_keys" not in viewer.get(url).content.decode()
    token = csrf(viewer, url)
    viewer.post(
        url, {"action": "revoke_keys", "_selected_action": [key.pk], "csrfmiddlewaretoken": token}
    )
    assert authenticate(secret) is not None, "the key still works"
    allowed = staff_with("view_apikey", "change_apikey")
    allowed.post(
        url,
        {
            "action": "revoke_keys",
            "_selected_action": [key.pk],
            "csrfmiddlewaretoken": csrf(allowed, url),
        },
    )
    assert authenticate(secret) is None


def test_the_item_list_sorts_only_by_the_columns_an_index_serves(
    staff: Client, make_queue: Any
) -> None:
    make_queue("q")
    for n in range(3):
        post("q", n)
    by_attempts = item_admin.ItemAdmin.list_display.index("attempts") + 1
    scheduled = item_admin.ItemAdmin.list_display.index("scheduled") + 1
    unindexed = staff.get(ITEMS, {"o": str(by_attempts)}).context["cl"]
    assert "attempts" not in str(unindexed.queryset.query.order_by)
    indexed = staff.get(ITEMS, {"o": str(scheduled)}).context["cl"]
    assert "scheduled_at" in str(indexed.queryset.query.order_by)
