"""I1 and I2 under a power cut: every state the disk can be left in after any file operation
of a run of group commits loses no acknowledged post and undoes no acknowledged verdict.

How (in the spirit of the ALICE and CrashMonkey studies, which enumerate crash states from
syscall traces): a run of groups (posts single and batched, threaded items, claims, results,
retryable and final failures with a dead-letter copy, a restart, lapsed leases) goes through
the real engine with the store's syscalls recorded in order, with the moment each answer went
out. A power cut after operation k leaves what ``crash_model`` allows: durability per file and
per directory (a file's ``fsync`` keeps its data, a directory's keeps its entries, ``syncfs``
keeps everything; of the rest any subset of the entries, and of each file a prefix of its
writes, the last one cut short or zeroed). So a flush that forgets a directory, or aims at a
renamed file's old name, leaves states that lose what was acknowledged. Each state is written
out as a tree, the index is rebuilt from the files alone (``repair`` on an empty database: a
power cut may also lose the database), and then:

- every post answered before k exists, with its payload;
- every verdict answered before k (a result accepted, with its value; a final failure; a
  restart) stands;
- the index says what the directories say, and every thread is consistent.

Every crash point is visited (one after each recorded operation). The states of a point are
counted exactly; CI checks up to ``TASKHOSTER_POWER_CUT_STATES_PER_POINT`` of them (6; the state
that keeps nothing unflushed, and a seeded sample), and ``TASKHOSTER_POWER_CUT_ALL=1``
(``scripts/power-cut-all``) checks every one. Each mode prints ``explored N of M states``.
"""

from __future__ import annotations

import os
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from taskhoster import engine
from taskhoster.engine import committer
from taskhoster.engine.common import store as the_store
from taskhoster.engine.group import prepare_post
from taskhoster.engine.ops import Claim, Fail, NewItem, Restart, Result, Sweep
from taskhoster.models import Item, Queue, QueueCount, Thread
from taskhoster.store import Syscalls, decode
from taskhoster.timeutil import now as utcnow

from .consistency import assert_index_matches_directories, assert_threads_consistent
from .crash_model import Disk, write_tree

# Every state of every crash point (``scripts/power-cut-all``), or up to this many a point.
ALL_STATES = os.environ.get("TASKHOSTER_POWER_CUT_ALL") == "1"
STATES_PER_POINT = int(os.environ.get("TASKHOSTER_POWER_CUT_STATES_PER_POINT", "6"))


@dataclass
class Trace:
    root: Path
    ops: list[tuple[Any, ...]] = field(default_factory=list)

    def rel(self, path: str) -> str:
        return os.path.relpath(path, self.root)


class RecordingSyscalls(Syscalls):
    """Does every operation for real and writes it down."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace

    def create(self, path: str, data: bytes) -> None:
        super().create(path, data)
        self.trace.ops.append(("create", self.trace.rel(path), data))

    def append(self, path: str, data: bytes) -> int:
        size = super().append(path, data)
        self.trace.ops.append(("append", self.trace.rel(path), data))
        return size

    def truncate(self, path: str, size: int) -> None:
        super().truncate(path, size)
        self.trace.ops.append(("truncate", self.trace.rel(path), size))

    def rename(self, src: str, dst: str) -> None:
        super().rename(src, dst)
        self.trace.ops.append(("rename", self.trace.rel(src), self.trace.rel(dst)))

    def unlink(self, path: str) -> None:
        super().unlink(path)
        self.trace.ops.append(("unlink", self.trace.rel(path)))

    def fsync(self, path: str) -> None:
        super().fsync(path)
        kind = "fsync-dir" if os.path.isdir(path) else "fsync"
        self.trace.ops.append((kind, self.trace.rel(path)))

    def syncfs(self, path: str) -> None:
        super().syncfs(path)
        self.trace.ops.append(("barrier",))


def record_acks(trace: Trace, monkeypatch: pytest.MonkeyPatch) -> None:
    """Note, at the moment each answer goes out, what it acknowledged."""
    deliver = committer.answer

    def answer(outcomes: list[tuple[Any, bool, Any]]) -> None:
        for op, ok, value in outcomes:
            if not ok:
                continue
            for posted in value if isinstance(value, list) else []:
                if isinstance(posted, engine.Posted) and posted.created:
                    trace.ops.append(("ack-post", posted.row.id, posted.payload))
            if isinstance(op, Result | Fail) and value.accepted:
                if value.status == "finished":
                    trace.ops.append(("ack-verdict", op.item_id, value.status, op.result))
                elif value.status == "failed":
                    trace.ops.append(("ack-verdict", op.item_id, value.status, None))
            if isinstance(op, Restart):
                trace.ops.append(("ack-verdict", op.item_id, "restarted", None))
        deliver(outcomes)

    monkeypatch.setattr(committer, "answer", answer)


def group(*ops: Any) -> list[Any]:
    """Run ``ops`` as one group commit and return their answers."""
    committer.run_group(list(ops), 0)
    return [op.future.result() for op in ops]


def post(queue: str, *payloads: Any, thread: str | None = None) -> Any:
    return prepare_post(queue, [NewItem(payload=p, thread_id=thread) for p in payloads])


def with_future(op: Any) -> Any:
    from concurrent.futures import Future

    op.future = Future()
    return op


def run_workload(trace: Trace) -> None:
    """Groups of every kind of transition that writes item files."""
    ops = [
        with_future(post("q", "a")),
        with_future(post("q", "b", "c")),
        with_future(post("q", "t1", "t2", thread="t")),
    ]
    group(*ops)
    (claimed,) = group(with_future(Claim(queue_name="q", max_items=4)))
    assert len(claimed) == 4
    a, b, c, t1 = (x.row for x in claimed)
    group(
        with_future(Result(item_id=a.id, result={"done": "a"})),
        with_future(Fail(item_id=b.id, lease=b.lease, error="again", retry=True)),
        with_future(Fail(item_id=c.id, lease=c.lease, error="fatal", retry=False)),
        with_future(post("q", "d")),
    )
    (again,) = group(with_future(Claim(queue_name="q", max_items=3)))
    # A restart may take back a verdict (rule 10): from here on, c's may be undone.
    trace.ops.append(("restart", c.id))
    group(
        with_future(Restart(item_id=c.id)),
        *(with_future(Result(item_id=x.row.id, result=x.payload)) for x in again[:1]),
        with_future(post("q", "e", "f")),
    )
    later = utcnow().replace(year=utcnow().year + 1)
    group(
        with_future(Sweep(clock="lapse", ids=(t1.id, *(x.row.id for x in again)), at=later)),
        with_future(Result(item_id=t1.id, result="late")),
    )


# -- crash states -----------------------------------------------------------------------------


FILE_OPS = {"create", "append", "truncate", "rename", "unlink", "fsync", "fsync-dir", "barrier"}


def crash_points(base: Path, ops: list[tuple[Any, ...]]) -> Any:
    """(k, the disk as a power cut after the first k operations may leave it), for every k."""
    disk = Disk(base)
    yield 0, disk.crash_point()
    for k, op in enumerate(ops, start=1):
        if op[0] in FILE_OPS:
            disk.play(op)
        yield k, disk.crash_point()


def chosen_states(count: int, rng: random.Random) -> list[int]:
    """Which of a crash point's ``count`` states to check: all of them with ``ALL_STATES``
    (or when there are few), else the state that keeps nothing unflushed, and a seeded
    sample."""
    if ALL_STATES or count <= STATES_PER_POINT:
        return list(range(count))
    return [0, *rng.sample(range(1, count), STATES_PER_POINT - 1)]


def acknowledged(
    ops: list[tuple[Any, ...]], k: int
) -> tuple[dict[str, Any], dict[str, tuple[str, Any]]]:
    """The posts acknowledged before operation k (id: payload), and each item's last
    acknowledged verdict (id: (status, result)): finished, failed, or restarted (rule 10
    takes a failure back)."""
    posts: dict[str, Any] = {}
    verdicts: dict[str, tuple[str, Any]] = {}
    for op in ops[:k]:
        if op[0] == "ack-post":
            posts[op[1]] = op[2]
        elif op[0] == "ack-verdict":
            verdicts[op[1]] = (op[2], op[3])
    return posts, verdicts


@dataclass
class StateName:
    """A crash state as a failure names it: which one, after what."""

    number: int
    count: int
    ops: list[tuple[Any, ...]]
    k: int

    def __str__(self) -> str:
        recent = [
            " ".join(str(x) if not isinstance(x, bytes) else f"<{len(x)} bytes>" for x in op)
            for op in self.ops[max(0, self.k - 25) : self.k]
        ]
        return f"state {self.number} of {self.count} after op {self.k} (the last ops: {recent})"


def check_after_repair(root: Path, ops: list[tuple[Any, ...]], k: int, what: StateName) -> None:
    Item.objects.all().delete()
    Thread.objects.all().delete()
    QueueCount.objects.all().delete()
    Queue.objects.all().delete()
    engine.repair(grace_seconds=0)
    posts, verdicts = acknowledged(ops, k)
    # A restart is acknowledged only once durable, but one not yet acknowledged may already
    # have taken the failure back.
    restarting = {op[1] for op in ops[:k] if op[0] == "restart"}
    rows = {r.id: r for r in Item.objects.select_related("queue")}
    records = {}
    for item_id in set(posts) | set(verdicts):
        row = rows.get(item_id)
        assert row is not None, f"acknowledged item {item_id} lost in {what}"
        found = next(root.glob(f"{row.queue.name}/*/{item_id}.json"))
        records[item_id] = decode(found.read_bytes())[0]
    for item_id, payload in posts.items():
        got = records[item_id]["payload"]
        assert got == payload, f"post {item_id} has another payload in {what}"
    for item_id, (status, result) in verdicts.items():
        row = rows[item_id]
        if status == "restarted":
            # In this workload nothing claims a restarted item again.
            assert row.status == "pending", f"restart of {item_id} undone in {what}"
        elif item_id not in restarting:
            assert row.status == status, f"verdict {status} of {item_id} undone in {what}"
            if status == "finished":
                got = records[item_id].get("result")
                assert got == result, f"result of {item_id} is {got!r} in {what}"
    assert_index_matches_directories(root)
    assert_threads_consistent()


@pytest.mark.slow
@pytest.mark.django_db
@pytest.mark.parametrize("flush", ["syncfs", "fsync"])
def test_no_power_cut_loses_an_acknowledged_post_or_undoes_a_verdict(
    flush: str,
    settings: Any,
    state_root: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    settings.TASKHOSTER = {**settings.TASKHOSTER, "FSYNC": True, "FLUSH": flush}
    engine.upsert_queue(name="dead", body={})
    engine.upsert_queue(
        name="q", body={"deadLetterQueue": "dead", "backoffSeconds": 0, "maxAttempts": 5}
    )
    base = tmp_path / "base"
    shutil.copytree(state_root, base)
    trace = Trace(root=the_store().root)
    monkeypatch.setattr(the_store(), "sys", RecordingSyscalls(trace))
    record_acks(trace, monkeypatch)
    run_workload(trace)
    ops = trace.ops
    assert {op[0] for op in ops} >= {"ack-post", "ack-verdict", "create", "append", "rename"}

    crashed = tmp_path / "crashed"
    settings.TASKHOSTER = {**settings.TASKHOSTER, "ROOT": str(crashed)}
    rng = random.Random(20261201)
    total = explored = points = 0
    checked: set[tuple[int, int]] = set()  # (tree, acknowledgements) already checked
    for k, point in crash_points(base, ops):
        count = point.count()
        total += count
        points += 1
        acks = hash(repr([op for op in ops[:k] if op[0] not in FILE_OPS]))
        for number in chosen_states(count, rng):
            contents = point.state(number)
            explored += 1
            seen = (hash(tuple(sorted(contents.items()))), acks)
            if seen in checked:
                continue
            checked.add(seen)
            shutil.rmtree(crashed, ignore_errors=True)
            write_tree(base, crashed, contents)
            check_after_repair(crashed, ops, k, StateName(number, count, ops, k))
    with capsys.disabled():
        print(
            f"\npower cut ({flush}): explored {explored} of {total} states "
            f"({len(checked)} distinct trees checked) over {points} crash points of "
            f"{len(ops)} recorded operations"
            + ("" if ALL_STATES else f" (up to {STATES_PER_POINT} a point, seeded)")
        )
    assert points == len(ops) + 1
    if ALL_STATES:
        assert explored == total
