"""Counters and gauges for ``/metrics``, shared across server processes through the database.

Each process counts in memory and adds its counts to its own ``Counter`` rows at most once a
second, so counting never makes two processes contend for one row. ``render()`` sums the rows
of all processes and adds live item counts from the index.

Gauges (a process's open sockets, the items it believes its sockets hold) are rows of the
same table named ``gauge:<name>``, replaced by their process while it runs and shown per
process; a row its process stopped refreshing for ``GAUGE_TTL`` seconds (the process is gone)
is left out, so whichever process answers ``/metrics`` shows the same live picture.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from collections import defaultdict

from django.db import transaction
from django.db.models import F, Sum

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
    "failures": "Items that died or timed out.",
    "requeues": "Items put back to pending (lease lapse, disconnect, retryable failure).",
    "timeouts": "Items failed by the queue timeout.",
}


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
    with _lock:
        for bound in LATENCY_BUCKETS:
            if seconds <= bound:
                _pending[(queue, f"latency_le_{bound}")] += 1
        _pending[(queue, "latency_sum")] += seconds
        _pending[(queue, "latency_count")] += 1
    maybe_flush()


def maybe_flush(force: bool = False) -> None:
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
    from .models import Counter

    try:
        with transaction.atomic():
            for (queue, name), amount in batch.items():
                updated = Counter.objects.filter(process=PROCESS, queue=queue, name=name).update(
                    value=F("value") + amount
                )
                if not updated:
                    Counter.objects.create(process=PROCESS, queue=queue, name=name, value=amount)
    except Exception:
        with _lock:
            for key, amount in batch.items():
                _pending[key] += amount
        raise


def publish_gauges(values: dict[tuple[str, str], float]) -> None:
    """Replace this process's gauges: ``{(queue or "", name): value}``."""
    from django.utils import timezone

    from .models import Counter

    at = timezone.now()
    with transaction.atomic():
        stale = Counter.objects.filter(process=PROCESS, name__startswith=GAUGE_PREFIX)
        for row in stale.values_list("queue", "name"):
            if (row[0], row[1].removeprefix(GAUGE_PREFIX)) not in values:
                Counter.objects.filter(process=PROCESS, queue=row[0], name=row[1]).delete()
        for (queue, name), value in values.items():
            updated = Counter.objects.filter(
                process=PROCESS, queue=queue, name=GAUGE_PREFIX + name
            ).update(value=value, updated_at=at)
            if not updated:
                Counter.objects.create(
                    process=PROCESS, queue=queue, name=GAUGE_PREFIX + name, value=value
                )


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render() -> str:
    from .models import Counter, Queue, QueueCount
    from .status import Status

    maybe_flush(force=True)
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
    for queue in Queue.objects.filter(deleting=False).values_list("name", flat=True):
        for status in Status:
            n = counts.get((queue, status.value), 0)
            lines.append(f'taskhoster_items{{queue="{_escape(queue)}",status="{status}"}} {n}')
    totals = {
        (row["queue"], row["name"]): row["total"]
        for row in Counter.objects.exclude(name__startswith=GAUGE_PREFIX)
        .values("queue", "name")
        .annotate(total=Sum("value"))
    }
    queues = sorted({q for q, _ in totals if q})
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
        for bound in LATENCY_BUCKETS:
            value = totals.get((queue, f"latency_le_{bound}"), 0)
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
    lines.extend(_render_gauges())
    return "\n".join(lines) + "\n"


GAUGE_HELP = {
    "sockets_open": "Open /work sockets, per server process.",
    "socket_held_items": "Items a server process believes its /work sockets hold, per queue.",
}


def _render_gauges() -> list[str]:
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
            labels = f'process="{_escape(process)}"'
            if queue:
                labels += f',queue="{_escape(queue)}"'
            lines.append(f"taskhoster_{name}{{{labels}}} {value:g}")
    return lines
