"""A backup restored: the database's copy older than the state root's (README, "Operating
it"). The items are their files; the database indexes them. Restored from a dump taken
before some work was done, and repaired, the index holds that work again: an item finished
since the dump is finished, with its result; one posted since is there; one claimed since is
pending again, its claim forgotten (a claim writes nothing to the file).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.django_db(transaction=True)

KEPT = [
    f"taskhoster.{model}"
    for model in (
        "installation",
        "apikey",
        "queue",
        "thread",
        "item",
        "schedule",
        "queuecount",
        "claimstart",
    )
]


def test_a_database_restored_from_an_older_backup_is_brought_up_to_the_files_by_repair(
    server_factory: Any, manage: Any, make_key: Any, tmp_path: Path
) -> None:
    key = make_key()
    headers = {"Authorization": f"Token {key}"}
    server = server_factory()
    with httpx.Client(base_url=server.url, headers=headers, timeout=10) as http:
        assert http.put("/api/queues/q", json={"leaseSeconds": 300}).status_code == 201
        ids = [http.post("/api/queues/q/items", json={"payload": n}).json()["id"] for n in range(3)]
        dump = tmp_path / "backup.json"
        # What a restore needs (not the processes' own rows, counters and sockets, which
        # any process, this test's included, may write meanwhile).
        manage("dumpdata", *KEPT, "-o", str(dump))
        # Work done after the backup: the first item finished, the second claimed, a fourth
        # posted.
        claimed = http.post("/api/queues/q/claim", json={"max": 2}).json()["items"]
        assert [i["id"] for i in claimed] == ids[:2], claimed
        taken = http.post(f"/api/items/{ids[0]}/result", json={"result": "r0"})
        assert taken.json()["accepted"] is True, taken.text[:300]
        ids.append(http.post("/api/queues/q/items", json={"payload": 3}).json()["id"])
    server.stop()

    manage("flush", "--no-input")  # the database as the backup left it
    loaded = manage("loaddata", str(dump), check=False)
    assert loaded.returncode == 0, loaded.stderr[-600:]
    repaired = manage("sweep", "--repair", "--grace", "0")
    # The item posted since is indexed again, the one finished since corrected, the one
    # claimed since moved back to pending/ (and its row with it); none dropped.
    assert "1 row(s) added, 2 corrected, 0 removed" in repaired.stdout, repaired.stdout[-600:]

    server = server_factory()
    with httpx.Client(base_url=server.url, headers=headers, timeout=10) as http:
        found = {i: http.get(f"/api/items/{i}").json() for i in ids}
        assert [found[i]["status"] for i in ids] == ["finished", "pending", "pending", "pending"]
        assert found[ids[0]]["result"] == "r0"
        assert [found[i]["payload"] for i in ids] == [0, 1, 2, 3]
        # A claim writes nothing to the item's file: one made since the backup is forgotten,
        # as a claim that never committed would be (its attempt not counted).
        assert found[ids[1]]["attempts"] == 0, found[ids[1]]
        counts = http.get("/api/queues/q").json()["counts"]
        assert (counts["pending"], counts["finished"]) == (3, 1), counts
