"""Invariant I8: every malformed, oversized or impossible request gets a 4xx JSON error of the
form ``{"error": {"code", "message"}}`` and changes nothing: no item row, thread row, queue
setting or key changes, no file appears, changes or disappears under the state root, and no
file or directory appears outside it.

Each test builds one world (queues with items in every status) and snapshots it before the
bad request; ``refused`` compares the snapshot after.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from rest_framework.test import APIClient

from taskhoster.models import ApiKey, Item, Queue, Thread

LEASE = "<lease>"  # replaced by the world's processing lease


# -- the world and its snapshot --------------------------------------------------------------


def _tree(root: Path, *, skip: Path | None = None) -> dict[str, str]:
    """Every path under ``root`` (except under ``skip``): directories as "dir", files by hash."""
    out: dict[str, str] = {}
    if not root.exists():
        return out
    for path in root.rglob("*"):
        if skip is not None and (path == skip or skip in path.parents):
            continue
        rel = str(path.relative_to(root))
        out[rel] = "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def snapshot(root: Path) -> dict[str, Any]:
    """Everything a request could change: index rows, keys, the state tree, and what is
    around the state root (its parent, recursively, and its grandparent's entries)."""
    return {
        "items": list(Item.objects.order_by("id").values()),
        "queues": list(Queue.objects.order_by("name").values()),
        "threads": list(Thread.objects.order_by("queue_id", "thread_id").values()),
        "keys": list(ApiKey.objects.order_by("id").values()),
        "state": _tree(root),
        "beside": _tree(root.parent, skip=root),
        "above": sorted(p.name for p in root.parent.parent.iterdir()),
    }


@dataclass
class World:
    root: Path
    api: APIClient
    pending: str = ""
    threaded: str = ""
    processing: str = ""
    lease: str = ""
    finished: str = ""
    failed: str = ""
    other: str = ""
    before: dict[str, Any] = field(default_factory=dict)

    def fill(self, value: Any) -> Any:
        """Replace ``LEASE`` and ``{name}`` placeholders in a path or body."""
        if isinstance(value, str):
            if value == LEASE:
                return self.lease
            return value.format(
                **{
                    k: getattr(self, k)
                    for k in ("pending", "threaded", "processing", "finished", "failed", "other")
                }
            )
        if isinstance(value, dict):
            return {k: self.fill(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.fill(v) for v in value]
        return value

    def freeze(self) -> None:
        self.before = snapshot(self.root)


def _ok(response: Any, status: int = 201) -> Any:
    assert response.status_code == status, response.content
    return response.json()


@pytest.fixture
def world(api: APIClient, make_queue: Any, state_root: Path) -> World:
    return build_world(api, make_queue, state_root)


def build_world(api: APIClient, make_queue: Any, state_root: Path) -> World:
    """Queue ``q`` (queueSeconds 3600, maxAttempts 3) holding one item in each status, a
    threaded pending item with a key, and queue ``other`` with one pending item."""
    make_queue("q", queueSeconds=3600, maxAttempts=3)
    make_queue("other")
    w = World(root=state_root, api=api)

    def post(body: dict[str, Any], queue: str = "q") -> str:
        return str(_ok(api.post(f"/api/queues/{queue}/items", body, format="json"))["id"])

    def claim_one() -> dict[str, Any]:
        items = _ok(api.post("/api/queues/q/claim", {}, format="json"), 200)["items"]
        assert len(items) == 1
        return dict(items[0])

    w.finished = post({"payload": "finished"})
    assert claim_one()["id"] == w.finished
    _ok(api.post(f"/api/items/{w.finished}/result", {"result": "r"}, format="json"), 200)
    w.failed = post({"payload": "failed"})
    failing = claim_one()
    _ok(
        api.post(
            f"/api/items/{w.failed}/fail",
            {"lease": failing["lease"], "error": "x", "retry": False},
            format="json",
        ),
        200,
    )
    w.processing = post({"payload": "processing"})
    held = claim_one()
    assert held["id"] == w.processing
    w.lease = held["lease"]
    w.pending = post({"payload": "pending"})
    w.threaded = post({"payload": "threaded", "threadId": "t", "key": "k1"})
    w.other = post({"payload": "other"}, queue="other")
    w.freeze()
    return w


def refused(
    world: World, response: Any, status: int | tuple[int, ...] | None = None
) -> dict[str, str]:
    """Assert a 4xx JSON error of the contract's shape and that nothing changed."""
    assert 400 <= response.status_code < 500, (response.status_code, response.content)
    if status is not None:
        allowed = status if isinstance(status, tuple) else (status,)
        assert response.status_code in allowed, (response.status_code, response.content)
    assert response["Content-Type"].startswith("application/json"), response["Content-Type"]
    body = json.loads(response.content)
    assert isinstance(body, dict), body
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"code", "message"}, body
    assert isinstance(body["error"]["code"], str), body
    assert body["error"]["code"], body
    assert isinstance(body["error"]["message"], str), body
    assert body["error"]["message"], body
    after = snapshot(world.root)
    for part in world.before:
        assert after[part] == world.before[part], f"{part} changed"
    return dict(body["error"])


def send(
    world: World,
    method: str,
    path: str,
    body: Any = None,
    *,
    raw: bytes | None = None,
    content_type: str = "application/json",
    client: Any = None,
) -> Any:
    path = world.fill(path)
    if raw is not None:
        data = raw
    elif body is None:
        data = b""
    else:
        data = json.dumps(world.fill(body)).encode()
    # The body is bytes on purpose (malformed and non-UTF-8 bodies among them); generic() takes
    # bytes (Django's force_bytes), but DRF's stubs type its data as str.
    return (client or world.api).generic(
        method.upper(),
        path,
        data,  # type: ignore[arg-type]
        content_type=content_type,
    )


# Every endpoint that reads a JSON body, with a body it would accept.
BODY_ENDPOINTS = {
    "put_queue": ("put", "/api/queues/q", {"leaseSeconds": 30}),
    "post_item": ("post", "/api/queues/q/items", {"payload": 1}),
    "bulk_delete": ("post", "/api/queues/q/items/delete", {"status": "pending"}),
    "claim": ("post", "/api/queues/q/claim", {"max": 5}),
    "result": ("post", "/api/items/{processing}/result", {"result": 1}),
    "fail": ("post", "/api/items/{processing}/fail", {"lease": LEASE, "retry": False}),
    "extend": ("post", "/api/items/{processing}/extend", {"lease": LEASE}),
}

# Every endpoint naming a queue in its path.
QUEUE_ENDPOINTS = {
    "put_queue": ("put", "/api/queues/{name}", {}),
    "get_queue": ("get", "/api/queues/{name}", None),
    "delete_queue": ("delete", "/api/queues/{name}", None),
    "post_item": ("post", "/api/queues/{name}/items", {"payload": 1}),
    "list_items": ("get", "/api/queues/{name}/items", None),
    "bulk_delete": ("post", "/api/queues/{name}/items/delete", {"status": "pending"}),
    "claim": ("post", "/api/queues/{name}/claim", {}),
}

# Every endpoint naming an item in its path.
ITEM_ENDPOINTS = {
    "get_item": ("get", "/api/items/{id}", None),
    "delete_item": ("delete", "/api/items/{id}", None),
    "restart": ("post", "/api/items/{id}/restart", None),
    "result": ("post", "/api/items/{id}/result", {"result": 1}),
    "fail": ("post", "/api/items/{id}/fail", {"lease": "x"}),
    "extend": ("post", "/api/items/{id}/extend", {"lease": "x"}),
}


@pytest.mark.parametrize("endpoint", sorted(BODY_ENDPOINTS))
def test_the_good_bodies_are_accepted(world, endpoint):
    """Control: each body the refusal tests corrupt is accepted as sent, so a refusal below is
    caused by the corruption and not by a broken baseline."""
    method, path, body = BODY_ENDPOINTS[endpoint]
    response = send(world, method, path, body)
    assert response.status_code in (200, 201), response.content
    answer = response.json()
    if endpoint in ("result", "fail", "extend"):
        assert answer["accepted"] is True, answer
    if endpoint == "claim":
        assert {i["id"] for i in answer["items"]} == {world.pending, world.threaded}
    if endpoint == "bulk_delete":
        assert answer == {"deleted": 2}
    assert snapshot(world.root) != world.before


# -- malformed and non-object bodies -----------------------------------------------------------

MALFORMED = {
    "truncated": b'{"payload": 1',
    "single_quotes": b"{'payload': 1}",
    "trailing_garbage": b'{"payload": 1} x',
    "trailing_comma": b'{"payload": 1,}',
    "bare_word": b"payload",
    "invalid_utf8": b'{"payload": "\xff\xfe"}',
    "utf16": '{"payload": 1}'.encode("utf-16"),
    "comment": b'{"payload": 1 /* c */}',
    "deep_nesting": b"[" * 100_000 + b"]" * 100_000,
}


@pytest.mark.parametrize("endpoint", sorted(BODY_ENDPOINTS))
@pytest.mark.parametrize("kind", sorted(MALFORMED))
def test_malformed_json_is_refused_with_400(world, endpoint, kind):
    method, path, _body = BODY_ENDPOINTS[endpoint]
    refused(world, send(world, method, path, raw=MALFORMED[kind]), 400)


NON_OBJECTS = {
    "array": [],
    "list_of_object": [{"payload": 1}],
    "string": "x",
    "number": 1,
    "null": None,
    "true": True,
}


@pytest.mark.parametrize("endpoint", sorted(BODY_ENDPOINTS))
@pytest.mark.parametrize("kind", sorted(NON_OBJECTS))
def test_non_object_body_is_refused_with_400(world, endpoint, kind):
    method, path, _body = BODY_ENDPOINTS[endpoint]
    raw = json.dumps(NON_OBJECTS[kind]).encode()
    refused(world, send(world, method, path, raw=raw), 400)


@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"],
)
@pytest.mark.parametrize("endpoint", sorted(BODY_ENDPOINTS))
def test_body_that_is_not_json_media_type_is_refused_with_415(world, endpoint, content_type):
    method, path, body = BODY_ENDPOINTS[endpoint]
    raw = json.dumps(world.fill(body)).encode()
    refused(world, send(world, method, path, raw=raw, content_type=content_type), 415)


# -- wrong types, unknown fields, missing fields, out of range ---------------------------------

WRONG_TYPES = [
    ("put_queue", {"leaseSeconds": "60"}),
    ("put_queue", {"queueSeconds": None}),
    ("put_queue", {"maxAttempts": 1.5}),
    ("put_queue", {"maxAttempts": True}),
    ("put_queue", {"maxAttempts": "3"}),
    ("put_queue", {"retainFrom": 1}),
    ("put_queue", {"retainFrom": {}}),
    ("put_queue", {"retainFrom": ["finished"]}),
    ("put_queue", {"deadLetterQueue": 5}),
    ("put_queue", {"backoffSeconds": [1]}),
    ("put_queue", {"leaseSeconds": True}),
    ("post_item", {"payload": 1, "threadId": 5}),
    ("post_item", {"payload": 1, "threadId": ["t"]}),
    ("post_item", {"payload": 1, "threadId": True}),
    ("post_item", {"payload": 1, "key": 5}),
    ("post_item", {"payload": 1, "key": {"k": 1}}),
    ("post_item", {"payload": 1, "scheduledAt": 1767225600}),
    ("post_item", {"payload": 1, "delaySeconds": "5"}),
    ("post_item", {"payload": 1, "delaySeconds": True}),
    ("post_item", {"items": {"payload": 1}}),
    ("post_item", {"items": "x"}),
    ("post_item", {"items": None}),
    ("post_item", {"items": [1, 2]}),
    ("post_item", {"items": [{"payload": 1}, "x"]}),
    ("bulk_delete", {"ids": "abc"}),
    ("bulk_delete", {"ids": [1]}),
    ("bulk_delete", {"ids": [None]}),
    ("bulk_delete", {"ids": {"{pending}": 1}}),
    ("bulk_delete", {"status": 5}),
    ("bulk_delete", {"status": ["pending"]}),
    ("claim", {"max": "1"}),
    ("claim", {"max": 1.0}),
    ("claim", {"max": True}),
    ("claim", {"max": None}),
    ("claim", {"wait": "1"}),
    ("claim", {"wait": True}),
    ("claim", {"wait": None}),
    ("fail", {"lease": 5}),
    ("fail", {"lease": [LEASE]}),
    ("fail", {"lease": LEASE, "retry": "true"}),
    ("fail", {"lease": LEASE, "retry": "false"}),
    ("fail", {"lease": LEASE, "retry": 0}),
    ("fail", {"lease": LEASE, "retry": None}),
    ("fail", {"lease": LEASE, "error": 5, "retry": False}),
    ("fail", {"lease": LEASE, "error": {"m": 1}, "retry": False}),
    ("extend", {"lease": 5}),
    ("extend", {"lease": LEASE, "seconds": "10"}),
    ("extend", {"lease": LEASE, "seconds": True}),
]


@pytest.mark.parametrize(("endpoint", "body"), WRONG_TYPES)
def test_wrong_type_is_refused_with_400(world, endpoint, body):
    method, path, _good = BODY_ENDPOINTS[endpoint]
    refused(world, send(world, method, path, body), 400)


UNKNOWN_FIELDS = [
    ("put_queue", {"bogus": 1}, "bogus"),
    ("put_queue", {"lease_seconds": 30}, "lease_seconds"),
    ("put_queue", {"name": "q"}, "name"),
    ("put_queue", {"counts": {}}, "counts"),
    ("post_item", {"payload": 1, "bogus": 1}, "bogus"),
    ("post_item", {"payload": 1, "thread_id": "t"}, "thread_id"),
    ("post_item", {"payload": 1, "delay": 5}, "delay"),
    ("post_item", {"payload": 1, "id": "x"}, "id"),
    ("post_item", {"payload": 1, "status": "finished"}, "status"),
    ("post_item", {"items": [{"payload": 1, "bogus": 1}]}, "bogus"),
    ("post_item", {"items": [{"payload": 1}], "bogus": 1}, "bogus"),
    ("post_item", {"items": [{"payload": 1}], "payload": 1}, "payload"),
    ("bulk_delete", {"status": "pending", "bogus": 1}, "bogus"),
    ("bulk_delete", {"ids": ["{pending}"], "queue": "q"}, "queue"),
    ("claim", {"max": 1, "bogus": 1}, "bogus"),
    ("claim", {"count": 5}, "count"),
    ("claim", {"timeout": 1}, "timeout"),
    ("result", {"result": 1, "bogus": 1}, "bogus"),
    ("fail", {"lease": LEASE, "retry": False, "bogus": 1}, "bogus"),
    ("fail", {"lease": LEASE, "retryable": False}, "retryable"),
    ("extend", {"lease": LEASE, "bogus": 1}, "bogus"),
    ("extend", {"lease": LEASE, "leaseSeconds": 5}, "leaseSeconds"),
]


@pytest.mark.parametrize(("endpoint", "body", "name"), UNKNOWN_FIELDS)
def test_unknown_field_is_refused_with_400_naming_it(world, endpoint, body, name):
    method, path, _good = BODY_ENDPOINTS[endpoint]
    error = refused(world, send(world, method, path, body), 400)
    assert name in error["message"], error


MISSING_FIELDS = [
    ("post_item", {}),
    ("post_item", {"threadId": "t"}),
    ("post_item", {"items": [{}]}),
    ("post_item", {"items": [{"payload": 1}, {"threadId": "t"}]}),
    ("result", {}),
    ("fail", {}),
    ("fail", {"error": "x", "retry": False}),
    ("extend", {}),
    ("extend", {"seconds": 5}),
    ("bulk_delete", {}),
]


@pytest.mark.parametrize(("endpoint", "body"), MISSING_FIELDS)
def test_missing_required_field_is_refused_with_400(world, endpoint, body):
    method, path, _good = BODY_ENDPOINTS[endpoint]
    refused(world, send(world, method, path, body), 400)


@pytest.mark.parametrize("endpoint", ["post_item", "result", "fail", "extend", "bulk_delete"])
def test_empty_body_where_fields_are_required_is_refused_with_400(world, endpoint):
    method, path, _good = BODY_ENDPOINTS[endpoint]
    refused(world, send(world, method, path, raw=b""), 400)


def test_bulk_delete_with_both_ids_and_status_is_refused_with_400(world):
    body = {"ids": ["{pending}"], "status": "pending"}
    refused(world, send(world, "post", "/api/queues/q/items/delete", body), 400)


OUT_OF_RANGE = [
    ("put_queue", {"leaseSeconds": 0}),
    ("put_queue", {"leaseSeconds": -1}),
    ("put_queue", {"leaseSeconds": 10**12}),
    ("put_queue", {"leaseSeconds": 10**400}),
    ("put_queue", {"retainSeconds": -(10**400)}),
    ("put_queue", {"maxAttempts": 10**400}),
    ("put_queue", {"queueSeconds": 0}),
    ("put_queue", {"retainSeconds": -1}),
    ("put_queue", {"maxAttempts": 0}),
    ("put_queue", {"maxAttempts": -3}),
    ("put_queue", {"backoffSeconds": -1}),
    ("put_queue", {"backoffSeconds": 100, "backoffMaxSeconds": 10}),
    ("put_queue", {"retainFrom": "never"}),
    ("put_queue", {"deadLetterQueue": "q"}),
    ("put_queue", {"deadLetterQueue": "nosuch"}),
    ("put_queue", {"deadLetterQueue": ".."}),
    ("put_queue", {"deadLetterQueue": ""}),
    ("post_item", {"payload": 1, "threadId": ""}),
    ("post_item", {"payload": 1, "threadId": "t" * 201}),
    ("post_item", {"payload": 1, "threadId": "a\nb"}),
    ("post_item", {"payload": 1, "threadId": "a\x00b"}),
    ("post_item", {"payload": 1, "threadId": "a\x7fb"}),
    ("post_item", {"payload": 1, "threadId": "a\x85b"}),
    ("post_item", {"payload": 1, "scheduledAt": None, "delaySeconds": 5}),
    ("post_item", {"payload": 1, "scheduledAt": "2030-01-31 12:00:00Z"}),
    ("post_item", {"payload": 1, "scheduledAt": "2030-01-31T12:00Z"}),
    ("post_item", {"payload": 1, "scheduledAt": "20300131T120000Z"}),
    ("post_item", {"payload": 1, "key": ""}),
    ("post_item", {"payload": 1, "key": "k" * 201}),
    ("post_item", {"payload": 1, "key": "a\x00b"}),
    ("post_item", {"payload": 1, "delaySeconds": -1}),
    ("post_item", {"payload": 1, "delaySeconds": 10**400}),
    ("bulk_delete", {"status": "done"}),
    ("bulk_delete", {"status": "bogus"}),
    ("bulk_delete", {"ids": ["../{pending}"]}),
    ("bulk_delete", {"ids": ["{pending}", "a/b"]}),
    ("bulk_delete", {"ids": ["x" * 65]}),
    ("bulk_delete", {"ids": [""]}),
    ("claim", {"max": 0}),
    ("claim", {"max": -1}),
    ("claim", {"max": 101}),
    ("claim", {"wait": -1}),
    ("claim", {"wait": 61}),
    ("claim", {"wait": 10**400}),
    ("claim", {"max": 10**400}),
    ("fail", {"lease": LEASE, "error": "e" * 10_001, "retry": False}),
    ("fail", {"lease": LEASE, "error": "a\x00b", "retry": False}),
    ("extend", {"lease": LEASE, "seconds": 0}),
    ("extend", {"lease": LEASE, "seconds": -5}),
    ("extend", {"lease": LEASE, "seconds": 10**9}),
    ("extend", {"lease": LEASE, "seconds": 10**400}),
]


@pytest.mark.parametrize(("endpoint", "body"), OUT_OF_RANGE)
def test_value_out_of_range_is_refused_with_400(world, endpoint, body):
    method, path, _good = BODY_ENDPOINTS[endpoint]
    refused(world, send(world, method, path, body), 400)


def test_invalid_settings_for_a_new_queue_create_nothing(world):
    refused(world, send(world, "put", "/api/queues/fresh", {"leaseSeconds": -1}), 400)
    assert not (world.root / "fresh").exists()


# -- NaN and Infinity --------------------------------------------------------------------------

NON_FINITE = [
    ("post_item", b'{"payload": NaN}'),
    ("post_item", b'{"payload": Infinity}'),
    ("post_item", b'{"payload": -Infinity}'),
    ("post_item", b'{"payload": [1, {"x": NaN}]}'),
    ("post_item", b'{"payload": 1e999}'),
    ("post_item", b'{"payload": {"x": -1e999}}'),
    ("post_item", b'{"payload": 1, "delaySeconds": Infinity}'),
    ("post_item", b'{"payload": 1, "delaySeconds": NaN}'),
    ("post_item", b'{"items": [{"payload": 1}, {"payload": NaN}]}'),
    ("result", b'{"result": NaN}'),
    ("result", b'{"result": Infinity}'),
    ("result", b'{"result": 1e999}'),
    ("claim", b'{"max": Infinity}'),
    ("claim", b'{"wait": NaN}'),
    ("claim", b'{"wait": 1e999}'),
    ("put_queue", b'{"leaseSeconds": NaN}'),
    ("put_queue", b'{"leaseSeconds": Infinity}'),
    ("put_queue", b'{"queueSeconds": 1e999}'),
    ("extend", b'{"lease": "<lease>", "seconds": NaN}'),
    ("extend", b'{"lease": "<lease>", "seconds": 1e999}'),
]


@pytest.mark.parametrize(("endpoint", "raw"), NON_FINITE)
def test_nan_and_infinity_are_refused_with_400(world, endpoint, raw):
    method, path, _good = BODY_ENDPOINTS[endpoint]
    raw = raw.replace(b"<lease>", world.lease.encode())
    refused(world, send(world, method, path, raw=raw), 400)


LONE_SURROGATES = [
    ("post_item", b'{"payload": "\\ud800"}'),
    ("post_item", b'{"payload": {"\\udfff": 1}}'),
    ("post_item", b'{"payload": 1, "key": "\\ud800"}'),
    ("post_item", b'{"payload": 1, "threadId": "\\ud800"}'),
    ("result", b'{"result": ["\\udc00"]}'),
    ("fail", b'{"lease": "<lease>", "error": "\\ud800", "retry": false}'),
    ("fail", b'{"lease": "\\ud800"}'),
    ("extend", b'{"lease": "\\ud800"}'),
    ("bulk_delete", b'{"ids": ["\\ud800"]}'),
]


@pytest.mark.parametrize(("endpoint", "raw"), LONE_SURROGATES)
def test_lone_surrogate_escapes_are_refused_with_400(world, endpoint, raw):
    """A ``\\ud800`` escape is valid JSON syntax but no Unicode text: it cannot be stored."""
    method, path, _good = BODY_ENDPOINTS[endpoint]
    raw = raw.replace(b"<lease>", world.lease.encode())
    refused(world, send(world, method, path, raw=raw), 400)


# -- unknown queues and items ------------------------------------------------------------------


@pytest.mark.parametrize("endpoint", sorted(set(QUEUE_ENDPOINTS) - {"put_queue"}))
def test_unknown_queue_is_refused_with_404(world, endpoint):
    method, path, body = QUEUE_ENDPOINTS[endpoint]
    refused(world, send(world, method, path.replace("{name}", "nosuch"), body), 404)


@pytest.mark.parametrize("endpoint", sorted(set(ITEM_ENDPOINTS) - {"result"}))
def test_unknown_item_is_refused_with_404(world, endpoint):
    method, path, body = ITEM_ENDPOINTS[endpoint]
    missing = "00000000000000000000"
    refused(world, send(world, method, path.replace("{id}", missing), body), 404)


def test_result_for_an_unknown_item_is_not_accepted_and_changes_nothing(world):
    """Rule 9: a result for an item that is gone gets ``accepted: false`` (not an error)."""
    response = send(world, "post", "/api/items/00000000000000000000/result", {"result": 1})
    assert response.status_code == 200, response.content
    assert response.json() == {"accepted": False, "status": None}
    assert snapshot(world.root) == world.before


# -- names and ids aimed at paths --------------------------------------------------------------

BAD_QUEUE_NAMES = [
    "..",
    "%2e%2e",
    "%2E%2E",
    ".",
    "%2e",
    ".hidden",
    "-lead",
    "_lead",
    "a/b",
    "a%2Fb",
    "%2F",
    "..%2F..%2Fetc",
    "%2e%2e%2fescape",
    "%00",
    "a%00b",
    "q%00",
    "a%5Cb",
    "..%5C..",
    "%C3%A9",
    "a%20b",
    "%20",
    "~root",
    "a*b",
    "a%0Ab",
    "x" * 65,
    "%2e" * 3,
]


@pytest.mark.parametrize("endpoint", sorted(QUEUE_ENDPOINTS))
@pytest.mark.parametrize("name", BAD_QUEUE_NAMES)
def test_queue_name_aimed_at_a_path_is_refused(world, endpoint, name):
    method, path, body = QUEUE_ENDPOINTS[endpoint]
    refused(world, send(world, method, path.replace("{name}", name), body), (400, 404))


@pytest.mark.parametrize("name", ["..", "%2e%2e", "a/b", "%00", "x" * 65])
def test_queue_name_aimed_at_a_path_is_refused_as_a_dead_letter_target(world, name):
    body = {"deadLetterQueue": name.replace("%2e", ".").replace("%00", "\x00")}
    refused(world, send(world, "put", "/api/queues/q", body), 400)


BAD_ITEM_IDS = [
    "..",
    "%2e%2e",
    ".",
    "a/b",
    "a%2Fb",
    "..%2F..%2Fq",
    "%00",
    "a%00b",
    "a.json",
    "%C3%A9",
    "a%20b",
    "x" * 65,
    "{pending}%00",
]


@pytest.mark.parametrize("endpoint", sorted(ITEM_ENDPOINTS))
@pytest.mark.parametrize("item_id", BAD_ITEM_IDS)
def test_item_id_aimed_at_a_path_is_refused(world, endpoint, item_id):
    method, path, body = ITEM_ENDPOINTS[endpoint]
    refused(world, send(world, method, path.replace("{id}", item_id), body), (400, 404))


@pytest.mark.parametrize(
    "path",
    [
        "/api/queues/",
        "/api/queues//items",
        "/api/items/",
        "/api/items//result",
        "/api/queues/q/items/",
        "/api/nothing",
        "/api/queues/q/items/delete/x",
        "/api/queues/a/b/claim",
    ],
)
@pytest.mark.parametrize("method", ["get", "post", "put", "delete"])
def test_route_miss_is_a_json_404(world, path, method):
    refused(world, send(world, method, path, {"payload": 1}), 404)


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("patch", "/api/queues/q"),
        ("post", "/api/queues/q"),
        ("post", "/api/queues"),
        ("get", "/api/queues/q/claim"),
        ("put", "/api/queues/q/items"),
        ("delete", "/api/queues/q/items"),
        ("get", "/api/queues/q/items/delete"),
        ("put", "/api/items/{pending}"),
        ("post", "/api/items/{pending}"),
        ("get", "/api/items/{processing}/result"),
        ("delete", "/api/items/{failed}/restart"),
    ],
)
def test_wrong_method_is_refused_with_405(world, method, path):
    refused(world, send(world, method, path, {"payload": 1}), 405)


# -- sizes -------------------------------------------------------------------------------------


@pytest.fixture
def small_payloads(settings: Any) -> int:
    limit = 64
    settings.TASKHOSTER = {**settings.TASKHOSTER, "MAX_PAYLOAD_BYTES": limit}
    return limit


def test_payload_over_the_limit_is_refused_with_413(world, small_payloads):
    refused(world, send(world, "post", "/api/queues/q/items", {"payload": "x" * 100}), 413)


def test_batch_with_one_payload_over_the_limit_is_refused_with_413(world, small_payloads):
    body = {"items": [{"payload": 1}, {"payload": {"big": "x" * 100}}, {"payload": 2}]}
    refused(world, send(world, "post", "/api/queues/q/items", body), 413)


def test_result_over_the_limit_is_refused_with_413(world, small_payloads):
    body = {"result": ["x" * 100]}
    refused(world, send(world, "post", "/api/items/{processing}/result", body), 413)


def test_result_over_the_limit_for_a_pending_item_is_refused_with_413(world, small_payloads):
    body = {"result": "x" * 100}
    refused(world, send(world, "post", "/api/items/{pending}/result", body), 413)


def test_payload_limit_counts_utf8_bytes_not_characters(world, small_payloads):
    # 40 characters, 120 bytes of UTF-8: over a 64-byte limit.
    refused(world, send(world, "post", "/api/queues/q/items", {"payload": "€" * 40}), 413)


def test_request_body_over_the_body_limit_is_refused_with_413(world, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1000
    body = {"items": [{"payload": i} for i in range(200)]}
    refused(world, send(world, "post", "/api/queues/q/items", body), 413)


def test_batch_over_1000_items_is_refused_with_413(world):
    body = {"items": [{"payload": i} for i in range(1001)]}
    refused(world, send(world, "post", "/api/queues/q/items", body), 413)


def test_empty_batch_is_refused_with_400(world):
    refused(world, send(world, "post", "/api/queues/q/items", {"items": []}), 400)


def test_batch_with_one_invalid_member_posts_none(world):
    body = {"items": [{"payload": 1}, {"payload": 2, "threadId": 7}, {"payload": 3}]}
    refused(world, send(world, "post", "/api/queues/q/items", body), 400)


# -- scheduling --------------------------------------------------------------------------------


def _wire(at: datetime) -> str:
    return at.astimezone(UTC).isoformat().replace("+00:00", "Z")


def test_scheduled_at_beyond_the_queue_timeout_is_refused_with_409(world):
    later = datetime.now(UTC) + timedelta(hours=2)  # queueSeconds is 3600
    body = {"payload": 1, "scheduledAt": _wire(later)}
    refused(world, send(world, "post", "/api/queues/q/items", body), 409)


def test_delay_beyond_the_queue_timeout_is_refused_with_409(world):
    body = {"payload": 1, "delaySeconds": 3700}
    refused(world, send(world, "post", "/api/queues/q/items", body), 409)


def test_batch_with_one_member_beyond_the_queue_timeout_posts_none(world):
    later = datetime.now(UTC) + timedelta(hours=2)
    body = {"items": [{"payload": 1}, {"payload": 2, "scheduledAt": _wire(later)}]}
    refused(world, send(world, "post", "/api/queues/q/items", body), 409)


@pytest.mark.parametrize(
    "when",
    [
        "2030-01-01T00:00:00",
        "2030-01-01",
        "2030-01-01 00:00:00",
        datetime.now().replace(microsecond=0).isoformat(),
    ],
)
def test_naive_scheduled_at_is_refused_with_400(world, when):
    refused(
        world, send(world, "post", "/api/queues/q/items", {"payload": 1, "scheduledAt": when}), 400
    )


@pytest.mark.parametrize(
    "when",
    [
        "",
        "soon",
        "tomorrow at noon",
        "2030-13-01T00:00:00Z",
        "2030-01-01T25:00:00Z",
        "9999-12-31T23:59:59-01:00",
        "0001-01-01T00:00:00+01:00",
        "1" * 100,
    ],
)
def test_unparseable_scheduled_at_is_refused_with_400(world, when):
    refused(
        world, send(world, "post", "/api/queues/q/items", {"payload": 1, "scheduledAt": when}), 400
    )


def test_both_scheduled_at_and_delay_seconds_is_refused_with_400(world):
    soon = _wire(datetime.now(UTC) + timedelta(minutes=1))
    body = {"payload": 1, "scheduledAt": soon, "delaySeconds": 60}
    refused(world, send(world, "post", "/api/queues/q/items", body), 400)


# -- query parameters --------------------------------------------------------------------------


def _b64(text: bytes) -> str:
    import base64

    return base64.urlsafe_b64encode(text).decode().rstrip("=")


@pytest.mark.parametrize(
    "cursor",
    [
        "!!!",
        "a",
        "%25%25",
        "Li4vZXRj",
        _b64(b"../etc"),
        _b64(b"\xff\xfe"),
        _b64(b"a/b"),
        _b64(b"x" * 65),
        "x" * 200,
        _b64(b"a\x00b"),
        "%00",
        "!!!!",  # not base64url: once decoded leniently (to an empty position)
        "YWJj+w==",
    ],
)
def test_invalid_cursor_is_refused_with_400(world, cursor):
    refused(world, send(world, "get", f"/api/queues/q/items?cursor={cursor}"), 400)


@pytest.mark.parametrize(
    "status", ["bogus", "done", "PENDING", "pending,failed", "%00", "finished%20", ""]
)
def test_invalid_status_filter_is_refused_with_400(world, status):
    refused(world, send(world, "get", f"/api/queues/q/items?status={status}"), 400)


@pytest.mark.parametrize("thread_id", ["t" * 201, "%00", "a%0Ab", "", "a%C2%85b"])
def test_invalid_thread_id_filter_is_refused_with_400(world, thread_id):
    refused(world, send(world, "get", f"/api/queues/q/items?threadId={thread_id}"), 400)


@pytest.mark.parametrize(
    "limit", ["0", "-1", "1001", "100000000000000000000", "abc", "1.5", "1e3", "%00", "", "1_0"]
)
def test_limit_out_of_range_is_refused_with_400(world, limit):
    refused(world, send(world, "get", f"/api/queues/q/items?limit={limit}"), 400)


@pytest.mark.parametrize(
    "wait", ["-1", "61", "60.5", "1e9", "abc", "nan", "inf", "-inf", "%00", "", "1_0"]
)
@pytest.mark.parametrize("item", ["{pending}", "{finished}"])
def test_wait_out_of_range_is_refused_with_400(world, wait, item):
    refused(world, send(world, "get", f"/api/items/{item}?wait={wait}"), 400)


def test_refused_read_of_a_terminal_item_does_not_start_its_fetched_clock(world):
    refused(world, send(world, "get", "/api/items/{finished}?wait=abc"), 400)
    assert Item.objects.get(id=world.finished).fetched_at is None


# -- conflicts and stale claims ----------------------------------------------------------------


@pytest.mark.parametrize("item", ["{pending}", "{processing}", "{finished}", "{threaded}"])
def test_restart_of_an_item_that_is_not_failed_is_refused_with_409(world, item):
    refused(world, send(world, "post", f"/api/items/{item}/restart"), 409)


def test_bulk_delete_by_ids_of_another_queue_deletes_nothing(world):
    response = send(world, "post", "/api/queues/q/items/delete", {"ids": ["{other}"]})
    assert response.status_code == 200, response.content
    assert response.json() == {"deleted": 0}
    after = snapshot(world.root)
    assert after == world.before
