"""``manage.py bootstrap`` (run by scripts/serve): the first run makes an admin user and a
full-scope API key, saves them with mode 0600 and prints them once."""

from __future__ import annotations

import io
import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command

from taskhoster.keys import authenticate


@pytest.mark.django_db
def test_first_run_saves_admin_and_full_key_0600_and_prints_them_once(tmp_path, state_root):
    path = tmp_path / "var" / "credentials.json"
    first = io.StringIO()
    call_command("bootstrap", "--file", str(path), stdout=first)
    saved = json.loads(path.read_text())
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert saved["apiKey"] in first.getvalue()
    assert saved["admin"]["password"] in first.getvalue()
    principal = authenticate(saved["apiKey"])
    assert principal is not None
    assert principal.scopes == {"produce", "work", "manage"}
    assert principal.queues is None
    admin = get_user_model().objects.get(username="admin")
    assert admin.is_staff
    assert admin.check_password(saved["admin"]["password"])
    assert state_root.is_dir()

    again = io.StringIO()
    call_command("bootstrap", "--file", str(path), stdout=again)
    assert saved["apiKey"] not in again.getvalue()
    assert saved["admin"]["password"] not in again.getvalue()
    assert json.loads(path.read_text()) == saved


# Each process waits for the same moment, then reads the settings, which make the secret key
# on the first start. Run as ``python -c``, with the repository first on the path.
_STARTS_AT_ONCE = """
import os, sys, time
start = float(sys.argv[1])
time.sleep(max(0.0, start - time.time() - 0.02))
while time.time() < start:
    pass
import project.settings as s
print(s.SECRET_KEY)
"""


def test_processes_starting_at_once_on_a_fresh_var_share_one_secret_key(tmp_path):
    """The first start makes ``var/secret_key``. Processes starting together (the two test
    runs of CI side by side, serve-many's) must neither fail on the file another one made a
    moment before, nor read it half written: all get the one key, saved with mode 0600, and
    nothing else is left in the directory. Bounded by count: 5 fresh directories, 12
    processes each."""
    repo = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SECRET_KEY"}
    env["PYTHONPATH"] = os.pathsep.join([str(repo), env.get("PYTHONPATH", "")])
    for round_ in range(5):
        var = tmp_path / f"var{round_}"
        env["TASKHOSTER_VAR"] = str(var)
        start = time.time() + 1.5
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", _STARTS_AT_ONCE, str(start)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(12)
        ]
        results = [proc.communicate(timeout=60) for proc in procs]
        failed = [err for proc, (_out, err) in zip(procs, results, strict=True) if proc.returncode]
        assert not failed, failed[0]
        keys = {out.strip() for out, _err in results}
        saved = (var / "secret_key").read_text().strip()
        assert keys == {saved}
        assert len(saved) > 40
        assert stat.S_IMODE((var / "secret_key").stat().st_mode) == 0o600
        assert sorted(p.name for p in var.iterdir()) == ["secret_key"]
