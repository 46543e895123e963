"""``manage.py sweep``: one pass of the clocks; ``--every S`` repeats; ``--repair`` first
brings the index back in line with the state directories."""

from __future__ import annotations

import signal
import threading
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import close_old_connections

from ... import engine, identity
from ...conf import get_conf


class Command(BaseCommand):
    help = (
        "Apply the clocks: post schedules' due slots, re-queue lapsed leases, fail aged items, "
        "delete retained ones."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--every",
            type=float,
            default=None,
            metavar="SECONDS",
            help="repeat every SECONDS until interrupted",
        )
        parser.add_argument(
            "--repair",
            action="store_true",
            help="first rebuild or correct the index from the state directories",
        )
        parser.add_argument(
            "--adopt-state-root",
            action="store_true",
            help="with --repair: let this database index the state root even though another "
            "database's index claimed it (to rebuild a lost index from the files)",
        )
        parser.add_argument(
            "--grace",
            type=float,
            default=None,
            metavar="SECONDS",
            help="with --repair: leave files and rows younger than this alone "
            "(default REPAIR_GRACE_SECONDS; 0 when no server is running)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        every = options["every"]
        if every is not None and every <= 0:
            raise CommandError("--every must be a positive number of seconds")
        if options["adopt_state_root"] and not options["repair"]:
            raise CommandError("--adopt-state-root goes with --repair")
        if get_conf().root.is_dir():
            try:
                identity.check(adopt=options["adopt_state_root"])
            except identity.StateRootTaken as exc:
                raise CommandError(str(exc)) from None
        if options["repair"]:
            grace = options["grace"]
            if grace is None:
                grace = get_conf().repair_grace_seconds
            self.stdout.write(str(engine.repair(grace_seconds=grace)))
        stop = threading.Event()
        if every is not None:
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: stop.set())
        while True:
            # A slot this pass finds up to one interval late was not missed.
            report = engine.sweep(on_time=max(2.0, (every or 0) + 1.0))
            if every is None or report.changed:
                self.stdout.write(str(report))
            if every is None:
                return
            close_old_connections()
            if stop.wait(every):
                return
