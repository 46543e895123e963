"""``manage.py check`` in a process of its own: our settings pass it (``--deploy`` too), and
the checks that depend on the database's settings or on a fresh process (SQLite with several
processes, deferred SQLite transactions, no committer started by looking at the ASGI
application). The other check ids are in ``tests/unit/test_checks.py``."""

from __future__ import annotations

import asyncio
import json
import subprocess
import textwrap
from pathlib import Path

import httpx
import pytest

from ..conftest import REPO, python_in_project
from .wsclient import (
    PONG,
    assert_nothing_before,
    connect,
    make_queue,
    ping,
    post,
    recv,
    send,
    subscribe,
)

pytestmark = pytest.mark.slow


def run(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``python *args`` from the repository, with the project's settings and a var/ and state
    root of the test's own."""
    return python_in_project(
        *args,
        env={
            "PYTHONPATH": str(REPO),
            "TASKHOSTER_VAR": str(tmp_path / "var"),
            "TASKHOSTER_ROOT": str(tmp_path / "state"),
            **env,
        },
    )


def test_manage_check_passes_on_the_projects_settings(tmp_path):
    done = run(tmp_path, "manage.py", "check")
    assert done.returncode == 0, done.stderr
    assert "System check identified no issues" in done.stdout


def test_manage_check_deploy_passes_and_none_of_our_checks_complains(tmp_path):
    """Django's own deploy warnings (HSTS, secure cookies) are the host's to decide; none of
    Taskhoster's checks, Redis answering included when REDIS_URL is set, may complain, and
    no other check may fail on our project."""
    done = run(tmp_path, "manage.py", "check", "--deploy")
    assert "taskhoster." not in done.stdout + done.stderr
    assert done.returncode == 0, done.stderr


def test_manage_check_deploy_finds_nothing_with_the_production_settings(tmp_path):
    """TASKHOSTER_HTTPS=1 (TLS ended in front), named hosts and a secret of its own: not one
    deploy warning, Django's HSTS, SSL redirect and secure cookies included."""
    import secrets

    done = run(
        tmp_path,
        "manage.py",
        "check",
        "--deploy",
        "--fail-level",
        "WARNING",
        TASKHOSTER_HTTPS="1",
        DJANGO_ALLOWED_HOSTS="tasks.example.com",
        DJANGO_SECRET_KEY=secrets.token_urlsafe(50),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "System check identified no issues" in done.stdout


def test_fsync_off_by_environment_warns_W001(tmp_path):
    done = run(tmp_path, "manage.py", "check", TASKHOSTER_FSYNC="0")
    assert done.returncode == 0, done.stderr
    assert "taskhoster.W001" in done.stderr


def test_sqlite_served_by_several_processes_is_E010_and_stops_commands(tmp_path):
    database = f"sqlite:///{tmp_path / 'index.sqlite3'}"
    done = run(tmp_path, "manage.py", "sweep", DATABASE_URL=database, TASKHOSTER_PROCESSES="2")
    assert done.returncode != 0
    assert "taskhoster.E010" in done.stderr
    done = run(tmp_path, "manage.py", "check", DATABASE_URL=database, TASKHOSTER_PROCESSES="1")
    assert done.returncode == 0, done.stderr


def test_postgresql_served_by_several_processes_is_no_error(tmp_path):
    # The check reads the settings only: no PostgreSQL server need answer.
    done = run(
        tmp_path,
        "manage.py",
        "check",
        DATABASE_URL="postgres://nobody@127.0.0.1:1/none",
        TASKHOSTER_PROCESSES="4",
        REDIS_URL="redis://127.0.0.1:6379/0",
    )
    assert done.returncode == 0, done.stderr
    assert "taskhoster." not in done.stderr


def test_sqlite_with_deferred_write_transactions_is_W005(tmp_path):
    database = f"sqlite:///{tmp_path / 'index.sqlite3'}"
    done = run(
        tmp_path,
        "manage.py",
        "check",
        DATABASE_URL=database,
        DJANGO_SETTINGS_MODULE="tests.integration.check_settings",
    )
    assert done.returncode == 0, done.stderr
    assert "taskhoster.W005" in done.stderr
    done = run(tmp_path, "manage.py", "check", DATABASE_URL=database)
    assert "taskhoster.W005" not in done.stderr


def test_postgresql_prepared_statements_with_plans_kept_for_any_values_is_W008(tmp_path):
    # The check reads the settings only: no PostgreSQL server need answer.
    nowhere = "postgres://nobody@127.0.0.1:1/none"
    kept = nowhere + "?options=-c%20plan_cache_mode%3Dauto"
    done = run(tmp_path, "manage.py", "check", DATABASE_URL=kept)
    assert done.returncode == 0, done.stderr
    assert "taskhoster.W008" in done.stderr
    for env in ({"DATABASE_URL": nowhere}, {"DATABASE_URL": kept, "TASKHOSTER_DB_PREPARE": "0"}):
        done = run(tmp_path, "manage.py", "check", **env)
        assert done.returncode == 0, done.stderr
        assert "taskhoster.W008" not in done.stderr, env


CHILDREN = """
import json, os, sys
import django
django.setup()
from django.core.checks import run_checks
from taskhoster.conf import get_conf
from taskhoster.engine import committer

def children():
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{pid}/stat").read()
        except OSError:
            continue
        if stat.rsplit(")", 1)[1].split()[1] == str(os.getpid()):
            found.append(pid)
    return found

messages = [m.id for m in run_checks(tags=["taskhoster"])]
after_check = children()
committer.start()  # what the ASGI module does at import, unheld
print(json.dumps({
    "committer": get_conf().committer,
    "imported": "project.asgi" in sys.modules,
    "messages": messages,
    "after_check": after_check,
    "after_start": children(),
}))
"""


def test_checking_the_work_route_imports_the_asgi_module_but_starts_no_committer(tmp_path):
    done = run(tmp_path, "-c", textwrap.dedent(CHILDREN), TASKHOSTER_COMMITTER="process")
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["committer"] == "process"
    assert seen["imported"]
    assert seen["messages"] == []
    assert seen["after_check"] == []
    assert len(seen["after_start"]) == 1  # started when asked to: the check held it back


def test_no_channel_layer_is_no_misconfiguration_a_socket_is_served_without_one(
    server_factory, make_key, tmp_path
):
    """Why no check asks for CHANNEL_LAYERS: sockets hear of work through Taskhoster's bus."""
    done = run(
        tmp_path,
        "manage.py",
        "check",
        DJANGO_SETTINGS_MODULE="tests.integration.no_channel_layer_settings",
    )
    assert done.returncode == 0, done.stderr
    assert "no issues" in done.stdout
    server = server_factory(DJANGO_SETTINGS_MODULE="tests.integration.no_channel_layer_settings")
    key = make_key()
    with httpx.Client(
        base_url=server.url, headers={"Authorization": f"Token {key}"}, timeout=10
    ) as http:
        make_queue(http, "q")

        async def run_worker() -> None:
            ws = await connect(server, key)
            await subscribe(ws, ["q"], 1)
            await ping(ws)
            await assert_nothing_before(ws, PONG)  # subscribed: no error
            item = post(http, "work")
            frame = await recv(ws)
            assert frame["id"] == item
            await send(ws, {"type": "result", "id": item, "result": "done"})
            assert (await recv(ws))["accepted"] is True
            await ws.close()

        asyncio.run(run_worker())
