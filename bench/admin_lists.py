"""Time the admin's list pages over an index of 1,000,000 items (SQLite).

Makes a scratch SQLite database in a temp dir (``manage.py migrate``), bulk-inserts index rows
only (list pages never read item files), logs in a staff user with Django's test ``Client``
and times each page: the median and the worst of ``--repeat`` requests after one warm-up.

    .venv/bin/python bench/admin_lists.py                # 1,000,000 items
    .venv/bin/python bench/admin_lists.py --items 100000 --repeat 5
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
# The header of the live pages' script: the page's regions, as JSON.
LIVE = {"HTTP_X_TASKHOSTER_LIVE": "1"}
# The bench's server process stays "alive" (its heartbeat is set ahead) while it runs.
ALIVE = timedelta(days=1)
QUEUES = ("emails", "images", "reports", "webhooks")
STATUSES = (("finished", 0.70), ("failed", 0.05), ("pending", 0.20), ("processing", 0.05))


def fmt(at: datetime) -> str:
    return at.strftime("%Y-%m-%d %H:%M:%S.%f")


def fill(db: Path, count: int) -> dict[str, str]:
    rnd = random.Random(7)
    con = sqlite3.connect(db)
    now = datetime.now(UTC).replace(tzinfo=None)
    con.executemany(
        "INSERT INTO taskhoster_queue (name, lease_seconds, queue_seconds, retain_seconds, "
        "retain_from, max_attempts, backoff_seconds, backoff_max_seconds, dead_letter_queue, "
        "paused, max_processing, rate_limit, thread_limit, created_at, deleting) "
        "VALUES (?, 60, 86400, 3600, 'finished', NULL, 1, 300, NULL, 0, NULL, NULL, 1, ?, 0)",
        [(q, fmt(now)) for q in QUEUES],
    )
    queue_ids = [r[0] for r in con.execute("SELECT id FROM taskhoster_queue ORDER BY id")]
    start_us = int((now - timedelta(hours=2)).replace(tzinfo=UTC).timestamp() * 1_000_000)
    step = max(1, (2 * 3600 * 1_000_000) // count)
    threads: dict[tuple[int, str], list[str]] = {}
    sample: dict[str, str] = {}
    rows = []
    for n in range(count):
        micros = start_us + n * step
        item_id = f"{micros:014x}{rnd.randrange(1 << 24):06x}"
        posted = datetime(1970, 1, 1) + timedelta(microseconds=micros)
        r = rnd.random()
        acc = 0.0
        status = "finished"
        for s, share in STATUSES:
            acc += share
            if r < acc:
                status = s
                break
        queue = queue_ids[n % len(queue_ids)]
        thread = (
            f"t{rnd.randrange(20_000)}"
            if rnd.random() < 0.1
            and status
            in (
                "pending",
                "processing",
            )
            else None
        )
        key = f"k{n}" if n % 3 == 0 else None
        finished = fmt(posted + timedelta(seconds=2)) if status in ("finished", "failed") else None
        lease_exp = fmt(now + timedelta(seconds=60)) if status == "processing" else None
        rows.append(
            (
                item_id,
                queue,
                status,
                status == "pending" and thread is None,
                thread,
                key,
                item_id,
                fmt(posted),
                fmt(posted),
                1 if status != "pending" else 0,
                "lease" if status == "processing" else None,
                lease_exp,
                finished,
                "boom" if status == "failed" else None,
                fmt(now),
                fmt(now - timedelta(seconds=5)) if status == "processing" else None,
                f"worker-{n % 50}" if status == "processing" else None,
                '{"done": 3, "of": 4}' if status == "processing" and n % 2 else None,
            )
        )
        if thread is not None:
            threads.setdefault((queue, thread), []).append(item_id)
        sample.setdefault("id", item_id)
        if status == "processing":
            sample.setdefault("processing", item_id)
        if key:
            sample["key"] = key
        if thread:
            sample["thread"] = thread
        if len(rows) == 50_000:
            insert(con, rows)
            rows = []
    insert(con, rows)
    con.executemany(
        "INSERT INTO taskhoster_thread (queue_id, thread_id, member_count, processing, "
        "processing_item, heads) VALUES (?, ?, ?, 0, NULL, ?)",
        [(q, t, len(m), json.dumps(m[:1])) for (q, t), m in threads.items()],
    )
    # The counts the group commits keep (the overview and the queue pages read these).
    con.execute(
        "INSERT INTO taskhoster_queuecount (queue_id, status, shard, n) "
        "SELECT queue_id, status, 0, count(*) FROM taskhoster_item GROUP BY queue_id, status"
    )
    con.commit()
    con.close()
    sample["threads"] = str(len(threads))
    return sample


def insert(con: sqlite3.Connection, rows: Sequence[tuple[object, ...]]) -> None:
    con.executemany(
        "INSERT INTO taskhoster_item (id, queue_id, status, eligible, thread_id, key, seq, "
        "scheduled_at, posted_at, attempts, lease, lease_expires_at, finished_at, error, "
        "updated_at, claimed_at, claimed_by, progress, priority, rev) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 0, 1)",
        rows,
    )


def column(name: str) -> int:
    """The number ``?o=`` gives the item list's column ``name`` (the selection box is 0)."""
    from taskhoster.admin.items import ItemAdmin

    return ItemAdmin.list_display.index(name) + 1


def workers(now: datetime, sockets: int = 50, each: int = 20) -> None:
    """A live server process with ``sockets`` workers holding ``each`` processing items each,
    as the registry writes them (the workers page reads these rows)."""
    from taskhoster.metrics import PROCESS
    from taskhoster.models import Item, ServerProcess, WorkerSocket

    ServerProcess.objects.create(
        process=PROCESS, host="bench", pid=os.getpid(), started_at=now, seen_at=now + ALIVE
    )
    held = list(
        Item.objects.filter(status="processing").values_list("id", flat=True)[: sockets * each]
    )
    WorkerSocket.objects.bulk_create(
        WorkerSocket(
            id=f"{n:016x}",
            process=PROCESS,
            name=f"worker-{n}",
            queues=["emails"],
            capacity=each,
            held=held[n * each : (n + 1) * each],
            connected_at=now,
            last_seen_at=now,
        )
        for n in range(sockets)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="th-admin-bench-"))
    db = tmp / "bench.sqlite3"
    os.environ.update(
        DATABASE_URL=f"sqlite:///{db}",
        TASKHOSTER_ROOT=str(tmp / "state"),
        DJANGO_SETTINGS_MODULE="project.settings",
    )
    subprocess.run(
        [sys.executable, "manage.py", "migrate", "-v", "0"], cwd=REPO, check=True, env=os.environ
    )
    began = time.monotonic()
    sample = fill(db, args.items)
    print(
        f"filled {args.items:,} items, {sample['threads']} threads in "
        f"{time.monotonic() - began:.0f} s ({db})"
    )

    # Run as a script, bench/ leads sys.path; keep its other modules from shadowing stdlib ones.
    here = str(Path(__file__).resolve().parent)
    sys.path[:] = [str(REPO), *(p for p in sys.path if p and str(Path(p).resolve()) != here)]
    import django

    django.setup()
    from django.contrib.auth.models import User
    from django.test import Client

    from taskhoster.models import Queue

    User.objects.create_user("bench", password="pw", is_staff=True, is_superuser=True)
    client = Client()
    client.login(username="bench", password="pw")
    workers(now=datetime.now(UTC))
    q = Queue.objects.get(name="emails").pk
    pages: list[tuple[Any, ...]] = [
        ("items", "/admin/taskhoster/item/"),
        ("items ?status=failed", "/admin/taskhoster/item/?status__exact=failed"),
        (
            "items ?queue&status=pending",
            f"/admin/taskhoster/item/?queue__id__exact={q}&status__exact=pending",
        ),
        ("items page 50", "/admin/taskhoster/item/?p=50"),
        ("items sorted by scheduledAt", f"/admin/taskhoster/item/?o={column('scheduled')}"),
        ("items search id", f"/admin/taskhoster/item/?q={sample['id']}"),
        ("items search key", f"/admin/taskhoster/item/?q={sample['key']}"),
        ("items search threadId", f"/admin/taskhoster/item/?q={sample['thread']}"),
        ("queues", "/admin/taskhoster/queue/"),
        ("threads", "/admin/taskhoster/thread/"),
        ("overview", "/admin/taskhoster/queue/overview/"),
        ("overview, live redraw", "/admin/taskhoster/queue/overview/", LIVE),
        ("queue page", f"/admin/taskhoster/queue/{q}/change/"),
        ("queue page, live redraw", f"/admin/taskhoster/queue/{q}/change/", LIVE),
        ("item page (processing)", f"/admin/taskhoster/item/{sample['processing']}/change/"),
        (
            "item page, live redraw",
            f"/admin/taskhoster/item/{sample['processing']}/change/",
            LIVE,
        ),
        ("items in flight", "/admin/taskhoster/item/processing/"),
        ("items in flight, live redraw", "/admin/taskhoster/item/processing/", LIVE),
        ("items in flight ?queue", "/admin/taskhoster/item/processing/?queue=emails", LIVE),
        ("workers", "/admin/taskhoster/workersocket/"),
        ("workers, live redraw", "/admin/taskhoster/workersocket/", LIVE),
        (
            "items ?status=failed&error",
            f"/admin/taskhoster/item/?status__exact=failed&queue__id__exact={q}&error=boom",
        ),
        (
            "cancel matching: confirm page",
            f"/admin/taskhoster/item/cancel-matching/?queue__id__exact={q}&status__exact=pending",
        ),
        (
            "restart matching: confirm page",
            f"/admin/taskhoster/item/restart-matching/?queue__id__exact={q}&error=boom",
        ),
    ]
    print(f"{'page':34} {'median ms':>10} {'max ms':>8}")
    for name, url, *headers in pages:
        extra = headers[0] if headers else {}
        response = client.get(url, **extra)
        assert response.status_code == 200, (url, response.status_code)
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            response = client.get(url, **extra)
            times.append((time.perf_counter() - t0) * 1000)
            assert response.status_code == 200
        print(f"{name:34} {statistics.median(times):10.1f} {max(times):8.1f}")


if __name__ == "__main__":
    main()
