"""``manage.py createkey --name N --scopes produce,work,manage [--queues a,b]``: print a new key."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from ...errors import InvalidInput
from ...keys import create_key


class Command(BaseCommand):
    help = "Create an API key and print it (alone) on stdout. Only its hash is stored."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--name", required=True)
        parser.add_argument("--scopes", required=True, help="comma-separated: produce,work,manage")
        parser.add_argument("--queues", default=None, help="comma-separated queue names")

    def handle(self, *args: Any, **options: Any) -> None:
        queues = options["queues"].split(",") if options["queues"] else None
        try:
            _key, secret = create_key(
                name=options["name"], scopes=options["scopes"].split(","), queues=queues
            )
        except InvalidInput as exc:
            raise CommandError(exc.message) from exc
        self.stdout.write(secret)
