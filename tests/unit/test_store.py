"""The state-directory store: item files as logs of lines, new files, file batches that
can be undone, one flush per batch, safe paths.

Plain files under ``tmp_path``; no database. The store's syscalls are recorded by a
``Syscalls`` subclass that still performs each one for real.
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from taskhoster import store as store_module
from taskhoster.errors import StoreError
from taskhoster.status import State
from taskhoster.store import FileMissing, StateStore, Syscalls, decode, encode_line

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
    return {"id": item_id, "payload": {"n": item_id}, "status": "pending", "rev": 1, **extra}


class Recorder(Syscalls):
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def create(self, path: str, data: bytes) -> None:
        super().create(path, data)
        self.calls.append(("create", path))

    def append(self, path: str, data: bytes) -> int:
        self.calls.append(("append", path))
        return super().append(path, data)

    def rename(self, src: str, dst: str) -> None:
        super().rename(src, dst)
        self.calls.append(("rename", dst))

    def unlink(self, path: str) -> None:
        self.calls.append(("unlink", path))
        super().unlink(path)

    def truncate(self, path: str, size: int) -> None:
        self.calls.append(("truncate", path))
        super().truncate(path, size)

    def mkdir(self, path: str) -> None:
        super().mkdir(path)
        self.calls.append(("mkdir", path))

    def rmdir(self, path: str) -> None:
        super().rmdir(path)
        self.calls.append(("rmdir", path))

    def fsync(self, path: str) -> None:
        self.calls.append(("fsync", path))
        super().fsync(path)

    def syncfs(self, path: str) -> None:
        self.calls.append(("syncfs", path))
        super().syncfs(path)

    def kinds(self) -> list[str]:
        return [kind for kind, _path in self.calls]


@pytest.fixture
def store(tmp_path: Path) -> StateStore:
    st_ = StateStore(tmp_path / "root", fsync=True)
    st_.sys = Recorder()
    return st_


def calls(store: StateStore) -> Recorder:
    assert isinstance(store.sys, Recorder)
    return store.sys


def posted(store: StateStore, queue: str, item_id: str) -> Path:
    """A new item, created in ``pending/`` by a flushed batch."""
    batch = store.batch()
    batch.create(queue, item_id, encode_line(record(item_id)))
    batch.flush()
    return store.item_path(queue, State.PENDING, item_id)


# -- the record: lines folded in order ----------------------------------------------------------


def test_a_record_is_its_first_line_updated_by_the_others() -> None:
    data = encode_line(record("a")) + encode_line({"rev": 2, "status": "finished", "result": 7})
    folded, end = decode(data)
    assert folded == {**record("a"), "rev": 2, "status": "finished", "result": 7}
    assert end == len(data)


def test_a_torn_last_line_is_ignored() -> None:
    whole = encode_line(record("a")) + encode_line({"rev": 2, "status": "finished"})
    folded, end = decode(whole + b'{"rev": 3, "sta')
    assert folded["rev"] == 2
    assert end == len(whole)


@pytest.mark.parametrize("data", [b"", b'{"id": "a"', b"not json\n", b"[1]\n"])
def test_a_file_without_a_whole_first_line_is_a_store_error(data: bytes) -> None:
    with pytest.raises(StoreError):
        decode(data)


def test_a_record_ends_at_its_first_torn_line_whatever_follows() -> None:
    first = encode_line(record("a"))
    torn = b'{"rev": 2, "status": "fini'
    later = encode_line({"rev": 3, "status": "finished"})
    folded, end = decode(first + torn + later)
    assert folded == record("a")
    assert end == len(first)


# -- posts: one new file each ------------------------------------------------------------------


def test_a_post_creates_its_file_in_pending(store: StateStore) -> None:
    store.ensure_queue("q")
    calls(store).calls.clear()
    batch = store.batch()
    batch.create("q", "a1", encode_line(record("a1")))
    assert store.read("q", State.PENDING, "a1") == record("a1")
    assert calls(store).kinds() == ["create"]


def test_a_new_queues_directories_are_durable_before_anything_is_written_into_them(
    store: StateStore,
) -> None:
    """A file flushed into a directory whose own entry a power cut takes is lost with it: the
    queue's directory is flushed into the root, its state directories into it; and each new
    directory is flushed itself (on a filesystem without a journal its parent's flush does
    not write its own block: ``test_flush_fails.py`` read such a directory back as EBADMSG)."""
    store.root.mkdir()
    batch = store.batch()
    batch.create("q", "a1", encode_line(record("a1")))
    root, queue = str(store.root), str(store.queue_dir("q"))
    made = [path for kind, path in calls(store).calls if kind == "mkdir"]
    assert made == [queue, *(f"{queue}/{state.value}" for state in State)]
    flushed = calls(store).calls[len(made) : len(made) * 2 + 1]
    assert flushed == [*(("fsync", path) for path in made), ("fsync", root)]
    assert calls(store).kinds()[-1] == "create"
    calls(store).calls.clear()
    store.ensure_queue("q")
    assert calls(store).calls == []  # nothing new, nothing flushed


def test_a_new_queues_directories_whose_flush_failed_are_made_and_flushed_again_next_time(
    store: StateStore,
) -> None:
    """A directory made but not made durable (its flush failed) is taken away again, so that
    the next try makes and flushes it rather than find it and flush nothing."""
    store.root.mkdir()
    failing = [True]

    class FlushFails(Recorder):
        def fsync(self, path: str) -> None:
            if failing and path.endswith("/processing"):
                raise OSError(errno.EIO, "I/O error")
            super().fsync(path)

    store.sys = FlushFails()
    with pytest.raises(StoreError):
        store.batch().create("q", "a1", encode_line(record("a1")))
    assert not store.queue_dir("q").exists()
    failing.clear()
    calls(store).calls.clear()
    posted(store, "q", "a1")
    queue = str(store.queue_dir("q"))
    flushed = {path for kind, path in calls(store).calls if kind == "fsync"}
    assert {queue, *(f"{queue}/{state.value}" for state in State)} <= flushed


def test_a_post_into_an_existing_id_is_refused(store: StateStore) -> None:
    posted(store, "q", "a1")
    with pytest.raises(StoreError):
        store.batch().create("q", "a1", encode_line(record("a1", payload="other")))
    assert store.read("q", State.PENDING, "a1") == record("a1")


# -- transitions: append a line, rename; nothing created ----------------------------------------


def test_a_change_appends_its_line_and_moves_the_same_file(store: StateStore) -> None:
    path = posted(store, "q", "a1")
    inode = path.stat().st_ino
    calls(store).calls.clear()
    batch = store.batch()
    assert batch.change("q", "a1", State.PENDING, State.DONE, {"rev": 2, "status": "finished"})
    done = store.item_path("q", State.DONE, "a1")
    assert done.stat().st_ino == inode  # no new file
    assert not path.exists()
    assert store.read("q", State.DONE, "a1")["status"] == "finished"
    assert calls(store).kinds() == ["append", "rename"]


def test_a_claim_is_a_rename_without_a_write(store: StateStore) -> None:
    posted(store, "q", "a1")
    calls(store).calls.clear()
    batch = store.batch()
    assert batch.change("q", "a1", State.PENDING, State.PROCESSING, None)
    assert calls(store).kinds() == ["rename"]


def test_a_change_finds_the_file_in_another_state(store: StateStore) -> None:
    posted(store, "q", "a1")
    batch = store.batch()
    assert batch.change("q", "a1", State.PROCESSING, State.DONE, {"rev": 2, "status": "failed"})
    assert store.read("q", State.DONE, "a1")["status"] == "failed"


def test_a_change_of_a_file_that_is_nowhere_says_so(store: StateStore) -> None:
    store.ensure_queue("q")
    assert store.batch().change("q", "a1", State.PENDING, State.DONE, {"rev": 2}) is False


def test_rollback_undoes_appends_and_renames_newest_first(store: StateStore) -> None:
    path = posted(store, "q", "a1")
    before = path.read_bytes()
    batch = store.batch()
    batch.create("q", "b2", encode_line(record("b2")))
    batch.change("q", "a1", State.PENDING, State.PROCESSING, None)
    batch.change("q", "a1", State.PROCESSING, State.DONE, {"rev": 2, "status": "finished"})
    batch.remove("q", "a1", State.DONE)
    batch.rollback()
    assert path.read_bytes() == before
    assert not store.item_path("q", State.PENDING, "b2").exists()
    assert batch.unlinks == []


def test_removals_wait_for_apply_unlinks(store: StateStore) -> None:
    path = posted(store, "q", "a1")
    batch = store.batch()
    batch.remove("q", "a1", State.PROCESSING)
    assert path.exists()
    batch.apply_unlinks()
    assert not path.exists()


# -- flushing: one barrier per batch ------------------------------------------------------------


def test_a_batch_flushes_once_with_syncfs_after_all_its_changes(store: StateStore) -> None:
    for n in range(5):
        posted(store, "q", f"a{n}")
    calls(store).calls.clear()
    batch = store.batch()
    for n in range(5):
        batch.change("q", f"a{n}", State.PENDING, State.DONE, {"rev": 2, "status": "finished"})
    batch.flush()
    kinds = calls(store).kinds()
    assert kinds.count("syncfs") == 1
    assert kinds[-1] == "syncfs"


def test_fsync_mode_flushes_every_written_file_and_touched_directory(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "root", fsync=True, flush="fsync")
    store.sys = Recorder()
    posted(store, "q", "a1")
    calls(store).calls.clear()
    batch = store.batch()
    batch.change("q", "a1", State.PENDING, State.DONE, {"rev": 2, "status": "finished"})
    batch.flush()
    flushed = [path for kind, path in calls(store).calls if kind == "fsync"]
    assert str(store.item_path("q", State.DONE, "a1")) in flushed
    assert str(store.state_dir("q", State.DONE)) in flushed
    assert str(store.state_dir("q", State.PENDING)) in flushed


def test_auto_flushes_a_group_of_one_file_the_way_measured_cheaper_and_more_with_syncfs(
    tmp_path: Path,
) -> None:
    """``FLUSH = "auto"``: a group that wrote one file (a lone post, a lone result) is
    flushed the way ``one_file_flush`` found cheaper for one file; a group that wrote two
    files or more with one ``syncfs``, whatever was measured."""
    store = StateStore(tmp_path / "root", fsync=True, flush="auto")
    store.sys = Recorder()
    store.ensure_queue("q")
    for way, other in (("fsync", "syncfs"), ("syncfs", "fsync")):
        store.one_file_way = way
        calls(store).calls.clear()
        batch = store.batch()
        batch.create("q", f"lone-{way}", encode_line(record(f"lone-{way}")))
        batch.flush()
        assert way in calls(store).kinds()
        assert other not in calls(store).kinds()
        if way == "fsync":
            flushed = [path for kind, path in calls(store).calls if kind == "fsync"]
            assert flushed == [
                str(store.item_path("q", State.PENDING, f"lone-{way}")),
                str(store.state_dir("q", State.PENDING)),
            ]
        calls(store).calls.clear()
        batch = store.batch()
        for n in range(2):
            batch.create("q", f"pair-{way}-{n}", encode_line(record(f"pair-{way}-{n}")))
        batch.flush()
        assert calls(store).kinds()[-1] == "syncfs"
        assert "fsync" not in calls(store).kinds()


def test_auto_measures_the_flush_of_one_file_once_on_the_roots_filesystem_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    """The measurement runs at the first group of one file, in a probe directory under the
    root that is no queue and is gone afterwards; its answer is kept, so the second group
    measures nothing. A probe a crash left over an hour ago is removed; a fresh one (another
    process measuring now) is not."""
    store = StateStore(tmp_path / "root", fsync=True, flush="auto")
    store.ensure_queue("q")
    stale = store.root / f"{store_module.FLUSH_PROBE}1-dead"
    stale.mkdir()
    (stale / "fsync-0.json").write_bytes(b"{}\n")
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    fresh = store.root / f"{store_module.FLUSH_PROBE}2-busy"
    fresh.mkdir()
    store.sys = Recorder()
    assert store.one_file_way is None
    batch = store.batch()
    batch.create("q", "a1", encode_line(record("a1")))
    batch.flush()
    way = store.one_file_way
    assert way in ("fsync", "syncfs")
    assert way in calls(store).kinds(), "the lone group was flushed the way measured"
    assert sorted(p.name for p in store.root.iterdir() if p.name.startswith(".flush")) == [
        fresh.name
    ]
    assert store.queues() == ["q"]
    store.one_file_way = None
    assert store.one_file_flush() in ("fsync", "syncfs")
    store.one_file_way = "measured"
    assert store.one_file_flush() == "measured", "measured once, then kept"


@pytest.mark.parametrize("flush", ["fsync", "auto"])
def test_a_post_moved_on_by_another_process_before_its_flush_is_flushed_where_it_is(
    tmp_path: Path, flush: str
) -> None:
    """Between a post's commit and its group's flush, another server process's claim may
    take the file to ``processing/`` (the news goes out at the commit). A flush file by file
    must then flush the data under its new name, and that directory, not skip the file it
    no longer finds; otherwise the post is answered with its data never flushed."""
    store = StateStore(tmp_path / "root", fsync=True, flush=flush)
    store.one_file_way = "fsync"
    store.sys = Recorder()
    store.ensure_queue("q")
    posting = store.batch()
    posting.create("q", "a1", encode_line(record("a1")))
    claiming = StateStore(tmp_path / "root", fsync=True).batch()  # the other process's
    assert claiming.take("q", "a1", State.PENDING, State.PROCESSING)
    calls(store).calls.clear()
    posting.flush()
    flushed = [path for kind, path in calls(store).calls if kind == "fsync"]
    assert str(store.item_path("q", State.PROCESSING, "a1")) in flushed
    assert str(store.state_dir("q", State.PROCESSING)) in flushed
    assert str(store.state_dir("q", State.PENDING)) in flushed


def test_a_store_refuses_a_flush_way_it_does_not_know(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="flush must be one of"):
        StateStore(tmp_path / "root", flush="sync")


def test_with_fsync_off_nothing_is_flushed(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "root", fsync=False)
    store.sys = Recorder()
    posted(store, "q", "a1")
    assert "syncfs" not in calls(store).kinds()
    assert "fsync" not in calls(store).kinds()


def test_a_read_during_an_append_never_sees_a_half_line(store: StateStore) -> None:
    """A reader meets an append at any byte (the writer's ``write`` calls are not atomic
    with respect to reads): at every cut of the line, it reads the record as before the
    append, and the whole line only once it ends with its newline."""
    posted(store, "q", "a1")
    path = Path(store.item_file("q", State.PENDING, "a1"))
    before = path.read_bytes()
    line = encode_line({"rev": 2, "x": "y" * 3000})
    reads = 0
    for cut in range(0, len(line), 7):
        path.write_bytes(before + line[:cut])
        assert store.read("q", State.PENDING, "a1")["rev"] == 1, f"cut at {cut} of {len(line)}"
        reads += 1
    # The line whole but for its newline is valid JSON: still not a line.
    path.write_bytes(before + line[:-1])
    assert store.read("q", State.PENDING, "a1")["rev"] == 1
    path.write_bytes(before + line)
    assert store.read("q", State.PENDING, "a1")["rev"] == 2
    assert reads > 400


# -- reading ------------------------------------------------------------------------------------


def test_read_any_finds_the_file_in_another_state(store: StateStore) -> None:
    posted(store, "q", "a1")
    state, found = store.read_any("q", "a1", State.DONE)
    assert state is State.PENDING
    assert found == record("a1")


def test_read_of_a_missing_item_raises_file_missing(store: StateStore) -> None:
    store.ensure_queue("q")
    with pytest.raises(FileMissing):
        store.read_any("q", "nope", State.PENDING)


def test_read_of_a_corrupt_file_is_a_store_error_not_a_crash(store: StateStore) -> None:
    store.ensure_queue("q")
    store.item_path("q", State.PENDING, "bad").write_bytes(b"\x00\x01 not json\n")
    with pytest.raises(StoreError):
        store.read("q", State.PENDING, "bad")


def test_truncate_torn_cuts_a_torn_last_line(store: StateStore) -> None:
    path = posted(store, "q", "a1")
    whole = path.read_bytes()
    with open(path, "ab") as handle:
        handle.write(b'{"rev": 2, "sta')
    assert store.truncate_torn(path)
    assert path.read_bytes() == whole
    assert not store.truncate_torn(path)


def test_scan_lists_item_files_and_skips_temporaries(store: StateStore) -> None:
    posted(store, "q", "a1")
    store.state_dir("q", State.PENDING).joinpath(".a2.xx.tmp").write_bytes(b"x")
    found = [(f.state, f.item_id) for f in store.scan("q")]
    assert found == [(State.PENDING, "a1")]


# -- whole queues -------------------------------------------------------------------------------


def test_a_deleted_queue_leaves_the_namespace_in_one_rename(store: StateStore) -> None:
    posted(store, "q", "a1")
    trash = store.move_queue_to_trash("q", "7")
    assert trash is not None
    assert not store.queue_dir("q").exists()
    assert store.trash_entries() == [trash]
    posted(store, "q", "b1")  # the name is free: a new queue starts empty
    assert [f.item_id for f in store.scan("q")] == ["b1"]
    assert store.remove_trash(trash) == 1
    assert not trash.exists()


def test_remove_trash_refuses_anything_outside_the_trash(store: StateStore) -> None:
    posted(store, "q", "a1")
    with pytest.raises(StoreError):
        store.remove_trash(store.queue_dir("q"))
    assert store.item_path("q", State.PENDING, "a1").exists()


# -- safe paths ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", BAD_NAMES)
def test_bad_queue_name_is_refused_by_every_operation(store: StateStore, name: str) -> None:
    for call in (
        lambda: store.queue_dir(name),
        lambda: store.ensure_queue(name),
        lambda: store.read(name, State.PENDING, "a1"),
        lambda: store.batch().change(name, "a1", State.PENDING, State.DONE, None),
        lambda: store.batch().create(name, "a1", b"{}\n"),
        lambda: store.move_queue_to_trash(name, "1"),
    ):
        with pytest.raises(StoreError):
            call()
    assert not any(store.root.parent.glob("*/**/a1.json"))


@pytest.mark.parametrize("item_id", BAD_IDS)
def test_bad_item_id_is_refused_by_every_operation(store: StateStore, item_id: str) -> None:
    for call in (
        lambda: store.item_path("q", State.PENDING, item_id),
        lambda: store.read("q", State.PENDING, item_id),
        lambda: store.batch().create("q", item_id, b"{}\n"),
        lambda: store.batch().change("q", item_id, State.PENDING, State.DONE, None),
    ):
        with pytest.raises(StoreError):
            call()


@pytest.mark.parametrize("bad", [None, 7, b"q"])
def test_non_string_queue_or_id_is_refused(store: StateStore, bad: Any) -> None:
    with pytest.raises(StoreError):
        store.queue_dir(bad)
    with pytest.raises(StoreError):
        store.item_path("q", State.PENDING, bad)


def test_longest_allowed_queue_name_and_id_are_accepted(store: StateStore) -> None:
    path = store.item_path("q" * 64, State.DONE, "i" * 64)
    assert path.parent == store.root / ("q" * 64) / "done"


def test_queues_lists_only_valid_queue_directories(store: StateStore) -> None:
    posted(store, "good", "a1")
    (store.root / ".hidden").mkdir()
    (store.root / "not a queue").mkdir()
    (store.root / "afile").write_text("x")
    assert store.queues() == ["good"]


@hsettings(max_examples=400, deadline=None, database=None)
@given(queue=st.text(max_size=70), item_id=st.text(max_size=70), state=st.sampled_from(list(State)))
def test_any_accepted_name_and_id_resolve_to_a_file_directly_inside_its_state_dir(
    tmp_path_factory: pytest.TempPathFactory, queue: str, item_id: str, state: State
) -> None:
    root = tmp_path_factory.getbasetemp() / "hyp-root"
    store = StateStore(root, fsync=False)
    try:
        path = store.item_path(queue, state, item_id)
    except StoreError:
        return
    assert path.parent == store.root / queue / state.value
    assert os.path.commonpath([path, store.root]) == str(store.root)
    assert path.name == f"{item_id}.json"


def test_the_filesystem_type_is_that_of_the_deepest_mount_holding_the_path(tmp_path: Path) -> None:
    from taskhoster.store import filesystem_type

    assert filesystem_type(Path("/proc/self")) == "proc"
    if Path("/dev/shm").is_dir():
        assert filesystem_type(Path("/dev/shm/not/made/yet")) == "tmpfs"
    assert filesystem_type(tmp_path / "missing") == filesystem_type(tmp_path)


def test_a_file_written_then_renamed_in_one_group_is_flushed_under_its_new_name(
    store: StateStore,
) -> None:
    """A post its claim joined, a failure claimed again: the data must be flushed where the
    file is now (an fsync of its old name finds nothing, and the data would not be durable)."""
    store.flush_mode = "fsync"
    store.ensure_queue("q")
    batch = store.batch()
    batch.create("q", "a1", encode_line(record("a1")))
    assert batch.take("q", "a1", State.PENDING, State.PROCESSING)
    calls(store).calls.clear()
    batch.flush()
    flushed = [path for kind, path in calls(store).calls if kind == "fsync"]
    assert str(store.item_path("q", State.PROCESSING, "a1")) in flushed
    assert str(store.item_path("q", State.PENDING, "a1")) not in flushed


# -- directories read: closed however the reading ends ------------------------------------------
# (An unclosed directory iterator warns when it is collected: under ``filterwarnings =
# error`` that fails whichever test is running then. These fail without the ``with``.)


def test_a_scan_stopped_after_its_first_file_leaves_no_directory_open(store: StateStore) -> None:
    store.ensure_queue("q")
    for item_id in ("a1", "a2", "a3"):
        posted(store, "q", item_id)
    scan = store.scan("q")
    assert next(scan).item_id in {"a1", "a2", "a3"}
    scan.close()


def test_the_look_for_queues_stops_at_the_first_without_leaving_the_root_open(
    tmp_path: Path,
) -> None:
    from taskhoster.identity import _has_queues

    for name in ("q1", "q2", "q3"):
        (tmp_path / name).mkdir()
    assert _has_queues(tmp_path)
