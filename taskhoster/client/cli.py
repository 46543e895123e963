"""The ``taskhoster`` command: post, read, wait for and cancel items, list queues and workers,
drain workers, manage schedules, and run a shell command as a worker.

    taskhoster post emails '{"to": "ada@example.com"}'
    taskhoster wait ITEM_ID --timeout 30
    taskhoster cancel ITEM_ID --reason "sent by mistake"
    taskhoster attempts ITEM_ID                  # who took it, when, and how each claim ended
    taskhoster queues
    taskhoster pause emails                      # hand out nothing until: resume emails
    taskhoster workers                           # the connected workers
    taskhoster drain --prefix web-1:             # they finish what they hold, then close
    taskhoster put-schedule emails digest --cron '0 8 * * 1-5' --payload '{"kind": "digest"}'
    taskhoster schedules emails                  # its schedules, their next and last slots
    taskhoster work emails -- ./send-email.sh

The server is ``--url`` or ``$TASKHOSTER_URL`` (default http://127.0.0.1:8000); the key is
``--key`` or ``$TASKHOSTER_KEY``, else the one ``scripts/serve`` saved in
``var/credentials.json`` under the current directory.

``work QUEUE... -- COMMAND`` runs COMMAND once per item: the payload as JSON on standard input
(one line), and ``TASKHOSTER_ITEM_ID``, ``TASKHOSTER_QUEUE``, ``TASKHOSTER_ATTEMPTS`` and
``TASKHOSTER_THREAD_ID`` in its environment. Exit 0: its standard output is the result (as
JSON if it is JSON, else as a string without its final newline; empty output is null).
Another exit status: the item fails with standard error as the error (retried, unless
``--no-retry``). A line of standard error that starts with ``TASKHOSTER_PROGRESS `` and goes on
with JSON (at most 4 KiB) is sent as the item's progress instead. One argument after ``--``
runs through ``/bin/sh -c``; more are run as they are. The command runs in its own process
group: if the item is cancelled (or deleted, or times out) the group gets SIGTERM, and SIGKILL
``--kill-grace`` seconds later. SIGINT, SIGTERM or a drain lets the running commands finish
for up to ``--grace`` seconds, takes no new items, then exits 0; an item still running then (or
at a second signal) is handed back to its queue and its command stopped as for a cancel.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any, NoReturn, TextIO

from .command import KILL_GRACE_SECONDS, command_handler
from .errors import TaskhosterError, WaitTimeout
from .models import (
    CANCEL_REASON_MAX_CHARS,
    MAX_PRIORITY,
    WORKER_NAME_MAX_CHARS,
    Item,
    ItemOptionFields,
    NewItem,
    RateLimit,
    Schedule,
    WorkerInfo,
)
from .producer import Producer
from .worker import Worker

EXIT_FAILED = 1
EXIT_TIMEOUT = 124
#: ``attempts``: the server tells a long story by its first 10 attempts and its last 40.
ATTEMPTS_SHOWN_FIRST = 10
# 128 + SIGPIPE: what a shell reports for a command whose output's reader has gone.
EXIT_BROKEN_PIPE = 141
#: ``work``: seconds a stop or drain lets the running commands finish.
GRACE_SECONDS = 30.0


def _print_json(value: Any, out: TextIO) -> None:
    indent = 2 if out.isatty() else None
    out.write(json.dumps(value, indent=indent, ensure_ascii=False) + "\n")
    out.flush()


def _read_payload(text: str | None, as_string: bool) -> Any:
    if text is None or text == "-":
        text = sys.stdin.read()
        if as_string:
            return text[:-1] if text.endswith("\n") else text
    if as_string:
        return text
    try:
        return json.loads(text)
    except ValueError as exc:
        raise SystemExit(f"taskhoster: the payload is not JSON ({exc}); use --string") from None


def _text(most: int) -> Callable[[str], str]:
    """A text option of 1 to ``most`` printable characters, or a usage error saying so."""

    def parse(value: str) -> str:
        if not 0 < len(value) <= most or any(
            ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F for c in value
        ):
            raise argparse.ArgumentTypeError(f"{value[:40]!r} is not 1-{most} printable characters")
        return value

    parse.__name__ = "text"
    return parse


def _none_or(convert: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(value: str) -> Any:
        return None if value.lower() in ("none", "null") else convert(value)

    # argparse names the expected type by the converter's __name__ in its errors.
    parse.__name__ = getattr(convert, "__name__", "value")
    return parse


def _int_from(low: int, high: int | None = None) -> Callable[[str], int]:
    """An integer of at least ``low`` (and at most ``high``), or a usage error saying so."""
    wanted = f"an integer from {low} to {high}" if high is not None else f"an integer {low} or more"

    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not {wanted}") from None
        if number < low or (high is not None and number > high):
            raise argparse.ArgumentTypeError(f"{value!r} is not {wanted}")
        return number

    return parse


def parse_rate_limit(value: str) -> RateLimit | None:
    """``--rate-limit``: ``COUNT/SECONDS`` (``10/1``: at most 10 claims start in any second;
    ``100/0.5``), or ``none`` (no limit)."""
    if value.strip().lower() in ("none", "null"):
        return None
    count_text, slash, seconds_text = value.partition("/")
    try:
        if not slash:
            raise ValueError
        count, seconds = int(count_text), float(seconds_text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not COUNT/SECONDS (e.g. 10/1) or none"
        ) from None
    if count < 1 or not 0 < seconds < float("inf"):
        raise argparse.ArgumentTypeError(
            f"{value!r}: COUNT must be 1 or more and SECONDS a number greater than 0"
        )
    return RateLimit(count, int(seconds) if seconds.is_integer() else seconds)


def _json_value(value: str) -> Any:
    """A JSON option (``--payload``), or a usage error saying it is not JSON."""
    try:
        return json.loads(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{value[:40]!r} is not JSON ({exc})") from None


WORK_DESCRIPTION = """\
Run COMMAND once per item of the QUEUEs, everything after -- being the command:
one argument runs through /bin/sh -c, more are run as they are.

COMMAND reads the payload as JSON on standard input (one line), with
TASKHOSTER_ITEM_ID, TASKHOSTER_QUEUE, TASKHOSTER_ATTEMPTS and TASKHOSTER_THREAD_ID
in its environment. Exit 0: its standard output is the result (JSON if it is
JSON, else text; nothing is null). Another exit status fails the item with its
standard error as the error (retried, unless --no-retry).

A line COMMAND writes to standard error starting with "TASKHOSTER_PROGRESS "
and going on with JSON (at most 4 KiB) is sent as the item's progress, not kept
as error text:  echo 'TASKHOSTER_PROGRESS {"done": 40}' >&2

COMMAND runs in its own process group. If its item is cancelled (or deleted, or
times out), the group gets SIGTERM, and SIGKILL --kill-grace seconds later; no
result is sent. SIGINT or SIGTERM to this command, or a drain (taskhoster
drain), takes no new items and lets the running commands finish for up to
--grace seconds, then exits 0. An item still running then, or at a second
signal, is handed back to its queue and its command stopped as for a cancel."""
WORK_EXAMPLES = """\
examples:
  taskhoster work emails -- ./send-email.sh
  taskhoster work shout -- 'tr a-z A-Z'
  taskhoster work emails --capacity 4 --name "$(hostname):emails" -- python3 send.py"""


class _Parser(argparse.ArgumentParser):
    """argparse's parser, telling a bad option value in one line: the error names the
    option, so the usage (a dozen lines for put-queue) would only bury it. Other usage
    errors (a missing argument, an unknown option) come with the usage, as usual."""

    def error(self, message: str) -> NoReturn:
        if message.startswith("argument -"):
            self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")
        super().error(message)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="taskhoster", description="Talk to a Taskhoster server from the shell.")
    parser.add_argument(
        "--url", help="server address (default: $TASKHOSTER_URL or http://127.0.0.1:8000)"
    )
    parser.add_argument(
        "--key", help="API key (default: $TASKHOSTER_KEY, or the apiKey in ./var/credentials.json)"
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    post = commands.add_parser("post", help="post an item (prints it)")
    post.add_argument("queue")
    post.add_argument("payload", nargs="?", help="JSON (default: read standard input)")
    post.add_argument("--string", action="store_true", help="the payload is a plain string")
    post.add_argument(
        "--lines",
        action="store_true",
        help="post each line of standard input as one payload (prints JSON lines)",
    )
    post.add_argument("--thread", dest="thread_id", help="threadId")
    when = post.add_mutually_exclusive_group()
    when.add_argument("--delay", type=float, help="seconds before it may be claimed")
    when.add_argument("--at", dest="scheduled_at", help="scheduledAt, e.g. 2030-01-31T12:00:00Z")
    post.add_argument("--idempotency-key", help="the item's key (default: one is made up)")
    post.add_argument(
        "--priority",
        type=_int_from(0, MAX_PRIORITY),
        metavar="N",
        help=f"0-{MAX_PRIORITY} (default 0): higher priorities are handed out first",
    )
    post.add_argument(
        "--wait",
        type=float,
        metavar="SECONDS",
        help="then wait this long for its verdict and print the final item",
    )

    get = commands.add_parser("get", help="print an item")
    get.add_argument("id")

    wait = commands.add_parser(
        "wait",
        help="wait for an item's verdict and print it (exit 1 if failed, 124 if not done in time)",
    )
    wait.add_argument("id")
    wait.add_argument("--timeout", type=float, help="seconds (default: no limit)")
    wait.add_argument("--result", action="store_true", help="print only the result")

    delete = commands.add_parser("delete", help="delete an item")
    delete.add_argument("id")

    restart = commands.add_parser("restart", help="restart a failed item")
    restart.add_argument("id")

    cancel = commands.add_parser(
        "cancel",
        help="fail a pending or processing item now, stopping its worker (prints it; "
        "exit 1 if it was already done)",
    )
    cancel.add_argument("id")
    cancel.add_argument(
        "--reason", help=f"why, at most {CANCEL_REASON_MAX_CHARS} characters (its cancelReason)"
    )

    attempts = commands.add_parser(
        "attempts", help="an item's claims: when, by which worker, and how each ended"
    )
    attempts.add_argument("id")
    attempts.add_argument("--json", action="store_true", help="print JSON")

    queues = commands.add_parser("queues", help="list queues with their counts")
    queues.add_argument("name", nargs="?", help="only this queue")
    queues.add_argument("--json", action="store_true", help="print JSON")

    put = commands.add_parser("put-queue", help="create a queue or update its settings")
    put.add_argument("name")
    put.add_argument("--lease-seconds", type=float)
    put.add_argument("--queue-seconds", type=float)
    put.add_argument("--retain-seconds", type=float)
    put.add_argument("--retain-from", choices=["finished", "fetched"])
    put.add_argument(
        "--max-attempts",
        type=_none_or(int),
        default=argparse.SUPPRESS,
        help="a number, or none (unlimited)",
    )
    put.add_argument("--backoff-seconds", type=float)
    put.add_argument("--backoff-max-seconds", type=float)
    put.add_argument(
        "--dead-letter-queue",
        type=_none_or(str),
        default=argparse.SUPPRESS,
        help="a queue, or none",
    )
    put.add_argument(
        "--paused",
        action=argparse.BooleanOptionalAction,
        help="hand out nothing of the queue (--no-paused: hand out again)",
    )
    put.add_argument(
        "--max-processing",
        type=_none_or(_int_from(1)),
        default=argparse.SUPPRESS,
        metavar="N",
        help="at most N items processing at once, or none (no limit)",
    )
    put.add_argument(
        "--rate-limit",
        type=parse_rate_limit,
        default=argparse.SUPPRESS,
        metavar="COUNT/SECONDS",
        help="at most COUNT claims start in any SECONDS (e.g. 10/1), or none (no limit)",
    )
    put.add_argument(
        "--thread-limit",
        type=_int_from(1),
        metavar="N",
        help="at most N members of one thread processing at once (default 1)",
    )

    pause = commands.add_parser(
        "pause", help="hand out nothing of a queue until it is resumed (prints the queue)"
    )
    pause.add_argument("name", metavar="QUEUE")
    resume = commands.add_parser(
        "resume", help="hand out a paused queue's items again (prints the queue)"
    )
    resume.add_argument("name", metavar="QUEUE")

    workers = commands.add_parser("workers", help="list the connected workers")
    workers.add_argument("--json", action="store_true", help="print JSON")

    drain = commands.add_parser(
        "drain",
        help="push nothing more to a worker (by id, or every one whose name starts with "
        "--prefix); it finishes what it holds, then closes (prints the drained workers)",
        usage="%(prog)s [-h] [--json] (WORKER_ID | --prefix PREFIX)",
    )
    which = drain.add_mutually_exclusive_group(required=True)
    which.add_argument("worker_id", nargs="?", metavar="WORKER_ID", help="as workers lists it")
    which.add_argument(
        "--prefix",
        type=_text(WORKER_NAME_MAX_CHARS),
        help="drain every worker whose name starts with this",
    )
    drain.add_argument("--json", action="store_true", help="print JSON")

    _schedule_parsers(commands)

    items = commands.add_parser("items", help="list a queue's items (JSON lines, no payloads)")
    items.add_argument("queue")
    items.add_argument("--status", choices=["pending", "processing", "finished", "failed"])
    items.add_argument("--thread", dest="thread_id")

    # What follows "--" is split off before parsing (``_split_command``), so argparse would
    # not show it: the usage says it, and the description how it is run.
    work = commands.add_parser(
        "work",
        help="run COMMAND for each item: work QUEUE... -- COMMAND",
        usage="%(prog)s [options] QUEUE [QUEUE ...] -- COMMAND [ARG ...]",
        description=WORK_DESCRIPTION,
        epilog=WORK_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    work.add_argument("queues", nargs="+", metavar="QUEUE", help="a queue to take items from")
    work.add_argument(
        "--capacity", type=int, default=1, metavar="N", help="items run at once (default 1)"
    )
    work.add_argument(
        "--name",
        type=_text(WORKER_NAME_MAX_CHARS),
        help="how workers and drain --prefix know it (default: HOST:PID)",
    )
    work.add_argument(
        "--grace",
        "--stop-timeout",
        type=float,
        default=GRACE_SECONDS,
        metavar="SECONDS",
        help=f"on SIGINT/SIGTERM or a drain, seconds to let running commands finish "
        f"(default {GRACE_SECONDS:g})",
    )
    work.add_argument(
        "--kill-grace",
        type=float,
        default=KILL_GRACE_SECONDS,
        metavar="SECONDS",
        help=f"seconds between SIGTERM and SIGKILL for the command of a cancelled item "
        f"(default {KILL_GRACE_SECONDS:g})",
    )
    work.add_argument(
        "--no-retry", action="store_true", help="a failed command fails its item for good"
    )
    work.add_argument("--quiet", action="store_true", help="log only warnings")
    work.set_defaults(usage_error=work.error)  # a missing COMMAND is told with work's usage
    return parser


def _schedule_parsers(commands: Any) -> None:
    """The schedule commands (SPEC section 8.3): schedules, schedule, put-schedule,
    delete-schedule, pause-schedule, resume-schedule."""
    schedules = commands.add_parser(
        "schedules", help="list a queue's schedules: timing, next slot, last slot, state"
    )
    schedules.add_argument("queue", metavar="QUEUE")
    schedules.add_argument("--json", action="store_true", help="print JSON")

    schedule = commands.add_parser("schedule", help="print a schedule")
    schedule.add_argument("queue", metavar="QUEUE")
    schedule.add_argument("name", metavar="NAME")

    put = commands.add_parser(
        "put-schedule",
        help="create a schedule (--cron or --every, and --payload) or change what is given "
        "(prints it)",
    )
    put.add_argument("queue", metavar="QUEUE")
    put.add_argument("name", metavar="NAME")
    timing = put.add_mutually_exclusive_group()
    timing.add_argument(
        "--cron", metavar="EXPR", help="five cron fields, e.g. '*/15 * * * *' (in --timezone)"
    )
    timing.add_argument(
        "--every",
        type=_int_from(1),
        metavar="SECONDS",
        help="seconds between slots, counted from the Unix epoch",
    )
    put.add_argument("--timezone", metavar="TZ", help="an IANA name the cron is read in (UTC)")
    put.add_argument(
        "--payload",
        type=_json_value,
        default=argparse.SUPPRESS,
        metavar="JSON",
        help="each slot's item's payload (needed for a new schedule)",
    )
    put.add_argument(
        "--thread",
        "--thread-id",
        dest="thread_id",
        type=_none_or(str),
        default=argparse.SUPPRESS,
        help="each slot's item's threadId, or none",
    )
    put.add_argument(
        "--priority",
        type=_int_from(0, MAX_PRIORITY),
        metavar="N",
        help=f"each slot's item's priority, 0-{MAX_PRIORITY}",
    )
    put.add_argument(
        "--overlap",
        choices=["allow", "skip"],
        help="skip: post no slot while the previous item is not finished or failed (default allow)",
    )
    put.add_argument(
        "--catchup-seconds",
        type=float,
        metavar="SECONDS",
        help="a slot found late is posted if at most this late (default 60)",
    )
    put.add_argument(
        "--paused",
        action=argparse.BooleanOptionalAction,
        help="post no slot (--no-paused: post again, from the next slot)",
    )

    for name, what in (
        ("delete-schedule", "delete a schedule: none of its slots is posted from now on"),
        ("pause-schedule", "post none of a schedule's slots until it is resumed (prints it)"),
        ("resume-schedule", "post a paused schedule's slots again, from the next (prints it)"),
    ):
        command = commands.add_parser(name, help=what)
        command.add_argument("queue", metavar="QUEUE")
        command.add_argument("name", metavar="NAME")


def _split_command(argv: list[str]) -> tuple[list[str], list[str]]:
    """``work ... -- COMMAND``: the arguments before ``--``, and the command after it."""
    if "--" in argv:
        at = argv.index("--")
        head = argv[:at]
        if "work" in head:
            return head, argv[at + 1 :]
    return argv, []


def main(argv: Sequence[str] | None = None) -> int:
    try:
        try:
            return _main(argv)
        finally:
            sys.stdout.flush()  # what print() still holds fails here, not at exit
    except BrokenPipeError:
        # Whoever read standard output has gone (``taskhoster queues | head -3``): stop
        # quietly, as a command killed by SIGPIPE does; standard output goes to /dev/null so
        # that Python's own flush at exit has nowhere to fail.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_BROKEN_PIPE


def _main(argv: Sequence[str] | None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    head, command = _split_command(args_list)
    parser = _parser()
    args = parser.parse_args(head)
    if args.command == "work" and not command:
        args.usage_error(
            "the command to run per item goes after --, e.g. taskhoster work q -- ./handle.sh"
        )
    try:
        if args.command == "work":
            return _work(args, command)
        with Producer(args.url, args.key) as producer:
            return int(COMMANDS[args.command](producer, args))
    except WaitTimeout as exc:
        _print_json(exc.item.raw, sys.stdout)
        print(f"taskhoster: {exc.message}", file=sys.stderr)
        return EXIT_TIMEOUT
    except TaskhosterError as exc:
        print(f"taskhoster: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return 130


def _verdict(item: Item) -> int:
    _print_json(item.raw, sys.stdout)
    return EXIT_FAILED if item.failed else 0


def _post(producer: Producer, args: argparse.Namespace) -> int:
    fields: ItemOptionFields = {
        "thread_id": args.thread_id,
        "delay": args.delay,
        "scheduled_at": args.scheduled_at,
        "priority": args.priority,
    }
    if args.lines:
        payloads = [
            line if args.string else _read_payload(line, False)
            for line in sys.stdin.read().splitlines()
            if line.strip()
        ]
        news = [NewItem(p, **fields) for p in payloads]
        for item in producer.post_many(args.queue, news):
            _print_json(item.raw, sys.stdout)
        return 0
    fields["key"] = args.idempotency_key  # a key names one item: not for --lines
    item = producer.post(args.queue, _read_payload(args.payload, args.string), **fields)
    if args.wait is None:
        _print_json(item.raw, sys.stdout)
        return 0
    return _verdict(producer.wait(item.id, args.wait))


def _get(producer: Producer, args: argparse.Namespace) -> int:
    _print_json(producer.get(args.id).raw, sys.stdout)
    return 0


def _wait(producer: Producer, args: argparse.Namespace) -> int:
    item = producer.wait(args.id, args.timeout)
    if args.result:
        _print_json(item.result if item.finished else None, sys.stdout)
        if item.failed:
            print(f"taskhoster: item {item.id} failed: {item.error}", file=sys.stderr)
        return EXIT_FAILED if item.failed else 0
    return _verdict(item)


def _delete(producer: Producer, args: argparse.Namespace) -> int:
    producer.delete(args.id)
    return 0


def _restart(producer: Producer, args: argparse.Namespace) -> int:
    _print_json(producer.restart(args.id).raw, sys.stdout)
    return 0


def _print_table(rows: list[tuple[str, ...]]) -> None:
    """Rows (the first the header) in columns as wide as their widest cell."""
    widths = [max(len(r[n]) for r in rows) for n in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def _when(at: datetime | None) -> str:
    """A time in a table: UTC to the second; ``-`` for none."""
    return at.strftime("%Y-%m-%dT%H:%M:%SZ") if at is not None else "-"


def _queues(producer: Producer, args: argparse.Namespace) -> int:
    found = [producer.queue(args.name)] if args.name else producer.queues()
    if args.json:
        _print_json([q.raw for q in found], sys.stdout)
        return 0
    rows: list[tuple[str, ...]] = [
        ("QUEUE", "PENDING", "PROCESSING", "FINISHED", "FAILED", "LEASE")
    ]
    rows += [
        (
            q.name,
            *(str(q.counts.get(s, 0)) for s in ("pending", "processing", "finished", "failed")),
            f"{q.lease_seconds:g}s",
        )
        for q in found
    ]
    _print_table(rows)
    return 0


def _put_queue(producer: Producer, args: argparse.Namespace) -> int:
    settings: dict[str, Any] = {
        name: getattr(args, name)
        for name in (
            "lease_seconds",
            "queue_seconds",
            "retain_seconds",
            "retain_from",
            "backoff_seconds",
            "backoff_max_seconds",
            "paused",
            "thread_limit",
        )
    }
    # None on these means "unlimited" / "none": they are passed only when given.
    for name in ("max_attempts", "dead_letter_queue", "max_processing", "rate_limit"):
        if hasattr(args, name):
            settings[name] = getattr(args, name)
    _print_json(producer.put_queue(args.name, **settings).raw, sys.stdout)
    return 0


def _pause(producer: Producer, args: argparse.Namespace) -> int:
    _print_json(producer.pause(args.name).raw, sys.stdout)
    return 0


def _resume(producer: Producer, args: argparse.Namespace) -> int:
    _print_json(producer.resume(args.name).raw, sys.stdout)
    return 0


def _items(producer: Producer, args: argparse.Namespace) -> int:
    for item in producer.items(args.queue, status=args.status, thread_id=args.thread_id):
        _print_json(item.raw, sys.stdout)
    return 0


def _cancel(producer: Producer, args: argparse.Namespace) -> int:
    _print_json(producer.cancel(args.id, args.reason).raw, sys.stdout)
    return 0


def _attempts(producer: Producer, args: argparse.Namespace) -> int:
    history = producer.attempts(args.id)
    if args.json:
        _print_json({"attempts": [a.raw for a in history], "omitted": history.omitted}, sys.stdout)
        return 0
    rows: list[tuple[str, ...]] = [("ATTEMPT", "CLAIMED", "WORKER", "ENDED", "OUTCOME", "ERROR")]
    for n, attempt in enumerate(history):
        if history.omitted and n == ATTEMPTS_SHOWN_FIRST:
            rows.append(("...", f"({history.omitted} more)", "", "", "", ""))
        rows.append(
            (
                str(attempt.attempt),
                _when(attempt.claimed_at),
                attempt.worker or "-",
                _when(attempt.ended_at),
                attempt.outcome or "running",
                " ".join((attempt.error or "").split())[:80],
            )
        )
    _print_table(rows)
    return 0


def _print_workers(workers: list[WorkerInfo], as_json: bool) -> None:
    if as_json:
        _print_json([w.raw for w in workers], sys.stdout)
        return
    rows: list[tuple[str, ...]] = [
        ("ID", "NAME", "QUEUES", "CAPACITY", "HELD", "STATE", "CONNECTED", "LAST SEEN")
    ]
    rows += [
        (
            w.id,
            w.name,
            ",".join(w.queues),
            str(w.capacity),
            str(len(w.held)),
            "draining" if w.draining else "serving",
            _when(w.connected_at),
            _when(w.last_seen_at),
        )
        for w in workers
    ]
    _print_table(rows)


def _workers(producer: Producer, args: argparse.Namespace) -> int:
    _print_workers(producer.workers(), args.json)
    return 0


def _drain(producer: Producer, args: argparse.Namespace) -> int:
    if args.prefix is None:
        _print_workers([producer.drain_worker(args.worker_id)], args.json)
        return 0
    drained = producer.drain_workers(args.prefix)
    if not drained:
        # Nothing to drain is not a failure: no worker of that name takes work.
        print(
            f"taskhoster: no connected worker's name starts with {args.prefix!r}",
            file=sys.stderr,
        )
    if drained or args.json:
        _print_workers(drained, args.json)
    return 0


def _timing(schedule: Schedule) -> str:
    """A schedule's timing in a table: ``cron 0 8 * * 1-5 Europe/Paris`` or ``every 60s``."""
    if schedule.cron is not None:
        zone = "" if schedule.timezone == "UTC" else f" {schedule.timezone}"
        return f"cron {schedule.cron}{zone}"
    return f"every {schedule.every}s" if schedule.every is not None else "-"


def _schedules(producer: Producer, args: argparse.Namespace) -> int:
    found = list(producer.list_schedules(args.queue))
    if args.json:
        _print_json([s.raw for s in found], sys.stdout)
        return 0
    rows: list[tuple[str, ...]] = [("SCHEDULE", "TIMING", "NEXT", "LAST SLOT", "STATE")]
    rows += [
        (
            s.name,
            _timing(s),
            _when(s.next_at),
            _when(s.last_slot),
            "paused" if s.paused else "active",
        )
        for s in found
    ]
    _print_table(rows)
    return 0


def _schedule(producer: Producer, args: argparse.Namespace) -> int:
    _print_json(producer.get_schedule(args.queue, args.name).raw, sys.stdout)
    return 0


def _put_schedule(producer: Producer, args: argparse.Namespace) -> int:
    settings: dict[str, Any] = {
        name: getattr(args, name)
        for name in (
            "cron",
            "every",
            "timezone",
            "priority",
            "overlap",
            "catchup_seconds",
            "paused",
        )
    }
    # None is a payload (null) and means "no thread": these are passed only when given.
    for name in ("payload", "thread_id"):
        if hasattr(args, name):
            settings[name] = getattr(args, name)
    _print_json(producer.put_schedule(args.queue, args.name, **settings).raw, sys.stdout)
    return 0


def _delete_schedule(producer: Producer, args: argparse.Namespace) -> int:
    producer.delete_schedule(args.queue, args.name)
    return 0


def _pause_schedule(producer: Producer, args: argparse.Namespace) -> int:
    _print_json(producer.pause_schedule(args.queue, args.name).raw, sys.stdout)
    return 0


def _resume_schedule(producer: Producer, args: argparse.Namespace) -> int:
    _print_json(producer.resume_schedule(args.queue, args.name).raw, sys.stdout)
    return 0


COMMANDS: dict[str, Callable[[Producer, argparse.Namespace], int]] = {
    "post": _post,
    "get": _get,
    "wait": _wait,
    "delete": _delete,
    "restart": _restart,
    "queues": _queues,
    "put-queue": _put_queue,
    "pause": _pause,
    "resume": _resume,
    "items": _items,
    "cancel": _cancel,
    "attempts": _attempts,
    "workers": _workers,
    "drain": _drain,
    "schedules": _schedules,
    "schedule": _schedule,
    "put-schedule": _put_schedule,
    "delete-schedule": _delete_schedule,
    "pause-schedule": _pause_schedule,
    "resume-schedule": _resume_schedule,
}


# -- work -- COMMAND (the handler: ``command``) ------------------------------------------


def _work(args: argparse.Namespace, command: list[str]) -> int:
    logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    logging.getLogger("taskhoster").setLevel(logging.WARNING if args.quiet else logging.INFO)
    worker = Worker(
        args.url,
        args.key,
        capacity=args.capacity,
        name=args.name,
        grace=args.grace,
        retry_errors=not args.no_retry,
    )
    handler = command_handler(command, retry=not args.no_retry, kill_grace=args.kill_grace)
    for queue in args.queues:
        worker.add_handler(queue, handler)
    worker.run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
