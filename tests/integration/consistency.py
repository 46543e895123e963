"""Checks shared by the crash and repair tests: the index must say what the state directories say.

``assert_index_matches_directories``: every item row has its file exactly once, in the directory
of its status, with the row's ``rev`` and a last status line that agrees (a verdict in done/
and only there); no file lacks a row; no temporary file is left behind.
``assert_threads_consistent``: eligibility and the thread rows follow SPEC section 1 and rule 2
(at most one member processing, at most one eligible, the eligible one is the head, and only
while no member is processing).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from taskhoster.models import Item, Queue, Thread
from taskhoster.status import LIVE_STATUSES, State, Status
from taskhoster.store import QUEUE_NAME_PATTERN, decode

STATES = tuple(s.value for s in State)


def files_on_disk(root: Path) -> dict[str, list[tuple[str, str]]]:
    """Map each item id found under ``root`` to the (queue, state) directories holding it."""
    found: dict[str, list[tuple[str, str]]] = defaultdict(list)
    if not root.is_dir():
        return found
    for queue_dir in sorted(
        p for p in root.iterdir() if p.is_dir() and QUEUE_NAME_PATTERN.fullmatch(p.name)
    ):
        for state in STATES:
            directory = queue_dir / state
            if not directory.is_dir():
                continue
            for path in directory.iterdir():
                if path.name.endswith(".json") and not path.name.startswith("."):
                    found[path.name[: -len(".json")]].append((queue_dir.name, state))
    return found


def temporaries(root: Path) -> list[Path]:
    found = set(root.glob("*/*/*.tmp")) | set(root.glob("*/*.tmp"))
    return sorted(p for p in found if QUEUE_NAME_PATTERN.fullmatch(p.relative_to(root).parts[0]))


def read_file(root: Path, queue: str, state: str, item_id: str) -> dict:
    return decode((root / queue / state / f"{item_id}.json").read_bytes())[0]


def assert_index_matches_directories(root: Path) -> None:
    disk = files_on_disk(root)
    problems: list[str] = []
    rows = Item.objects.values_list("id", "queue__name", "status", "rev")
    for item_id, queue, status, rev in rows:
        where = disk.pop(item_id, [])
        expected = (queue, Status(status).state.value)
        if where != [expected]:
            problems.append(
                f"row {item_id} ({queue}, {status}) has files {where}, expected {[expected]}"
            )
            continue
        on_disk = read_file(root, queue, expected[1], item_id)
        if on_disk.get("rev") != rev:
            problems.append(f"row {item_id} has rev {rev}, its file rev {on_disk.get('rev')}")
        # The file's last word on its status agrees with its directory (repair's rows 2 and 3:
        # a verdict line outside done/, a done/ file without one).
        said = Status(on_disk.get("status") or Status.PENDING)
        if said.is_terminal != (expected[1] == State.DONE.value) or (
            said.is_terminal and said != Status(status)
        ):
            problems.append(f"file of {item_id} in {expected[1]}/ says it is {said}")
    for item_id, where in sorted(disk.items()):
        problems.append(f"file without a row: {item_id} in {where}")
    for tmp in temporaries(root):
        problems.append(f"temporary file left behind: {tmp}")
    assert not problems, "index and directories disagree:\n" + "\n".join(problems)


def assert_threads_consistent() -> None:
    problems: list[str] = []
    eligible_wrong = Item.objects.exclude(status=Status.PENDING).filter(eligible=True)
    problems += [
        f"{i} is eligible but not pending" for i in eligible_wrong.values_list("id", flat=True)
    ]
    lonely = Item.objects.filter(status=Status.PENDING, thread_id__isnull=True, eligible=False)
    problems += [
        f"{i} is unthreaded pending but not eligible" for i in lonely.values_list("id", flat=True)
    ]
    members: dict[tuple[int, str], list[Item]] = defaultdict(list)
    for row in Item.objects.filter(thread_id__isnull=False, status__in=LIVE_STATUSES):
        assert row.thread_id is not None  # the filter's thread_id__isnull=False
        members[(row.queue_id, row.thread_id)].append(row)
    threads = {(t.queue_id, t.thread_id): t for t in Thread.objects.all()}
    limits = dict(Queue.objects.values_list("id", "thread_limit"))
    for key, rows in members.items():
        processing = [r.id for r in rows if r.status == Status.PROCESSING]
        eligible = [r.id for r in rows if r.eligible]
        pending = sorted(
            (r for r in rows if r.status == Status.PENDING), key=lambda r: (r.scheduled_at, r.seq)
        )
        limit = limits.get(key[0], 1)
        heads = [r.id for r in pending[: max(0, limit - len(processing))]]
        if len(processing) > limit:
            problems.append(f"thread {key}: more than {limit} members processing: {processing}")
        if sorted(eligible) != sorted(heads):
            problems.append(f"thread {key}: eligible {eligible}, expected heads {heads}")
        thread = threads.pop(key, None)
        if thread is None:
            problems.append(f"thread {key} has live members but no thread row")
            continue
        if thread.member_count != len(rows):
            problems.append(
                f"thread {key}: member_count {thread.member_count}, live members {len(rows)}"
            )
        if thread.processing != len(processing) or (
            thread.processing_item not in processing if processing else thread.processing_item
        ):
            problems.append(
                f"thread {key}: processing {thread.processing} ({thread.processing_item}), "
                f"members processing {processing}"
            )
        if thread.heads != heads:
            problems.append(f"thread {key}: heads {thread.heads}, expected {heads}")
    for key in threads:
        problems.append(f"thread row {key} has no live member")
    assert not problems, "threads are inconsistent:\n" + "\n".join(problems)
