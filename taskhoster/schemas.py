"""JSON Schemas of the contract's declarations (``contract``), for ``/api/schema`` (OpenAPI
3.0) and the socket's AsyncAPI document (JSON Schema draft 7).

The server validates with ``contract.validate``; these describe the same declarations, so
the documents say exactly what the server enforces: a value these schemas accept, the server
accepts, and the other way round. The patterns are the server's own, written for both
Python's ``re`` and ECMAScript (what JSON Schema tools use).
"""

from __future__ import annotations

from typing import Any, Literal

from . import patterns
from .conf import get_conf
from .contract import Body, Field, resolve

Dialect = Literal["openapi", "jsonschema"]

ID_REGEX = patterns.ID
QUEUE_REGEX = patterns.QUEUE
PRINTABLE_REGEX = patterns.PRINTABLE
PATTERNS = {"id": patterns.ID, "queue": patterns.QUEUE, "key": patterns.KEY}


def _number(value: float | None) -> float | int | None:
    if value is None:
        return None
    return int(value) if float(value).is_integer() else value


def field_schema(
    spec: Field, dialect: Dialect = "openapi", *, sent: bool = False
) -> dict[str, Any]:
    """The schema of one field's value; ``sent``: as the server sends it (times in UTC with
    ``Z``, as ``timeutil.to_wire`` writes them)."""
    kind = spec.kind
    schema: dict[str, Any]
    if kind == "json":
        schema = {}
        if spec.sized:
            most = get_conf().max_payload_bytes
            schema["description"] = f"At most {most} bytes of JSON."
    elif kind == "string":
        schema = {"type": "string"}
        if spec.min_length:
            schema["minLength"] = spec.min_length
        longest = resolve(spec.max_length)
        if longest is not None:
            schema["maxLength"] = int(longest)
        if spec.pattern:
            schema["pattern"] = PATTERNS[spec.pattern]
        elif spec.printable:
            schema["pattern"] = PRINTABLE_REGEX
        else:
            schema["pattern"] = patterns.TEXT
    elif kind == "choice":
        schema = {"type": "string", "enum": list(spec.choices)}
    elif kind in ("integer", "number"):
        schema = {"type": kind}
        low, high = _number(resolve(spec.minimum)), _number(resolve(spec.maximum))
        if low is not None:
            if spec.exclusive_minimum and dialect == "openapi":
                schema.update(minimum=low, exclusiveMinimum=True)
            elif spec.exclusive_minimum:
                schema["exclusiveMinimum"] = low
            else:
                schema["minimum"] = low
        if high is not None:
            schema["maximum"] = high
    elif kind == "boolean":
        schema = {"type": "boolean"}
    elif kind == "time":
        schema = {"type": "string", "format": "date-time", "maxLength": 64}
        schema["pattern"] = patterns.SENT_TIME if sent else patterns.TIME
    elif kind == "list":
        assert spec.item is not None
        item = spec.item
        schema = {"type": "array"}
        if item.kind == "object":
            assert item.body is not None
            schema["items"] = body_schema(item.body, dialect, sent=sent)
        else:
            schema["items"] = field_schema(item, dialect, sent=sent)
        if spec.min_length is not None:
            schema["minItems"] = spec.min_length
        longest = resolve(spec.max_length)
        if longest is not None:
            schema["maxItems"] = int(longest)
    elif kind == "object":
        assert spec.body is not None
        schema = body_schema(spec.body, dialect, sent=sent)
    else:
        raise ValueError(f"unknown field kind {kind}")
    if spec.nullable and kind != "json":
        if dialect == "openapi":
            schema["nullable"] = True
        else:
            schema["type"] = [schema["type"], "null"]
            if "enum" in schema:
                schema["enum"] = [*schema["enum"], None]
    if spec.default is not None:
        schema["default"] = spec.default
    if spec.description:
        schema["description"] = " ".join([spec.description, schema.get("description", "")]).strip()
    return schema


def body_schema(
    body: Body, dialect: Dialect = "openapi", *, sent: bool = False, frame_type: str | None = None
) -> dict[str, Any]:
    """The schema of a body: its fields, which are required, and nothing else; for a socket
    frame, its ``type`` as a constant."""
    properties = {spec.name: field_schema(spec, dialect, sent=sent) for spec in body.fields}
    if frame_type is not None:
        properties["type"] = {"const": frame_type}
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    if dialect == "jsonschema":
        schema["title"] = body.name
    schema["additionalProperties"] = False
    required = [spec.name for spec in body.fields if spec.required]
    if required:
        schema["required"] = required
    rules: list[dict[str, Any]] = [
        {"not": {"required": list(group)}} for group in body.at_most_one_of
    ]
    for group in body.exactly_one_of:
        rules.append({"oneOf": [{"required": [name]} for name in group]})
    if len(rules) == 1:
        schema.update(rules[0])
    elif rules:
        schema["allOf"] = rules
    if body.description:
        schema["description"] = body.description
    return schema
