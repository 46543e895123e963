"""A post answered on the server's event loop (``taskhoster.asgi``, ``QueueItemsView``).

Under ``OneHopASGIHandler`` a post of items runs on daphne's event loop, not in a thread,
and the key is checked by the engine's group (``ops.Post.key_hash``) rather than looked up
by the view. These tests hold it to the rules of a post answered in a thread:

- the same status, body and headers as the thread gives (Django's test client runs the
  same view in a thread);
- a missing, wrong or revoked key is 401 and a key without the scope or the queue is 403,
  with the thread's envelope, and posts nothing, even when the body is bad as well (the key
  is judged first, as always);
- in one group, a refused key fails only its own post;
- and posts really are answered without a request thread (their CPU time), while a bad one
  is answered in a thread.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from taskhoster.engine import runner
from taskhoster.engine.ops import NewItem, Op
from taskhoster.engine.posts import prepare_post
from taskhoster.errors import KeyForbidden, KeyRefused
from taskhoster.keys import hash_key, known_keys
from taskhoster.models import ApiKey, Item

pytestmark = pytest.mark.django_db(transaction=True)

# Headers the ASGI server or the clock set, not the application.
SERVER_HEADERS = {"date", "server", "content-length", "connection", "transfer-encoding"}


def _post(server: Any, key: str | None, body: Any, queue: str = "q") -> httpx.Response:
    headers = {"Authorization": f"Token {key}"} if key is not None else {}
    if isinstance(body, bytes):
        headers["Content-Type"] = "application/json"
        return httpx.post(
            f"{server.url}/api/queues/{queue}/items", content=body, headers=headers, timeout=10
        )
    return httpx.post(f"{server.url}/api/queues/{queue}/items", json=body, headers=headers)


def _app_headers(headers: Any) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items() if k.lower() not in SERVER_HEADERS}


@pytest.fixture
def keys(make_key: Callable[..., str], make_queue: Callable[..., Any]) -> dict[str, str]:
    make_queue("q")
    make_queue("other")
    revoked = make_key(scopes="produce")
    ApiKey.objects.filter(key_hash=hash_key(revoked)).update(revoked_at=timezone.now())
    return {
        "producer": make_key(scopes="produce"),
        "worker": make_key(scopes="work"),
        "other_queue": make_key(scopes="produce", queues=["other"]),
        "revoked": revoked,
    }


def test_a_post_on_the_loop_answers_as_the_thread_does(server_factory, keys) -> None:
    server = server_factory()
    body = {"payload": {"n": 1}, "key": "order-1"}
    loop_first = _post(server, keys["producer"], body)
    loop_again = _post(server, keys["producer"], body)
    batch = _post(server, keys["producer"], {"items": [{"payload": 2}, {"payload": 3}]})
    thread_client = APIClient()
    thread_client.credentials(HTTP_AUTHORIZATION=f"Token {keys['producer']}")
    thread = thread_client.post("/api/queues/q/items", {"payload": {"n": 9}}, format="json")

    assert (loop_first.status_code, loop_again.status_code, batch.status_code) == (201, 200, 201)
    assert loop_again.json() == loop_first.json()  # the repeated key: the same item
    assert [i["payload"] for i in batch.json()["items"]] == [2, 3]
    assert set(loop_first.json()) == set(thread.json())
    assert _app_headers(loop_first.headers) == _app_headers(thread.headers)
    assert loop_first.headers["content-length"] == str(len(loop_first.content))
    got = httpx.get(
        f"{server.url}/api/items/{loop_first.json()['id']}",
        headers={"Authorization": f"Token {keys['producer']}"},
    )
    assert got.json()["payload"] == {"n": 1}
    assert Item.objects.count() == 4


@pytest.mark.parametrize(
    ("who", "body", "status", "code", "message"),
    [
        (None, {"payload": 1}, 401, "unauthorized", "this needs an API key"),
        ("wrong", {"payload": 1}, 401, "unauthorized", "invalid or revoked key"),
        ("revoked", {"payload": 1}, 401, "unauthorized", "invalid or revoked key"),
        ("worker", {"payload": 1}, 403, "forbidden", "this key needs the produce scope"),
        ("other_queue", {"payload": 1}, 403, "forbidden", "this key may not use queue 'q'"),
        # The key is judged before the body, as in a thread.
        ("revoked", b"{not json", 401, "unauthorized", "invalid or revoked key"),
        ("worker", {"nopayload": 1}, 403, "forbidden", "this key needs the produce scope"),
        ("producer", b"{not json", 400, "bad_json", "not valid JSON"),
        ("producer", {"nopayload": 1}, 400, "unknown_field", "nopayload"),
    ],
)
def test_a_refused_post_gets_the_threads_answer_and_posts_nothing(
    server_factory, keys, who, body, status, code, message
) -> None:
    server = server_factory()
    key = "th_" + "x" * 43 if who == "wrong" else keys.get(who) if who else None
    answer = _post(server, key, body)
    assert answer.status_code == status, answer.text
    assert answer.json()["error"]["code"] == code
    assert message in answer.json()["error"]["message"]
    if status == 401:
        assert answer.headers["www-authenticate"] == "Token"
    assert Item.objects.count() == 0


def test_a_missing_queue_is_404_for_a_good_key_and_401_for_a_revoked_one(
    server_factory, keys
) -> None:
    server = server_factory()
    missing = _post(server, keys["producer"], {"payload": 1}, queue="nope")
    refused = _post(server, keys["revoked"], {"payload": 1}, queue="nope")
    assert (missing.status_code, missing.json()["error"]["code"]) == (404, "queue_not_found")
    assert (refused.status_code, refused.json()["error"]["code"]) == (401, "unauthorized")


def test_a_key_revoked_between_two_posts_refuses_the_second_at_once(server_factory, keys) -> None:
    server = server_factory()
    assert _post(server, keys["producer"], {"payload": 1}).status_code == 201
    ApiKey.objects.filter(key_hash=hash_key(keys["producer"])).update(revoked_at=timezone.now())
    assert _post(server, keys["producer"], {"payload": 2}).status_code == 401
    assert Item.objects.count() == 1


def test_in_one_group_a_refused_key_fails_only_its_own_post(keys) -> None:
    def post(key: str, payload: int) -> Any:
        op = prepare_post("q", [NewItem(payload=payload)], key_hash=hash_key(key))
        op.future = Future()
        return op

    ops = [
        post(keys["producer"], 1),
        post(keys["revoked"], 2),
        post(keys["worker"], 3),
        post(keys["other_queue"], 4),
        post(keys["producer"], 5),
    ]
    runner.run_group(ops, 0)
    errors = [op.future.exception() for op in ops]
    assert errors[0] is None
    assert errors[4] is None
    assert [type(e) for e in errors[1:4]] == [KeyRefused, KeyForbidden, KeyForbidden]
    assert [e.http_status for e in errors[1:4] if e is not None] == [401, 403, 403]
    assert sorted(Item.objects.values_list("status", flat=True)) == ["pending", "pending"]
    assert [p.payload for op in (ops[0], ops[4]) for p in op.future.result()] == [1, 5]


def _request_thread_seconds(pid: int) -> float:
    """The CPU seconds of a process's request threads (named ``th-http-N``)."""
    total = 0.0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            if not (task / "comm").read_text().startswith("th-http-"):
                continue
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / 100
    return total


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_posts_are_answered_without_a_request_thread_and_bad_ones_in_one(
    server_factory, keys
) -> None:
    server = server_factory()
    assert server.proc is not None
    headers = {"Authorization": f"Token {keys['producer']}", "Content-Type": "application/json"}
    url = f"{server.url}/api/queues/q/items"
    with httpx.Client(headers=headers, timeout=10) as client:
        client.post(url, content=b"{bad")  # starts a request thread
        before = _request_thread_seconds(server.proc.pid)
        for n in range(400):
            assert client.post(url, content=b'{"payload": %d}' % n).status_code == 201
        good = _request_thread_seconds(server.proc.pid) - before
        before = _request_thread_seconds(server.proc.pid)
        for _ in range(400):
            assert client.post(url, content=b"{bad").status_code == 400
        bad = _request_thread_seconds(server.proc.pid) - before
    # In a thread, a post costs that thread ~0.3-0.8 ms: 400 of them well over 0.1 s.
    assert good <= 0.03, good
    assert bad >= 0.05, bad


def test_a_group_that_fails_as_a_whole_still_tells_a_refused_key_so(keys, monkeypatch) -> None:
    from taskhoster.engine import group as group_module
    from taskhoster.errors import StoreError

    def fail(self: Any) -> None:
        raise StoreError("the disk went away")

    monkeypatch.setattr(group_module.Group, "_dead_letters", fail)
    ops: list[Op] = []
    futures: list[Future[Any]] = []
    for key in (keys["revoked"], keys["producer"]):
        op = prepare_post("q", [NewItem(payload=1)], key_hash=hash_key(key))
        future: Future[Any] = Future()
        op.future = future
        ops.append(op)
        futures.append(future)
    runner.run_group(ops, 0)
    assert type(futures[0].exception()) is KeyRefused
    assert type(futures[1].exception()) is StoreError
    assert Item.objects.count() == 0


def _asgi_post(handler: Any, key: str, body: bytes) -> tuple[int, bytes]:
    """One POST through the handler in this process, on an event loop of its own."""
    import asyncio

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/api/queues/q/items",
        "raw_path": b"/api/queues/q/items",
        "root_path": "",
        "query_string": b"",
        "headers": [
            (b"host", b"127.0.0.1"),
            (b"authorization", f"Token {key}".encode()),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
        "client": ("127.0.0.1", 5000),
        "server": ("127.0.0.1", 80),
    }
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(handler(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    content = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], content


def test_once_a_post_is_handed_on_it_is_answered_even_if_middleware_fails_after(
    keys, monkeypatch, caplog
) -> None:
    """Answering it again in a thread would post it twice."""
    from django.http import HttpResponse

    from taskhoster.asgi import OneHopASGIHandler

    handler = OneHopASGIHandler(size=1)
    assert handler.loop_safe
    real = handler.get_response

    def failing_on_the_way_out(request: Any) -> Any:
        real(request)
        return HttpResponse("Internal Server Error", status=500)  # what Django makes of it

    monkeypatch.setattr(handler, "get_response", failing_on_the_way_out)
    # A key seen accepted lately is let on the loop (others are judged in a thread first).
    known_keys.add(hash_key(keys["producer"]))
    status, content = _asgi_post(handler, keys["producer"], b'{"payload": 7}')
    assert status == 201, content
    assert Item.objects.count() == 1
    assert "middleware failed on the way out" in caplog.text


def test_with_sessions_saved_on_every_request_nothing_runs_on_the_loop(settings, keys) -> None:
    from taskhoster.asgi import OneHopASGIHandler

    assert OneHopASGIHandler(size=1).loop_safe
    settings.SESSION_SAVE_EVERY_REQUEST = True
    assert not OneHopASGIHandler(size=1).loop_safe
    settings.SESSION_SAVE_EVERY_REQUEST = False
    settings.CSRF_USE_SESSIONS = True
    assert not OneHopASGIHandler(size=1).loop_safe
    settings.CSRF_USE_SESSIONS = False
    settings.MIDDLEWARE = [*settings.MIDDLEWARE, "django.middleware.gzip.GZipMiddleware"]
    assert not OneHopASGIHandler(size=1).loop_safe
