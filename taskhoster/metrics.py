"""Counters and gauges for ``/metrics``, shared across server processes through the database.

Each process counts in memory and adds its counts to its own ``Counter`` rows at most once a
second, so counting never makes two processes contend for one row. ``render()`` sums the rows
of all processes and adds live item counts from the index.

Gauges (a process's open sockets, the items it believes its sockets hold) are rows of the
same table named ``gauge:<name>``, replaced by their process while it runs and shown per
process; a row its process stopped refreshing for ``GAUGE_TTL`` seconds (the process is gone)
is left out, so whichever process answers ``/metrics`` shows the same live picture.

The engine counts into this module, so it stands below the engine and imports none of it: what
it shows of the state root (free space, files still to unlink) it reads from the root the
settings name, and the items held back by flow control (SPEC section 8.1) come from the
caller, who passes the engine's ``held_by_queue`` as ``render(held=...)``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from django.db import transaction
from django.db.models import Sum

from .conf import get_conf
from .store import StateStore, free_space

log = logging.getLogger(__name__)

PROCESS = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
FLUSH_INTERVAL = 1.0
GAUGE_PREFIX = "gauge:"
GAUGE_TTL = 15.0

_lock = threading.Lock()
_pending: dict[tuple[str, str], float] = defaultdict(float)
_last_flush = 0.0

GROUP_HELP = {
    "group_commits": "Group commits (every change to items is an operation of one).",
    "group_operations": "Operations committed in groups (divided by commits: the mean group).",
    "group_seconds": "Seconds spent running group commits, from taking them to answering.",
}
COUNTER_HELP = {
    "posts": "Items posted.",
    "claim_attempts": "Claim attempts (each may hand out several items, or none).",
    "claims": "Items handed to a worker.",
    "results": "Items finished by a worker's result.",
    "failures": "Items that died, timed out or were cancelled.",
    "requeues": "Items put back to pending (lease lapse, disconnect, retryable failure).",
    "timeouts": "Items failed by the queue timeout.",
    "cancels": "Items cancelled (POST /api/items/{id}/cancel, the admin).",
}


class HeldCounts(Protocol):
    """A queue's items held back by flow control (the engine's ``Held``)."""

    def wire(self) -> dict[str, int]: ...


# The queues named -> each one's held counts (the engine's ``held_by_queue``).
HeldSource = Callable[[Sequence[str]], Mapping[str, HeldCounts]]


def count(queue: str, name: str, amount: float = 1) -> None:
    with _lock:
        _pending[(queue, name)] += amount
    maybe_flush()


def count_group(operations: int, seconds: float) -> None:
    """A group commit of ``operations`` that took ``seconds`` (from taking them to answering)."""
    with _lock:
        _pending[("", "group_commits")] += 1
        _pending[("", "group_operations")] += operations
        _pending[("", "group_seconds")] += seconds
    maybe_flush()


def observe_latency(queue: str, seconds: float) -> None:
    """One post-to-claim latency: counted in its own bucket only (``latency_in_<bound>``);
    the cumulative buckets of Prometheus are summed when rendered, so an observation costs
    one counter, not one per bucket above it (per queue, per flush: with a thousand queues
    the flush wrote fourteen rows a queue)."""
    with _lock:
        bucket = next((b for b in LATENCY_BUCKETS if seconds <= b), None)
        if bucket is not None:
            _pending[(queue, f"latency_in_{bucket}")] += 1
        _pending[(queue, "latency_sum")] += seconds
        _pending[(queue, "latency_count")] += 1
    maybe_flush()


def maybe_flush(force: bool = False) -> None:
    """Write the counts made since the last flush, at most every ``FLUSH_INTERVAL`` (any time
    with ``force``). Unforced, it never raises: counts that could not be written wait for
    the next flush; forced, the error is the caller's."""
    global _last_flush
    now = time.monotonic()
    if not force and now - _last_flush < FLUSH_INTERVAL:
        return
    with _lock:
        if not _pending:
            _last_flush = now
            return
        batch = dict(_pending)
        _pending.clear()
        _last_flush = now
    try:
        with transaction.atomic():
            _upsert(batch, add=True)
    except Exception as exc:
        with _lock:
            for key, amount in batch.items():
                _pending[key] += amount
        if force:
            raise
        # Counted in passing (after a group's commit, among others): the database away is
        # the caller's to meet, not a count's; the counts wait for the next flush.
        log.warning("could not write the metrics (kept for the next try): %s", exc)


def _upsert(values: dict[tuple[str, str], float], *, add: bool) -> None:
    """Write this process's rows ``{(queue, name): value}`` in one statement: each value
    added to its row (``add``) or put in its place; a missing row is made."""
    from django.db import connection
    from django.utils import timezone

    from .models import Counter

    if not values:
        return
    table = Counter._meta.db_table
    at = connection.ops.adapt_datetimefield_value(timezone.now())
    new_value = f"{table}.value + excluded.value" if add else "excluded.value"
    with connection.cursor() as cursor:
        cursor.executemany(
            f"INSERT INTO {table} (process, queue, name, value, updated_at) "
            "VALUES (%s, %s, %s, %s, %s) ON CONFLICT (process, queue, name) DO UPDATE "
            f"SET value = {new_value}, updated_at = excluded.updated_at",
            [(PROCESS, queue, name, value, at) for (queue, name), value in values.items()],
        )


def publish_gauges(values: dict[tuple[str, str], float]) -> None:
    """Replace this process's gauges: ``{(queue or "", name): value}``."""
    from .models import Counter

    with transaction.atomic():
        mine = Counter.objects.filter(process=PROCESS, name__startswith=GAUGE_PREFIX)
        wanted = {(q, GAUGE_PREFIX + n) for q, n in values}
        stale = [pk for pk, q, n in mine.values_list("id", "queue", "name") if (q, n) not in wanted]
        if stale:
            Counter.objects.filter(id__in=stale).delete()
        _upsert({(q, GAUGE_PREFIX + n): v for (q, n), v in values.items()}, add=False)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render(may_see: Callable[[str], bool] | None = None, held: HeldSource | None = None) -> str:
    """The Prometheus text of every live queue (those ``may_see`` allows, for a key limited
    to some queues); a deleted queue's counters are left out. ``held`` (the engine's
    ``held_by_queue``) gives the items each queue's flow control holds back; without it
    those gauges are left out, never shown as zeros."""
    from .models import Counter, Queue, QueueCount
    from .status import Status

    maybe_flush(force=True)
    paused = {
        name: is_paused
        for name, is_paused in Queue.objects.filter(deleting=False).values_list("name", "paused")
        if may_see is None or may_see(name)
    }
    live = list(paused)
    shown = set(live)
    lines: list[str] = []
    lines.append("# HELP taskhoster_items Items per queue and status.")
    lines.append("# TYPE taskhoster_items gauge")
    # Kept by every group commit (QueueCount): a handful of rows, however many items.
    counts = {
        (row["queue__name"], row["status"]): row["n"]
        for row in QueueCount.objects.filter(queue__deleting=False)
        .values("queue__name", "status")
        .annotate(n=Sum("n"))
    }
    for queue in live:
        for status in Status:
            n = counts.get((queue, status.value), 0)
            lines.append(f'taskhoster_items{{queue="{_escape(queue)}",status="{status}"}} {n}')
    lines.extend(_render_flow(paused, held))
    totals = {
        (row["queue"], row["name"]): row["total"]
        for row in Counter.objects.exclude(name__startswith=GAUGE_PREFIX)
        .values("queue", "name")
        .annotate(total=Sum("value"))
    }
    queues = sorted({q for q, _ in totals if q in shown})
    for name, help_text in GROUP_HELP.items():
        lines.append(f"# HELP taskhoster_{name}_total {help_text}")
        lines.append(f"# TYPE taskhoster_{name}_total counter")
        lines.append(f"taskhoster_{name}_total {totals.get(('', name), 0):g}")
    for name, help_text in COUNTER_HELP.items():
        lines.append(f"# HELP taskhoster_{name}_total {help_text}")
        lines.append(f"# TYPE taskhoster_{name}_total counter")
        for queue in queues:
            value = totals.get((queue, name), 0)
            lines.append(f'taskhoster_{name}_total{{queue="{_escape(queue)}"}} {value:g}')
    lines.append("# HELP taskhoster_post_to_claim_seconds Time from due to first claim.")
    lines.append("# TYPE taskhoster_post_to_claim_seconds histogram")
    for queue in queues:
        q = _escape(queue)
        below = 0.0
        for bound in LATENCY_BUCKETS:
            # Rows of processes that counted cumulatively (latency_le_) add as they are.
            below += totals.get((queue, f"latency_in_{bound}"), 0)
            value = below + totals.get((queue, f"latency_le_{bound}"), 0)
            lines.append(
                f'taskhoster_post_to_claim_seconds_bucket{{queue="{q}",le="{bound}"}} {value:g}'
            )
        total = totals.get((queue, "latency_count"), 0)
        lines.append(f'taskhoster_post_to_claim_seconds_bucket{{queue="{q}",le="+Inf"}} {total:g}')
        lines.append(
            f'taskhoster_post_to_claim_seconds_sum{{queue="{q}"}} '
            f"{totals.get((queue, 'latency_sum'), 0):g}"
        )
        lines.append(f'taskhoster_post_to_claim_seconds_count{{queue="{q}"}} {total:g}')
    lines.extend(_render_gauges(shown))
    # The state root the settings name, looked at (the engine writes it; nothing here asks
    # for a flush, so none is chosen).
    root = StateStore(get_conf().root, flush="fsync")
    lines.extend(_render_reclaim(root))
    lines.extend(_render_state_root(root))
    return "\n".join(lines) + "\n"


def _render_flow(paused: dict[str, bool], held: HeldSource | None) -> list[str]:
    """Flow control (SPEC section 8.1) per queue shown: paused or not, and (given ``held``)
    the due pending items that wait only because of a control, by control."""
    lines = [
        "# HELP taskhoster_queue_paused 1 while the queue is paused (nothing of it is handed "
        "out), else 0.",
        "# TYPE taskhoster_queue_paused gauge",
    ]
    for queue, is_paused in paused.items():
        lines.append(f'taskhoster_queue_paused{{queue="{_escape(queue)}"}} {int(is_paused)}')
    if held is None:
        return lines
    found = held(list(paused))
    lines.append(
        "# HELP taskhoster_queue_held_items Due pending items that wait only because of a "
        "control: paused, maxProcessing (at its cap), rateLimit (window full) or thread "
        "(threadLimit, or behind their thread's heads); exact up to the engine's cap."
    )
    lines.append("# TYPE taskhoster_queue_held_items gauge")
    for queue in paused:
        counts = found.get(queue)
        if counts is None:
            continue  # deleted since it was listed
        q = _escape(queue)
        for control, n in counts.wire().items():
            lines.append(
                f'taskhoster_queue_held_items{{queue="{q}",control="{_escape(control)}"}} {n}'
            )
    return lines


def _render_reclaim(root: StateStore) -> list[str]:
    """What background work still has to remove: the items of deleted queues not reclaimed
    yet (their counts are kept as their rows go), and the files named by lists of deferred
    unlinks (deletes by status, retention of many)."""
    from .models import QueueCount

    rows = QueueCount.objects.filter(queue__deleting=True).aggregate(n=Sum("n"))["n"] or 0
    listed = 0
    for path in root.unlink_lists():
        with contextlib.suppress(OSError), open(path, "rb") as handle:
            listed += sum(1 for _line in handle)
    return [
        "# HELP taskhoster_reclaim_items Items of deleted queues still to be reclaimed "
        "(rows and files), behind the delete's answer.",
        "# TYPE taskhoster_reclaim_items gauge",
        f"taskhoster_reclaim_items {int(rows)}",
        "# HELP taskhoster_reclaim_files Files of deleted items still to be unlinked, behind "
        "the delete's answer.",
        "# TYPE taskhoster_reclaim_files gauge",
        f"taskhoster_reclaim_files {listed}",
    ]


def _render_state_root(root: StateStore) -> list[str]:
    """Free space and inodes of the state root's filesystem (readiness: ``/healthz``)."""
    free = free_space(root.root)
    if free is None:
        return []
    return [
        "# HELP taskhoster_state_root_free_bytes Free space of the state root's filesystem "
        "(what an unprivileged process may use).",
        "# TYPE taskhoster_state_root_free_bytes gauge",
        f"taskhoster_state_root_free_bytes {free[0]}",
        "# HELP taskhoster_state_root_free_inodes Free inodes of the state root's filesystem.",
        "# TYPE taskhoster_state_root_free_inodes gauge",
        f"taskhoster_state_root_free_inodes {free[1]}",
    ]


GAUGE_HELP = {
    "sockets_open": "Open /work sockets, per server process.",
    "socket_held_items": "Items a server process believes its /work sockets hold, per queue.",
}


def _render_gauges(shown: set[str]) -> list[str]:
    from datetime import timedelta

    from django.utils import timezone

    from .models import Counter

    fresh = timezone.now() - timedelta(seconds=GAUGE_TTL)
    rows = Counter.objects.filter(name__startswith=GAUGE_PREFIX, updated_at__gte=fresh)
    by_name: dict[str, list[tuple[str, str, float]]] = defaultdict(list)
    for process, queue, name, value in rows.values_list("process", "queue", "name", "value"):
        by_name[name.removeprefix(GAUGE_PREFIX)].append((process, queue, value))
    lines: list[str] = []
    for name, help_text in GAUGE_HELP.items():
        lines.append(f"# HELP taskhoster_{name} {help_text}")
        lines.append(f"# TYPE taskhoster_{name} gauge")
        for process, queue, value in sorted(by_name.get(name, [])):
            if queue and queue not in shown:
                continue
            labels = f'process="{_escape(process)}"'
            if queue:
                labels += f',queue="{_escape(queue)}"'
            lines.append(f"taskhoster_{name}{{{labels}}} {value:g}")
    return lines
