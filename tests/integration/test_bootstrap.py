"""``manage.py bootstrap`` (run by scripts/serve): the first run makes an admin user and a
full-scope API key, saves them with mode 0600 and prints them once."""

from __future__ import annotations

import io
import json
import stat

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
