"""With ``FLUSH = "auto"``, how the state root's filesystem makes one file durable sooner is
measured once (``StateStore.one_file_flush``, some 20 ms). The committer process measures it
at its start, before it says it is ready, so the first lone post after a start does not wait
for it; a fixed way, or fsync off, measures nothing."""

from __future__ import annotations

import json

import pytest

from taskhoster import identity
from taskhoster import store as store_module
from taskhoster.engine import runner
from taskhoster.engine.common import store

MEASURED = "a group that wrote one file is flushed by"


@pytest.mark.slow
def test_the_committer_process_measures_the_flush_of_one_file_before_it_is_ready(
    server_factory,
):
    server = server_factory(TASKHOSTER_FLUSH="auto", TASKHOSTER_FSYNC="1", TASKHOSTER_LOG="INFO")
    # Ready (``/healthz`` answers 200 once the committer process says so), and nothing
    # posted: only the measurement ahead can have written this line, and it is there now.
    log = server.log.read_text(errors="replace")
    assert MEASURED in log, log[-2000:]


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


@pytest.mark.django_db(transaction=True)
def test_no_flush_is_measured_ahead_in_a_state_root_another_database_holds(settings, state_root):
    settings.TASKHOSTER = {**settings.TASKHOSTER, "FLUSH": "auto", "FSYNC": True}
    state_root.mkdir(parents=True)
    identity.check()  # this database's ...
    (state_root / identity.FILE).write_text(json.dumps({"identity": "another-database"}))
    runner.measure_flush_ahead()  # ... but the root now says it is another's
    assert store().one_file_way is None
    assert [p.name for p in state_root.iterdir()] == [identity.FILE], "a probe written there"


@pytest.mark.django_db(transaction=True)
def test_no_flush_is_measured_ahead_where_the_store_flushes_file_by_file_anyway(
    settings, state_root, monkeypatch
):
    """A FUSE filesystem (or no ``syncfs``): every group is flushed file by file, so no
    group asks how one file is flushed sooner, and nothing is measured at the start."""
    monkeypatch.setattr(store_module, "_syncfs_reaches_storage", lambda _root: False)
    settings.TASKHOSTER = {**settings.TASKHOSTER, "FLUSH": "auto", "FSYNC": True}
    state_root.mkdir(parents=True)
    assert store().flush_mode == "fsync"
    runner.measure_flush_ahead()
    assert store().one_file_way is None


@pytest.mark.django_db(transaction=True)
def test_the_flush_of_one_file_is_measured_ahead_in_a_state_root_given_relative(
    settings, state_root, monkeypatch
):
    """As the default (``var/state``) is: resolved against the working directory."""
    monkeypatch.chdir(state_root.parent)
    settings.TASKHOSTER = {**settings.TASKHOSTER, "ROOT": state_root.name, "FLUSH": "auto"}
    state_root.mkdir(parents=True)
    runner.measure_flush_ahead()
    assert store().one_file_way in ("fsync", "syncfs")
