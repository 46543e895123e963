"""The admin's side of issue 24, "What happened" and "Acting on many": cancelling or
restarting every item the list's filter matches (each behind the confirmation page, through
the engine, only with the permission to change items), the filter by error, and on a failed
item's page its "Restart item" button and its dead-letter copy.

Django's test client drives the admin over the real engine and real item files."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse

from taskhoster import engine
from taskhoster.admin import bulk
from taskhoster.engine import NewItem
from taskhoster.models import Item, Queue

from .admin_users import staff_with

pytestmark = pytest.mark.django_db

ITEMS = reverse("admin:taskhoster_item_changelist")
CANCEL_MATCHING = reverse("admin:taskhoster_item_cancel_matching")
RESTART_MATCHING = reverse("admin:taskhoster_item_restart_matching")


def csrf(client: Client, url: str = ITEMS) -> str:
    client.get(url)
    return str(client.cookies["csrftoken"].value)


def pending(queue: str, n: int = 1) -> list[str]:
    posted = engine.post_items(queue_name=queue, items=[NewItem(payload=k) for k in range(n)])
    return [p.row.id for p in posted]


def failed(queue: str, error: str, n: int = 1) -> list[str]:
    """``n`` items of ``queue`` that failed with ``error`` (the queue has no other pending
    items: each is claimed as it is posted)."""
    ids = []
    for item_id in pending(queue, n):
        claimed = engine.claim(queue_name=queue, max_items=1)[0].row
        assert claimed.id == item_id
        engine.fail(item_id=item_id, lease=claimed.lease, error=error, retry=False)
        ids.append(item_id)
    return ids


def queue_id(name: str) -> int:
    return int(Queue.objects.get(name=name).pk)


def statuses(ids: list[str]) -> set[str]:
    return set(Item.objects.filter(id__in=ids).values_list("status", flat=True))


def page_of(item_id: str) -> str:
    return reverse("admin:taskhoster_item_change", args=[item_id])


def restart_url(item_id: str) -> str:
    return reverse("admin:taskhoster_item_restart", args=[item_id])


def said(response: Any) -> list[str]:
    return [str(m) for m in response.context["messages"]] if response.context else []


def error_choices(client: Client, **params: Any) -> list[tuple[str, str]]:
    """The error filter's choices (value, label) on the item list with ``params``."""
    response = client.get(ITEMS, params)
    assert response.status_code == 200
    (spec,) = [f for f in response.context["cl"].filter_specs if isinstance(f, bulk.ErrorFilter)]
    return [(str(value), str(label)) for value, label in spec.lookup_choices]


def listed(client: Client, **params: Any) -> set[str]:
    response = client.get(ITEMS, params)
    return {item.id for item in response.context["cl"].queryset}


@pytest.fixture
def boom(make_queue: Any) -> dict[str, list[str]]:
    """Queue a: 3 failed with "boom", 2 with "other"; queue b: 1 with "boom"."""
    make_queue("a")
    make_queue("b")
    return {
        "a-boom": failed("a", "boom", 3),
        "a-other": failed("a", "other", 2),
        "b-boom": failed("b", "boom"),
    }


# -- restart all matching the filter ---------------------------------------------------------


def test_restart_matching_counts_exactly_the_filtered_items_and_restarts_only_those(
    staff: Client, boom: dict[str, list[str]]
) -> None:
    query = f"?queue__id__exact={queue_id('a')}&error=boom"
    assert "item/restart-matching/?" in staff.get(ITEMS + query).content.decode()
    text = staff.get(RESTART_MATCHING + query).content.decode()
    assert 'id="th-total">3<' in text
    assert 'class="th-count-failed">3<' in text
    assert statuses(boom["a-boom"]) == {"failed"}, "the confirmation page changes nothing"

    token = csrf(staff)
    answer = staff.post(RESTART_MATCHING + query, {"confirm": "yes", "csrfmiddlewaretoken": token})
    assert answer.status_code == 302
    assert answer["Location"] == ITEMS + query, "back to the list, filtered as it was"
    assert statuses(boom["a-boom"]) == {"pending"}
    assert statuses(boom["a-other"] + boom["b-boom"]) == {"failed"}
    assert "Restarted 3 item(s); skipped 0 (not failed, or gone)." in said(staff.get(ITEMS))


def test_matching_walks_in_chunks_and_reads_only_the_statuses_it_can_touch(
    staff: Client, make_queue: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_queue("a")
    dead = failed("a", "boom", 5)
    waiting = pending("a", 3)
    calls: dict[str, list[str]] = {"restart": [], "cancel": []}
    real_restart, real_cancel = engine.restart, engine.cancel

    def restart(*, item_id: str) -> Any:
        calls["restart"].append(item_id)
        return real_restart(item_id=item_id)

    def cancel(*, item_id: str, reason: str | None = None) -> Any:
        calls["cancel"].append(item_id)
        return real_cancel(item_id=item_id, reason=reason)

    monkeypatch.setattr(bulk, "BULK_CHUNK", 2)
    monkeypatch.setattr(bulk.engine, "restart", restart)
    monkeypatch.setattr(bulk.engine, "cancel", cancel)
    query = f"?queue__id__exact={queue_id('a')}"
    data = {"confirm": "yes", "csrfmiddlewaretoken": csrf(staff)}
    assert staff.post(RESTART_MATCHING + query, data).status_code == 302
    assert calls["restart"] == dead, "the failed ones only, in id order"
    assert staff.post(CANCEL_MATCHING + query, data).status_code == 302
    assert calls["cancel"] == sorted(dead + waiting), "the pending ones (the restarted too)"
    assert statuses(dead + waiting) == {"failed"}


# -- cancel all matching the filter ----------------------------------------------------------


def test_cancel_matching_cancels_the_pending_items_of_the_filtered_queue_and_no_others(
    staff: Client, make_queue: Any
) -> None:
    make_queue("a")
    make_queue("b")
    held = pending("a")[0]
    assert engine.claim(queue_name="a", max_items=1)[0].row.id == held
    mine = pending("a", 3)
    others = pending("b", 2)
    query = f"?queue__id__exact={queue_id('a')}&status__exact=pending"
    assert "item/cancel-matching/?" in staff.get(ITEMS + query).content.decode()
    text = staff.get(CANCEL_MATCHING + query).content.decode()
    assert 'id="th-total">3<' in text
    assert 'class="th-count-pending">3<' in text
    assert 'name="reason"' in text

    token = csrf(staff)
    answer = staff.post(
        CANCEL_MATCHING + query,
        {"confirm": "yes", "reason": "wrong input", "csrfmiddlewaretoken": token},
        follow=True,
    )
    assert "Cancelled 3 item(s)." in said(answer)
    rows = Item.objects.filter(id__in=mine)
    assert {(r.status, r.error, r.cancel_reason) for r in rows} == {
        ("failed", "cancelled", "wrong input")
    }
    assert statuses(others) == {"pending"}, "another queue's pending items are left"
    assert statuses([held]) == {"processing"}, "outside the filter: left"


def test_cancel_matching_refuses_a_reason_too_long_and_cancels_nothing(
    staff: Client, make_queue: Any
) -> None:
    make_queue("a")
    waiting = pending("a", 2)
    token = csrf(staff)
    answer = staff.post(
        CANCEL_MATCHING,
        {"confirm": "yes", "reason": "x" * 10_000, "csrfmiddlewaretoken": token},
        follow=True,
    )
    assert any(text.startswith("Nothing cancelled:") for text in said(answer))
    assert statuses(waiting) == {"pending"}


# -- permissions ----------------------------------------------------------------------------


def test_without_change_item_the_bulk_pages_and_the_restart_page_answer_403(
    boom: dict[str, list[str]],
) -> None:
    viewer = staff_with("view_item", "view_queue")
    page = viewer.get(ITEMS).content.decode()
    assert "th-cancel-matching" not in page
    assert "th-restart-matching" not in page
    item = boom["a-boom"][0]
    assert 'id="th-restart"' not in viewer.get(page_of(item)).content.decode()
    token = csrf(viewer)
    for url in (CANCEL_MATCHING, RESTART_MATCHING, restart_url(item)):
        assert viewer.get(url).status_code == 403
        assert viewer.post(url, {"confirm": "yes", "csrfmiddlewaretoken": token}).status_code == 403
    assert statuses([i for ids in boom.values() for i in ids]) == {"failed"}

    changer = staff_with("view_item", "change_item")
    assert "th-restart-matching" in changer.get(ITEMS).content.decode()
    assert changer.get(RESTART_MATCHING).status_code == 200


@pytest.mark.parametrize(
    "url",
    [CANCEL_MATCHING, RESTART_MATCHING, "/admin/taskhoster/item/0661a6f9bee88bdba995/restart/"],
)
def test_anonymous_and_non_staff_are_sent_to_the_login_page(url: str) -> None:
    User.objects.create_user("u", password="pw", is_staff=False)
    user = Client()
    user.login(username="u", password="pw")
    for client in (Client(), user):
        response = client.get(url)
        assert response.status_code == 302
        assert "/admin/login/" in response["Location"]


# -- the filter by error ----------------------------------------------------------------------


def test_the_error_filter_offers_the_most_common_errors_of_the_chosen_queue(
    staff: Client, boom: dict[str, list[str]], make_queue: Any
) -> None:
    make_queue("c")
    failed("c", "only in c")
    assert error_choices(staff, queue__id__exact=queue_id("a")) == [
        ("boom", "boom"),
        ("other", "other"),
    ]
    specs = staff.get(ITEMS).context["cl"].filter_specs
    assert not [f for f in specs if isinstance(f, bulk.ErrorFilter)], "not before a queue"
    assert listed(staff, error="boom") == set(boom["a-boom"] + boom["b-boom"])
    assert listed(staff, error="boom", queue__id__exact=queue_id("a")) == set(boom["a-boom"])


def test_the_error_filter_cuts_a_long_error_in_its_label_and_matches_it_whole(
    staff: Client, make_queue: Any
) -> None:
    make_queue("a")
    long = "Traceback: " + "x" * 200
    item = failed("a", long)
    failed("a", long[:80])
    choices = dict(error_choices(staff, queue__id__exact=queue_id("a")))
    assert len(choices[long]) == bulk.ERROR_LABEL_CHARS
    assert choices[long].endswith("…")
    assert listed(staff, error=long) == set(item), "exact, never a prefix"


def test_the_error_choices_come_from_the_latest_failed_items_only(
    staff: Client, make_queue: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_queue("a")
    failed("a", "old", 3)
    failed("a", "new", 2)
    a = queue_id("a")
    monkeypatch.setattr(bulk, "ERROR_SAMPLE", 3)
    assert error_choices(staff, queue__id__exact=a) == [("new", "new"), ("old", "old")]
    monkeypatch.setattr(bulk, "ERROR_SAMPLE", 2)
    assert error_choices(staff, queue__id__exact=a) == [("new", "new")]


def test_an_error_chosen_but_not_among_the_common_ones_still_filters(
    staff: Client, make_queue: Any
) -> None:
    make_queue("a")
    waiting = pending("a", 2)
    assert listed(staff) == set(waiting)
    assert listed(staff, error="never seen") == set(), "never the whole list"
    assert error_choices(staff, error="never seen") == [("never seen", "never seen")]
    assert staff.get(CANCEL_MATCHING, {"error": "never seen"}).context["total"] == 0


# -- a failed item's page --------------------------------------------------------------------


def test_the_restart_button_shows_on_failed_items_only_and_restarts_after_a_confirmation(
    staff: Client, make_queue: Any
) -> None:
    make_queue("q")
    item = failed("q", "boom")[0]
    waiting = pending("q")[0]
    page = staff.get(page_of(item)).content.decode()
    assert f'id="th-restart" href="{restart_url(item)}"' in page
    assert 'id="th-restart"' not in staff.get(page_of(waiting)).content.decode()

    text = staff.get(restart_url(item)).content.decode()
    assert 'id="th-total">1<' in text
    assert 'class="th-count-failed">1<' in text
    assert statuses([item]) == {"failed"}, "the confirmation page changes nothing"
    assert staff.post(restart_url(item), {"confirm": "yes"}).status_code == 403, "CSRF"
    token = csrf(staff)
    answer = staff.post(
        restart_url(item), {"confirm": "yes", "csrfmiddlewaretoken": token}, follow=True
    )
    assert answer.redirect_chain[-1][0] == page_of(item)
    assert "Restarted: the item is pending again." in said(answer)
    row = Item.objects.get(id=item)
    assert (row.status, row.attempts, row.error) == ("pending", 0, None)
    assert 'id="th-restart"' not in answer.content.decode(), "no longer failed: no button"


def test_restarting_an_item_that_is_not_failed_says_so_and_changes_nothing(
    staff: Client, make_queue: Any
) -> None:
    make_queue("q")
    waiting = pending("q")[0]
    token = csrf(staff)
    answer = staff.post(
        restart_url(waiting), {"confirm": "yes", "csrfmiddlewaretoken": token}, follow=True
    )
    assert any(text.startswith("Not restarted:") for text in said(answer))
    assert statuses([waiting]) == {"pending"}
    gone = staff.get(restart_url("0661a6f9bee88bdba995"), follow=True)
    assert "Item 0661a6f9bee88bdba995 does not exist." in said(gone)


def test_a_failed_items_page_shows_its_dead_letter_copys_queue_and_status(
    staff: Client, make_queue: Any
) -> None:
    make_queue("dlq")
    make_queue("q", deadLetterQueue="dlq")
    item = failed("q", "boom")[0]
    copy = Item.objects.get(id=item).dead_letter
    assert copy
    link = f'<a href="{page_of(copy)}">{copy}</a>'
    assert f"{link} in queue “dlq” (pending)" in staff.get(page_of(item)).content.decode()
    assert engine.claim(queue_name="dlq", max_items=1)[0].row.id == copy
    assert f"{link} in queue “dlq” (processing)" in staff.get(page_of(item)).content.decode()
    engine.delete_items(item_ids=[copy])
    assert f"{copy} (deleted)" in staff.get(page_of(item)).content.decode()
    assert bulk.dead_letter_copy(None) == "-"


def test_a_matching_page_with_a_filter_that_is_not_valid_does_nothing_and_says_so(
    staff: Client, boom: dict[str, list[str]]
) -> None:
    token = csrf(staff)
    answer = staff.post(
        RESTART_MATCHING + "?queue__id__exact=not-a-number",
        {"confirm": "yes", "csrfmiddlewaretoken": token},
        follow=True,
    )
    assert "The filter is not valid: nothing done." in said(answer)
    assert statuses([i for ids in boom.values() for i in ids]) == {"failed"}


# -- bad filters change nothing -----------------------------------------------------------------


@pytest.mark.parametrize(
    "query",
    [
        "?queue__id__exact=abc",
        "?queue__id__exact=0",
        "?queue__id__exact=999999",
        "?queue__id__exact=99999999999999999999999999",
        "?nothing_of_the_list=1",
    ],
)
def test_an_all_matching_action_with_a_filter_not_applied_acts_on_nothing(
    staff: Client, make_queue: Any, query: str
) -> None:
    """With one queue, Django drops its queue filter and ignores the parameter: "all matching"
    would have meant every item. A filter not applied, or a queue that is not there, refuses
    the action."""
    make_queue("only")
    waiting = pending("only", 3)
    token = csrf(staff)
    for url in (CANCEL_MATCHING, ITEMS + "delete-matching/"):
        shown = staff.get(url + query)
        assert shown.status_code == 302, "no confirmation page for a filter not applied"
        answer = staff.post(url + query, {"confirm": "yes", "csrfmiddlewaretoken": token})
        assert answer.status_code == 302
    assert set(Item.objects.filter(status="pending").values_list("id", flat=True)) == set(
        waiting
    ), "nothing cancelled or deleted"


def test_the_confirmation_counts_only_the_items_the_action_will_touch(
    staff: Client, make_queue: Any
) -> None:
    make_queue("a")
    make_queue("b")
    failed("a", "boom", 2)
    pending("a", 3)
    query = f"?queue__id__exact={queue_id('a')}"
    assert staff.get(RESTART_MATCHING + query).context["total"] == 2, "the failed ones"
    assert staff.get(CANCEL_MATCHING + query).context["total"] == 3, "the pending ones"


@pytest.mark.parametrize(
    "query",
    ["?p=99999999999999999999", "?queue__id__exact=-99999999999999999999", "?error=%00"],
)
def test_the_item_list_and_its_matching_pages_answer_odd_parameters_without_a_500(
    staff: Client, make_queue: Any, query: str
) -> None:
    make_queue("a")
    make_queue("b")
    pending("a")
    for url in (ITEMS, CANCEL_MATCHING, RESTART_MATCHING):
        assert staff.get(url + query).status_code in (200, 302), url


@pytest.mark.parametrize("nul", ["%00", "_00"])  # the admin's own quoting: _00 is NUL
def test_an_item_id_with_a_nul_character_is_no_item_and_no_500(
    staff: Client, make_queue: Any, nul: str
) -> None:
    """PostgreSQL refuses to compare text with a NUL character: every item page says the
    item is not there instead."""
    make_queue("q")
    pending("q")
    base = f"/admin/taskhoster/item/{nul}"
    for tail in ("/change/", "/history/", "/cancel/", "/restart/"):
        assert staff.get(base + tail).status_code in (302, 404), tail
    assert staff.get("/admin/taskhoster/item/processing/?queue=%00").status_code == 400
