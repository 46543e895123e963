"""I1 and I2 under a power cut: every state the disk can be left in after any file operation
of a run of group commits loses no acknowledged post and undoes no acknowledged verdict.

How (in the spirit of the ALICE study, which enumerated crash states from syscall traces):
a run of groups (posts single and batched, threaded items, claims, results, retryable and
final failures with a dead-letter copy, a restart, lapsed leases) goes through the real
engine with the store's syscalls recorded in order, with the moment each answer went out.
A power cut after operation k keeps everything up to the last flush barrier before k, and of
the operations after it any subset, each write possibly cut short (the weakest model a POSIX
filesystem allows: nothing after a barrier is ordered; a stronger filesystem leaves fewer
states). Each state is built from a copy of the run's starting tree, the index is rebuilt
from the files alone (``repair`` on an empty database: a power cut may also lose the
database), and then:

- every post answered before k exists, with its payload;
- every verdict answered before k (a result accepted, a final failure) stands;
- the index says what the directories say.

A FUSE layer that drops unsynced writes (Jepsen's LazyFS) tests a real mount, but it is a C++
daemon to build from source and run privileged beside the suite, and it drops the unsynced
writes as a whole, not in every subset; the recording here needs nothing beyond the test,
runs in seconds and explores states a real power cut would rarely produce. The exploration is
bounded by ``TASKHOSTER_POWER_CUT_SECONDS`` (default 25 per flush mode) and reports how much
it covered.
"""

from __future__ import annotations

import itertools
import os
import random
import shutil
import time
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

from .consistency import assert_index_matches_directories

BUDGET = float(os.environ.get("TASKHOSTER_POWER_CUT_SECONDS", "25"))
MAX_SUBSETS = 48  # subsets of one crash point's unflushed operations, at most


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
        self.trace.ops.append(("fsync", self.trace.rel(path)))

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
            if (
                isinstance(op, Result | Fail)
                and value.accepted
                and value.status
                in (
                    "finished",
                    "failed",
                )
            ):
                trace.ops.append(("ack-verdict", op.item_id, value.status))
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


def apply(root: Path, op: tuple[Any, ...], cut: bool) -> None:
    """Replay one recorded operation on a copy (``cut``: only half of its data got there).
    An operation whose file is not there (its creation was lost) is lost with it."""
    kind = op[0]
    try:
        if kind == "create":
            data = op[2][: len(op[2]) // 2] if cut else op[2]
            (root / op[1]).write_bytes(data)
        elif kind == "append":
            data = op[2][: len(op[2]) // 2] if cut else op[2]
            path = root / op[1]
            if path.exists():
                with open(path, "ab") as handle:
                    handle.write(data)
        elif kind == "truncate":
            os.truncate(root / op[1], op[2])
        elif kind == "rename":
            os.rename(root / op[1], root / op[2])
        elif kind == "unlink":
            os.unlink(root / op[1])
    except FileNotFoundError:
        pass


def crash_states(ops: list[tuple[Any, ...]], rng: random.Random) -> Any:
    """(k, durable prefix, unflushed subset, cut) for crash points k, most informative first."""
    points = list(range(len(ops) + 1))
    rng.shuffle(points)
    for k in points:
        last = max((i for i in range(k) if ops[i][0] == "barrier"), default=-1)
        tail = [i for i in range(last + 1, k) if ops[i][0] in FILE_OPS]
        if len(tail) <= 5:
            subsets = [
                list(s) for n in range(len(tail) + 1) for s in itertools.combinations(tail, n)
            ]
        else:
            subsets = [[], tail] + [
                [i for i in tail if rng.random() < 0.5] for _ in range(MAX_SUBSETS - 2)
            ]
        for subset in subsets[:MAX_SUBSETS]:
            writes = [i for i in subset if ops[i][0] in ("create", "append")]
            yield k, last, subset, None
            if writes:
                yield k, last, subset, rng.choice(writes)


FILE_OPS = {"create", "append", "truncate", "rename", "unlink"}


def with_fsync_barriers(ops: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """In fsync mode a group's flush is an fsync of each file it wrote and each directory it
    touched: a barrier for the group once the last of them returns (a crash part-way leaves
    a subset of the group's operations, as before any barrier)."""
    out: list[tuple[Any, ...]] = []
    for n, op in enumerate(ops):
        out.append(op)
        following = ops[n + 1][0] if n + 1 < len(ops) else None
        if op[0] == "fsync" and following != "fsync":
            out.append(("barrier",))
    return out


def build(base: Path, target: Path, ops: list[tuple[Any, ...]], state: tuple[Any, ...]) -> None:
    _k, last, subset, cut = state
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(base, target)
    for i in range(last + 1):
        if ops[i][0] in FILE_OPS:
            apply(target, ops[i], cut=False)
    for i in subset:
        apply(target, ops[i], cut=(i == cut))


def acknowledged(ops: list[tuple[Any, ...]], k: int) -> tuple[dict[str, Any], dict[str, str]]:
    posts: dict[str, Any] = {}
    verdicts: dict[str, str] = {}
    for op in ops[:k]:
        if op[0] == "ack-post":
            posts[op[1]] = op[2]
        elif op[0] == "ack-verdict":
            verdicts[op[1]] = op[2]
    return posts, verdicts


def check_after_repair(root: Path, ops: list[tuple[Any, ...]], state: tuple[Any, ...]) -> None:
    Item.objects.all().delete()
    Thread.objects.all().delete()
    QueueCount.objects.all().delete()
    Queue.objects.all().delete()
    engine.repair(grace_seconds=0)
    posts, verdicts = acknowledged(ops, state[0])
    restarted = {op[1] for op in ops[: state[0]] if op[0] == "restart"}
    rows = {r.id: r for r in Item.objects.select_related("queue")}
    for item_id, payload in posts.items():
        assert item_id in rows, f"acknowledged post {item_id} lost in {state}"
        row = rows[item_id]
        found = next(root.glob(f"{row.queue.name}/*/{item_id}.json"))
        record = decode(found.read_bytes())[0]
        assert record["payload"] == payload, f"post {item_id} has another payload in {state}"
    for item_id, status in verdicts.items():
        row = rows.get(item_id)
        assert row is not None, f"item {item_id} with an acknowledged verdict lost in {state}"
        if item_id not in restarted:
            assert row.status == status, f"verdict {status} of {item_id} undone in {state}"
    assert_index_matches_directories(root)


@pytest.mark.slow
@pytest.mark.django_db
@pytest.mark.parametrize("flush", ["syncfs", "fsync"])
def test_no_power_cut_loses_an_acknowledged_post_or_undoes_a_verdict(
    flush: str, settings: Any, state_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
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
    ops = with_fsync_barriers(trace.ops)
    assert {op[0] for op in ops} >= {"ack-post", "ack-verdict", "create", "append", "rename"}

    crashed = tmp_path / "crashed"
    settings.TASKHOSTER = {**settings.TASKHOSTER, "ROOT": str(crashed)}
    rng = random.Random(20261130)
    explored = 0
    started = time.monotonic()
    for state in crash_states(ops, rng):
        build(base, crashed, ops, state)
        check_after_repair(crashed, ops, state)
        explored += 1
        if time.monotonic() - started > BUDGET:
            break
    barriers = sum(1 for op in ops if op[0] == "barrier")
    print(
        f"power cut ({flush}): {explored} crash states of {len(ops)} recorded operations, "
        f"{barriers} barriers"
    )
    assert explored >= 200
