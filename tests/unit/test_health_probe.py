"""The state root's write probe (``taskhoster.health``): the health monitor's thread and a
request's thread (Django's ``/healthz`` view, before the monitor's first report) may probe
the same root at the same moment, and neither may see the other's file as its own failure;
a probe's file a kill left is removed later, and only then."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from taskhoster.health import PROBE_LEFT_AFTER, PROBE_PREFIX, _write_probe, remove_left_probes


def test_write_probes_at_once_in_one_process_do_not_fail_each_other(tmp_path: Path) -> None:
    threads, rounds = 4, 400
    failures: list[str] = []
    start = threading.Barrier(threads)

    def probe() -> None:
        start.wait()
        for _ in range(rounds):
            failed = _write_probe(tmp_path)
            if failed is not None:
                failures.append(failed)

    running = [threading.Thread(target=probe) for _ in range(threads)]
    for thread in running:
        thread.start()
    for thread in running:
        thread.join()
    assert failures == [], f"{len(failures)} of {threads * rounds} probes failed: {failures[:3]}"
    assert list(tmp_path.iterdir()) == [], "every probe removes its file"


def test_a_probes_file_a_kill_left_is_removed_once_old_and_nothing_else(tmp_path: Path) -> None:
    """Only an old regular file named as a probe is removed: not a fresh one (another
    process's, probing now), nor a symlink of that name to an old file, nor a name that only
    begins like a probe's, nor a queue."""

    def made(name: str, age: float) -> Path:
        path = tmp_path / name
        path.write_bytes(b"ok\n")
        then = time.time() - age
        os.utime(path, (then, then))
        return path

    old = PROBE_LEFT_AFTER + 60
    made(f"{PROBE_PREFIX}0123456789abcdef", old)
    target = made("elsewhere", old)
    link = tmp_path / f"{PROBE_PREFIX}00000000000000aa"
    link.symlink_to(target)
    os.utime(link, (time.time() - old, time.time() - old), follow_symlinks=False)
    (tmp_path / "q").mkdir()
    kept = {
        made(f"{PROBE_PREFIX}fedcba9876543210", 5).name,  # another process's, probing now
        link.name,
        target.name,
        made(f"{PROBE_PREFIX}notes", old).name,  # begins like a probe's name, is none
        made("health.0123456789abcdef", old).name,  # not the prefix
        "q",
    }
    assert remove_left_probes(tmp_path) == 1
    assert {p.name for p in tmp_path.iterdir()} == kept
    assert remove_left_probes(tmp_path / "missing") == 0


def test_a_probe_whose_file_another_host_removed_first_was_still_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A host whose clock runs an hour ahead of a network filesystem's server may take a
    probe's file for one a kill left and remove it between its write and its unlink; the
    write was made, so the state root answered."""
    unlink = os.unlink

    def taken_first(path: str | os.PathLike[str]) -> None:
        unlink(path)  # the other host's removal
        unlink(path)  # the probe's own

    monkeypatch.setattr(os, "unlink", taken_first)
    assert _write_probe(tmp_path) is None
