"""The system checks (``taskhoster.checks``): one test (at least) per id, on real settings,
real directories and a real closed port. The checks that need another settings module or a
fresh process (SQLite with several processes, the committer left alone) are in
``tests/integration/test_checks_command.py``."""

from __future__ import annotations

import os
import re
import socket
import time
from pathlib import Path
from typing import Any

import pytest
from django.core.checks import CheckMessage, run_checks

from taskhoster import checks
from taskhoster.checks import TAG
from taskhoster.conf import SETTINGS
from taskhoster.contract import ENVELOPE_BYTES

SYSFS = Path("/sys")  # Linux: no process, root included, can create an entry here
REPO = Path(__file__).resolve().parents[2]


def found(*, deploy: bool = False) -> dict[str, list[CheckMessage]]:
    """Taskhoster's check messages, by id."""
    by_id: dict[str, list[CheckMessage]] = {}
    for message in run_checks(tags=[TAG], include_deployment_checks=deploy):
        by_id.setdefault(str(message.id).removeprefix(f"{TAG}."), []).append(message)
    return by_id


def configure(settings: Any, **values: Any) -> None:
    settings.TASKHOSTER = {**settings.TASKHOSTER, **values}


def can_create_in(directory: Path) -> bool:
    try:
        (directory / "probe").mkdir()
    except OSError:
        return False
    (directory / "probe").rmdir()
    return True


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- the settings as the project and the test suite give them ----------------------------------


def test_the_project_and_test_settings_pass_every_check_deploy_included():
    assert found(deploy=True) == {}


def test_every_setting_has_a_default_that_passes_its_own_declaration():
    for setting in SETTINGS:
        assert setting.problem(setting.default) is None, setting.name


# -- TASKHOSTER ----------------------------------------------------------------------------


def test_taskhoster_that_is_not_a_dict_is_E001(settings):
    settings.TASKHOSTER = [("ROOT", "/srv/state")]
    assert list(found()) == ["E001"]


def test_unknown_key_is_E002_and_the_hint_names_the_likely_one(settings):
    configure(settings, MAX_CLIAM=5)
    (message,) = found()["E002"]
    assert "'MAX_CLIAM'" in message.msg
    assert message.hint == "Did you mean 'MAX_CLAIM'?"


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("FSYNC", "0"),
        ("FSYNC", 0),
        ("MAX_CLAIM", "100"),
        ("MAX_CLAIM", 1.5),
        ("MAX_BATCH", True),
        ("MAX_WAIT_SECONDS", "60"),
        ("ROOT", 5),
        ("COMMITTER", None),
        ("REDIS_URL", None),
    ],
)
def test_a_value_of_the_wrong_type_is_E003(settings, name, value):
    configure(settings, **{name: value})
    messages = found()
    (message,) = messages["E003"]
    assert f"TASKHOSTER['{name}']" in message.msg
    assert set(messages) == {"E003"}  # nothing else fails on reading it


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("MAX_CLAIM", 0),
        ("MAX_BATCH", -1),
        ("MAX_PAYLOAD_BYTES", 0),
        ("MAX_CAPACITY", 0),
        ("MAX_WAIT_SECONDS", -1),
        ("MAX_WAIT_SECONDS", float("inf")),
        ("LONG_POLL_INTERVAL", 0),
        ("SOCKET_BACKSTOP_SECONDS", 0),
        ("SWEEP_CHUNK", 0),
        ("PAGE_SIZE", 0),
        ("PROCESSES", 0),
        ("COMMITTER", "threads"),
        ("FLUSH", "sync"),
        ("ROOT", ""),
    ],
)
def test_a_value_out_of_range_or_not_a_choice_is_E004(settings, name, value):
    configure(settings, **{name: value})
    messages = found()
    (message,) = messages["E004"]
    assert f"TASKHOSTER['{name}']" in message.msg
    assert "E003" not in messages


def test_max_page_size_below_page_size_is_E005(settings):
    configure(settings, PAGE_SIZE=200, MAX_PAGE_SIZE=100)
    assert "E005" in found()
    configure(settings, PAGE_SIZE=100, MAX_PAGE_SIZE=100)
    assert "E005" not in found()


def test_body_limit_that_cannot_hold_one_full_payload_is_E006(settings):
    configure(settings, MAX_PAYLOAD_BYTES=4000)
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 4000 + ENVELOPE_BYTES - 1
    assert "E006" in found()
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 4000 + ENVELOPE_BYTES
    assert "E006" not in found()
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = None  # Django's "no limit": Taskhoster's 64 MiB
    assert "E006" not in found()
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = "64MB"
    assert "E006" in found()


def test_E006_is_real_a_payload_within_its_limit_is_refused_by_a_small_body_limit(
    settings, api, make_queue
):
    make_queue("q")
    configure(settings, MAX_PAYLOAD_BYTES=4000)
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 4000
    body = {"payload": "x" * 3990}
    assert api.post("/api/queues/q/items", body, format="json").status_code == 413
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 4000 + ENVELOPE_BYTES
    assert api.post("/api/queues/q/items", body, format="json").status_code == 201


def test_a_limit_below_the_contracts_figure_is_W004(settings):
    configure(settings, MAX_BATCH=10, MAX_WAIT_SECONDS=1)
    named = {m.msg.split("]")[0] for m in found()["W004"]}
    assert named == {"TASKHOSTER['MAX_BATCH'", "TASKHOSTER['MAX_WAIT_SECONDS'"}


def test_a_limit_above_the_contracts_figure_is_no_warning(settings):
    configure(settings, MAX_BATCH=5000, MAX_CLAIM=500, MAX_WAIT_SECONDS=120)
    assert found() == {}


# -- the state root ----------------------------------------------------------------------------


def test_state_root_that_is_a_file_is_E007(settings, tmp_path):
    root = tmp_path / "state"
    root.write_text("not a directory")
    configure(settings, ROOT=str(root))
    assert list(found()) == ["E007"]


def test_state_root_under_a_regular_file_cannot_be_created_E008(settings, tmp_path):
    (tmp_path / "a-file").write_text("")
    configure(settings, ROOT=str(tmp_path / "a-file" / "state"))
    (message,) = found()["E008"]
    assert "is not a directory" in message.msg


def test_state_root_in_a_folder_where_nothing_can_be_made_is_E008(settings):
    assert SYSFS.is_dir()
    assert not can_create_in(SYSFS)
    configure(settings, ROOT=str(SYSFS / "taskhoster-state"))
    assert list(found()) == ["E008"]


def test_missing_state_root_that_can_be_created_is_fine_and_is_not_created(settings, tmp_path):
    root = tmp_path / "not" / "yet" / "state"
    configure(settings, ROOT=str(root))
    assert found() == {}
    assert not (tmp_path / "not").exists()


def test_state_root_that_cannot_be_written_is_E009(settings):
    assert not can_create_in(SYSFS)
    configure(settings, ROOT=str(SYSFS))
    (message,) = found()["E009"]
    assert str(SYSFS) in message.msg


def test_state_root_writability_is_judged_by_a_real_write_not_mode_bits(settings, tmp_path):
    """A 0555 directory stops an ordinary user; root writes there anyway (so no E009)."""
    root = tmp_path / "read-only"
    root.mkdir()
    root.chmod(0o555)
    try:
        writable = can_create_in(root)
        assert writable == (os.geteuid() == 0)
        configure(settings, ROOT=str(root))
        assert ("E009" in found()) == (not writable)
        assert list(root.iterdir()) == []  # the probe leaves nothing behind
    finally:
        root.chmod(0o755)


def test_relative_state_root_is_W003(settings):
    configure(settings, ROOT="var/state")
    assert "W003" in found()


# -- durability, processes, Redis --------------------------------------------------------------


def test_fsync_off_is_W001_and_only_then(settings):
    assert "W001" not in found()
    configure(settings, FSYNC=False)
    (message,) = found()["W001"]
    assert "power cut" in message.msg


def test_several_processes_without_redis_is_W002(settings):
    configure(settings, PROCESSES=3, REDIS_URL="")
    assert "W002" in found()
    configure(settings, PROCESSES=1)
    assert "W002" not in found()


@pytest.mark.parametrize("url", ["localhost:6379", "http://127.0.0.1:6379/0", "127.0.0.1"])
def test_redis_url_that_is_not_a_redis_url_is_E011(settings, url):
    configure(settings, REDIS_URL=url)
    assert list(found()) == ["E011"]


def test_redis_that_does_not_answer_is_E012_under_deploy_only_and_fast(settings):
    configure(settings, REDIS_URL=f"redis://:secret@127.0.0.1:{closed_port()}/0")
    assert "E012" not in found()
    started = time.monotonic()
    (message,) = found(deploy=True)["E012"]
    assert time.monotonic() - started < 3
    assert "secret" not in message.msg  # the password is not shown


# -- the /work route -----------------------------------------------------------------------------


@pytest.mark.parametrize("application", ["wrapped", "plain"])
def test_work_route_is_found_through_routers_and_middleware(settings, application):
    settings.ASGI_APPLICATION = f"tests.unit.asgi_apps.{application}"
    assert found() == {}


def test_no_asgi_application_to_look_at_is_W006(settings):
    del settings.ASGI_APPLICATION
    assert list(found()) == ["W006"]


@pytest.mark.parametrize(
    "path", ["tests.unit.asgi_apps.no_such_application", "tests.unit.asgi_broken.application"]
)
def test_asgi_application_that_cannot_be_imported_is_E013(settings, path):
    settings.ASGI_APPLICATION = path
    (message,) = found()["E013"]
    assert path in message.msg


@pytest.mark.parametrize("application", ["http_only", "django_only", "other_sockets"])
def test_asgi_application_without_the_work_route_is_E014(settings, application):
    settings.ASGI_APPLICATION = f"tests.unit.asgi_apps.{application}"
    assert list(found()) == ["E014"]


def test_asgi_router_the_check_cannot_look_into_is_W007(settings):
    settings.ASGI_APPLICATION = "tests.unit.asgi_apps.opaque"
    (message,) = found()["W007"]
    assert "hand_written_router" in message.msg


# -- the documentation -----------------------------------------------------------------------


def test_docs_list_every_setting_with_its_default():
    text = (REPO / "docs" / "configuration.md").read_text()
    rows = re.findall(r"^\| `([A-Z_]+)` \| `([^`]*)` \|", text, re.M)
    assert dict(rows) == {s.name: repr(s.default) for s in SETTINGS}


def test_every_check_id_is_documented_and_has_a_test_named_after_it():
    raised = set(re.findall(r'"([EW]\d{3})"', Path(checks.__file__).read_text()))
    text = (REPO / "docs" / "configuration.md").read_text()
    documented = set(re.findall(r"^\| `taskhoster\.([EW]\d{3})` \|", text, re.M))
    assert raised == documented
    tests = "".join(
        (REPO / "tests" / path).read_text()
        for path in ("unit/test_checks.py", "integration/test_checks_command.py")
    )
    named = {i for name in re.findall(r"^def (test_\w+)", tests, re.M) for i in raised if i in name}
    assert named == raised


def test_use_tz_off_is_E015(settings):
    """The engine's times are aware UTC; with USE_TZ off, the database hands it naive ones."""
    settings.USE_TZ = False
    assert "E015" in found()
    settings.USE_TZ = True
    assert "E015" not in found()
