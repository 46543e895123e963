"""Schedules (SPEC section 8.3): definitions kept as data, and the sweep's step that posts
their due slots.

Exactly one item per slot, whatever the number of sweeps and server processes and across
their crashes, rests on three things, all in the group's one transaction (``group._fire``):

- the sweep reads the due schedules (one query over the ``schedule_due`` index) and, for
  each, the slots it owes; each slot's step (``ops.Firing``) carries what it expects of the
  schedule: its definition's ``rev`` and its next slot. Under the schedule's row lock the
  group posts the slot and moves the schedule on only if both still hold, so of two sweeps
  the second finds the schedule moved and posts nothing, and a change or a pause of the
  schedule stops every step read before it;
- the slot's item has the key ``schedule:<name>:<slot>``: a slot posted but not recorded
  (a power cut can take a committed transaction back, as the index need not be durable)
  is found by its key, not posted again;
- the slot's item has an id made from the slot (``slots.slot_item_id``): a crash between its
  file and the commit leaves a file at that very name, which the next attempt replaces,
  never a second item for repair to find.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.db import IntegrityError, transaction

from ..contract import SCHEDULE, validate
from ..errors import InvalidInput, QueueNotFound, ScheduleNotFound, TaskhosterError
from ..models import Queue, Schedule
from ..store import QUEUE_NAME_PATTERN, encode_line, read_schedules, write_schedules
from ..timeutil import now as utcnow
from ..timeutil import to_wire
from . import slots
from .committer import execute
from .common import store
from .ops import Fire, Fired, Firing, NewItem, Post
from .pacing import background
from .posts import new_row, record_of
from .transitions import get_live_queue

log = logging.getLogger(__name__)

# Due schedules read per query, and firings per group.
DUE_BATCH = 500
# Slots one schedule may post in one pass (a long catch-up goes on in the next pass).
MOST_SLOTS_PER_PASS = 1000
# A slot at most this late was found on time, whatever its catchupSeconds (a pass of a sweep
# run by hand, or once a minute by cron, should not skip one it finds 0.5 s late).
ON_TIME_SECONDS = 2.0
# Rounds of one pass: a round reads the due schedules again (those a lost race or a batch
# left due).
MOST_ROUNDS = 20


def validate_schedule_name(name: object) -> str:
    if not isinstance(name, str) or QUEUE_NAME_PATTERN.fullmatch(name) is None:
        raise InvalidInput(
            "a schedule name is 1-64 characters of letters, digits, '_', '.' and '-', "
            "starting with a letter or digit",
            code="invalid_schedule_name",
        )
    return name


def _spec(schedule: Schedule) -> slots.Spec:
    return slots.Spec(cron=schedule.cron, every=schedule.every, timezone=schedule.timezone)


def schedule_wire(schedule: Schedule, queue_name: str | None = None) -> dict[str, Any]:
    """A schedule as the API answers it."""
    return {
        "queue": queue_name or schedule.queue.name,
        "name": schedule.name,
        "cron": schedule.cron,
        "every": schedule.every,
        "timezone": schedule.timezone,
        "payload": schedule.payload,
        "threadId": schedule.thread_id,
        "priority": schedule.priority,
        "overlap": schedule.overlap,
        "catchupSeconds": _number(schedule.catchup_seconds),
        "paused": schedule.paused,
        "nextAt": None if schedule.paused else to_wire(schedule.next_at),
        "lastSlot": None if schedule.last_slot is None else to_wire(schedule.last_slot),
        "lastItem": schedule.last_item,
        "createdAt": to_wire(schedule.created_at),
        "updatedAt": to_wire(schedule.updated_at),
    }


def _number(value: float) -> float | int:
    return int(value) if float(value).is_integer() else value


def get_schedule(queue_name: str, name: str) -> Schedule:
    validate_schedule_name(name)
    queue = get_live_queue(queue_name)
    found = Schedule.objects.filter(queue=queue, name=name).first()
    if found is None:
        raise ScheduleNotFound(f"schedule {name!r} of queue {queue_name!r} does not exist")
    found.queue = queue
    return found


def list_schedules(queue_name: str, *, after: str | None, limit: int) -> list[Schedule]:
    """A queue's schedules by name, a page at a time (``limit`` + 1 read, to tell a next
    page)."""
    queue = get_live_queue(queue_name)
    found = Schedule.objects.filter(queue=queue).order_by("name")
    if after is not None:
        found = found.filter(name__gt=after)
    page = list(found[: limit + 1])
    for schedule in page:
        schedule.queue = queue
    return page


TIMING = ("cron", "every", "timezone")


def put_schedule(
    queue_name: str,
    name: str,
    body: Any,
    *,
    at: datetime | None = None,
    check_only: bool = False,
) -> tuple[Schedule, bool]:
    """Create the schedule or change what ``body`` gives; True when it was created.

    A change of its timing (cron, every, timezone) or a resume starts it again from the first
    slot after now; any change makes steps read before it post nothing (``rev``).
    ``check_only``: refuse what the change would refuse, and change nothing (a form's
    check)."""
    validate_schedule_name(name)
    values = validate(SCHEDULE, body)
    at = at or utcnow()
    wrote = False
    found_queue: Queue | None = None
    try:
        with transaction.atomic():
            # FOR NO KEY UPDATE: a group inserting this queue's items (which takes FOR KEY
            # SHARE on its row, for the foreign key) is not kept waiting by it.
            queue = Queue.objects.select_for_update(no_key=True).filter(
                name=queue_name, deleting=False
            )
            found_queue = queue.first()
            if found_queue is None:
                raise QueueNotFound(f"queue {queue_name!r} does not exist")
            schedule = (
                Schedule.objects.select_for_update().filter(queue=found_queue, name=name).first()
            )
            created = schedule is None
            if schedule is None:
                if "cron" not in values and "every" not in values:
                    raise InvalidInput("a new schedule needs cron or every", code="missing_field")
                if "payload" not in values:
                    raise InvalidInput("a new schedule needs a payload", code="missing_field")
                schedule = Schedule(
                    queue=found_queue,
                    name=name,
                    salt=secrets.token_hex(8),
                    created_at=at,
                    updated_at=at,
                )
            before = {f: getattr(schedule, f) for f in DEFINITION}
            _apply(schedule, values)
            if not created and before == {f: getattr(schedule, f) for f in DEFINITION}:
                schedule.queue = found_queue
                return schedule, False  # nothing changed: steps read before it still hold
            spec = _spec(schedule)
            _check_spec(spec)
            retime = created or any(before[f] != getattr(schedule, f) for f in (*TIMING, "paused"))
            if retime:
                # Never at or before a slot it posted (another host's clock may be behind).
                since = max(at, schedule.last_slot) if schedule.last_slot else at
                schedule.next_at = slots.first_slot(spec, since)
            if not created:
                schedule.rev += 1
            schedule.updated_at = at
            if check_only:
                schedule.queue = found_queue
                return schedule, created
            schedule.save()
            _keep_definitions(found_queue)
            wrote = True
    except IntegrityError:  # made at once elsewhere: change it
        return put_schedule(queue_name, name, body, at=at, check_only=check_only)
    except BaseException:
        if wrote:  # the file is ahead of a change that did not commit: put it back
            _resync_definitions(found_queue)
        raise
    schedule.queue = found_queue
    return schedule, created


def _apply(schedule: Schedule, values: dict[str, Any]) -> None:
    if "cron" in values:
        cron = values["cron"]
        schedule.cron = None if cron is None else _cron(cron)
        schedule.every = None
    if "every" in values:
        schedule.every = values["every"]
        schedule.cron = None
    if "timezone" in values:
        schedule.timezone = values["timezone"] or "UTC"
    if "payload" in values:
        schedule.payload = values["payload"]
    if "threadId" in values:
        schedule.thread_id = values["threadId"]
    if "priority" in values:
        schedule.priority = values["priority"] or 0
    if "overlap" in values:
        schedule.overlap = values["overlap"]
    if "catchupSeconds" in values:
        schedule.catchup_seconds = float(values["catchupSeconds"])
    if "paused" in values:
        schedule.paused = values["paused"]


def _cron(text: str) -> str:
    try:
        return slots.check_cron(text)
    except slots.BadSpec as exc:
        raise InvalidInput(str(exc), code="invalid_schedule") from None


def _check_spec(spec: slots.Spec) -> None:
    if spec.cron is None and spec.every is None:
        raise InvalidInput("a schedule needs cron or every", code="invalid_schedule")
    try:
        slots.zone(spec.timezone)
    except slots.BadSpec as exc:
        raise InvalidInput(str(exc), code="invalid_schedule") from None


def delete_schedule(queue_name: str, name: str) -> None:
    """Gone at once: a step the sweep read before finds it gone and posts nothing."""
    schedule = get_schedule(queue_name, name)
    wrote = False
    try:
        with transaction.atomic():
            queue = (
                Queue.objects.select_for_update(no_key=True).filter(id=schedule.queue_id).first()
            )
            deleted, _ = Schedule.objects.filter(id=schedule.id).delete()
            if deleted and queue is not None:
                _keep_definitions(queue)
                wrote = True
    except BaseException:
        if wrote:
            _resync_definitions(schedule.queue)
        raise
    if not deleted:
        raise ScheduleNotFound(f"schedule {name!r} of queue {queue_name!r} does not exist")


# -- the definitions beside the items ------------------------------------------------------

# What ``<root>/<queue>/schedules.json`` keeps of each schedule: its definition (the rest,
# its next and last slots, the index keeps; a lost one is found again by the slots' keys).
DEFINITION = (
    "name",
    "cron",
    "every",
    "timezone",
    "payload",
    "thread_id",
    "priority",
    "overlap",
    "catchup_seconds",
    "paused",
    "salt",
)


def _keep_definitions(queue: Queue) -> None:
    """Write the queue's schedules to its directory, inside the change's transaction (under
    the queue's row lock, so two changes write in the order they commit): a failed write
    fails the change, and a change the database loses in a power cut is restored by repair
    (``restore_definitions``)."""
    rows = Schedule.objects.filter(queue=queue).order_by("name").values(*DEFINITION)
    write_schedules(store(), queue.name, [dict(row) for row in rows])


def _resync_definitions(queue: Queue | None) -> None:
    """After a change that wrote the file but did not commit: the file as the committed rows
    are (best effort: a failure leaves it to the next change, or to repair's reading)."""
    if queue is None:
        return
    try:
        _keep_definitions(queue)
    except Exception:
        log.exception("schedules of queue %s: could not rewrite schedules.json", queue.name)


def restore_definitions(queue: Queue, *, at: datetime | None = None) -> int:
    """Bring the queue's schedule rows in line with its ``schedules.json`` (repair): a
    definition missing from the index is made again, one changed is changed back, a row the
    file does not hold is deleted. How many rows changed. A queue that never had a
    schedule (no file) is left alone."""
    at = at or utcnow()
    changed = 0
    with transaction.atomic():
        # Under the queue's row lock, as every change takes it: a put or delete committing
        # meanwhile is read, never undone.
        if Queue.objects.select_for_update(no_key=True).filter(id=queue.id).first() is None:
            return 0
        saved = read_schedules(store(), queue.name)
        if saved is None:
            return 0
        wanted = {str(d.get("name")): d for d in saved if isinstance(d.get("name"), str)}
        rows = {
            s.name: s
            for s in Schedule.objects.select_for_update().filter(queue=queue).order_by("id")
        }
        for name, extra in rows.items():
            if name not in wanted:
                extra.delete()
                changed += 1
        for name, definition in wanted.items():
            values = {k: definition.get(k) for k in DEFINITION if k in definition}
            found = rows.get(name)
            if found is not None and all(getattr(found, k) == v for k, v in values.items()):
                continue
            if found is None:
                row = Schedule(queue=queue, created_at=at)
            else:
                row = found
                row.rev += 1
            for k, v in values.items():
                setattr(row, k, v)
            if not row.salt:
                row.salt = secrets.token_hex(8)
            try:
                _check_spec(_spec(row))
                row.next_at = slots.first_slot(_spec(row), at)
            except (InvalidInput, slots.BadSpec):
                log.error("repair: schedule %s of queue %s is not valid; left out", name, queue)
                continue
            row.updated_at = at
            row.save()
            changed += 1
    return changed


# -- the sweep's step ---------------------------------------------------------------------------


@dataclass
class ScheduleReport:
    posted: int = 0  # slots whose item this pass made
    found: int = 0  # slots whose item was there already (under its key)
    overlapped: int = 0  # slots passed over by overlap: skip
    skipped: int = 0  # slots later than catchupSeconds, passed over
    lost: int = 0  # steps another sweep or a change got to first
    errors: list[str] = field(default_factory=list)


def fire_due(*, at: datetime | None = None, on_time: float = ON_TIME_SECONDS) -> ScheduleReport:
    """Post every due slot of every unpaused schedule of a live queue (as the module
    docstring says), oldest first; one indexed query per round finds the due schedules.

    ``on_time``: a slot at most this late was not found late, whatever its
    ``catchupSeconds`` (a sweep every S seconds finds its slots up to S late: the sweep
    command passes its interval and a second more)."""
    report = ScheduleReport()
    at = at or utcnow()
    done: set[int] = set()
    for _round in range(MOST_ROUNDS):
        due = list(
            Schedule.objects.filter(paused=False, next_at__lte=at, queue__deleting=False)
            .exclude(id__in=done)
            .select_related("queue")
            .order_by("next_at", "id")[:DUE_BATCH]
        )
        if not due:
            break
        firings: list[Firing] = []
        for schedule in due:
            steps, skipped = _firings(schedule, at, on_time)
            firings.extend(steps)
            report.skipped += skipped
            while len(firings) >= DUE_BATCH:  # a group at a time: memory stays bounded
                _run(firings[:DUE_BATCH], report)
                del firings[:DUE_BATCH]
        if firings:
            _run(firings, report)
        # A schedule done in this round is not read again in this pass (one whose slots ran
        # past the pass's cap goes on in the next; one that lost a race is another sweep's).
        done |= {s.id for s in due}
        if len(due) < DUE_BATCH:
            break
    return report


def _firings(schedule: Schedule, at: datetime, on_time: float = 0.0) -> tuple[list[Firing], int]:
    """A due schedule's steps (one per slot it owes, oldest first; the first also passes
    over the slots too late to catch up), and how many slots it passes over."""
    assert schedule.next_at is not None
    spec = _spec(schedule)
    try:
        late = max(schedule.catchup_seconds, on_time)
        due, skipped, after = slots.due_slots(spec, schedule.next_at, at, late, MOST_SLOTS_PER_PASS)
    except slots.BadSpec as exc:
        log.error("schedule %s of queue %s: %s", schedule.name, schedule.queue.name, exc)
        return [], 0
    if not due:
        return [Firing(schedule.id, schedule.rev, schedule.next_at, after)], skipped
    firings: list[Firing] = []
    expect = schedule.next_at
    for n, slot in enumerate(due):
        following = due[n + 1] if n + 1 < len(due) else after
        firings.append(
            Firing(
                schedule.id,
                schedule.rev,
                expect,
                following,
                slot=slot,
                post=_slot_post(schedule, slot, at),
            )
        )
        if following is None:
            break
        expect = following
    return firings, skipped


def _slot_post(schedule: Schedule, slot: datetime, at: datetime) -> Post:
    """A slot's item, as a post makes one before its group (``posts.prepare_post``), with
    the slot's own id and key."""
    item = NewItem(
        payload=schedule.payload,
        thread_id=schedule.thread_id,
        key=slots.slot_key(schedule.name, slot),
        priority=schedule.priority,
    )
    item_id = slots.slot_item_id(schedule.salt, slot)
    row = new_row(
        item_id,
        at=at,
        scheduled_at=min(slot, at),
        thread_id=item.thread_id,
        key=item.key,
        origin=None,
        priority=item.priority,
    )
    line = encode_line(record_of(row, schedule.queue.name, item.payload))
    return Post(
        queue_name=schedule.queue.name,
        items=[item],
        rows=[row],
        lines=[line],
        replace_leftover=True,
    )


def _run(firings: list[Firing], report: ScheduleReport) -> None:
    try:
        with background():
            answers: list[Fired] = execute(Fire(firings=firings))
    except TaskhosterError as exc:
        log.error("schedules: %d step(s) failed: %s", len(firings), exc.message)
        report.errors.append(exc.message)
        return
    for answer in answers:
        if answer.error is not None:
            report.errors.append(answer.error)
        elif not answer.done:
            report.lost += 1
        elif answer.overlap:
            report.overlapped += 1
        elif answer.item is not None:
            if answer.created:
                report.posted += 1
            else:
                report.found += 1
