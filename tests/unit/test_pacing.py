"""Background work rests only while there is foreground work to yield to, whichever process of
the host runs that foreground (``engine.pacing``)."""

from __future__ import annotations

import itertools
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from taskhoster import engine
from taskhoster.engine.pacing import (
    ALONE_CHUNKS,
    ForegroundMark,
    Pacer,
    background,
    foreground_recent,
    mark_foreground,
)

from ..conftest import REPO


def run_chunks(pacer: Pacer, chunks: int) -> None:
    """``chunks`` chunks of 10 units, each taking ~2 ms of work."""
    left = chunks

    def chunk(size: int) -> int:
        nonlocal left
        time.sleep(0.002)
        left -= 1
        return size if left > 0 else 0

    pacer.run(chunk)


def test_background_work_alone_never_rests(state_root: Path) -> None:
    pacer = Pacer(start=10, least=10, most=10, busy=lambda: False)
    run_chunks(pacer, 20)
    assert pacer.chunks == 20
    assert pacer.rested == 0


def test_background_work_rests_in_proportion_while_foreground_work_runs(state_root: Path) -> None:
    mark_foreground()
    pacer = Pacer(start=10, least=10, most=10, busy=lambda: False)
    run_chunks(pacer, 10)
    # At the default share (a quarter), three times each chunk's time, after each but the last.
    assert pacer.rested >= 3 * 0.9 * pacer.worked * 9 / 10


def test_foreground_work_of_another_process_makes_background_work_rest(
    state_root: Path, tmp_path: Path
) -> None:
    assert not foreground_recent()
    marker = textwrap.dedent(
        f"""
        import os, time
        from pathlib import Path
        import django
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
        django.setup()
        from taskhoster.engine.pacing import ForegroundMark
        at = time.monotonic()
        ForegroundMark(Path({str(state_root)!r})).mark(at)
        print(repr(at))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", marker], cwd=REPO, check=True, timeout=60, capture_output=True
    )
    marked = float(done.stdout.decode().strip().splitlines()[-1])
    assert ForegroundMark(state_root).last() == marked
    # (On a loaded machine the child may take a while to exit after its mark.)
    assert foreground_recent(within=time.monotonic() - marked + 1)
    # A mark as old as the window is not recent.
    ForegroundMark(state_root).mark(time.monotonic() - 5)
    assert not foreground_recent()


def test_a_state_root_of_its_own_has_a_mark_of_its_own(state_root: Path, tmp_path: Path) -> None:
    ForegroundMark(tmp_path / "another-root").mark(time.monotonic())
    assert not foreground_recent()


@pytest.mark.django_db(transaction=True)
def test_operations_of_background_work_do_not_mark_the_foreground_and_others_do(
    state_root: Path,
) -> None:
    engine.upsert_queue(name="q", body={})
    assert not foreground_recent()
    with background():
        engine.post_items(queue_name="q", items=[engine.NewItem(payload=1)])
    assert not foreground_recent()
    engine.post_items(queue_name="q", items=[engine.NewItem(payload=2)])
    assert foreground_recent()


def test_chunks_grow_to_the_largest_alone_and_shrink_beside_foreground_work(
    state_root: Path,
) -> None:
    foreground = False
    pacer = Pacer(start=5, least=5, most=640, busy=lambda: False, foreground=lambda: foreground)
    sizes = []

    def chunk(size: int) -> int:
        sizes.append(size)
        time.sleep(0.001 * size)  # 1 ms a unit: about 20 units take BACKGROUND_CHUNK_SECONDS
        return size if len(sizes) < 12 else 0

    def switch(size: int) -> int:
        nonlocal foreground
        foreground = len(sizes) >= 6
        return chunk(size)

    pacer.run(switch)
    # Alone: each chunk twice the last, past the ~20 units that take BACKGROUND_CHUNK_SECONDS,
    # up to ALONE_CHUNKS times that (~100 units).
    assert all(b == 2 * a for a, b in itertools.pairwise(sizes[1:4])), sizes
    assert 60 <= sizes[5] <= 20 * ALONE_CHUNKS * 1.2, sizes
    assert max(sizes[7:]) <= 40  # beside the foreground: about 20 ms each
    assert pacer.rested > 0
