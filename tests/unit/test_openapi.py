"""``/api/schema`` says what the server enforces (issue: the API contract as a precise schema).

These read the generated document; ``scripts/fuzz`` (schemathesis) and
``tests/integration/test_generated_client.py`` prove it against a running server.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.core.management import call_command
from drf_spectacular.generators import SchemaGenerator
from drf_spectacular.settings import patched_settings

from taskhoster import contract, patterns
from taskhoster.api.schema_view import SPECTACULAR
from taskhoster.conf import get_conf
from taskhoster.ids import ID_PATTERN
from taskhoster.store import QUEUE_NAME_PATTERN


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    with patched_settings(SPECTACULAR):  # what /api/schema uses
        return SchemaGenerator().get_schema(request=None, public=True)


def operations(schema: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {op["operationId"]: op for path in schema["paths"].values() for op in path.values()}


def test_the_schema_generates_without_a_warning_and_validates(tmp_path) -> None:
    call_command(
        "spectacular",
        "--custom-settings",
        "taskhoster.api.schema_view.SPECTACULAR",
        "--validate",
        "--fail-on-warn",
        "--file",
        str(tmp_path / "s.yaml"),
    )


def test_every_operation_has_a_stable_id_a_tag_and_a_summary(schema) -> None:
    ops = operations(schema)
    assert len(ops) == sum(len(path) for path in schema["paths"].values())
    for op_id, op in ops.items():
        assert re.fullmatch(r"[a-z][A-Za-z]+", op_id)
        assert op["tags"]
        assert op["summary"]


def test_path_parameters_carry_the_servers_patterns(schema) -> None:
    seen = {}
    for path in schema["paths"].values():
        for op in path.values():
            for param in op.get("parameters", []):
                if param["in"] == "path":
                    seen[param["name"]] = param["schema"]
    assert seen["queue"]["pattern"] == QUEUE_NAME_PATTERN.pattern
    assert seen["item_id"]["pattern"] == ID_PATTERN.pattern
    assert seen["thread_id"]["pattern"] == patterns.PRINTABLE
    assert seen["thread_id"]["maxLength"] == 200


def test_query_parameters_and_bodies_carry_the_limits_of_the_settings(schema) -> None:
    conf = get_conf()
    ops = operations(schema)
    limit = next(p for p in ops["listItems"]["parameters"] if p["name"] == "limit")
    assert limit["schema"]["maximum"] == conf.max_page_size
    claim = schema["components"]["schemas"]["Claim"]["properties"]
    assert claim["max"]["maximum"] == conf.max_claim
    assert claim["wait"]["maximum"] == conf.max_wait_seconds
    batch = schema["components"]["schemas"]["PostBatch"]["properties"]["items"]
    assert batch["maxItems"] == conf.max_batch


def test_settings_bounds_are_declared_with_their_exclusive_minimum(schema) -> None:
    lease = schema["components"]["schemas"]["QueueSettings"]["properties"]["leaseSeconds"]
    assert (lease["minimum"], lease["exclusiveMinimum"]) == (0, True)
    extend = schema["components"]["schemas"]["Extend"]["properties"]["seconds"]
    assert (extend["minimum"], extend["exclusiveMinimum"]) == (0, True)


def test_bodies_refuse_unknown_fields_and_require_what_the_contract_requires(schema) -> None:
    components = schema["components"]["schemas"]
    for name, body in [("PostItem", contract.POST_ITEM), ("Fail", contract.FAIL)]:
        component = components[name]
        assert component["additionalProperties"] is False
        assert set(component["properties"]) == set(body.names)
        assert component.get("required", []) == [f.name for f in body.fields if f.required]


def test_every_authenticated_operation_names_its_scopes_and_answers_the_error_envelope(
    schema,
) -> None:
    for op_id, op in operations(schema).items():
        if op_id == "health":
            assert op.get("security", []) in ([], [{}])
            assert "security" not in schema
            continue
        assert op["security"] == [{"tokenAuth": []}], op_id
        for status in ("401", "403"):
            answer = op["responses"][status]["content"]["application/json"]["schema"]
            assert answer == {"$ref": "#/components/schemas/Error"}, (op_id, status)
            assert "`error.code`" in op["responses"][status]["description"]
        # Any keyed request may find the database away, or every request thread taken.
        busy = op["responses"]["503"]["description"].split("`error.code`: ")[1]
        assert {"overloaded", "unavailable"} <= set(busy.rstrip(".").split(", ")), op_id
        assert set(op["x-scopes"]) <= {"produce", "work", "manage"}, op_id
    error = schema["components"]["schemas"]["Error"]
    assert error["properties"]["error"]["required"] == ["code", "message"]


def test_metrics_is_documented_as_prometheus_text(schema) -> None:
    content = operations(schema)["metrics"]["responses"]["200"]["content"]
    assert list(content) == ["text/plain"]


def test_links_lead_from_created_queues_and_items_to_the_operations_that_use_them(schema) -> None:
    ops = operations(schema)
    queue_links = ops["putQueue"]["responses"]["201"]["links"]
    assert queue_links["postItems"]["parameters"] == {"queue": "$response.body#/name"}
    item_links = ops["postItems"]["responses"]["201"]["links"]
    assert item_links["getItem"]["parameters"] == {"item_id": "$response.body#/id"}
    held = ops["claimItems"]["responses"]["200"]["links"]
    assert held["extendLease"]["requestBody"] == {"lease": "$response.body#/items/0/lease"}
    for links in (queue_links, item_links, held):
        for link in links.values():
            assert link["operationId"] in ops
