"""Taskhoster added to someone else's Django project (``tests/hostproject``, the project
``docs/embedding.md`` is made of): its own app and admin, Taskhoster under ``/tasks/``, no
``REST_FRAMEWORK`` settings, Django's plain ASGI handler.

One daphne serves the host project for the module, on a database of its own (a SQLite file,
or a PostgreSQL database made for the run when ``DATABASE_URL`` names PostgreSQL), migrated
and given a key by the commands the docs page shows, with the page's sweep running beside it.
"""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from django.conf import settings

from taskhoster.client import AsyncProducer, Job, Worker

from ..conftest import REPO, PortTaken, daphne_listens, free_port
from . import wsclient

pytestmark = pytest.mark.slow

HOST = REPO / "tests" / "hostproject"
DOC = REPO / "docs" / "embedding.md"
SETTINGS_MODULE = "tests.hostproject.settings"

# The commands of the page's "run" blocks, each run by this module (by the line's start).
MIGRATE = "python manage.py migrate"
CREATEKEY = "python manage.py createkey"
CHECK = "python manage.py check"
SWEEP = "python manage.py sweep --every"
SERVE = "daphne "
DOC_COMMANDS = (MIGRATE, CREATEKEY, CHECK, SWEEP, SERVE)


# -- the docs page ---------------------------------------------------------------------------


@dataclass
class Block:
    marker: str  # the HTML comment before the fence: a file, or "run in tests/hostproject"
    text: str
    line: int


def doc_blocks() -> list[Block]:
    """Every fenced block of the page, with the marker comment on the line before it."""
    blocks = []
    lines = DOC.read_text().splitlines()
    n = 0
    while n < len(lines):
        if lines[n].startswith("```"):
            start = n
            n += 1
            while not lines[n].startswith("```"):
                n += 1
            before = next((line for line in reversed(lines[:start]) if line.strip()), "")
            marker = re.fullmatch(r"<!-- (.+) -->", before.strip())
            blocks.append(
                Block(
                    marker=marker.group(1) if marker else "",
                    text="\n".join(lines[start + 1 : n]),
                    line=start + 1,
                )
            )
        n += 1
    return blocks


def run_lines() -> list[str]:
    return [
        line.strip()
        for block in doc_blocks()
        if block.marker == "run in tests/hostproject"
        for line in block.text.splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]


def doc_command(start: str) -> list[str]:
    """The page's command that begins with ``start``, as arguments to run in ``HOST``."""
    (line,) = [line for line in run_lines() if line.startswith(start)]
    words = shlex.split(line)
    if words[0] == "python":
        return [sys.executable, *words[1:]]
    assert words[0] == "daphne", line
    return [sys.executable, "-m", "daphne", *words[1:]]


def test_every_code_block_of_the_docs_page_is_in_the_test_project_or_run_by_this_test() -> None:
    blocks = doc_blocks()
    assert blocks
    for block in blocks:
        where = f"docs/embedding.md line {block.line}"
        if block.marker == "run in tests/hostproject":
            for line in block.text.splitlines():
                if line.strip() and not line.strip().startswith("#"):
                    assert line.strip().startswith(DOC_COMMANDS), f"{where}: not run: {line}"
            continue
        assert block.marker.startswith("tests/hostproject/"), f"{where}: no file named"
        source = "\n".join(line.rstrip() for line in (REPO / block.marker).read_text().splitlines())
        text = "\n".join(line.rstrip() for line in block.text.splitlines())
        assert text in source, f"{where} is not in {block.marker}"
    for start in DOC_COMMANDS:
        doc_command(start)  # each one, exactly once


def test_the_docs_page_leaves_the_settings_table_to_the_configuration_page() -> None:
    """One table of the settings (docs/configuration.md, held to ``taskhoster.conf`` by its
    own test): this page links it rather than keeping a copy that could drift."""
    text = DOC.read_text()
    assert "(configuration.md)" in text
    assert not re.search(r"^\| `MAX_[A-Z_]+` \|", text, re.MULTILINE)


# -- the host project, served ----------------------------------------------------------------


@dataclass
class Host:
    url: str
    env: dict[str, str]
    key: str
    sweep_log: Path

    def manage(self, command: list[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            command, cwd=HOST, env=self.env, capture_output=True, text=True, timeout=120
        )

    def api(self) -> httpx.Client:
        return httpx.Client(
            base_url=f"{self.url}/tasks/api",
            headers={"Authorization": f"Token {self.key}"},
            timeout=30,
        )


@pytest.fixture(scope="module")
def host_database(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A database of the host project's own: like the suite's (SQLite or PostgreSQL)."""
    db = settings.DATABASES["default"]
    if "sqlite" in str(db["ENGINE"]):
        yield f"sqlite:///{tmp_path_factory.mktemp('hostdb') / 'host.sqlite3'}"
        return
    import psycopg

    name = f"{os.environ.get('TASKHOSTER_TEST_DB') or 'test_taskhoster'}_host_{os.getpid()}"
    server: dict[str, Any] = {
        "host": db.get("HOST") or "127.0.0.1",
        "port": db.get("PORT") or 5432,
        "user": db.get("USER") or "postgres",
        "password": db.get("PASSWORD") or None,
    }
    with psycopg.connect(dbname="postgres", autocommit=True, **server) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.execute(f'CREATE DATABASE "{name}"')
    password = f":{server['password']}" if server["password"] else ""
    yield f"postgres://{server['user']}{password}@{server['host']}:{server['port']}/{name}"
    with psycopg.connect(dbname="postgres", autocommit=True, **server) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _stop(proc: subprocess.Popen[bytes]) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
            raise
    return proc.returncode


def start_server(env: dict[str, str], log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """The page's daphne command on a free port, once ``healthz`` answers 200 (on another
    port if another process took the chosen one first)."""
    for attempt in range(5):
        try:
            return _start_server(env, log)
        except PortTaken:
            if attempt == 4:
                raise
    raise AssertionError("unreachable")


def _start_server(env: dict[str, str], log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    serve = doc_command(SERVE)
    serve = [*serve[:-1], "-b", "127.0.0.1", "-p", str(port), serve[-1]]
    with open(log, "ab") as out:
        start = out.tell()
        daphne = subprocess.Popen(serve, cwd=HOST, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        if time.monotonic() > deadline:
            _stop(daphne)
            raise RuntimeError("the host project did not start")
        if not daphne_listens(daphne, log, start, port):
            time.sleep(0.05)  # an answer on the port before daphne listens is another's
            continue
        try:
            if httpx.get(f"{url}/tasks/healthz", timeout=5).status_code == 200:
                return daphne, url
        except httpx.HTTPError:
            pass
        time.sleep(0.1)


@pytest.fixture(scope="module")
def host(host_database: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Host]:
    """The host project served by daphne as the page says, its sweep running beside it."""
    tmp = tmp_path_factory.mktemp("hostproject")
    root = tmp / "state"
    root.mkdir()  # the page: make the state root before serving
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": SETTINGS_MODULE,
        "PYTHONPATH": str(REPO),
        "DATABASE_URL": host_database,
        "TASKHOSTER_ROOT": str(root),
        "DJANGO_SUPERUSER_PASSWORD": "host-admin-password",
        "DJANGO_SUPERUSER_EMAIL": "admin@example.com",
    }
    host = Host(url="", env=env, key="", sweep_log=tmp / "sweep.log")
    migrated = host.manage(doc_command(MIGRATE))
    assert migrated.returncode == 0, migrated.stderr
    created = host.manage(doc_command(CREATEKEY))
    assert created.returncode == 0, created.stderr
    host.key = created.stdout.strip()
    admin = host.manage(
        [sys.executable, "manage.py", "createsuperuser", "--noinput", "--username", "admin"]
    )
    assert admin.returncode == 0, admin.stderr

    with open(host.sweep_log, "wb") as sweep_log:
        sweep = subprocess.Popen(
            doc_command(SWEEP),
            cwd=HOST,
            env={**env, "PYTHONUNBUFFERED": "1"},  # its reports reach the log as they are made
            stdout=sweep_log,
            stderr=subprocess.STDOUT,
        )
    try:
        daphne, host.url = start_server(env, tmp / "daphne.log")
        try:
            yield host
        finally:
            daphne_stopped = _stop(daphne)
    finally:
        sweep_stopped = _stop(sweep)
    assert sweep_stopped == 0, host.sweep_log.read_text()[-3000:]
    assert daphne_stopped == 0, (tmp / "daphne.log").read_text()[-3000:]


@pytest.fixture(scope="module")
def drf_host(host: Host, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Host]:
    """The same project (its database, state root and key), served with its own
    ``REST_FRAMEWORK`` and ``SPECTACULAR_SETTINGS`` and a DRF view of its own."""
    env = {**host.env, "DJANGO_SETTINGS_MODULE": "tests.hostproject.settings_drf"}
    log = tmp_path_factory.mktemp("hostproject-drf") / "daphne.log"
    daphne, url = start_server(env, log)
    try:
        yield Host(url=url, env=env, key=host.key, sweep_log=host.sweep_log)
    finally:
        stopped = _stop(daphne)
    assert stopped == 0, log.read_text()[-3000:]


def assert_envelope(response: httpx.Response, status: int, code: str | None = None) -> None:
    """Our error envelope, ``{"error": {"code", "message"}}``, with ``status`` (and ``code``)."""
    assert response.status_code == status, response.text
    assert response.headers["Content-Type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"code", "message"}, body
    assert body["error"]["code"], body
    if code is not None:
        assert body["error"]["code"] == code, body
    assert isinstance(body["error"]["message"], str)
    assert body["error"]["message"]


def test_the_host_project_runs_on_the_suites_database_and_bus(host: Host) -> None:
    key = {"Authorization": f"Token {host.key}"}  # (the details are for callers with a key)
    health = httpx.get(f"{host.url}/tasks/healthz", headers=key, timeout=10).json()
    vendor = "sqlite" if "sqlite" in str(settings.DATABASES["default"]["ENGINE"]) else "postgresql"
    assert health["database"]["vendor"] == vendor
    assert health["bus"]["kind"] == ("redis" if os.environ.get("REDIS_URL") else "doorbell")


def test_a_call_without_a_key_answers_the_401_envelope_not_drfs_403(host: Host) -> None:
    response = httpx.get(f"{host.url}/tasks/api/queues", timeout=10)
    assert_envelope(response, 401, "unauthorized")
    assert response.headers["WWW-Authenticate"] == "Token"
    wrong = httpx.get(
        f"{host.url}/tasks/api/queues", headers={"Authorization": "Token nope"}, timeout=10
    )
    assert_envelope(wrong, 401, "unauthorized")


def test_a_post_and_a_read_with_a_key_under_the_prefix(host: Host) -> None:
    with host.api() as api:
        assert api.put("/queues/mail", json={"leaseSeconds": 30}).status_code in (200, 201)
        posted = api.post("/queues/mail/items", json={"payload": {"to": "ada"}, "key": "k1"})
        assert posted.status_code == 201, posted.text
        read = api.get(f"/items/{posted.json()['id']}")
    assert read.status_code == 200, read.text
    assert read.json()["payload"] == {"to": "ada"}
    assert read.json()["status"] == "pending"


def test_a_hosts_request_transactions_do_not_hold_our_long_poll_against_a_post(
    host: Host,
) -> None:
    """The host sets ATOMIC_REQUESTS: a claim waiting in a request-wide transaction would
    hold the index (on SQLite, its write lock) until it answered, and the post it waits
    for could only commit after it gave up."""
    with host.api() as api:
        api.put("/queues/atomic", json={})
    claimed: list[httpx.Response] = []

    def wait_for_one() -> None:
        with host.api() as api:
            claimed.append(api.post("/queues/atomic/claim", json={"max": 1, "wait": 30}))

    waiter = threading.Thread(target=wait_for_one)
    waiter.start()
    time.sleep(0.5)  # the claim is waiting
    with host.api() as api:
        started = time.monotonic()
        posted = api.post("/queues/atomic/items", json={"payload": "now"})
        took = time.monotonic() - started
    waiter.join(40)
    assert posted.status_code == 201, posted.text
    # (had it waited for the long-poll's transaction, it would have waited its 30 s)
    assert took < 15, f"the post waited {took:.1f} s for the long-poll's transaction"
    assert [i["id"] for i in claimed[0].json()["items"]] == [posted.json()["id"]]


def test_bad_input_answers_the_envelope_in_the_host_too(host: Host) -> None:
    with host.api() as api:
        api.put("/queues/strict", json={})
        malformed = api.post(
            "/queues/strict/items", content=b"{", headers={"Content-Type": "application/json"}
        )
        assert_envelope(malformed, 400)
        assert_envelope(api.post("/queues/strict/items", json={"payload": 1, "x": 2}), 400)
        assert_envelope(api.post("/queues/strict/items", content=b"x=1"), 415)
        assert api.get("/queues/strict").json()["counts"]["pending"] == 0


def test_an_unknown_path_under_the_api_answers_the_json_404_and_the_rest_is_the_hosts(
    host: Host,
) -> None:
    for method in ("GET", "POST", "DELETE"):
        response = httpx.request(method, f"{host.url}/tasks/api/nothing/here", timeout=10)
        assert_envelope(response, 404, "not_found")
    # Outside the app's api/: the host's own 404 (Django's page), and the host's own views.
    outside = httpx.get(f"{host.url}/tasks/nothing", timeout=10)
    assert outside.status_code == 404
    assert outside.headers["Content-Type"].startswith("text/html")
    assert httpx.get(f"{host.url}/shop/", timeout=10).text.startswith("Products:")


def test_the_schema_has_taskhosters_operations_under_the_hosts_prefix(host: Host) -> None:
    response = httpx.get(f"{host.url}/tasks/api/schema?format=json", timeout=30)
    assert response.status_code == 200, response.text
    schema = response.json()
    assert schema["info"]["title"] == "Taskhoster API"
    assert "/tasks/api/queues/{queue}/items" in schema["paths"]
    assert all(path.startswith("/tasks/") for path in schema["paths"])
    assert "Item" in schema["components"]["schemas"]  # our post-processing hook ran


def test_a_worker_on_the_prefixed_socket_gets_an_item_and_finishes_it(host: Host) -> None:
    with host.api() as api:
        api.put("/queues/sock", json={})
        item_id = api.post("/queues/sock/items", json={"payload": {"n": 1}}).json()["id"]

    async def work() -> None:
        ws = await wsclient.connect(SimpleNamespace(url=f"{host.url}/tasks"), host.key)
        try:
            await wsclient.send(ws, {"type": "subscribe", "queues": ["sock"], "capacity": 1})
            item = await wsclient.recv(ws, timeout=10)
            assert (item["type"], item["id"]) == ("item", item_id)
            await wsclient.send(
                ws, {"type": "result", "id": item_id, "result": {"ok": 1}, "lease": item["lease"]}
            )
            ack = await wsclient.recv(ws, timeout=10)
            assert (ack["type"], ack["accepted"], ack["status"]) == ("ack", True, "finished")
        finally:
            await ws.close()

    asyncio.run(work())
    with host.api() as api:
        done = api.get(f"/items/{item_id}").json()
    assert (done["status"], done["result"]) == ("finished", {"ok": 1})


def test_the_python_client_takes_the_prefixed_address_for_rest_and_socket(host: Host) -> None:
    base = f"{host.url}/tasks"
    worker = Worker(base, host.key)

    @worker.handler("client")
    async def shout(job: Job) -> str:
        return str(job.payload).upper()

    async def main() -> None:
        async with AsyncProducer(base, host.key) as producer:
            await producer.put_queue("client")
            task = asyncio.create_task(worker.serve())
            try:
                item = await producer.post("client", "hello")
                assert await producer.result(item.id, timeout=20) == "HELLO"
            finally:
                worker.stop()
                await asyncio.wait_for(task, 15)

    asyncio.run(main())


def test_the_sweep_beside_the_host_project_requeues_a_lapsed_lease(host: Host) -> None:
    with host.api() as api:
        api.put("/queues/lapse", json={"leaseSeconds": 0.5})
        item_id = api.post("/queues/lapse/items", json={"payload": 1}).json()["id"]
        claimed = api.post("/queues/lapse/claim", json={"max": 1})
        assert claimed.status_code == 200, claimed.text
        assert [i["id"] for i in claimed.json()["items"]] == [item_id]
        deadline = time.monotonic() + 15
        while api.get(f"/items/{item_id}").json()["status"] != "pending":
            assert time.monotonic() < deadline, host.sweep_log.read_text()[-2000:]
            time.sleep(0.1)
    # The sweep says so (only a sweep re-queues a lapsed lease; the server runs none).
    deadline = time.monotonic() + 5
    while "lapsed lease(s) re-queued" not in host.sweep_log.read_text():
        assert time.monotonic() < deadline, host.sweep_log.read_text()[-2000:]
        time.sleep(0.1)


def test_manage_check_passes_for_the_host_project(host: Host) -> None:
    checked = host.manage(doc_command(CHECK))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "no issues" in checked.stdout


def test_the_host_projects_models_and_ours_need_no_new_migration(host: Host) -> None:
    result = host.manage([sys.executable, "manage.py", "makemigrations", "--check", "--dry-run"])
    assert result.returncode == 0, result.stdout + result.stderr


# -- a host with DRF defaults of its own -----------------------------------------------------


def test_the_hosts_drf_defaults_rule_its_own_views_only(drf_host: Host) -> None:
    # Their view: sessions and staff only, as their REST_FRAMEWORK says.
    theirs = httpx.get(f"{drf_host.url}/shop/api/products", timeout=10)
    assert theirs.status_code == 403
    # Ours, again and again (their anonymous throttle allows one a day): our 401 envelope.
    for _ in range(3):
        response = httpx.get(f"{drf_host.url}/tasks/api/queues", timeout=10)
        assert_envelope(response, 401, "unauthorized")


def test_our_views_parse_render_and_fail_as_ever_beside_the_hosts_drf_defaults(
    drf_host: Host,
) -> None:
    with drf_host.api() as api:
        assert api.put("/queues/drf", json={}).status_code in (200, 201)
        posted = api.post("/queues/drf/items", json={"payload": {"name": "Zoë"}})
        assert posted.status_code == 201, posted.text  # JSON, not their forms only
        read = api.get(f"/items/{posted.json()['id']}")
        json_type = {"Content-Type": "application/json"}
        assert_envelope(api.post("/queues/drf/items", content=b"{", headers=json_type), 400)
        assert_envelope(api.get("/queues/no such"), 400)
    # DRF's default JSON: compact and UTF-8, not their pretty ASCII.
    assert read.headers["Content-Type"] == "application/json"
    assert '"payload":{"name":"Zoë"}' in read.content.decode()
    assert_envelope(httpx.post(f"{drf_host.url}/tasks/api/nothing", timeout=10), 404)


def test_our_schema_ignores_the_hosts_spectacular_settings_and_drf_views(drf_host: Host) -> None:
    response = httpx.get(f"{drf_host.url}/tasks/api/schema?format=json", timeout=30)
    assert response.status_code == 200, response.text
    schema = response.json()
    assert schema["info"]["title"] == "Taskhoster API"
    assert "Item" in schema["components"]["schemas"]
    assert "PostItem" in schema["components"]["schemas"]  # COMPONENT_SPLIT_REQUEST, ours
    assert "/shop/api/products" not in schema["paths"]
    assert all(path.startswith("/tasks/") for path in schema["paths"])


# -- the admin -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def staff(host: Host) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=host.url, timeout=30) as client:
        client.get("/admin/login/")
        login = client.post(
            "/admin/login/?next=/admin/",
            data={
                "username": "admin",
                "password": host.env["DJANGO_SUPERUSER_PASSWORD"],
                "csrfmiddlewaretoken": client.cookies["csrftoken"],
                "next": "/admin/",
            },
        )
        assert login.status_code == 302, login.text[-2000:]
        yield client


def test_the_admin_serves_the_host_apps_model_beside_taskhosters_pages(
    host: Host, staff: httpx.Client
) -> None:
    added = staff.post(
        "/admin/shop/product/add/",
        data={
            "name": "Teapot",
            "price_cents": "1200",
            "csrfmiddlewaretoken": staff.cookies["csrftoken"],
        },
    )
    assert added.status_code == 302, added.text[-2000:]
    assert "Teapot" in staff.get("/admin/shop/product/").text
    with host.api() as api:
        api.put("/queues/seen", json={})
        item_id = api.post("/queues/seen/items", json={"payload": 1}).json()["id"]
    items = staff.get("/admin/taskhoster/item/")
    assert items.status_code == 200
    assert item_id in items.text
    overview = staff.get("/admin/taskhoster/queue/overview/")
    assert overview.status_code == 200
    assert 'id="th-queues"' in overview.text
    assert "seen" in overview.text


def test_the_hosts_admin_keeps_its_own_header_and_index_and_links_our_overview(
    staff: httpx.Client,
) -> None:
    index = staff.get("/admin/").text
    assert '<a href="/admin/">Django administration</a>' in index
    assert "Taskhoster admin" not in index
    assert "th-overview-link" not in index  # our project's index override is not the app's
    assert 'href="/admin/shop/"' in index
    assert 'href="/admin/taskhoster/"' in index
    app_index = staff.get("/admin/taskhoster/").text
    assert 'id="th-overview-link"' in app_index
    assert 'href="/admin/taskhoster/queue/overview/"' in app_index
