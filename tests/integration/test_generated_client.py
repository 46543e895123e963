"""A client generated from ``/api/schema`` by a standard generator drives a real server.

If the schema says less (or otherwise) than the server does, the generated client cannot
build the request or parse the answer, and this fails. The generated code is made in a
temporary directory for each run, never committed.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import types
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow

PACKAGE = "taskhoster_api_client"


@pytest.fixture
def generated(server_factory, tmp_path):
    server = server_factory()
    schema = httpx.get(f"{server.url}/api/schema?format=json", timeout=30)
    assert schema.status_code == 200
    path = tmp_path / "schema.json"
    path.write_bytes(schema.content)
    bin_dir = Path(sys.executable).parent
    done = subprocess.run(
        [
            str(bin_dir / "openapi-python-client"),
            "generate",
            "--path",
            str(path),
            "--meta",
            "none",
            "--output-path",
            str(tmp_path / PACKAGE),
        ],
        cwd=tmp_path,
        env={**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Warning" not in done.stdout, done.stdout
    sys.path.insert(0, str(tmp_path))
    try:
        yield server, importlib.import_module(PACKAGE)
    finally:
        sys.path.remove(str(tmp_path))
        for name in [m for m in sys.modules if m == PACKAGE or m.startswith(f"{PACKAGE}.")]:
            del sys.modules[name]


def test_a_client_generated_from_the_schema_drives_an_item_through_its_life(generated, make_key):
    server, client_package = generated
    models = importlib.import_module(f"{PACKAGE}.models")
    api = types.SimpleNamespace()
    for module in (
        "queues.put_queue",
        "queues.get_queue",
        "items.post_items",
        "items.get_item",
        "items.list_items",
        "work.claim_items",
        "work.extend_lease",
        "work.submit_result",
        "work.fail_item",
    ):
        name = module.split(".")[1]
        setattr(api, name, importlib.import_module(f"{PACKAGE}.api.{module}"))
    client = client_package.AuthenticatedClient(
        base_url=server.url, token=make_key(), prefix="Token", raise_on_unexpected_status=True
    )
    with client:
        queue = api.put_queue.sync(
            "jobs", client=client, body=models.QueueSettings(lease_seconds=30)
        )
        assert isinstance(queue, models.Queue)
        assert (queue.name, queue.lease_seconds) == ("jobs", 30)

        posted = api.post_items.sync(
            "jobs", client=client, body=models.PostItem(payload={"n": 1}, thread_id="t-1")
        )
        assert isinstance(posted, models.Item)
        assert posted.status == models.ItemStatus.PENDING

        claimed = api.claim_items.sync("jobs", client=client, body=models.Claim(max_=1))
        assert isinstance(claimed, models.Claimed)
        [held] = claimed.items
        assert (held.id, held.payload, held.attempts) == (posted.id, {"n": 1}, 1)

        extended = api.extend_lease.sync(
            held.id, client=client, body=models.Extend(lease=held.lease, seconds=10)
        )
        assert isinstance(extended, models.Extended)
        assert extended.accepted is True
        assert extended.lease_expires_at is not None

        verdict = api.submit_result.sync(
            held.id, client=client, body=models.Result(result={"ok": True})
        )
        assert isinstance(verdict, models.Verdict)
        assert (verdict.accepted, verdict.status) == (True, models.VerdictStatus.FINISHED)

        item = api.get_item.sync(held.id, client=client)
        assert isinstance(item, models.Item)
        assert (item.status, item.result, item.thread_id) == (
            models.ItemStatus.FINISHED,
            {"ok": True},
            "t-1",
        )

        second = api.post_items.sync("jobs", client=client, body=models.PostItem(payload=2))
        [held] = api.claim_items.sync("jobs", client=client, body=models.Claim()).items
        assert held.id == second.id
        failed = api.fail_item.sync(
            held.id,
            client=client,
            body=models.Fail(lease=held.lease, error="no luck", retry=False),
        )
        assert (failed.accepted, failed.status) == (True, models.VerdictStatus.FAILED)

        page = api.list_items.sync("jobs", client=client, limit=10)
        assert isinstance(page, models.ItemPage)
        assert [(i.id, i.status) for i in page.items] == [
            (posted.id, models.ItemStatus.FINISHED),
            (second.id, models.ItemStatus.FAILED),
        ]
        assert page.next_ is None

        missing = api.get_queue.sync("no-such-queue", client=client)
        assert isinstance(missing, models.Error)
        assert missing.error.code == "queue_not_found"
