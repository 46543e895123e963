"""The state-directory store: atomic and durable writes, atomic moves, safe paths.

Plain files under ``tmp_path``; no database. ``os.fsync`` and libc's ``syncfs`` are wrapped by
spies that record what was flushed and then call the real function.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

import taskhoster.store as store_module
from taskhoster.errors import StoreError
from taskhoster.status import State
from taskhoster.store import BATCH_SYNCFS_THRESHOLD, FileMissing, StateStore

BAD_NAMES = [
    "..",
    ".",
    "a/b",
    "../q",
    ".hidden",
    "x\x00y",
    "q\n",
    "",
    "-lead",
    "/abs",
    "a" * 65,
    "a\\b",
]
BAD_IDS = ["..", ".", "a/b", "../x", ".hidden", "x\x00y", "id\n", "", "a.b", "a" * 65, "a\\b"]


def record(item_id: str, **extra: Any) -> dict[str, Any]:
    return {"id": item_id, "payload": {"n": item_id}, "rev": 1, **extra}


def files_in(directory: Path) -> list[str]:
    return sorted(os.listdir(directory)) if directory.is_dir() else []


def everything_under(path: Path) -> set[str]:
    return {str(p.relative_to(path)) for p in path.rglob("*")}


@pytest.fixture
def store(tmp_path: Path) -> StateStore:
    return StateStore(tmp_path / "root", fsync=True)


class FlushSpy:
    """Records, in call order, the path behind each ``os.fsync`` and ``syncfs`` (or ``os.sync``)
    and which final ``.json`` files of ``watch`` were visible at that moment."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, watch: Path | None = None) -> None:
        self.calls: list[tuple[str, str]] = []
        self.visible: list[list[str]] = []
        real_fsync = os.fsync
        real_syncfs = store_module._syncfs

        def note(kind: str, fd: int | None) -> None:
            path = os.readlink(f"/proc/self/fd/{fd}") if fd is not None else "os.sync"
            self.calls.append((kind, path))
            if watch is not None:
                self.visible.append([n for n in files_in(watch) if n.endswith(".json")])

        def fsync(fd: int) -> None:
            note("fsync", fd)
            real_fsync(fd)

        def syncfs(fd: int) -> int:
            note("syncfs", fd)
            return int(real_syncfs(fd)) if real_syncfs is not None else 0

        def sync() -> None:
            note("syncfs", None)

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "sync", sync)
        monkeypatch.setattr(store_module, "_syncfs", syncfs)

    def kinds(self) -> list[str]:
        return [kind for kind, _path in self.calls]


# -- atomic writes --------------------------------------------------------------------------


def test_write_creates_final_file_with_record_and_leaves_no_tmp(store: StateStore) -> None:
    store.write("q", State.PENDING, [record("a1")], durable=True)
    directory = store.state_dir("q", State.PENDING)
    assert files_in(directory) == ["a1.json"]
    assert json.loads((directory / "a1.json").read_text()) == record("a1")
    assert list(store.stale_temporaries("q")) == []


def test_write_creates_missing_state_directories(store: StateStore) -> None:
    assert not store.root.exists()
    store.write("fresh", State.DONE, [record("a1")], durable=False)
    assert sorted(files_in(store.queue_dir("fresh"))) == ["done", "pending", "processing"]
    assert store.read("fresh", State.DONE, "a1") == record("a1")


def test_rewrite_replaces_the_whole_file_atomically(store: StateStore) -> None:
    store.write("q", State.PENDING, [record("a1", payload="x" * 10_000)], durable=True)
    store.write("q", State.PENDING, [record("a1", rev=2, payload="short")], durable=True)
    assert store.read("q", State.PENDING, "a1") == record("a1", rev=2, payload="short")
    assert files_in(store.state_dir("q", State.PENDING)) == ["a1.json"]


def test_concurrent_reader_never_sees_a_half_written_file(store: StateStore) -> None:
    big = "y" * 300_000
    store.write("q", State.PENDING, [record("a1", payload=big, rev=0)], durable=False)
    stop = threading.Event()
    errors: list[BaseException] = []
    seen: set[int] = set()

    def reader() -> None:
        while not stop.is_set():
            try:
                got = store.read("q", State.PENDING, "a1")
                assert got["payload"] == big
                seen.add(got["rev"])
            except BaseException as exc:
                errors.append(exc)
                return

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for rev in range(1, 60):
            store.write("q", State.PENDING, [record("a1", payload=big, rev=rev)], durable=False)
    finally:
        stop.set()
        thread.join()
    assert errors == []
    assert len(seen) > 1  # the reader really ran during the rewrites
    assert list(store.stale_temporaries("q")) == []


def test_failed_batch_write_leaves_no_final_and_no_tmp_file(store: StateStore) -> None:
    store.ensure_queue("q")
    batch = [record("a1"), record("a2"), record("a3", payload=object())]
    with pytest.raises(TypeError):
        store.write("q", State.PENDING, batch, durable=True)
    assert files_in(store.state_dir("q", State.PENDING)) == []


def test_batch_with_an_invalid_id_writes_nothing(store: StateStore) -> None:
    store.ensure_queue("q")
    with pytest.raises(StoreError):
        store.write("q", State.PENDING, [record("a1"), record("../evil")], durable=True)
    assert files_in(store.state_dir("q", State.PENDING)) == []
    assert not (store.queue_dir("q") / "evil.json").exists()


# -- durability -----------------------------------------------------------------------------


def test_durable_write_fsyncs_file_before_rename_and_directory_after(
    store: StateStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    store.ensure_queue("q")
    directory = store.state_dir("q", State.PENDING)
    spy = FlushSpy(monkeypatch, watch=directory)
    store.write("q", State.PENDING, [record("a1")], durable=True)
    assert len(spy.calls) == 2
    (kind_file, file_path), (kind_dir, dir_path) = spy.calls
    assert kind_file == kind_dir == "fsync"
    assert Path(file_path).parent == directory
    assert file_path.endswith(".tmp")
    assert dir_path == str(directory)
    # the file is flushed before it appears under its name; the directory after the rename
    assert spy.visible == [[], ["a1.json"]]


@pytest.mark.parametrize("records", [1, BATCH_SYNCFS_THRESHOLD - 1])
def test_small_durable_write_fsyncs_every_file_and_the_directory(
    store: StateStore, monkeypatch: pytest.MonkeyPatch, records: int
) -> None:
    store.ensure_queue("q")
    spy = FlushSpy(monkeypatch)
    store.write("q", State.PENDING, [record(f"a{n}") for n in range(records)], durable=True)
    directory = str(store.state_dir("q", State.PENDING))
    file_flushes = [p for kind, p in spy.calls if kind == "fsync" and p.endswith(".tmp")]
    assert len(file_flushes) == records
    assert spy.calls[-1] == ("fsync", directory)
    assert "syncfs" not in spy.kinds()


@pytest.mark.parametrize("records", [BATCH_SYNCFS_THRESHOLD, 50])
def test_batch_durable_write_uses_one_filesystem_flush_before_renaming(
    store: StateStore, monkeypatch: pytest.MonkeyPatch, records: int
) -> None:
    store.ensure_queue("q")
    directory = store.state_dir("q", State.PENDING)
    spy = FlushSpy(monkeypatch, watch=directory)
    store.write("q", State.PENDING, [record(f"a{n:03d}") for n in range(records)], durable=True)
    assert spy.kinds() == ["syncfs", "fsync"]  # one flush of all files, then the directory
    assert spy.calls[-1] == ("fsync", str(directory))
    assert spy.visible[0] == []  # flushed while every file was still a temporary
    assert len(spy.visible[1]) == records
    assert len(files_in(directory)) == records


@pytest.mark.parametrize("records", [1, BATCH_SYNCFS_THRESHOLD])
def test_write_with_fsync_off_never_flushes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, records: int
) -> None:
    store = StateStore(tmp_path / "root", fsync=False)
    store.ensure_queue("q")
    spy = FlushSpy(monkeypatch)
    store.write("q", State.PENDING, [record(f"a{n}") for n in range(records)], durable=True)
    assert spy.calls == []
    assert len(files_in(store.state_dir("q", State.PENDING))) == records


def test_non_durable_write_never_flushes_even_with_fsync_on(
    store: StateStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    store.ensure_queue("q")
    spy = FlushSpy(monkeypatch)
    store.write("q", State.PENDING, [record(f"a{n}") for n in range(10)], durable=False)
    assert spy.calls == []


def test_durable_move_fsyncs_both_directories(
    store: StateStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    store.write("q", State.PENDING, [record("a1")], durable=False)
    spy = FlushSpy(monkeypatch)
    store.move("q", "a1", State.PENDING, State.PROCESSING, durable=True)
    assert sorted(p for _k, p in spy.calls) == sorted(
        [str(store.state_dir("q", State.PENDING)), str(store.state_dir("q", State.PROCESSING))]
    )


def test_non_durable_move_and_fsync_off_move_never_flush(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    on = StateStore(tmp_path / "on", fsync=True)
    off = StateStore(tmp_path / "off", fsync=False)
    for st_ in (on, off):
        st_.write("q", State.PENDING, [record("a1")], durable=False)
    spy = FlushSpy(monkeypatch)
    on.move("q", "a1", State.PENDING, State.PROCESSING)
    off.move("q", "a1", State.PENDING, State.PROCESSING, durable=True)
    assert spy.calls == []


# -- moves ----------------------------------------------------------------------------------


def test_move_renames_the_file_between_state_directories(store: StateStore) -> None:
    store.write("q", State.PENDING, [record("a1")], durable=False)
    store.move("q", "a1", State.PENDING, State.PROCESSING)
    assert files_in(store.state_dir("q", State.PENDING)) == []
    assert store.read("q", State.PROCESSING, "a1") == record("a1")


def test_second_mover_to_another_state_gets_file_missing(store: StateStore) -> None:
    store.write("q", State.PENDING, [record("a1")], durable=False)
    store.move("q", "a1", State.PENDING, State.PROCESSING)
    with pytest.raises(FileMissing):
        store.move("q", "a1", State.PENDING, State.DONE)
    assert files_in(store.state_dir("q", State.DONE)) == []
    assert files_in(store.state_dir("q", State.PROCESSING)) == ["a1.json"]


def test_racing_movers_exactly_one_wins_and_the_file_is_in_one_place(store: StateStore) -> None:
    for round_ in range(30):
        item_id = f"r{round_}"
        store.write("q", State.PENDING, [record(item_id)], durable=False)
        barrier = threading.Barrier(2)
        outcome: dict[State, str] = {}

        def mover(
            dst: State,
            item_id: str = item_id,
            barrier: threading.Barrier = barrier,
            outcome: dict[State, str] = outcome,
        ) -> None:
            barrier.wait()
            try:
                store.move("q", item_id, State.PENDING, dst)
                outcome[dst] = "moved"
            except FileMissing:
                outcome[dst] = "missing"

        threads = [
            threading.Thread(target=mover, args=(dst,)) for dst in (State.PROCESSING, State.DONE)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(outcome.values()) == ["missing", "moved"]
        winner = next(dst for dst, what in outcome.items() if what == "moved")
        where = [s for s in State if (store.state_dir("q", s) / f"{item_id}.json").exists()]
        assert where == [winner]


def test_move_repeated_after_file_already_in_destination_is_not_an_error(
    store: StateStore,
) -> None:
    store.write("q", State.PENDING, [record("a1")], durable=False)
    store.move("q", "a1", State.PENDING, State.PROCESSING)
    store.move("q", "a1", State.PENDING, State.PROCESSING)
    assert store.read("q", State.PROCESSING, "a1") == record("a1")


def test_move_of_a_file_that_is_nowhere_gets_file_missing(store: StateStore) -> None:
    store.ensure_queue("q")
    with pytest.raises(FileMissing):
        store.move("q", "nothing", State.PENDING, State.PROCESSING)


# -- reads and unlinks ------------------------------------------------------------------------


def test_read_any_finds_the_file_in_another_state(store: StateStore) -> None:
    store.write("q", State.DONE, [record("a1", result=7)], durable=False)
    state, got = store.read_any("q", "a1", first=State.PENDING)
    assert state is State.DONE
    assert got["result"] == 7


def test_read_any_prefers_the_first_state_when_two_copies_exist(store: StateStore) -> None:
    store.write("q", State.PENDING, [record("a1", rev=1)], durable=False)
    store.write("q", State.DONE, [record("a1", rev=2)], durable=False)
    assert store.read_any("q", "a1", first=State.DONE)[0] is State.DONE
    assert store.read_any("q", "a1", first=State.PENDING)[0] is State.PENDING


def test_read_any_of_a_missing_item_raises_file_missing(store: StateStore) -> None:
    store.ensure_queue("q")
    with pytest.raises(FileMissing):
        store.read_any("q", "a1", first=State.PENDING)


def test_read_of_a_corrupt_file_is_a_store_error_not_a_crash(store: StateStore) -> None:
    store.ensure_queue("q")
    (store.state_dir("q", State.PENDING) / "a1.json").write_text('{"id": "a1", "pay')
    with pytest.raises(StoreError) as caught:
        store.read("q", State.PENDING, "a1")
    assert not isinstance(caught.value, FileMissing)


def test_unlink_removes_the_file_from_every_state_and_reports_it(store: StateStore) -> None:
    store.write("q", State.PENDING, [record("a1")], durable=False)
    store.write("q", State.DONE, [record("a1")], durable=False)
    assert store.unlink("q", "a1") is True
    assert all(files_in(store.state_dir("q", s)) == [] for s in State)
    assert store.unlink("q", "a1") is False


def test_scan_lists_item_files_and_skips_temporaries(store: StateStore) -> None:
    store.write("q", State.PENDING, [record("a1")], durable=False)
    store.write("q", State.DONE, [record("a2")], durable=False)
    (store.state_dir("q", State.PENDING) / ".a3.dead.tmp").write_text("{")
    found = sorted((f.state.value, f.item_id) for f in store.scan("q"))
    assert found == [("done", "a2"), ("pending", "a1")]
    assert [p.name for p in store.stale_temporaries("q")] == [".a3.dead.tmp"]


# -- paths: nothing escapes the root --------------------------------------------------------


@pytest.mark.parametrize("name", BAD_NAMES)
def test_bad_queue_name_is_refused_by_every_operation(store: StateStore, name: str) -> None:
    outside_before = everything_under(store.root.parent)
    operations = [
        lambda: store.queue_dir(name),
        lambda: store.state_dir(name, State.PENDING),
        lambda: store.item_path(name, State.PENDING, "a1"),
        lambda: store.ensure_queue(name),
        lambda: store.write(name, State.PENDING, [record("a1")], durable=True),
        lambda: store.move(name, "a1", State.PENDING, State.PROCESSING),
        lambda: store.read(name, State.PENDING, "a1"),
        lambda: store.read_any(name, "a1", State.PENDING),
        lambda: store.unlink(name, "a1"),
        lambda: store.remove_queue(name),
    ]
    for operation in operations:
        with pytest.raises(StoreError) as caught:
            operation()
        assert caught.value.code == "invalid_queue_name"
    assert everything_under(store.root.parent) == outside_before


@pytest.mark.parametrize("item_id", BAD_IDS)
def test_bad_item_id_is_refused_by_every_operation(store: StateStore, item_id: str) -> None:
    store.ensure_queue("q")
    before = everything_under(store.root.parent)
    operations = [
        lambda: store.item_path("q", State.PENDING, item_id),
        lambda: store.write("q", State.PENDING, [record(item_id)], durable=True),
        lambda: store.move("q", item_id, State.PENDING, State.PROCESSING),
        lambda: store.read("q", State.PENDING, item_id),
        lambda: store.read_any("q", item_id, State.PENDING),
        lambda: store.unlink("q", item_id),
    ]
    for operation in operations:
        with pytest.raises(StoreError) as caught:
            operation()
        assert caught.value.code == "invalid_id"
    assert everything_under(store.root.parent) == before


@pytest.mark.parametrize("bad", [None, 7, b"q"])
def test_non_string_queue_or_id_is_refused(store: StateStore, bad: Any) -> None:
    with pytest.raises(StoreError):
        store.queue_dir(bad)
    with pytest.raises(StoreError):
        store.item_path("q", State.PENDING, bad)


def test_longest_allowed_queue_name_and_id_are_accepted(store: StateStore) -> None:
    name, item_id = "Q" + "a" * 63, "i" * 64
    store.write(name, State.PENDING, [record(item_id)], durable=False)
    assert store.read(name, State.PENDING, item_id)["id"] == item_id


def test_remove_queue_with_parent_reference_does_not_touch_anything(store: StateStore) -> None:
    store.write("q", State.PENDING, [record("a1")], durable=False)
    sibling = store.root.parent / "sibling.txt"
    sibling.write_text("keep")
    for name in ("..", ".", "../root", "q/.."):
        with pytest.raises(StoreError):
            store.remove_queue(name)
    assert sibling.read_text() == "keep"
    assert store.read("q", State.PENDING, "a1") == record("a1")


def test_queues_lists_only_valid_queue_directories(store: StateStore) -> None:
    store.ensure_queue("b")
    store.ensure_queue("a")
    (store.root / ".hidden").mkdir()
    (store.root / "file.txt").write_text("x")
    assert store.queues() == ["a", "b"]


@hsettings(max_examples=400, deadline=None, database=None)
@given(queue=st.text(max_size=70), item_id=st.text(max_size=70), state=st.sampled_from(list(State)))
def test_any_accepted_name_and_id_resolve_to_a_file_directly_inside_its_state_dir(
    queue: str, item_id: str, state: State
) -> None:
    root = Path("/nonexistent-taskhoster-root/state")
    store = StateStore(root)
    try:
        path = store.item_path(queue, state, item_id)
    except StoreError:
        return
    resolved = path.resolve()
    assert resolved.parent.parent.parent == store.root
    assert resolved.parent.name == state.value
    assert resolved.parent.parent.name == queue
    assert resolved.name == f"{item_id}.json"
    assert not queue.startswith(".")
    assert not item_id.startswith(".")
