"""The power-cut model persists per file and per directory (``tests/integration/crash_model``):
what a flush of one file or one directory makes durable, and nothing more."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ..integration.crash_model import Disk

DATA = b'{"id": "a"}\n'


def states(tmp_path: Path, *ops: tuple[Any, ...], start: dict[str, bytes] | None = None) -> set:
    """Every state a power cut after ``ops`` may leave: frozensets of (path, content)."""
    base = tmp_path / "base"
    for directory in ("q/pending", "q/processing", "q/done"):
        (base / directory).mkdir(parents=True, exist_ok=True)
    for path, data in (start or {}).items():
        (base / path).write_bytes(data)
    disk = Disk(base)
    for op in ops:
        disk.play(op)
    point = disk.crash_point()
    return {frozenset(point.state(n).items()) for n in range(point.count())}


def test_a_created_file_flushed_by_syncfs_is_all_there_is(tmp_path: Path) -> None:
    found = states(tmp_path, ("create", "q/pending/a.json", DATA), ("barrier",))
    assert found == {frozenset({("q/pending/a.json", DATA)})}


def test_an_unflushed_create_may_be_missing_empty_cut_zeroed_or_whole(tmp_path: Path) -> None:
    found = states(tmp_path, ("create", "q/pending/a.json", DATA))
    contents = {dict(s).get("q/pending/a.json") for s in found}
    assert contents == {None, b"", DATA, DATA[: len(DATA) // 2], b"\0" * len(DATA)}


def test_a_file_fsync_keeps_its_data_but_not_its_name(tmp_path: Path) -> None:
    found = states(tmp_path, ("create", "q/pending/a.json", DATA), ("fsync", "q/pending/a.json"))
    assert found == {frozenset(), frozenset({("q/pending/a.json", DATA)})}


def test_a_directory_fsync_keeps_the_name_but_not_the_data(tmp_path: Path) -> None:
    found = states(tmp_path, ("create", "q/pending/a.json", DATA), ("fsync-dir", "q/pending"))
    contents = {dict(s)["q/pending/a.json"] for s in found}
    assert contents == {b"", DATA, DATA[: len(DATA) // 2], b"\0" * len(DATA)}


def test_both_fsyncs_make_a_new_file_durable(tmp_path: Path) -> None:
    found = states(
        tmp_path,
        ("create", "q/pending/a.json", DATA),
        ("fsync", "q/pending/a.json"),
        ("fsync-dir", "q/pending"),
    )
    assert found == {frozenset({("q/pending/a.json", DATA)})}


def test_an_unflushed_rename_leaves_the_file_at_one_name_or_the_other(tmp_path: Path) -> None:
    start = {"q/pending/a.json": DATA}
    found = states(tmp_path, ("rename", "q/pending/a.json", "q/processing/a.json"), start=start)
    assert found == {
        frozenset({("q/pending/a.json", DATA)}),
        frozenset({("q/processing/a.json", DATA)}),
    }


@pytest.mark.parametrize("flushed", ["q/done", "q/pending"])
def test_a_rename_is_durable_once_either_of_its_directories_is_flushed(
    tmp_path: Path, flushed: str
) -> None:
    start = {"q/pending/a.json": DATA}
    found = states(
        tmp_path,
        ("rename", "q/pending/a.json", "q/done/a.json"),
        ("fsync-dir", flushed),
        start=start,
    )
    assert found == {frozenset({("q/done/a.json", DATA)})}


def test_a_directory_fsync_leaves_other_directories_entries_to_chance(tmp_path: Path) -> None:
    found = states(
        tmp_path,
        ("create", "q/pending/a.json", DATA),
        ("fsync", "q/pending/a.json"),
        ("create", "q/done/b.json", DATA),
        ("fsync", "q/done/b.json"),
        ("fsync-dir", "q/done"),
    )
    assert found == {
        frozenset({("q/done/b.json", DATA)}),
        frozenset({("q/done/b.json", DATA), ("q/pending/a.json", DATA)}),
    }


def test_the_data_of_a_renamed_file_follows_it_and_an_fsync_of_its_old_name_does_nothing(
    tmp_path: Path,
) -> None:
    start = {"q/pending/a.json": DATA}
    line = b'{"status": "finished"}\n'
    ops = [
        ("append", "q/pending/a.json", line),
        ("rename", "q/pending/a.json", "q/done/a.json"),
        ("fsync-dir", "q/pending"),
        ("fsync-dir", "q/done"),
    ]
    aimed_at_old = states(tmp_path / "1", *ops, ("fsync", "q/pending/a.json"), start=start)
    assert frozenset({("q/done/a.json", DATA)}) in aimed_at_old  # the line may be lost
    aimed_at_new = states(tmp_path / "2", *ops, ("fsync", "q/done/a.json"), start=start)
    assert aimed_at_new == {frozenset({("q/done/a.json", DATA + line)})}


def test_an_unflushed_unlink_may_be_undone(tmp_path: Path) -> None:
    start = {"q/done/a.json": DATA}
    found = states(tmp_path, ("unlink", "q/done/a.json"), start=start)
    assert found == {frozenset(), frozenset({("q/done/a.json", DATA)})}
    flushed = states(
        tmp_path / "2", ("unlink", "q/done/a.json"), ("fsync-dir", "q/done"), start=start
    )
    assert flushed == {frozenset()}


def test_a_file_in_a_new_directory_is_lost_with_the_directorys_entry(tmp_path: Path) -> None:
    ops = [
        ("mkdir", "r"),
        ("mkdir", "r/pending"),
        ("create", "r/pending/a.json", DATA),
        ("fsync", "r/pending/a.json"),
        ("fsync-dir", "r/pending"),
    ]
    found = states(tmp_path / "1", *ops)
    assert frozenset() in found  # the file is durable in a directory nothing durable names
    flushed = states(tmp_path / "2", *ops, ("fsync-dir", "r"), ("fsync-dir", "."))
    assert flushed == {frozenset({("r/pending/a.json", DATA)})}


def test_a_renamed_directory_takes_its_files_along(tmp_path: Path) -> None:
    start = {"q/pending/a.json": DATA, "q/done/b.json": DATA}
    ops = [("mkdir", ".trash"), ("rename", "q", ".trash/q.1"), ("fsync-dir", ".")]
    found = states(tmp_path, *ops, start=start)
    assert found == {
        frozenset({(".trash/q.1/pending/a.json", DATA), (".trash/q.1/done/b.json", DATA)})
    }


def test_a_directory_is_flushed_as_the_inode_it_is_whatever_it_is_called_now(
    tmp_path: Path,
) -> None:
    ops = [
        ("create", "q/pending/a.json", DATA),
        ("fsync", "q/pending/a.json"),
        ("mkdir", ".trash"),
        ("rename", "q", ".trash/q.1"),
        ("fsync-dir", "."),
        ("fsync-dir", ".trash/q.1/pending"),  # the directory a.json was created in
    ]
    found = states(tmp_path, *ops)
    assert found == {frozenset({(".trash/q.1/pending/a.json", DATA)})}
