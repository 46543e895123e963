"""``manage.py bootstrap``: on first run, an admin user and a full-scope API key.

Both are saved under ``var/credentials.json`` (mode 0600) and printed once; later runs only
say where the file is.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser

from ... import identity
from ...conf import get_conf
from ...keys import create_key


class Command(BaseCommand):
    help = "Create the first admin user and API key (once), saved to var/credentials.json."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--file", default=None, help="where to save the credentials")

    def handle(self, *args: Any, **options: Any) -> None:
        get_conf().root.mkdir(parents=True, exist_ok=True)  # /healthz reports it from the start
        try:
            identity.check()
        except identity.StateRootTaken as exc:
            raise CommandError(str(exc)) from None
        # VAR_DIR is our server's setting (project/settings.py); a host project has none.
        var = Path(getattr(settings, "VAR_DIR", "var"))
        path = Path(options["file"] or var / "credentials.json")
        user_model = get_user_model()
        if path.exists():
            if user_model.objects.filter(username="admin").exists():
                self.stdout.write(f"Credentials were created on first run; see {path}")
                return
            # Never overwrite them: they are another database's (its password and key were
            # shown only once).
            raise CommandError(
                f"{path} holds credentials, but this database has no admin user: they belong "
                "to another database. Keep them; to make this database's own, pass --file "
                "with another path (or set TASKHOSTER_VAR to a directory of its own)."
            )
        password = secrets.token_urlsafe(12)
        user = user_model.objects.filter(username="admin").first()
        if user is None:
            user = user_model.objects.create_superuser("admin", "", password)
        else:
            user.set_password(password)
            user.save()
        _key, secret = create_key(name="bootstrap", scopes=["produce", "work", "manage"])
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {"admin": {"username": "admin", "password": password}, "apiKey": secret}
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            json.dump(data, handle, indent=2)
        os.chmod(path, 0o600)
        self.stdout.write(
            "First run: created an admin user and a full-scope API key "
            f"(saved to {path}, mode 0600; shown only this once):\n"
            f"  admin user: admin\n  password:   {password}\n  API key:    {secret}"
        )
