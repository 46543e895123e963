"""The schedules' admin pages (SPEC section 8.3): the list shows each schedule's timing and
slots, and pause, resume, delete and the form go through the engine (``rev`` bumped, the next
slot recomputed), under Django's model permissions; bad input never answers 500."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.test import Client
from django.urls import reverse

from taskhoster import engine
from taskhoster.admin.common import when
from taskhoster.errors import ScheduleNotFound
from taskhoster.models import Item, Schedule
from taskhoster.timeutil import now as utcnow

from .admin_users import staff_with

pytestmark = pytest.mark.django_db

SCHEDULES = reverse("admin:taskhoster_schedule_changelist")
ADD = reverse("admin:taskhoster_schedule_add")


def csrf(client: Client, url: str) -> str:
    client.get(url)
    return str(client.cookies["csrftoken"].value)


def schedule(name: str = "tick", queue: str = "q", **body: Any) -> Schedule:
    engine.upsert_queue(name=queue, body={})
    timing = {} if "cron" in body else {"every": 60}
    return engine.put_schedule(queue, name, {**timing, "payload": {}, **body})[0]


def stored(name: str = "tick", queue: str = "q") -> Schedule:
    return engine.get_schedule(queue, name)


def change_url(s: Schedule) -> str:
    return reverse("admin:taskhoster_schedule_change", args=[s.pk])


def form_data(token: str, **changes: Any) -> dict[str, Any]:
    return {
        "cron": "",
        "every": "60",
        "timezone": "UTC",
        "payload": "{}",
        "thread_id": "",
        "priority": "0",
        "overlap": "allow",
        "catchup_seconds": "60",
        "csrfmiddlewaretoken": token,
        **changes,
    }


def test_the_list_shows_each_schedules_timing_next_slot_last_slot_and_last_item(
    staff: Client,
) -> None:
    tick = schedule()
    schedule("nightly", cron="30 2 * * *", timezone="Europe/Berlin")
    assert tick.next_at is not None
    report = engine.fire_due(at=tick.next_at + timedelta(seconds=1))
    assert report.posted == 1
    fired = stored()
    assert fired.last_slot == tick.next_at
    assert fired.last_item is not None
    body = staff.get(SCHEDULES).content.decode()
    assert "every 60 s" in body
    assert "<code>30 2 * * *</code> (Europe/Berlin)" in body
    assert str(when(fired.next_at)) in body, "the next slot"
    assert str(when(fired.last_slot)) in body, "the last slot"
    assert reverse("admin:taskhoster_item_change", args=[fired.last_item]) in body
    assert Item.objects.filter(id=fired.last_item).exists()


def test_the_list_filters_by_queue_and_paused_and_searches_by_name(staff: Client) -> None:
    schedule("alpha", queue="q1")
    beta = schedule("beta", queue="q2", paused=True)
    by_queue = staff.get(SCHEDULES, {"queue__id__exact": beta.queue_id}).content.decode()
    assert ">beta<" in by_queue
    assert ">alpha<" not in by_queue
    paused = staff.get(SCHEDULES, {"paused__exact": "1"}).content.decode()
    assert ">beta<" in paused
    assert ">alpha<" not in paused
    found = staff.get(SCHEDULES, {"q": "alp"}).content.decode()
    assert ">alpha<" in found
    assert ">beta<" not in found


def test_pausing_by_the_list_action_goes_through_the_engine_bumping_rev_and_clearing_next_at(
    staff: Client,
) -> None:
    tick = schedule()
    other = schedule("other")
    token = csrf(staff, SCHEDULES)
    answer = staff.post(
        SCHEDULES,
        {"action": "pause_schedules", "_selected_action": [tick.pk], "csrfmiddlewaretoken": token},
        follow=True,
    )
    assert answer.status_code == 200
    assert "Paused 1 schedule(s)" in answer.content.decode()
    paused = stored()
    assert paused.paused
    assert paused.rev == tick.rev + 1
    assert engine.schedule_wire(paused, "q")["nextAt"] is None
    assert not stored("other").paused, "only the schedule selected"
    assert stored("other").rev == other.rev
    assert 'class="th-paused"' in staff.get(SCHEDULES).content.decode()


def test_the_pause_button_pauses_by_post_with_csrf_only(staff: Client) -> None:
    tick = schedule()
    pause = reverse("admin:taskhoster_schedule_pause", args=[tick.pk])
    page = staff.get(change_url(tick)).content.decode()
    assert f'action="{pause}"' in page
    assert staff.post(pause).status_code == 403, "no CSRF token, no change"
    token = csrf(staff, change_url(tick))
    assert staff.get(pause).status_code == 405, "only a POST changes anything"
    answer = staff.post(pause, {"csrfmiddlewaretoken": token})
    assert answer.status_code == 302
    assert answer["Location"] == change_url(tick)
    paused = stored()
    assert paused.paused
    assert paused.rev == tick.rev + 1
    assert engine.schedule_wire(paused, "q")["nextAt"] is None
    page = staff.get(change_url(tick)).content.decode()
    assert 'id="th-resume"' in page
    assert 'id="th-paused-note"' in page


def test_resuming_recomputes_the_next_slot_from_now(staff: Client) -> None:
    tick = schedule(paused=True)
    long_ago = utcnow() - timedelta(days=3)
    Schedule.objects.filter(pk=tick.pk).update(next_at=long_ago)  # a stale slot
    resume = reverse("admin:taskhoster_schedule_resume", args=[tick.pk])
    before = utcnow()
    token = csrf(staff, change_url(tick))
    assert staff.post(resume, {"csrfmiddlewaretoken": token}).status_code == 302
    resumed = stored()
    assert not resumed.paused
    assert resumed.rev == tick.rev + 1
    assert resumed.next_at is not None
    assert resumed.next_at > before, "the first slot after the resume, not the stale one"
    assert resumed.next_at.timestamp() % 60 == 0
    assert engine.schedule_wire(resumed, "q")["nextAt"] is not None
    staff.post(
        SCHEDULES,
        {"action": "pause_schedules", "_selected_action": [tick.pk], "csrfmiddlewaretoken": token},
    )
    Schedule.objects.filter(pk=tick.pk).update(next_at=long_ago)
    staff.post(
        SCHEDULES,
        {"action": "resume_schedules", "_selected_action": [tick.pk], "csrfmiddlewaretoken": token},
    )
    again = stored()
    assert not again.paused
    assert again.next_at is not None
    assert again.next_at > before


def test_deleting_by_the_action_or_the_delete_page_removes_the_schedule(staff: Client) -> None:
    tick = schedule()
    other = schedule("other")
    token = csrf(staff, SCHEDULES)
    data = {"action": "delete_selected", "_selected_action": [tick.pk]}
    confirm = staff.post(SCHEDULES, {**data, "csrfmiddlewaretoken": token})
    assert confirm.status_code == 200, "Django's confirmation page first"
    assert Schedule.objects.filter(pk=tick.pk).exists()
    staff.post(SCHEDULES, {**data, "post": "yes", "csrfmiddlewaretoken": token})
    with pytest.raises(ScheduleNotFound):
        engine.get_schedule("q", "tick")
    delete = reverse("admin:taskhoster_schedule_delete", args=[other.pk])
    assert staff.post(delete, {"post": "yes", "csrfmiddlewaretoken": token}).status_code == 302
    assert not Schedule.objects.exists()


def test_a_view_only_staff_user_cannot_pause_resume_or_delete() -> None:
    tick = schedule()
    viewer = staff_with("view_schedule")
    page = viewer.get(SCHEDULES)
    assert page.status_code == 200
    assert ">tick<" in page.content.decode()
    for action in ("pause_schedules", "resume_schedules", "delete_selected"):
        assert action not in page.content.decode(), "the action is not offered"
    assert 'id="th-pause"' not in viewer.get(change_url(tick)).content.decode()
    token = csrf(viewer, SCHEDULES)
    for action in ("pause_schedules", "delete_selected"):
        viewer.post(
            SCHEDULES,
            {
                "action": action,
                "_selected_action": [tick.pk],
                "post": "yes",
                "csrfmiddlewaretoken": token,
            },
        )
    pause = reverse("admin:taskhoster_schedule_pause", args=[tick.pk])
    assert viewer.post(pause, {"csrfmiddlewaretoken": token}).status_code == 403
    delete = reverse("admin:taskhoster_schedule_delete", args=[tick.pk])
    assert viewer.post(delete, {"post": "yes", "csrfmiddlewaretoken": token}).status_code == 403
    unchanged = stored()
    assert (unchanged.paused, unchanged.rev) == (False, tick.rev), "nothing changed"
    allowed = staff_with("view_schedule", "change_schedule")
    assert "pause_schedules" in allowed.get(SCHEDULES).content.decode()
    assert "delete_selected" not in allowed.get(SCHEDULES).content.decode()
    assert allowed.post(pause, {"csrfmiddlewaretoken": csrf(allowed, SCHEDULES)}).status_code == 302
    assert stored().paused


def test_the_queue_page_links_to_its_schedules_with_their_count(staff: Client) -> None:
    schedule("a")
    schedule("b")
    schedule("c", queue="other")
    queue = stored("a").queue
    page = staff.get(reverse("admin:taskhoster_queue_change", args=[queue.pk])).content.decode()
    url = f"{SCHEDULES}?queue__id__exact={queue.pk}"
    assert f'href="{url}"' in page
    assert "Schedules (2)" in page
    listed = staff.get(url).content.decode()
    assert ">a<" in listed
    assert ">c<" not in listed
    nobody = staff_with("view_queue")
    page = nobody.get(reverse("admin:taskhoster_queue_change", args=[queue.pk])).content.decode()
    assert "th-schedules" not in page, "no link for one who may not see schedules"


def test_the_add_form_creates_through_the_engine_and_shows_its_refusals_as_form_errors(
    staff: Client,
) -> None:
    queue = engine.upsert_queue(name="q", body={})[0]
    token = csrf(staff, ADD)
    bad = staff.post(ADD, form_data(token, queue=queue.pk, name="n", every="", cron="61 * * * *"))
    assert bad.status_code == 200
    assert "cron" in bad.content.decode()
    assert "errorlist" in bad.content.decode()
    both = staff.post(ADD, form_data(token, queue=queue.pk, name="n", cron="* * * * *"))
    assert "not both" in both.content.decode()
    zone = staff.post(ADD, form_data(token, queue=queue.pk, name="n", timezone="Mars/Base"))
    assert "timezone" in zone.content.decode()
    assert "errorlist" in zone.content.decode()
    no_json = staff.post(ADD, form_data(token, queue=queue.pk, name="n", payload="{nope"))
    assert "errorlist" in no_json.content.decode()
    bad_name = staff.post(ADD, form_data(token, queue=queue.pk, name="-no"))
    assert "errorlist" in bad_name.content.decode()
    assert not Schedule.objects.exists(), "nothing saved by the checks"
    made = staff.post(ADD, form_data(token, queue=queue.pk, name="n", payload='{"job": 1}'))
    assert made.status_code == 302
    created = stored("n")
    assert (created.every, created.payload, created.rev) == (60, {"job": 1}, 1)
    assert created.next_at is not None
    assert created.salt
    again = staff.post(ADD, form_data(token, queue=queue.pk, name="n"))
    assert "already has a schedule" in again.content.decode()


def test_the_change_form_puts_only_what_changed_and_a_new_timing_moves_the_next_slot(
    staff: Client,
) -> None:
    tick = schedule(payload={"a": 1})
    token = csrf(staff, change_url(tick))
    same = form_data(token, payload='{"a": 1}')
    for field in ("every", "timezone", "payload", "priority", "overlap", "catchup_seconds"):
        same[f"initial-{field}"] = same[field]
    assert staff.post(change_url(tick), same).status_code == 302
    assert stored().rev == tick.rev, "nothing changed: no put"
    answer = staff.post(
        change_url(tick), form_data(token, every="", cron="0 3 * * *", payload='{"a": 2}')
    )
    assert answer.status_code == 302
    changed = stored()
    assert (changed.cron, changed.every, changed.payload) == ("0 3 * * *", None, {"a": 2})
    assert changed.rev > tick.rev
    assert changed.next_at is not None
    assert (changed.next_at.hour, changed.next_at.minute) == (3, 0)
    refused = staff.post(change_url(tick), form_data(token, priority="42"))
    assert refused.status_code == 200
    assert "errorlist" in refused.content.decode()
    assert stored().priority == 0


@pytest.mark.parametrize(
    "params",
    [
        {"queue__id__exact": "abc"},
        {"queue__id__exact": "99999999999999999999999"},
        {"queue__id__exact": "-1"},
        {"queue__id__exact": "\x00"},
        {"paused__exact": "maybe"},
        {"q": "ti\x00ck"},
        {"p": "abc"},
        {"p": "99999999999999999999"},
        {"o": "zz"},
        {"o": "99"},
        {"nope": "1"},
    ],
)
def test_a_bad_filter_answers_a_clean_page_never_a_500(
    staff: Client, params: dict[str, str]
) -> None:
    schedule()
    schedule("other", queue="q2")
    answer = staff.get(SCHEDULES, params, follow=True)
    assert answer.status_code == 200


@pytest.mark.parametrize("object_id", ["abc", "0", "99999999999999999999999", "%00", "1%002"])
def test_an_unknown_or_bad_id_answers_4xx_or_a_redirect_never_a_500(
    staff: Client, object_id: str
) -> None:
    schedule()
    base = f"{SCHEDULES}{object_id}"
    for url in (f"{base}/change/", f"{base}/history/", f"{base}/delete/"):
        assert staff.get(url, follow=True).status_code in {200, 404}, url
    token = csrf(staff, SCHEDULES)
    for url in (f"{base}/pause/", f"{base}/resume/", f"{base}/delete/"):
        assert staff.post(url, {"csrfmiddlewaretoken": token, "post": "yes"}).status_code in {
            302,
            404,
        }, url
    assert Schedule.objects.count() == 1
    huge = reverse("admin:taskhoster_schedule_pause", args=[2**70])
    assert staff.post(huge, {"csrfmiddlewaretoken": token}).status_code == 404
