"""The ``taskhoster`` command (installed with the package) against a real daphne."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from taskhoster.client import Producer, RateLimit

from ..conftest import REPO

pytestmark = pytest.mark.slow

COMMAND = Path(sys.executable).with_name("taskhoster")
# The command runs this checkout's code, wherever the package was installed from.
CODE = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


@pytest.fixture
def server(server_factory):
    return server_factory()


@pytest.fixture
def producer(server, key):
    with Producer(server.url, key) as producer:
        producer.put_queue("q")
        yield producer


@pytest.fixture
def cli(server, key, tmp_path):
    """Run ``taskhoster ARGS`` with the server and key in the environment."""

    def run(*args, input=None, env=None, timeout=30):
        full_env = {
            **os.environ,
            "TASKHOSTER_URL": server.url,
            "TASKHOSTER_KEY": key,
            **CODE,
            **(env or {}),
        }
        return subprocess.run(
            [str(COMMAND), *args],
            input=input,
            env=full_env,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=tmp_path,
        )

    return run


def test_the_command_is_installed_with_the_package():
    assert COMMAND.exists(), "pip install -e . puts taskhoster beside python"
    done = subprocess.run([str(COMMAND), "--help"], capture_output=True, text=True, check=True)
    for word in ("post", "get", "wait", "queues", "work", "pause", "resume"):
        assert word in done.stdout


def test_work_help_shows_the_command_it_runs_after_a_double_dash():
    done = subprocess.run(
        [str(COMMAND), "work", "--help"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **CODE},
    )
    usage = done.stdout.split("\n\n")[0]
    assert usage.startswith("usage: taskhoster work "), done.stdout
    assert " ".join(usage.split()).endswith("QUEUE [QUEUE ...] -- COMMAND [ARG ...]"), usage
    assert "/bin/sh -c" in done.stdout  # how COMMAND is run is said, not only that it is
    listed = subprocess.run(
        [str(COMMAND), "--help"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **CODE},
    )
    assert "QUEUE... -- COMMAND" in listed.stdout
    missing = subprocess.run(
        [str(COMMAND), "work", "q"], capture_output=True, text=True, env={**os.environ, **CODE}
    )
    assert missing.returncode == 2
    assert missing.stderr.startswith("usage: taskhoster work "), missing.stderr
    assert "the command to run per item goes after --" in missing.stderr


def test_the_client_imports_without_django():
    code = (
        "import sys, taskhoster.client, taskhoster.client.cli; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('django', 'rest_framework')))"
    )
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert done.stdout.strip() == "[]"


def test_post_get_and_queues_use_the_server_and_key_from_the_environment(cli, producer):
    posted = cli("post", "q", '{"to": "ada"}', "--thread", "t-1", "--idempotency-key", "k1")
    assert posted.returncode == 0, posted.stderr
    item = json.loads(posted.stdout)
    assert (item["payload"], item["threadId"], item["key"]) == ({"to": "ada"}, "t-1", "k1")
    assert producer.get(item["id"]).payload == {"to": "ada"}

    got = json.loads(cli("get", item["id"]).stdout)
    assert got["id"] == item["id"]
    assert got["status"] == "pending"

    from_stdin = cli("post", "q", "--string", "--delay", "60", input="plain text\n")
    assert json.loads(from_stdin.stdout)["payload"] == "plain text"

    table = cli("queues").stdout.splitlines()
    assert table[0].split() == ["QUEUE", "PENDING", "PROCESSING", "FINISHED", "FAILED", "LEASE"]
    assert table[1].split() == ["q", "2", "0", "0", "0", "60s"]
    assert json.loads(cli("queues", "q", "--json").stdout)[0]["counts"]["pending"] == 2


def test_post_lines_posts_one_item_per_line_and_put_queue_sets_settings(cli, producer):
    put = cli("put-queue", "batch", "--lease-seconds", "15", "--max-attempts", "3")
    assert put.returncode == 0, put.stderr
    assert (json.loads(put.stdout)["leaseSeconds"], json.loads(put.stdout)["maxAttempts"]) == (
        15,
        3,
    )
    posted = cli("post", "batch", "--lines", input='{"n": 1}\n\n{"n": 2}\n3\n')
    assert [json.loads(line)["payload"] for line in posted.stdout.splitlines()] == [
        {"n": 1},
        {"n": 2},
        3,
    ]
    listed = cli("items", "batch").stdout.splitlines()
    assert len(listed) == 3
    assert cli("put-queue", "batch", "--max-attempts", "none").returncode == 0
    assert producer.queue("batch").max_attempts is None
    assert producer.queue("batch").lease_seconds == 15


def claim_now(http, queue="q", most=1):
    """The ids a claim that does not wait hands out (none when nothing may be)."""
    answer = http.post(f"/api/queues/{queue}/claim", json={"max": most, "wait": 0})
    assert answer.status_code == 200, answer.text
    return [i["id"] for i in answer.json()["items"]]


def test_post_priority_sets_the_items_priority_and_higher_is_claimed_first(cli, producer, http):
    plain = cli("post", "q", '"plain"')
    urgent = cli("post", "q", '"urgent"', "--priority", "7")
    assert urgent.returncode == 0, urgent.stderr
    assert json.loads(plain.stdout)["priority"] == 0
    urgent_id = json.loads(urgent.stdout)["id"]
    assert json.loads(urgent.stdout)["priority"] == 7
    assert producer.get(urgent_id).priority == 7
    lines = cli("post", "q", "--lines", "--priority", "3", input="1\n2\n")
    assert [json.loads(line)["priority"] for line in lines.stdout.splitlines()] == [3, 3]
    assert claim_now(http)[0] == urgent_id


def test_pause_then_claims_get_nothing_and_resume_hands_the_item_out(cli, producer, http):
    paused = cli("pause", "q")
    assert paused.returncode == 0, paused.stderr
    assert json.loads(paused.stdout)["paused"] is True
    item = producer.post("q", 1)
    assert claim_now(http) == []
    assert producer.queue("q").held["paused"] == 1
    resumed = cli("resume", "q")
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(resumed.stdout)["paused"] is False
    assert claim_now(http) == [item.id]


def test_put_queue_sets_flow_controls_and_none_clears_them(cli, producer):
    put = cli(
        "put-queue",
        "q",
        "--max-processing",
        "4",
        "--rate-limit",
        "10/1",
        "--thread-limit",
        "2",
        "--paused",
    )
    assert put.returncode == 0, put.stderr
    shown = json.loads(put.stdout)
    assert (shown["maxProcessing"], shown["rateLimit"], shown["threadLimit"], shown["paused"]) == (
        4,
        {"count": 10, "seconds": 1},
        2,
        True,
    )
    assert cli("put-queue", "q", "--rate-limit", "3/0.5").returncode == 0
    queue = producer.queue("q")
    assert (queue.rate_limit, queue.max_processing, queue.paused) == (RateLimit(3, 0.5), 4, True)
    cleared = cli("put-queue", "q", "--max-processing", "none", "--rate-limit", "none")
    assert cleared.returncode == 0, cleared.stderr
    assert cli("put-queue", "q", "--no-paused").returncode == 0
    queue = producer.queue("q")
    assert (queue.max_processing, queue.rate_limit, queue.paused, queue.thread_limit) == (
        None,
        None,
        False,
        2,
    )


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (
            ["put-queue", "q", "--rate-limit", "10"],
            "argument --rate-limit: '10' is not COUNT/SECONDS",
        ),
        (["put-queue", "q", "--rate-limit", "ten/1"], "is not COUNT/SECONDS"),
        (["put-queue", "q", "--rate-limit", "10/x"], "is not COUNT/SECONDS"),
        (["put-queue", "q", "--rate-limit", "0/1"], "COUNT must be 1 or more"),
        (["put-queue", "q", "--rate-limit", "10/0"], "SECONDS a number greater than 0"),
        (["put-queue", "q", "--max-processing", "0"], "argument --max-processing: '0' is not"),
        (["put-queue", "q", "--thread-limit", "many"], "argument --thread-limit: 'many' is not"),
        (["post", "q", "1", "--priority", "10"], "argument --priority: '10' is not an integer"),
    ],
    ids=[
        "no-slash",
        "count-not-a-number",
        "seconds-not-a-number",
        "zero-count",
        "zero-seconds",
        "zero-max-processing",
        "thread-limit-not-a-number",
        "priority-over-9",
    ],
)
def test_a_bad_flow_control_value_is_a_one_line_usage_error_with_exit_2(cli, producer, args, said):
    done = cli(*args)
    assert done.returncode == 2
    assert done.stdout == ""
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith(f"taskhoster {args[0]}: error: "), done.stderr
    assert said in done.stderr
    queue = producer.queue("q")  # nothing reached the server
    assert (queue.max_processing, queue.rate_limit, queue.thread_limit) == (None, None, 1)
    assert queue.counts["pending"] == 0


def test_flags_override_the_environment_and_errors_exit_1_with_the_code(cli, server, key, producer):
    wrong_env = {"TASKHOSTER_KEY": "wrong", "TASKHOSTER_URL": "http://127.0.0.1:9"}
    ok = cli("--url", server.url, "--key", key, "queues", env=wrong_env)
    assert ok.returncode == 0, ok.stderr
    refused = cli("queues", env={"TASKHOSTER_KEY": "wrong"})
    assert refused.returncode == 1
    assert "401 unauthorized" in refused.stderr
    missing = cli("get", "nosuchitem")
    assert missing.returncode == 1
    assert "item_not_found" in missing.stderr


@pytest.mark.parametrize("buffered", [True, False], ids=["buffered", "unbuffered"])
def test_output_closed_early_ends_quietly_with_141(server, key, producer, tmp_path, buffered):
    """``taskhoster items q | head -1``: once the reader has gone, no traceback; 141, as a
    shell reports a command its pipe's reader left (128 + SIGPIPE). Buffered (as from a
    shell) the error comes at a flush; unbuffered, at the write."""
    producer.post_many("q", list(range(1000)))  # far more output than a pipe holds
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env.update(TASKHOSTER_URL=server.url, TASKHOSTER_KEY=key, **CODE)
    if not buffered:
        env["PYTHONUNBUFFERED"] = "1"

    reader = subprocess.Popen(
        [str(COMMAND), "items", "q"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )
    assert reader.stdout is not None
    assert reader.stderr is not None
    assert json.loads(reader.stdout.readline())["queue"] == "q"
    reader.stdout.close()
    assert reader.wait(30) == 141
    assert reader.stderr.read() == b""
    reader.stderr.close()

    # A pipe closed before the command starts: every command that prints, each its way
    # (a table, JSON, JSON lines).
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        for args in (["queues"], ["queues", "q", "--json"], ["items", "q"]):
            done = subprocess.run(
                [str(COMMAND), *args],
                stdout=write_end,
                stderr=subprocess.PIPE,
                env=env,
                cwd=tmp_path,
                timeout=30,
            )
            assert (done.returncode, done.stderr) == (141, b""), (args, done.stderr.decode())
    finally:
        os.close(write_end)


def test_wait_exits_0_finished_1_failed_124_not_done_in_time(cli, producer, server, key):
    item = producer.post("q", 1)
    started = time.monotonic()
    late = cli("wait", item.id, "--timeout", "0.5")
    assert late.returncode == 124
    assert json.loads(late.stdout)["status"] == "pending"
    assert time.monotonic() - started < 10

    worker = _work(server, key, "q", "--", "cat")
    try:
        done = cli("wait", item.id, "--timeout", "10")
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["result"] == 1
        assert json.loads(cli("wait", item.id, "--result").stdout) == 1
    finally:
        _stop(worker)

    failing = producer.post("q", 2)
    worker = _work(server, key, "q", "--no-retry", "--", "echo nope >&2; exit 3")
    try:
        failed = cli("post", "q", "3", "--wait", "10")
        assert failed.returncode == 1
        assert json.loads(failed.stdout)["error"] == "nope"
        assert cli("wait", failing.id, "--timeout", "10").returncode == 1
    finally:
        _stop(worker)


def _work(server, key, *args):
    env = {**os.environ, "TASKHOSTER_URL": server.url, "TASKHOSTER_KEY": key, **CODE}
    return subprocess.Popen(
        [str(COMMAND), "work", *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _stop(worker):
    worker.send_signal(signal.SIGTERM)
    try:
        assert worker.wait(10) == 0, worker.stderr.read()
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        worker.stderr.close()


HANDLER = textwrap.dedent("""
    import json, os, sys
    payload = json.load(sys.stdin)
    if payload.get("fail"):
        sys.stderr.write("cannot do " + payload["fail"] + "\\n")
        sys.exit(2)
    print(json.dumps({"double": payload["n"] * 2, "item": os.environ["TASKHOSTER_ITEM_ID"],
                      "attempts": os.environ["TASKHOSTER_ATTEMPTS"]}))
""")


def test_work_runs_the_command_per_item_payload_in_stdout_out_nonzero_exit_fails(
    server, key, producer, tmp_path
):
    script = tmp_path / "handler.py"
    script.write_text(HANDLER)
    producer.put_queue("q", max_attempts=1)
    worker = _work(server, key, "q", "--capacity", "2", "--", sys.executable, str(script))
    try:
        good = producer.post("q", {"n": 21})
        bad = producer.post("q", {"fail": "this"})
        text = producer.post("q", {"n": 1})
        assert producer.result(good.id, timeout=15) == {
            "double": 42,
            "item": good.id,
            "attempts": "1",
        }
        failed = producer.wait(bad.id, timeout=15)
        assert (failed.status, failed.error) == ("failed", "cannot do this")
        assert producer.result(text.id, timeout=15)["double"] == 2
    finally:
        _stop(worker)


def test_work_result_is_stdout_text_when_it_is_not_json_and_runs_through_the_shell(
    server, key, producer
):
    worker = _work(server, key, "q", "--", "tr a-z A-Z | sed 's/^/got /'")
    try:
        item = producer.post("q", "hello")
        assert producer.result(item.id, timeout=15) == 'got "HELLO"'
    finally:
        _stop(worker)


def test_work_kills_the_command_when_its_item_is_cancelled(server, key, producer, tmp_path):
    pidfile = tmp_path / "pid"
    worker = _work(server, key, "q", "--", f"echo $$ > {pidfile}; exec sleep 60")
    try:
        item = producer.post("q", 1)
        deadline = time.monotonic() + 10
        while not pidfile.exists() or not pidfile.read_text().strip():
            assert time.monotonic() < deadline, "the command did not start"
            time.sleep(0.05)
        pid = int(pidfile.read_text())
        producer.delete(item.id)
        deadline = time.monotonic() + 5
        while _alive(pid):
            assert time.monotonic() < deadline, "the command outlived its cancelled item"
            time.sleep(0.05)
    finally:
        _stop(worker)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
