"""The ``/work`` socket's AsyncAPI document (``taskhoster.asyncapi``): made from the contract,
it takes what the consumer takes, refuses what it refuses, and describes what the server sends.

The socket tests check every frame they receive against it (``tests.integration.wsclient``);
these prove the document's shape, that its schemas agree with ``contract.validate``, and that
the frame check can fail.
"""

from __future__ import annotations

import io
import json
import re
from typing import Any

import httpx
import pytest
from django.core.management import call_command
from jsonschema import Draft7Validator

from taskhoster import contract
from taskhoster.asyncapi import build_document
from taskhoster.errors import TaskhosterError
from tests.integration.wsclient import check_frame, sent_message_validators

FRAME_TYPES = {
    "subscribe",
    "result",
    "results",
    "fail",
    "extend",
    "progress",
    "item",
    "items",
    "ack",
    "acks",
    "cancel",
    "drain",
    "error",
}
ITEM_ID = "0641f3a0c2b1d4e5f6a7b8"


@pytest.fixture
def document() -> dict[str, Any]:
    return build_document()


def follow(document: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        target: Any = document
        for part in node["$ref"].removeprefix("#/").split("/"):
            target = target[part]
        node = target
    return node


def payload_schema(document: dict[str, Any], kind: str) -> dict[str, Any]:
    return follow(document, follow(document, document["components"]["messages"][kind])["payload"])


def schema_errors(document: dict[str, Any], kind: str, frame: Any) -> list[str]:
    validator = Draft7Validator(payload_schema(document, kind))
    return [error.message for error in validator.iter_errors(frame)]


# -- the document's shape -----------------------------------------------------------------------


def test_document_is_asyncapi_3_with_the_work_channel_and_all_thirteen_frames(document) -> None:
    assert document["asyncapi"] == "3.0.0"
    assert document["info"]["title"]
    assert document["info"]["version"]
    channel = document["channels"]["work"]
    assert channel["address"] == "/work"
    assert set(channel["messages"]) == FRAME_TYPES
    assert set(document["components"]["messages"]) == FRAME_TYPES
    for kind in FRAME_TYPES:
        schema = payload_schema(document, kind)
        Draft7Validator.check_schema(schema)
        assert schema["properties"]["type"] == {"const": kind}
        assert schema["additionalProperties"] is False
        assert follow(document, channel["messages"][kind])["name"] == kind


def test_operations_receive_the_contract_frames_and_send_the_server_frames(document) -> None:
    actions: dict[str, set[str]] = {"send": set(), "receive": set()}
    for operation in document["operations"].values():
        assert follow(document, operation["channel"]) is document["channels"]["work"]
        for ref in operation["messages"]:
            # An operation's messages are its channel's.
            assert ref["$ref"].startswith("#/channels/work/messages/")
            actions[operation["action"]].add(follow(document, ref)["name"])
    assert actions["receive"] == set(contract.FRAMES)
    assert actions["send"] == {"item", "items", "ack", "acks", "cancel", "drain", "error"}
    replies = {
        follow(document, ref)["name"]
        for ref in document["operations"]["receiveResult"]["reply"]["messages"]
    }
    assert replies == {"ack", "error"}
    # Several results in a frame (the optional extension) are answered by one acks frame.
    replies = {
        follow(document, ref)["name"]
        for ref in document["operations"]["receiveResults"]["reply"]["messages"]
    }
    assert replies == {"acks", "error"}


def test_document_states_the_auth_and_the_consumers_close_codes(document) -> None:
    from taskhoster.work import consumer

    scheme = document["components"]["securitySchemes"]["token"]
    assert (scheme["type"], scheme["name"], scheme["in"]) == (
        "httpApiKey",
        "Authorization",
        "header",
    )
    assert "work" in scheme["description"]
    headers = document["channels"]["work"]["bindings"]["ws"]["headers"]
    assert re.fullmatch(headers["properties"]["Authorization"]["pattern"], "Token abc123")
    codes = document["channels"]["work"]["x-close-codes"]
    expected = {
        consumer.CLOSE_UNAUTHORIZED,
        consumer.CLOSE_FORBIDDEN,
        consumer.CLOSE_ABUSE,
        consumer.CLOSE_SERVER_ERROR,
    }
    assert {int(code) for code in codes} == expected
    for code in expected:
        assert f"| {code} |" in document["info"]["description"]


def test_every_example_matches_its_message(document) -> None:
    for kind, message in document["components"]["messages"].items():
        for example in message["examples"]:
            assert schema_errors(document, kind, example["payload"]) == [], kind


def test_settings_bound_limits_are_read_when_the_document_is_built(settings) -> None:
    assert payload_schema(build_document(), "subscribe")["properties"]["capacity"]["maximum"] == (
        1000
    )
    settings.TASKHOSTER = {**settings.TASKHOSTER, "MAX_CAPACITY": 7}
    assert payload_schema(build_document(), "subscribe")["properties"]["capacity"]["maximum"] == 7


# -- the frames a worker sends: the schema agrees with contract.validate ------------------------

GOOD_FRAMES = [
    {"type": "subscribe", "queues": ["a", "b.c_d-1"], "capacity": 4},
    {"type": "subscribe", "queues": ["q"], "capacity": 0},
    {"type": "result", "id": ITEM_ID, "result": {"any": ["json", 1, None]}},
    {"type": "result", "id": ITEM_ID, "result": None},
    {"type": "fail", "id": ITEM_ID},
    {"type": "fail", "id": ITEM_ID, "error": "smtp down", "retry": False},
    {"type": "fail", "id": ITEM_ID, "error": None},
    {"type": "extend", "id": ITEM_ID},
    {"type": "extend", "id": ITEM_ID, "seconds": 0.5},
    {"type": "extend", "id": ITEM_ID, "seconds": None},
]
BAD_FRAMES = [
    pytest.param({"type": "subscribe", "queues": ["q"], "capacity": 1001}, id="capacity-too-big"),
    pytest.param({"type": "subscribe", "queues": ["q"], "capacity": -1}, id="capacity-negative"),
    pytest.param({"type": "subscribe", "queues": ["q"], "capacity": "4"}, id="capacity-string"),
    pytest.param({"type": "subscribe", "queues": ["q"]}, id="capacity-missing"),
    pytest.param({"type": "subscribe", "queues": [], "capacity": 1}, id="no-queues"),
    pytest.param({"type": "subscribe", "queues": ["-q"], "capacity": 1}, id="bad-queue-name"),
    pytest.param({"type": "subscribe", "queues": ["a/b"], "capacity": 1}, id="queue-with-slash"),
    pytest.param({"type": "subscribe", "queues": ["x" * 65], "capacity": 1}, id="queue-too-long"),
    pytest.param(
        {"type": "subscribe", "queues": ["q"], "capacity": 1, "prefetch": 2}, id="unknown-field"
    ),
    pytest.param({"type": "result", "result": 1}, id="result-missing-id"),
    pytest.param({"type": "result", "id": ITEM_ID}, id="result-missing-result"),
    pytest.param({"type": "result", "id": "a/b", "result": 1}, id="result-bad-id"),
    pytest.param({"type": "result", "id": "x" * 65, "result": 1}, id="result-id-too-long"),
    pytest.param({"type": "fail", "id": ITEM_ID, "retry": "no"}, id="fail-retry-not-boolean"),
    pytest.param({"type": "fail", "id": ITEM_ID, "error": 5}, id="fail-error-not-string"),
    pytest.param({"type": "fail", "id": ITEM_ID, "error": "a\x00b"}, id="fail-error-with-nul"),
    pytest.param({"type": "fail", "id": ITEM_ID, "error": "x" * 10_001}, id="fail-error-too-long"),
    pytest.param({"type": "extend", "id": ITEM_ID, "seconds": 0}, id="extend-zero-seconds"),
    pytest.param({"type": "extend", "id": ITEM_ID, "seconds": 10**7}, id="extend-too-long"),
    pytest.param({"type": "extend", "id": None}, id="extend-null-id"),
]


@pytest.mark.parametrize("frame", GOOD_FRAMES)
def test_a_frame_the_contract_takes_matches_its_message(document, frame) -> None:
    contract.validate(contract.FRAMES[frame["type"]], frame)
    assert schema_errors(document, frame["type"], frame) == []


@pytest.mark.parametrize("frame", BAD_FRAMES)
def test_a_frame_the_contract_refuses_does_not_match_its_message(document, frame) -> None:
    with pytest.raises(TaskhosterError):
        contract.validate(contract.FRAMES[frame["type"]], frame)
    assert schema_errors(document, frame["type"], frame) != []


def test_a_frame_of_another_type_does_not_match(document) -> None:
    frame = {"type": "fail", "id": ITEM_ID}
    assert schema_errors(document, "extend", frame) != []


# -- the frames the server sends: the check can pass and can fail -------------------------------


def good_server_frames() -> dict[str, dict[str, Any]]:
    return {
        "item": {
            "type": "item",
            "id": ITEM_ID,
            "queue": "q",
            "status": "processing",
            "payload": [1, 2],
            "threadId": "t",
            "priority": 3,
            "scheduledAt": "2026-01-31T12:00:00.000000Z",
            "postedAt": "2026-01-31T12:00:00.000000Z",
            "attempts": 2,
            "leaseExpiresAt": "2026-01-31T12:01:00.000000Z",
            "finishedAt": None,
            "error": "lease expired",
            "key": None,
            "origin": {"queue": "src", "id": ITEM_ID, "error": "boom", "attempts": 3},
            "progress": None,
            "lease": "abc",
        },
        "ack": {"type": "ack", "id": ITEM_ID, "accepted": False},
        "cancel": {"type": "cancel", "id": ITEM_ID, "reason": "timeout"},
        "error": {"type": "error", "code": "bad_json", "message": "a frame is one JSON object"},
    }


def without(frame: dict[str, Any], name: str) -> dict[str, Any]:
    return {k: v for k, v in frame.items() if k != name}


def test_good_server_frames_pass_the_check() -> None:
    for frame in good_server_frames().values():
        check_frame(frame)
    check_frame({"type": "ack", "id": ITEM_ID, "accepted": True, "status": "finished"})
    check_frame(
        {"type": "ack", "id": ITEM_ID, "accepted": True, "leaseExpiresAt": "2026-01-31T12:01:00Z"}
    )
    check_frame({"type": "ack", "id": ITEM_ID, "accepted": False, "leaseExpiresAt": None})
    check_frame({"type": "error", "code": "item_not_found", "message": "gone", "id": ITEM_ID})


def wrong_server_frames() -> list[Any]:
    good = good_server_frames()
    item, ack, cancel, error = good["item"], good["ack"], good["cancel"], good["error"]
    return [
        pytest.param(without(item, "id"), id="item-without-id"),
        pytest.param(without(item, "lease"), id="item-without-lease"),
        pytest.param({**item, "result": 1}, id="item-with-an-undeclared-field"),
        pytest.param({**item, "status": "pending"}, id="item-not-processing"),
        pytest.param({**item, "attempts": 0}, id="item-never-claimed"),
        pytest.param({**item, "leaseExpiresAt": None}, id="item-without-expiry"),
        pytest.param({**item, "scheduledAt": "2026-01-31T12:00:00+00:00"}, id="item-time-not-z"),
        pytest.param({**ack, "accepted": "yes"}, id="ack-accepted-not-boolean"),
        pytest.param(
            {**ack, "status": "finished", "leaseExpiresAt": "2026-01-31T12:01:00Z"},
            id="ack-with-status-and-expiry",
        ),
        pytest.param({**ack, "status": "done"}, id="ack-with-a-state-for-a-status"),
        pytest.param({**cancel, "reason": "bored"}, id="cancel-unknown-reason"),
        pytest.param(without(error, "message"), id="error-without-message"),
        pytest.param({**error, "id": "a b"}, id="error-with-bad-id"),
        pytest.param({"type": "subscribe", "queues": ["q"], "capacity": 1}, id="a-worker-frame"),
        pytest.param({"type": "hello"}, id="unknown-type"),
        pytest.param(["item"], id="not-an-object"),
    ]


@pytest.mark.parametrize("frame", wrong_server_frames())
def test_a_server_frame_that_breaks_the_document_fails_the_check(frame) -> None:
    with pytest.raises(AssertionError, match="frame"):
        check_frame(frame)


def test_the_check_names_the_frame_and_the_schema_error() -> None:
    frame = without(good_server_frames()["item"], "id")
    with pytest.raises(AssertionError) as failed:
        check_frame(frame)
    message = str(failed.value)
    assert "'item'" in message
    assert "'id' is a required property" in message
    assert repr(frame) in message


def test_the_check_reads_the_servers_messages_from_the_document(document) -> None:
    assert set(sent_message_validators(document)) == {
        "item",
        "items",
        "ack",
        "acks",
        "cancel",
        "drain",
        "error",
    }


# -- serving it -----------------------------------------------------------------------------------


@pytest.mark.django_db
def test_manage_py_asyncapi_prints_the_document() -> None:
    out = io.StringIO()
    call_command("asyncapi", "--host", "tasks.example.com", "--protocol", "wss", stdout=out)
    printed = json.loads(out.getvalue())
    assert printed == build_document(host="tasks.example.com", protocol="wss")
    assert printed["servers"]["taskhoster"]["host"] == "tasks.example.com"
    assert printed["servers"]["taskhoster"]["protocol"] == "wss"


@pytest.mark.django_db
def test_api_asyncapi_takes_only_get(client) -> None:
    assert client.post("/api/asyncapi").status_code == 405


@pytest.mark.slow
def test_get_api_asyncapi_serves_the_document_without_a_key(server_factory) -> None:
    server = server_factory()
    answer = httpx.get(f"{server.url}/api/asyncapi", timeout=10)
    assert answer.status_code == 200
    assert answer.headers["content-type"] == "application/json"
    served = answer.json()
    assert served["asyncapi"] == "3.0.0"
    assert served["servers"]["taskhoster"]["host"] == f"127.0.0.1:{server.port}"
    assert served["servers"]["taskhoster"]["protocol"] == "ws"
    expected = build_document(host=f"127.0.0.1:{server.port}")
    assert served["components"] == expected["components"]
    assert served["operations"] == expected["operations"]
