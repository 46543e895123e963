"""The index: queue settings, threads, API keys and item metadata (never payloads).

The state directories are the truth; these rows make claims, listings and the sweep fast and
can be rebuilt from the files (``manage.py sweep --repair``).
"""

from __future__ import annotations

from django.db import models
from django.db.models import Q

from .status import RetainFrom, Status

QUEUE_DEFAULTS = {
    "lease_seconds": 60.0,
    "queue_seconds": 86400.0,
    "retain_seconds": 3600.0,
    "retain_from": RetainFrom.FINISHED.value,
    "max_attempts": None,
    "backoff_seconds": 1.0,
    "backoff_max_seconds": 300.0,
    "dead_letter_queue": None,
    "paused": False,
    "max_processing": None,
    "rate_limit": None,
    "thread_limit": 1,
}


class Queue(models.Model):
    """A named stream of items and its settings (SPEC section 2)."""

    # Unique among live queues only: a deleted queue's row stays (``deleting``) while its items
    # are reclaimed, and its name is free again at once.
    name = models.CharField(max_length=64)
    lease_seconds = models.FloatField(
        default=60.0, help_text="How long a claim lasts unless extended."
    )
    queue_seconds = models.FloatField(
        default=86400.0,
        help_text="An item older than this (from postedAt) fails with error 'timeout'.",
    )
    retain_seconds = models.FloatField(
        default=3600.0, help_text="A done item is deleted this long after retainFrom."
    )
    retain_from = models.CharField(
        max_length=16,
        choices=[(r.value, r.value) for r in RetainFrom],
        default=RetainFrom.FINISHED.value,
        help_text="'finished': the clock starts at completion; 'fetched': at a producer's "
        "first read of the terminal item (never read = kept).",
    )
    max_attempts = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="Empty = unlimited; else an item that would be re-queued after its "
        "maxAttempts-th claim dies instead.",
    )
    backoff_seconds = models.FloatField(
        default=1.0, help_text="First retry delay after a retryable failure; doubles each attempt."
    )
    backoff_max_seconds = models.FloatField(default=300.0, help_text="Cap on the retry delay.")
    dead_letter_queue = models.CharField(
        max_length=64,
        null=True,
        blank=True,
        help_text="Name of another queue; an item that dies is copied there as a new pending item.",
    )
    paused = models.BooleanField(
        default=False,
        help_text="While on, nothing of the queue is handed out; posts, verdicts and every "
        "clock go on.",
    )
    max_processing = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="Empty = no limit; else at most this many items processing at once, across "
        "every worker and server process.",
    )
    rate_limit = models.JSONField(
        null=True,
        blank=True,
        help_text='Empty = no limit; else {"count": N, "seconds": S}: at most N claims start in '
        "any S seconds, across every server process.",
    )
    thread_limit = models.PositiveIntegerField(
        default=1,
        help_text="At most this many members of one thread processing at once (1: one at a "
        "time, the threads' rule).",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    deleting = models.BooleanField(default=False)

    class Meta:
        ordering = ["name"]
        constraints = [
            models.UniqueConstraint(
                fields=["name"], condition=Q(deleting=False), name="queue_live_name_unique"
            )
        ]

    def __str__(self) -> str:
        return self.name


class Thread(models.Model):
    """A live thread: the non-terminal members of one queue sharing a ``threadId``."""

    queue = models.ForeignKey(Queue, on_delete=models.CASCADE, related_name="threads")
    thread_id = models.CharField(max_length=200)
    member_count = models.PositiveIntegerField(default=0)
    # Its members processing, as the item rows said when the thread last changed, and one
    # of them (to show).
    processing = models.PositiveIntegerField(default=0)
    processing_item = models.CharField(max_length=64, null=True, blank=True)
    # Its eligible members: the first ``threadLimit - processing`` pending ones in line.
    heads = models.JSONField(default=list, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["queue", "thread_id"], name="thread_unique_per_queue")
        ]

    def __str__(self) -> str:
        return f"{self.queue_id}:{self.thread_id}"


class Item(models.Model):
    """The index row of one item. Its payload and result live only in its file."""

    id = models.CharField(max_length=64, primary_key=True)
    # No index of its own: ``item_by_queue`` (queue, id) serves every lookup by queue.
    queue = models.ForeignKey(Queue, on_delete=models.CASCADE, related_name="items", db_index=False)
    status = models.CharField(max_length=16, choices=Status.choices(), default=Status.PENDING)
    # True exactly when the item may be claimed as soon as it is due: pending, and either
    # unthreaded or the head of a thread with no member processing.
    eligible = models.BooleanField(default=False)
    # 0-9, higher first among the claimable items of a queue (SPEC section 8.1).
    priority = models.PositiveSmallIntegerField(default=0)
    thread_id = models.CharField(max_length=200, null=True, blank=True)
    key = models.CharField(max_length=200, null=True, blank=True)
    # Arrival order: the id at post, a fresh id-like value at restart (a brand-new arrival).
    seq = models.CharField(max_length=64)
    scheduled_at = models.DateTimeField()
    posted_at = models.DateTimeField()
    attempts = models.PositiveIntegerField(default=0)
    lease = models.CharField(max_length=64, null=True, blank=True)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    claimed_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    fetched_at = models.DateTimeField(null=True, blank=True)
    error = models.TextField(null=True, blank=True)
    origin = models.JSONField(null=True, blank=True)
    dead_letter = models.CharField(max_length=64, null=True, blank=True)
    rev = models.PositiveIntegerField(default=1)
    updated_at = models.DateTimeField()
    # Section 8.2: who holds the current attempt (a socket's name, or "http"), the latest
    # progress its worker reported, and the reason given with a cancel.
    claimed_by = models.CharField(max_length=200, null=True, blank=True)
    progress = models.JSONField(null=True, blank=True)
    cancel_reason = models.CharField(max_length=500, null=True, blank=True)
    # Its file was made, changed or moved by a group whose flush failed after it committed,
    # and is not yet written again: every process refuses to change or acknowledge the item
    # meanwhile, and the one that meets it writes the file again (``engine/runner.py``).
    # NULL for no: a nullable column without a default is added to a big table in place
    # (SQLite copies the whole table to add a NOT NULL one).
    unflushed = models.BooleanField(null=True, default=None)

    class Meta:
        indexes = [
            models.Index(
                # A claim probes it once per priority level (``rows.claim_query``).
                fields=["queue", "priority", "scheduled_at", "seq"],
                condition=Q(eligible=True),
                name="item_claimable_by_priority",
            ),
            models.Index(fields=["queue", "status", "id"], name="item_by_status"),
            # The admin's item list sorts by these over the whole index.
            models.Index(fields=["scheduled_at"], name="item_by_scheduled"),
            models.Index(fields=["posted_at"], name="item_by_posted"),
            models.Index(fields=["queue", "id"], name="item_by_queue"),
            models.Index(
                fields=["queue", "thread_id", "status", "scheduled_at", "seq"],
                condition=Q(thread_id__isnull=False),
                name="item_thread_order",
            ),
            models.Index(
                fields=["lease_expires_at"],
                condition=Q(status="processing"),
                name="item_lease_clock",
            ),
            models.Index(
                fields=["queue", "posted_at"],
                condition=Q(status__in=["pending", "processing"]),
                name="item_age_clock",
            ),
            models.Index(
                fields=["queue", "finished_at"],
                condition=Q(status__in=["finished", "failed"]),
                name="item_retain_finished",
            ),
            models.Index(
                fields=["queue", "fetched_at"],
                condition=Q(status__in=["finished", "failed"], fetched_at__isnull=False),
                name="item_retain_fetched",
            ),
            # The few rows a failed flush left (a process starting looks for them).
            models.Index(fields=["id"], condition=Q(unflushed=True), name="item_unflushed"),
        ]
        constraints = [
            models.UniqueConstraint(
                fields=["queue", "key"], condition=Q(key__isnull=False), name="item_key_unique"
            )
        ]

    def __str__(self) -> str:
        return self.id


class Schedule(models.Model):
    """A schedule of a queue (SPEC section 8.3): every slot of its ``cron`` (in ``timezone``)
    or of its ``every`` posts one item, under the key ``schedule:<name>:<slot>``.

    ``next_at`` is the slot the sweep posts next; only due, unpaused schedules are read
    (``schedule_due``). ``rev`` grows with every change of the definition, so a sweep that
    read an older one posts nothing for it (``engine.schedules``)."""

    queue = models.ForeignKey(Queue, on_delete=models.CASCADE, related_name="schedules")
    name = models.CharField(max_length=64)
    cron = models.CharField(max_length=200, null=True, blank=True)
    every = models.PositiveIntegerField(null=True, blank=True)
    timezone = models.CharField(max_length=64, default="UTC")
    payload = models.JSONField(null=True, blank=True)
    thread_id = models.CharField(max_length=200, null=True, blank=True)
    priority = models.PositiveSmallIntegerField(default=0)
    overlap = models.CharField(
        max_length=8, choices=[("allow", "allow"), ("skip", "skip")], default="allow"
    )
    catchup_seconds = models.FloatField(default=60.0)
    paused = models.BooleanField(default=False)
    next_at = models.DateTimeField(null=True, blank=True)
    last_slot = models.DateTimeField(null=True, blank=True)
    last_item = models.CharField(max_length=64, null=True, blank=True)
    # Makes the ids of this schedule's items (``slots.slot_item_id``); new when it is made again.
    salt = models.CharField(max_length=32)
    rev = models.PositiveIntegerField(default=1)
    created_at = models.DateTimeField()
    updated_at = models.DateTimeField()

    class Meta:
        ordering = ["queue", "name"]
        constraints = [
            models.UniqueConstraint(fields=["queue", "name"], name="schedule_unique_per_queue")
        ]
        indexes = [models.Index(fields=["next_at"], condition=Q(paused=False), name="schedule_due")]

    def __str__(self) -> str:
        return self.name


class QueueCount(models.Model):
    """Items per queue and status, kept by every group commit in the same transaction as the
    rows it changes, so counts cost the same with a thousand items or a million.

    Each process adds to its own ``shard`` (of ``COUNT_SHARDS``), so concurrent processes do
    not queue behind one row; a count is the sum over the shards. ``repair`` recounts.
    """

    queue = models.ForeignKey(
        Queue, on_delete=models.CASCADE, related_name="counts", db_index=False
    )
    status = models.CharField(max_length=16, choices=Status.choices())
    shard = models.PositiveSmallIntegerField(default=0)
    n = models.BigIntegerField(default=0)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["queue", "status", "shard"], name="queuecount_unique")
        ]

    def __str__(self) -> str:
        return f"{self.queue_id}:{self.status}#{self.shard}={self.n}"


class ClaimStart(models.Model):
    """Claims that started in a rate-limited queue (section 8.1's ``rateLimit``): one row per
    group commit that claimed there, with how many it took, kept only while inside the
    queue's window. Written in the claims' own transaction, so a crash never leaves one
    counted that did not happen, or the reverse."""

    queue = models.ForeignKey(Queue, on_delete=models.CASCADE, related_name="+", db_index=False)
    at = models.DateTimeField()
    n = models.PositiveIntegerField()

    class Meta:
        indexes = [models.Index(fields=["queue", "at"], name="claimstart_window")]

    def __str__(self) -> str:
        return f"{self.queue_id}@{self.at}x{self.n}"


class ApiKey(models.Model):
    """An API key. Only the SHA-256 of the secret is stored."""

    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=12, help_text="The first characters, to recognise a key.")
    key_hash = models.CharField(max_length=64, unique=True)
    scopes = models.JSONField(default=list, help_text="Any of: produce, work, manage.")
    queues = models.JSONField(
        null=True, blank=True, help_text="Queue names this key is limited to; empty = all."
    )
    created_at = models.DateTimeField(auto_now_add=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…)"


class Counter(models.Model):
    """Metric counters, one row per (process, queue, name), summed by ``/metrics``.

    Each server process owns its rows, so counting never contends across processes.
    """

    process = models.CharField(max_length=64)
    queue = models.CharField(max_length=64)
    name = models.CharField(max_length=64)
    value = models.FloatField(default=0)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["process", "queue", "name"], name="counter_unique")
        ]

    def __str__(self) -> str:
        return f"{self.queue}:{self.name}@{self.process}"


class ServerProcess(models.Model):
    """A server process that serves ``/work`` sockets, alive while ``seen_at`` is recent
    (each process touches its own row every few seconds, whatever its number of sockets)."""

    process = models.CharField(max_length=64, primary_key=True)
    host = models.CharField(max_length=255)
    pid = models.PositiveIntegerField()
    started_at = models.DateTimeField()
    seen_at = models.DateTimeField()

    def __str__(self) -> str:
        return self.process


class WorkerSocket(models.Model):
    """One open ``/work`` socket of a server process (SPEC section 8.2's ``GET
    /api/workers``), written by its process when it changes; gone with the socket, and
    hidden (then removed) once its process stops touching its ``ServerProcess`` row."""

    id = models.CharField(max_length=32, primary_key=True)
    process = models.CharField(max_length=64, db_index=True)
    name = models.CharField(max_length=200)
    key_id = models.IntegerField(null=True, blank=True)
    queues = models.JSONField(default=list)
    capacity = models.PositiveIntegerField(default=0)
    held = models.JSONField(default=list)
    draining = models.BooleanField(default=False)
    connected_at = models.DateTimeField()
    last_seen_at = models.DateTimeField()

    class Meta:
        verbose_name = "worker"
        verbose_name_plural = "workers"

    def __str__(self) -> str:
        return f"{self.name} ({self.id})"


class Installation(models.Model):
    """The index's identity: one row, made with the first server start, and written into
    the state root too (``<root>/.identity``), so that a server never serves a state root
    that another database indexes (``taskhoster.identity``)."""

    identity = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return self.identity
