"""With ``FLUSH = "auto"``, how the state root's filesystem makes one file durable sooner is
measured once (``StateStore.one_file_flush``, some 20 ms). The committer process measures it
at its start, before it says it is ready, so the first lone post after a start does not wait
for it; a fixed way, or fsync off, measures nothing."""

from __future__ import annotations

import time

import pytest

from taskhoster.engine import runner
from taskhoster.engine.common import store

MEASURED = "a group that wrote one file is flushed by"


@pytest.mark.slow
def test_the_committer_process_measures_the_flush_of_one_file_before_it_is_ready(
    server_factory,
):
    server = server_factory(TASKHOSTER_FLUSH="auto", TASKHOSTER_FSYNC="1")
    # Ready, and nothing posted: only the measurement ahead can have written this line.
    deadline = time.monotonic() + 5
    while MEASURED not in server.log.read_text(errors="replace"):
        assert time.monotonic() < deadline, server.log.read_text(errors="replace")[-2000:]
        time.sleep(0.05)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("flush", "fsync", "measured"),
    [("auto", True, True), ("syncfs", True, False), ("fsync", True, False), ("auto", False, False)],
)
def test_the_flush_of_one_file_is_measured_ahead_only_when_auto_chooses_it(
    settings, state_root, flush: str, fsync: bool, measured: bool
):
    settings.TASKHOSTER = {**settings.TASKHOSTER, "FLUSH": flush, "FSYNC": fsync}
    state_root.mkdir(parents=True)
    assert store().one_file_way is None
    runner.measure_flush_ahead()
    assert (store().one_file_way in ("fsync", "syncfs")) is measured


@pytest.mark.django_db(transaction=True)
def test_no_flush_is_measured_ahead_in_a_state_root_not_yet_made(settings, state_root):
    settings.TASKHOSTER = {**settings.TASKHOSTER, "FLUSH": "auto", "FSYNC": True}
    runner.measure_flush_ahead()
    assert store().one_file_way is None
    assert not state_root.exists(), "made before its identity was checked"
