"""Overload and readiness, against a real daphne.

- **Admission control**: while work already accepted waits for the committer, a new post is
  refused at once (503 ``overloaded`` with ``Retry-After``) instead of queueing behind it; a
  refused post changes nothing. The committer is made to stall on purpose (the fault
  ``committer.slow_group``), and "at once" is proven by order, not by a clock: the refusal,
  and ``/healthz``, are answered while the accepted post is still waiting.
- **The Python client** resends a refused post after the server's ``Retry-After``, with the
  same idempotency key, and the post lands once.
- **Readiness**: ``/healthz`` answers 503 with the reason while the state root's free space
  or inodes are below ``MIN_FREE_BYTES`` / ``MIN_FREE_INODES``, or while it refuses writes (a
  real full filesystem: a small tmpfs), and ``/metrics`` exports its free space and inodes.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from taskhoster import engine
from taskhoster.client import Producer
from taskhoster.engine.process import PIPE_BYTES
from taskhoster.models import Item

from ..conftest import Server, free_port, python_in_project

pytestmark = pytest.mark.slow

STALL = "5"  # seconds each group of the stalled committer sleeps


@pytest.fixture
def headers(make_key) -> dict[str, str]:
    return {"Authorization": f"Token {make_key()}"}


def wait_for(predicate: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def children_of(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (any of its threads)."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            found += [int(c) for c in (task / "children").read_text().split()]
    return found


class Background:
    """A request sent from a thread of its own; ``answer`` once it is back."""

    def __init__(self, send: Any) -> None:
        self.answer: httpx.Response | None = None
        self.thread = threading.Thread(target=self._run, args=(send,), daemon=True)
        self.thread.start()

    def _run(self, send: Any) -> None:
        self.answer = send()

    def join(self) -> httpx.Response:
        self.thread.join(60)
        assert self.answer is not None
        return self.answer


def test_posts_are_refused_at_once_while_accepted_work_waits_for_the_committer(
    server_factory, headers
):
    engine.upsert_queue(name="q", body={})
    server = server_factory(
        TASKHOSTER_FAULT="committer.slow_group",
        TASKHOSTER_FAULT_SLOW_SECONDS=STALL,
        TASKHOSTER_ADMISSION_MAX_ITEMS="1",
    )
    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as http:
        accepted = Background(
            lambda: httpx.post(
                f"{server.url}/api/queues/q/items",
                json={"payload": "a"},
                headers=headers,
                timeout=60,
            )
        )

        wait_for(
            lambda: http.get("/healthz").json()["committer"]["waitingItems"] >= 1,
            30,
            "the first post to wait for the committer",
        )
        answer = http.post("/api/queues/q/items", json={"payload": "b", "key": "kb"})
        health = http.get("/healthz")
        assert accepted.answer is None, "the refusal came while the accepted post waited"
        assert answer.json()["error"]["code"] == "overloaded"
        assert int(answer.headers["Retry-After"]) >= 1
        assert health.status_code == 200, "readiness is not load: the process answers"
        assert health.json()["status"] == "ok"

        assert accepted.join().status_code == 201
    assert list(Item.objects.values_list("key", flat=True)) == [None], (
        "the refused post left nothing"
    )


def test_a_post_bigger_than_the_committers_pipe_does_not_hold_the_event_loop_while_a_group_stalls(
    server_factory, headers
):
    """The committer process reads its pipe between groups. A post answered on the event
    loop (a key the process knows) whose operation is bigger than the pipe holds, handed in
    while a group stalls, waits in the outbox for the committer; the loop goes on answering
    (``/healthz``) while the stalled group's post still waits, and both posts land."""
    engine.upsert_queue(name="q", body={})
    server = server_factory(
        TASKHOSTER_FAULT="committer.slow_group", TASKHOSTER_FAULT_SLOW_SECONDS="3"
    )
    url = f"{server.url}/api/queues/q/items"
    # Accepted once, the key is one the process knows: its posts are answered on the loop.
    assert (
        httpx.post(url, json={"payload": "known"}, headers=headers, timeout=60).status_code == 201
    )
    with httpx.Client(base_url=server.url, headers=headers, timeout=2) as http:
        stalled = Background(
            lambda: httpx.post(url, json={"payload": "a"}, headers=headers, timeout=60)
        )
        wait_for(
            lambda: http.get("/healthz").json()["committer"]["waitingItems"] >= 1,
            30,
            "the post to wait for the stalled group",
        )
        big = {"items": [{"payload": "x" * 1_000_000} for _ in range(3)]}  # 3 MB, past any pipe
        bigger = Background(lambda: httpx.post(url, json=big, headers=headers, timeout=60))
        wait_for(
            lambda: http.get("/healthz").json()["committer"]["waitingItems"] >= 4,
            30,
            "the big post to be handed to the committer",
        )
        health = http.get("/healthz")
        assert stalled.answer is None, "the loop answered while the stalled group's post waited"
        assert health.status_code == 200
        assert stalled.join().status_code == 201
        assert bigger.join().status_code == 201, bigger.join().text
    assert Item.objects.count() == 5


def test_the_committer_process_reads_a_pipe_that_holds_a_mebibyte(server_factory, headers):
    """The pipe to a committer process is widened to ``PIPE_BYTES`` (Linux's default is
    64 KiB), so a batch's frame handed in while a group runs goes over in one write and one
    read, not piece by piece through the outbox. Read off the live process: its standard
    input, opened again through ``/proc``, reports the pipe's size."""
    engine.upsert_queue(name="q", body={})
    server = server_factory()
    pid = httpx.get(f"{server.url}/healthz", headers=headers).json()["pid"]
    children = children_of(pid)
    assert len(children) == 1, children
    with open("/proc/sys/fs/pipe-max-size") as limit:
        expected = min(PIPE_BYTES, int(limit.read()))
    assert expected > 64 * 1024, "this machine's limit leaves the pipe at Linux's default"
    fd = os.open(f"/proc/{children[0]}/fd/0", os.O_RDONLY | os.O_NONBLOCK)
    try:
        assert fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ) == expected
    finally:
        os.close(fd)


def test_a_server_whose_committer_is_starting_is_not_ready_and_refuses_no_post_as_overload(
    server_factory, headers
):
    """A committer process takes a second or two to start (more on a loaded machine). Until
    the first one says it is ready the server process is not ready (``/healthz`` 503,
    ``committer.ready`` false), and the posts sent meanwhile wait for it: its start is no
    backlog, so none is refused as ``overloaded`` (the fault ``committer.slow_start`` holds it
    well past ``ADMISSION_WAIT_SECONDS``). One started again after a crash waits for no
    readiness: the process stays ready, and the post waits for the new committer."""
    engine.upsert_queue(name="q", body={})
    server = server_factory(
        healthy=False,
        TASKHOSTER_FAULT="committer.slow_start",
        TASKHOSTER_FAULT_SLOW_SECONDS=STALL,
        TASKHOSTER_ADMISSION_WAIT_SECONDS="0.5",
    )
    starting = httpx.get(f"{server.url}/healthz", headers=headers)
    assert starting.status_code == 503, "the committer holds its ready frame for 5 s"
    assert starting.json()["status"] == "unavailable"
    assert starting.json()["committer"]["ready"] is False
    assert httpx.get(f"{server.url}/healthz").json()["committer"] == {"ready": False}
    first = Background(
        lambda: httpx.post(
            f"{server.url}/api/queues/q/items", json={"payload": "a"}, headers=headers, timeout=60
        )
    )
    time.sleep(1.5)  # the first post has waited three times ADMISSION_WAIT_SECONDS
    second = httpx.post(
        f"{server.url}/api/queues/q/items", json={"payload": "b"}, headers=headers, timeout=60
    )
    assert second.status_code == 201, second.text
    assert first.join().status_code == 201
    ready = httpx.get(f"{server.url}/healthz", headers=headers)
    assert ready.status_code == 200
    assert ready.json()["committer"]["ready"] is True
    assert httpx.get(f"{server.url}/healthz").json()["committer"] == {"ready": True}

    # Its committer process ends (killed, as a crash would); the next post starts another,
    # and waits for it, while the process stays ready.
    pid = ready.json()["pid"]
    children = children_of(pid)
    assert len(children) == 1, children
    os.kill(children[0], 9)
    wait_for(lambda: children_of(pid) == [], 30, "the killed committer process to be gone")
    third = Background(
        lambda: httpx.post(
            f"{server.url}/api/queues/q/items", json={"payload": "c"}, headers=headers, timeout=60
        )
    )
    wait_for(lambda: children_of(pid) != [], 30, "a new committer process")
    assert httpx.get(f"{server.url}/healthz").status_code == 200
    assert third.join().status_code == 201
    assert Item.objects.count() == 3


def test_the_client_resends_a_refused_post_after_retry_after_and_it_lands_once(
    server_factory, headers
):
    engine.upsert_queue(name="q", body={})
    server = server_factory(
        TASKHOSTER_FAULT="committer.slow_group",
        TASKHOSTER_FAULT_SLOW_SECONDS="2",
        TASKHOSTER_ADMISSION_MAX_ITEMS="1",
    )
    key = headers["Authorization"].split()[1]
    first = Background(
        lambda: httpx.post(
            f"{server.url}/api/queues/q/items", json={"payload": "a"}, headers=headers, timeout=60
        )
    )
    wait_for(
        lambda: (
            httpx.get(f"{server.url}/healthz", headers=headers).json()["committer"]["waitingItems"]
            >= 1
        ),
        30,
        "the first post to wait for the committer",
    )
    with Producer(server.url, key, retries=5, timeout=60) as producer:
        item = producer.post("q", {"n": 1})  # refused at first: resent after Retry-After
    assert first.join().status_code == 201
    assert item.payload == {"n": 1}
    mine = Item.objects.filter(key=item.key)
    assert mine.count() == 1
    assert item.key is not None
    assert item.key.startswith("auto-"), "the client gave the post its idempotency key"


@pytest.mark.parametrize(
    ("setting", "says"),
    [
        ("TASKHOSTER_MIN_FREE_BYTES", "below MIN_FREE_BYTES"),
        ("TASKHOSTER_MIN_FREE_INODES", "below MIN_FREE_INODES"),
    ],
)
def test_healthz_is_not_ready_while_free_space_or_inodes_are_below_the_thresholds(
    transactional_db, state_root, setting, says, headers
):
    server = Server(state_root, **{setting: str(10**18)}).start(healthy=False)
    try:
        answer = httpx.get(f"{server.url}/healthz", headers=headers)
        assert answer.status_code == 503
        body = answer.json()
        assert body["status"] == "unavailable"
        assert body["stateRoot"]["reachable"] is False
        assert says in body["stateRoot"]["error"]
        assert body["stateRoot"]["freeBytes"] > 0
    finally:
        server.stop()


@contextlib.contextmanager
def small_filesystem(path: Path, size: str) -> Any:
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},nr_inodes=4000", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_a_full_state_root_makes_healthz_say_why_and_posts_fail_cleanly(
    tmp_path, transactional_db, make_key
):
    root = tmp_path / "small"
    headers = {"Authorization": f"Token {make_key()}"}
    with small_filesystem(root, "2m"):
        server = Server(root, TASKHOSTER_MIN_FREE_BYTES="0", TASKHOSTER_MIN_FREE_INODES="0").start()
        try:
            with httpx.Client(base_url=server.url, headers=headers, timeout=30) as http:
                assert http.put("/api/queues/q", json={}).status_code == 201
                posted = []
                for n in range(200):
                    answer = http.post(
                        "/api/queues/q/items", json={"payload": {"n": n, "pad": "x" * 20000}}
                    )
                    if answer.status_code != 201:
                        assert answer.status_code == 503, answer.text
                        assert answer.json()["error"]["code"] == "store_error"
                        break
                    posted.append(answer.json()["id"])
                else:
                    raise AssertionError("a 2 MiB filesystem took 4 MB of items")
                assert posted

                def not_ready() -> dict[str, Any] | None:
                    answer = http.get("/healthz")
                    return answer.json() if answer.status_code == 503 else None

                body = wait_for(not_ready, 15, "/healthz to say the state root refuses writes")
                assert "write failed" in body["stateRoot"]["error"]
                metrics = http.get("/metrics").text
                assert "taskhoster_state_root_free_bytes " in metrics
                assert "taskhoster_state_root_free_inodes " in metrics
                for item_id in posted:  # nothing acknowledged was lost
                    assert http.get(f"/api/items/{item_id}").status_code == 200
        finally:
            server.stop()
            os.sync()


def test_healthz_on_its_own_port_answers_while_the_event_loop_is_held(server_factory, headers):
    """``HEALTH_LISTEN``: ``/healthz`` is answered by a thread of its own, not in the event
    loop's turn. The loop is held on purpose (the fault ``loop.stall``, in a post), and the
    order of the answers proves it: the own port answers while the post is still held, and
    the main port's ``/healthz`` only after it."""
    engine.upsert_queue(name="q", body={})
    port = free_port()
    server = server_factory(
        TASKHOSTER_HEALTH_LISTEN=f"127.0.0.1:{port}",
        TASKHOSTER_FAULT="loop.stall=1",
        TASKHOSTER_FAULT_SLOW_SECONDS=STALL,
    )
    own = f"http://127.0.0.1:{port}"
    # Before the stall: the public body only, and nothing but /healthz.
    ready = httpx.get(f"{own}/healthz", timeout=10)
    assert ready.status_code == 200
    assert ready.json() == {
        "status": "ok",
        "database": {"reachable": True},
        "bus": {"reachable": True},
        "stateRoot": {"reachable": True},
        "committer": {"ready": True},
    }
    assert httpx.head(f"{own}/healthz", timeout=10).content == b""
    assert httpx.get(f"{own}/metrics", timeout=10).status_code == 404
    assert httpx.post(f"{own}/healthz", timeout=10).status_code == 405

    held = Background(
        lambda: httpx.post(
            f"{server.url}/api/queues/q/items", json={"payload": 1}, headers=headers, timeout=60
        )
    )
    time.sleep(0.5)  # the post is in, holding the loop (STALL seconds)
    main_port = Background(lambda: httpx.get(f"{server.url}/healthz", timeout=60))
    answer = httpx.get(f"{own}/healthz", timeout=10)
    assert answer.status_code == 200
    assert held.answer is None, "the own port answered while the loop was held"
    assert main_port.answer is None, "the main port's /healthz waits for the loop"
    assert held.join().status_code == 201
    assert main_port.join().status_code == 200


def test_health_listen_must_be_host_and_port(tmp_path):
    """A HEALTH_LISTEN that is not ``host:port`` is refused by the system checks, by name."""
    done = python_in_project(
        "manage.py",
        "check",
        env={"TASKHOSTER_HEALTH_LISTEN": "localhost", "TASKHOSTER_ROOT": str(tmp_path / "state")},
        without=("TASKHOSTER_TEST_DB",),
        timeout=120,
    )
    assert done.returncode != 0
    assert "HEALTH_LISTEN" in done.stderr, done.stderr
    assert "host:port" in done.stderr, done.stderr
