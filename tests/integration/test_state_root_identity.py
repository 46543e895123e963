"""One state root, one index: a server, the sweep and ``bootstrap`` refuse a state root that
another database indexes, and ``bootstrap`` never overwrites saved credentials.

The trap these close: ``scripts/serve-many`` (PostgreSQL) started from a checkout where
``scripts/serve`` (SQLite) keeps its ``var/``: it overwrote ``var/credentials.json`` (the old
password and key, shown only once, were gone), indexed the other server's items into its own
database and re-queued the items the other's workers held. Here a second database (a SQLite
file of its own, migrated for the test) is pointed at a state root the test database already
serves, through the real commands and a real daphne.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command

from taskhoster import engine

from ..conftest import REPO, Server, server_env

pytestmark = pytest.mark.slow


def other_database(tmp_path: Path) -> str:
    """A second, migrated database (SQLite: it needs no server)."""
    url = f"sqlite:///{tmp_path / 'other.sqlite3'}"
    subprocess.run(
        [sys.executable, "manage.py", "migrate", "--noinput", "-v0"],
        cwd=REPO,
        env=server_env(tmp_path / "unused-root", DATABASE_URL=url),
        check=True,
        timeout=120,
    )
    return url


def run_manage(root: Path, url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=REPO,
        env=server_env(root, DATABASE_URL=url),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_server_refuses_a_state_root_another_database_indexes(
    server_factory, make_key, state_root, tmp_path
):
    server = server_factory()  # the test database binds the state root
    headers = {"Authorization": f"Token {make_key()}"}
    assert httpx.put(f"{server.url}/api/queues/q", json={}, headers=headers).status_code == 201
    posted = httpx.post(
        f"{server.url}/api/queues/q/items", json={"payload": 1}, headers=headers
    ).json()
    assert (state_root / ".identity").exists()
    url = other_database(tmp_path)

    other = Server(state_root, DATABASE_URL=url)
    with pytest.raises(RuntimeError, match="belongs to another database"):
        other.start()
    log = other.log.read_text()
    assert "TASKHOSTER_ROOT" in log, "the refusal says what to do"
    assert "--adopt-state-root" in log

    sweep = run_manage(state_root, url, "sweep", "--repair", "--grace", "0")
    assert sweep.returncode != 0
    assert "belongs to another database" in sweep.stderr
    boot = run_manage(state_root, url, "bootstrap", "--file", str(tmp_path / "creds.json"))
    assert boot.returncode != 0
    assert "belongs to another database" in boot.stderr
    # Nothing of the state root was indexed by the other database, and its item is as it was.
    check = run_manage(
        state_root,
        url,
        "shell",
        "-c",
        "from taskhoster.models import Item; print(Item.objects.count())",
    )
    assert check.stdout.strip().splitlines()[-1] == "0"
    item = httpx.get(f"{server.url}/api/items/{posted['id']}", headers=headers).json()
    assert item["status"] == "pending"


def test_adopting_the_state_root_rebuilds_a_lost_index_from_the_files(
    server_factory, make_key, state_root, tmp_path
):
    server = server_factory()
    headers = {"Authorization": f"Token {make_key()}"}
    httpx.put(f"{server.url}/api/queues/q", json={}, headers=headers)
    posted = httpx.post(f"{server.url}/api/queues/q/items", json={"payload": 7}, headers=headers)
    server.stop()
    url = other_database(tmp_path)  # the index was lost: a new, empty database

    adopted = run_manage(state_root, url, "sweep", "--repair", "--grace", "0", "--adopt-state-root")
    assert adopted.returncode == 0, adopted.stderr
    count = run_manage(
        state_root,
        url,
        "shell",
        "-c",
        "from taskhoster.models import Item; "
        "print(list(Item.objects.values_list('id', flat=True)))",
    )
    assert posted.json()["id"] in count.stdout
    Server(state_root, DATABASE_URL=url).start().stop()  # now it serves them


@pytest.mark.django_db
def test_bootstrap_never_overwrites_saved_credentials_of_another_database(tmp_path, state_root):
    path = tmp_path / "var" / "credentials.json"
    path.parent.mkdir()
    saved = {"admin": {"username": "admin", "password": "old"}, "apiKey": "the-only-copy"}
    path.write_text(json.dumps(saved))
    assert not get_user_model().objects.filter(username="admin").exists()
    with pytest.raises(CommandError, match="belong to another database"):
        call_command("bootstrap", "--file", str(path), stdout=io.StringIO())
    assert json.loads(path.read_text()) == saved, "the credentials were kept as they were"
    assert not get_user_model().objects.filter(username="admin").exists()


@pytest.mark.django_db
def test_a_fresh_state_root_and_database_are_bound_to_one_identity(state_root):
    from taskhoster import identity
    from taskhoster.models import Installation

    engine.upsert_queue(name="q", body={})
    made = identity.check()
    assert json.loads((state_root / ".identity").read_text())["identity"] == made
    assert Installation.objects.get().identity == made
    assert identity.check() == made, "the same answer the second time"
