"""PostgreSQL behind a connection pooler in transaction mode (Debian's PgBouncer, 1.18 here:
before 1.21, which carries prepared statements from one client to the next).

Such a pooler runs each transaction of a client in whichever of its server connections is
free. A statement the client prepared on one (psycopg names them ``_pg3_0``, ``_pg3_1``, ...
per client connection) is missing on the next, or another client's statement goes by that
name there: the server's groups failed (``bind message supplies 1 parameters, but prepared
statement "_pg3_0" requires 4``), its requests were answered 503, and a statement of
another client with as many parameters could have run with this one's values. The operator
is told to set ``TASKHOSTER_DB_PREPARE=0``; here the server is not told, and finds out: a
connection whose server process is not the one it was told of when it connected keeps
nothing prepared (``taskhoster.db.postgresql.base.direct``).
"""

from __future__ import annotations

import asyncio
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx
import psycopg
import pytest

from taskhoster.db.postgresql.base import direct

from ..conftest import Server, database_url, free_port, needs_postgresql, stop_process
from .wsclient import connect, recv, send, subscribe

pytestmark = [pytest.mark.slow, needs_postgresql("a PostgreSQL connection pooler")]

PGBOUNCER = shutil.which("pgbouncer") or (
    "/usr/sbin/pgbouncer" if os.access("/usr/sbin/pgbouncer", os.X_OK) else None
)
ROUNDS = 40  # each posted, pushed and finished: the engine's statements run many times over
WARNING = "is reached through a connection pooler or a proxy"


def _unprivileged_user() -> str:
    """PgBouncer refuses to run as root: it is given a user to switch to."""
    for name in ("postgres", "nobody"):
        try:
            pwd.getpwnam(name)
        except KeyError:
            continue
        return name
    raise RuntimeError("no user for PgBouncer to run as")


@pytest.fixture
def pooled_url() -> Iterator[str]:
    """The test database's URL through a PgBouncer of its own in transaction mode, which
    hands each transaction to the next of its three server connections in turn
    (``server_round_robin``)."""
    if PGBOUNCER is None:
        pytest.skip("needs Debian's pgbouncer (scripts/test installs it, as root)")
    url = urlsplit(database_url())
    port = free_port()
    # Not under pytest's directory (private to its user): PgBouncer may run as another.
    where = Path(tempfile.mkdtemp(prefix="taskhoster-pgbouncer-"))
    where.chmod(0o755)
    user, password = url.username or "postgres", url.password or ""
    (where / "users.txt").write_text(f'"{user}" "{password}"\n')
    (where / "users.txt").chmod(0o600)
    # (PgBouncer logs in to PostgreSQL with the password the test database's URL has.)
    login = f" password={password}" if password else ""
    (where / "pgbouncer.ini").write_text(
        "[databases]\n"
        f"* = host={url.hostname or '127.0.0.1'} port={url.port or 5432}{login}\n"
        "[pgbouncer]\n"
        "listen_addr = 127.0.0.1\n"
        f"listen_port = {port}\n"
        "unix_socket_dir =\n"
        "auth_type = trust\n"
        f"auth_file = {where / 'users.txt'}\n"
        "pool_mode = transaction\n"
        "default_pool_size = 3\n"
        "min_pool_size = 3\n"  # three server connections from the first client on
        "server_round_robin = 1\n"
        "max_client_conn = 200\n"
        # The server's own settings come as the startup option ``options``, which PgBouncer
        # refuses unless told to pass over it (docs/deploy.md: set them on the role).
        "ignore_startup_parameters = extra_float_digits,options\n"
        f"logfile = {where / 'pgbouncer.log'}\n"
    )
    command = [PGBOUNCER, str(where / "pgbouncer.ini")]
    if os.geteuid() == 0:
        runs_as = _unprivileged_user()
        shutil.chown(where, runs_as)
        for name in ("users.txt", "pgbouncer.ini"):
            shutil.chown(where / name, runs_as)
        command[1:1] = ["-u", runs_as]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 20
        while True:
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                said = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                log = where / "pgbouncer.log"
                said += log.read_text(errors="replace") if log.exists() else ""
                raise RuntimeError(f"PgBouncer did not start: {said[-2000:]}")
            time.sleep(0.05)
        secret = f":{password}" if password else ""
        pooled = urlunsplit(url._replace(netloc=f"{user}{secret}@127.0.0.1:{port}"))
        # Three transactions at once: the pooler's three server connections are made now,
        # and transactions go round them from the first.
        at_once = [psycopg.connect(pooled) for _ in range(3)]
        for client in at_once:
            client.execute("SELECT 1")  # (its transaction holds a server connection)
        for client in at_once:
            client.close()
        yield pooled
    finally:
        stop_process(proc)
        if proc.stderr:
            proc.stderr.close()
        shutil.rmtree(where, ignore_errors=True)


def test_a_connection_is_direct_to_postgresql_and_not_through_a_pooler(pooled_url) -> None:
    """The test's own database is reached directly: the server process that answers is the
    one the connection was told of. Through the pooler it is not."""
    with psycopg.connect(database_url(), autocommit=True) as straight:
        assert direct(straight)
    with psycopg.connect(pooled_url, autocommit=True) as pooled:
        assert not direct(pooled)


@pytest.mark.parametrize("pool", ["1", "0"], ids=["pooled", "a-connection-a-request"])
def test_a_server_behind_a_transaction_pooler_keeps_nothing_prepared_and_does_its_work(
    pooled_url, server_factory, make_key, pool
) -> None:
    """A server whose DATABASE_URL is a pooler in transaction mode, left to prepare its
    statements (``TASKHOSTER_DB_PREPARE=1``): every item is posted, pushed to the worker
    and finished, and the server says in its log why it keeps nothing prepared. With its
    own pool of connections (each looked at as the pool makes it) and without
    (``TASKHOSTER_DB_POOL=0``: each looked at as Django makes it)."""
    key = make_key()
    server = server_factory(
        DATABASE_URL=pooled_url, TASKHOSTER_DB_PREPARE="1", TASKHOSTER_DB_POOL=pool
    )
    finish_rounds(server, key, ROUNDS)
    said = server.log.read_text(errors="replace")
    assert WARNING in said
    assert "prepared statement" not in said, said[-3000:]


def finish_rounds(server: Server, key: str, rounds: int) -> None:
    """``rounds`` items, each posted, pushed to one socket and finished with a result."""

    async def run() -> None:
        async with httpx.AsyncClient(
            base_url=server.url, headers={"Authorization": f"Token {key}"}, timeout=30
        ) as http:
            answer = await http.put("/api/queues/pooled", json={})
            assert answer.status_code in (200, 201), answer.text
            ws = await connect(server, key)
            await subscribe(ws, ["pooled"], 1)
            for n in range(rounds):
                answer = await http.post("/api/queues/pooled/items", json={"payload": n})
                assert answer.status_code == 201, (n, answer.status_code, answer.text)
                frame = await recv(ws, timeout=30)
                assert frame["type"] == "item", (n, frame)
                await send(ws, {"type": "result", "id": frame["id"], "result": {"n": n}})
                ack = await recv(ws, timeout=30)
                assert (ack.get("type"), ack.get("id"), ack.get("accepted")) == (
                    "ack",
                    frame["id"],
                    True,
                ), (n, ack)
            answer = await http.get("/api/queues/pooled")
            assert dict(answer.json()["counts"]).get("finished") == rounds, answer.text
            await ws.close()

    asyncio.run(run())
