"""``manage.py asyncapi [--host H]``: print the ``/work`` socket's AsyncAPI 3.0 document."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from ...asyncapi import DEFAULT_HOST, build_document


class Command(BaseCommand):
    help = "Print the AsyncAPI 3.0 document of the /work socket (JSON), as /api/asyncapi serves it."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--host", default=DEFAULT_HOST, help="the server's host[:port]")
        parser.add_argument(
            "--protocol", default="ws", choices=["ws", "wss"], help="ws, or wss behind TLS"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        document = build_document(host=options["host"], protocol=options["protocol"])
        self.stdout.write(json.dumps(document, indent=2))
