"""Error messages say what is wrong and what to send instead, in the API's terms: never a
framework's field names (``non_field_errors``), its phrasing ("Unsupported media type",
"Authentication credentials were not provided") or Python's decoder internals ("'utf-8' codec
can't decode", "(char 2)"). The codes stay the ones the schema lists.

Every bad body, content type and method below is tried in-process and, all together, against a
real daphne (which parses the Content-Type header its own way); a few bad socket frames show
that the socket, judged by the same declarations, words its messages the same way.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from rest_framework.test import APIClient

from .wsclient import connect, recv, send

JSON = "application/json"
# Words of Django, DRF or Python that must not reach a client.
INTERNALS = (
    "non_field_errors",
    "Unsupported media type",
    "credentials were not provided",
    'Method "',
    "codec",
    "(char ",
    "Expecting",
    "JSON parse error",
    "malformed JSON",
    "sys.set_int_max_str_digits",
    "You do not have permission",
)


@dataclass(frozen=True)
class Case:
    name: str
    path: str
    body: bytes | None
    content_type: str | None
    status: int
    code: str
    message: str
    method: str = "POST"
    keyed: bool = True
    exact: bool = False  # the whole message, not a part of it


ITEMS = "/api/queues/q/items"
CASES = [
    Case("array", ITEMS, b"[1, 2]", JSON, 400, "invalid_body", "the body must be a JSON object"),
    Case("string", ITEMS, b'"x"', JSON, 400, "invalid_body", "the body must be a JSON object"),
    Case("null", ITEMS, b"null", JSON, 400, "invalid_body", "the body must be a JSON object"),
    Case(
        "array to claim",
        "/api/queues/q/claim",
        b"[]",
        JSON,
        400,
        "invalid_body",
        "the body must be a JSON object",
    ),
    Case(
        "array as queue settings",
        "/api/queues/q",
        b"[]",
        JSON,
        400,
        "invalid_body",
        "the body must be a JSON object of settings",
        method="PUT",
    ),
    Case(
        "array as a batch member",
        ITEMS,
        b'{"items": [[1]]}',
        JSON,
        400,
        "invalid_body",
        "items[0] must be a JSON object",
    ),
    # A post body is one item or a batch: a mix of the two is named as such.
    Case(
        "payload and items",
        ITEMS,
        b'{"payload": 1, "items": [{"payload": 2}]}',
        JSON,
        400,
        "invalid_body",
        "a post body is either one item (payload, threadId, scheduledAt, delaySeconds, key, "
        "priority) or "
        "a batch (items), not both: this one has items and payload",
        exact=True,
    ),
    Case(
        "a batch with an item's options beside items",
        ITEMS,
        b'{"items": [{"payload": 2}], "key": "k", "threadId": "t"}',
        JSON,
        400,
        "invalid_body",
        "or a batch (items), not both: this one has items and threadId, key",
    ),
    # A bad member of a batch is named by its index, whatever is wrong with it.
    Case(
        "an unknown field in a batch member",
        ITEMS,
        b'{"items": [{"payload": 1}, {"payload": 2, "thread": "t"}]}',
        JSON,
        400,
        "unknown_field",
        "unknown field(s): items[1].thread",
    ),
    Case(
        "a bad field in a batch member",
        ITEMS,
        b'{"items": [{"payload": 1}, {"payload": 2, "threadId": ""}]}',
        JSON,
        400,
        "invalid",
        "items[1].threadId must be 1-200 characters",
    ),
    Case(
        "a batch member with both scheduledAt and delaySeconds",
        ITEMS,
        b'{"items": [{"payload": 1}, {"payload": 2, "delaySeconds": 5, '
        b'"scheduledAt": "2030-01-01T00:00:00Z"}]}',
        JSON,
        400,
        "invalid",
        "give items[1].scheduledAt or items[1].delaySeconds, not both",
    ),
    Case(
        "a batch member without a payload",
        ITEMS,
        b'{"items": [{"payload": 1}, {"key": "k"}]}',
        JSON,
        400,
        "missing_field",
        "items[1].payload is required",
    ),
    # Counts of entries read as English, for one and for many.
    Case(
        "an empty batch",
        ITEMS,
        b'{"items": []}',
        JSON,
        400,
        "invalid",
        "items needs at least 1 entry",
        exact=True,
    ),
    Case(
        "a batch over the limit",
        ITEMS,
        b'{"items": [' + b",".join([b'{"payload": 1}'] * 1001) + b"]}",
        JSON,
        413,
        "batch_too_large",
        "items holds at most 1000 entries",
        exact=True,
    ),
    Case(
        "syntax error",
        ITEMS,
        b'{"payload": 1,}',
        JSON,
        400,
        "bad_json",
        "the body is not valid JSON: expecting property name enclosed in double quotes at "
        "line 1, column 15",
    ),
    Case(
        "syntax error on a later line",
        ITEMS,
        b'{\n  "payload": [1,\n  2 3]}',
        JSON,
        400,
        "bad_json",
        "at line 3, column 5",
    ),
    Case(
        "trailing data",
        ITEMS,
        b'{"payload": 1} {}',
        JSON,
        400,
        "bad_json",
        "the body is not valid JSON: extra data at line 1, column 16",
    ),
    Case(
        "whitespace only",
        ITEMS,
        b"  ",
        JSON,
        400,
        "bad_json",
        "the body is not valid JSON: expecting value at line 1, column 3",
    ),
    Case(
        "NaN",
        ITEMS,
        b'{"payload": NaN}',
        JSON,
        400,
        "bad_json",
        "the body is not valid JSON: NaN is not a JSON number",
    ),
    Case(
        "a number too large for a double",
        ITEMS,
        b'{"payload": 1e999}',
        JSON,
        400,
        "bad_json",
        "the body is not valid JSON: the number 1e999 is too large",
    ),
    Case(
        "an integer of 5000 digits",
        ITEMS,
        b'{"payload": ' + b"7" * 5000 + b"}",
        JSON,
        400,
        "bad_json",
        "the body holds a number with too many digits",
    ),
    Case(
        "nested too deeply",
        ITEMS,
        b'{"payload": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        JSON,
        400,
        "too_deep",
        "the JSON is nested more than 100 levels deep",
    ),
    Case(
        "nested deeper than MAX_JSON_DEPTH",
        ITEMS,
        b'{"payload": ' + b"[" * 101 + b"]" * 101 + b"}",
        JSON,
        400,
        "too_deep",
        "the JSON is nested more than 100 levels deep",
    ),
    Case(
        "invalid UTF-8",
        ITEMS,
        b'{"payload": "caf\xe9"}',
        JSON,
        400,
        "bad_json",
        "the body is not UTF-8 text (byte 16 is not UTF-8): send JSON encoded as UTF-8",
    ),
    Case(
        "a lone surrogate escape",
        ITEMS,
        b'{"payload": "\\ud800"}',
        JSON,
        400,
        "bad_json",
        "the body holds a lone surrogate escape",
    ),
    Case(
        "text/plain",
        ITEMS,
        b'{"payload": 1}',
        "text/plain",
        415,
        "unsupported_media_type",
        "send the body as JSON with the header Content-Type: application/json "
        "(this request's Content-Type is text/plain)",
    ),
    Case(
        "form-encoded",
        ITEMS,
        b"payload=1",
        "application/x-www-form-urlencoded",
        415,
        "unsupported_media_type",
        "Content-Type: application/json (this request's Content-Type is "
        "application/x-www-form-urlencoded)",
    ),
    Case(
        "multipart",
        ITEMS,
        b'--b\r\nContent-Disposition: form-data; name="payload"\r\n\r\n1\r\n--b--\r\n',
        "multipart/form-data; boundary=b",
        415,
        "unsupported_media_type",
        "(this request's Content-Type is multipart/form-data)",
    ),
    Case(
        "a wrong method",
        "/api/queues/q/claim",
        None,
        None,
        405,
        "method_not_allowed",
        "GET is not allowed here; use POST",
        method="GET",
    ),
    Case(
        "a wrong method, several allowed",
        "/api/queues/q",
        None,
        None,
        405,
        "method_not_allowed",
        "PATCH is not allowed here; use GET, PUT or DELETE",
        method="PATCH",
    ),
    Case(
        "no key",
        "/api/queues",
        None,
        None,
        401,
        "unauthorized",
        "this needs an API key: send the header Authorization: Token <key>",
        method="GET",
        keyed=False,
    ),
]
# Only over HTTP: Django's test client always sends some Content-Type with a body.
NO_CONTENT_TYPE = Case(
    "no Content-Type",
    ITEMS,
    b'{"payload": 1}',
    None,
    415,
    "unsupported_media_type",
    "send the body as JSON with the header Content-Type: application/json (this request has none)",
)
UNKNOWN_PATH = Case(
    "an unknown endpoint",
    "/api/nothing-here",
    None,
    None,
    404,
    "not_found",
    "no endpoint at /api/nothing-here",
    method="GET",
)


def check(case: Case, status: int, body: Any) -> None:
    assert status == case.status, (case.name, status, body)
    assert set(body) == {"error"}, (case.name, body)
    error = body["error"]
    assert error["code"] == case.code, (case.name, error)
    if case.exact:
        assert error["message"] == case.message, (case.name, error)
    else:
        assert case.message in error["message"], (case.name, error)
    leaked = [word for word in INTERNALS if word in error["message"]]
    assert not leaked, (case.name, error)


@pytest.fixture
def q(make_queue: Any) -> Any:
    return make_queue("q")


@pytest.mark.parametrize("case", [*CASES, UNKNOWN_PATH], ids=lambda c: c.name)
def test_a_bad_request_gets_a_plain_actionable_message(
    case: Case, q: Any, make_key: Any, api: APIClient
) -> None:
    client = api if case.keyed else APIClient()
    extra: dict[str, Any] = {}
    if case.body is not None:
        extra = {"data": case.body, "content_type": case.content_type}
    answer = client.generic(case.method, case.path, **extra)
    check(case, answer.status_code, answer.json())


@pytest.mark.slow
def test_every_bad_request_over_http_gets_the_same_plain_message(server_factory, make_key, q):
    server = server_factory()
    key = make_key()
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for case in [*CASES, NO_CONTENT_TYPE, UNKNOWN_PATH]:
            headers = {"Authorization": f"Token {key}"} if case.keyed else {}
            if case.content_type:
                headers["Content-Type"] = case.content_type
            answer = http.request(case.method, case.path, content=case.body, headers=headers)
            assert answer.headers["Content-Type"].startswith("application/json"), case.name
            check(case, answer.status_code, answer.json())
        # Nothing of all that was posted.
        listed = http.get("/api/queues/q/items", headers={"Authorization": f"Token {key}"})
        assert listed.json()["items"] == []


def test_a_batch_over_a_limit_of_one_says_1_entry(
    q: Any, make_key: Any, api: APIClient, settings: Any
) -> None:
    settings.TASKHOSTER = {**settings.TASKHOSTER, "MAX_BATCH": 1}
    answer = api.post(ITEMS, {"items": [{"payload": 1}, {"payload": 2}]}, format="json")
    assert answer.status_code == 413
    assert answer.json()["error"] == {
        "code": "batch_too_large",
        "message": "items holds at most 1 entry",
    }


# Socket frames are judged by the same declarations, so they read the same way; a frame's
# fields are named under its type.
FRAMES = [
    (
        {"type": "subscribe", "queues": [], "capacity": 1},
        "invalid_queues",
        "subscribe.queues needs at least 1 entry",
    ),
    (
        {"type": "result", "id": "x", "result": 1, "extra": True},
        "unknown_field",
        "unknown field(s): result.extra",
    ),
]


@pytest.mark.slow
def test_a_bad_socket_frame_gets_the_same_plain_message(server_factory, make_key, q):
    server = server_factory()
    key = make_key()

    async def run() -> list[tuple[str, str]]:
        answers = []
        async with await connect(server, key) as ws:
            for frame, _code, _message in FRAMES:
                await send(ws, frame)
                error = await recv(ws)
                assert error["type"] == "error", error
                answers.append((error["code"], error["message"]))
        return answers

    assert asyncio.run(run()) == [(code, message) for _frame, code, message in FRAMES]


def test_the_schema_lists_bad_json_for_every_operation_with_a_body(api: APIClient) -> None:
    schema = api.get("/api/schema", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()
    for path in schema["paths"].values():
        for operation in path.values():
            if "requestBody" in operation:
                assert "bad_json" in operation["responses"]["400"]["description"]
                assert "unsupported_media_type" in operation["responses"]["415"]["description"]
