"""The API's shapes in ``/api/schema`` (SPEC section 5).

Request bodies are validated by ``contract``; their serializers here are made from the same
declarations, so the schema says what the server enforces. Responses are described here
(``engine.item_json`` builds an item).
"""

from __future__ import annotations

from typing import Any

from rest_framework import serializers

from .. import contract
from ..contract import Body, Field, resolve
from ..errors import InvalidInput
from ..ids import is_valid_id
from ..status import Status


def _field(spec: Field) -> serializers.Field:
    """The DRF field that describes ``spec`` in the schema (validation is ``contract``'s)."""
    common: dict[str, Any] = {
        "required": spec.required,
        "allow_null": spec.nullable,
        "help_text": spec.description or None,
    }
    if spec.default is not None:
        common["default"] = spec.default
        common["required"] = False
    kind = spec.kind
    if kind == "json":
        return serializers.JSONField(**common)
    if kind == "string":
        return serializers.CharField(
            min_length=spec.min_length,
            max_length=_int(resolve(spec.max_length)),
            allow_blank=(spec.min_length or 0) == 0,
            trim_whitespace=False,
            **common,
        )
    if kind == "choice":
        return serializers.ChoiceField(choices=list(spec.choices), **common)
    if kind == "integer":
        return serializers.IntegerField(
            min_value=_int(resolve(spec.minimum)), max_value=_int(resolve(spec.maximum)), **common
        )
    if kind == "number":
        return serializers.FloatField(
            min_value=resolve(spec.minimum), max_value=resolve(spec.maximum), **common
        )
    if kind == "boolean":
        return serializers.BooleanField(**common)
    if kind == "time":
        return serializers.DateTimeField(**common)
    if kind == "list":
        assert spec.item is not None
        child = (
            serializer_for(spec.item.body)()
            if spec.item.kind == "object" and spec.item.body is not None
            else _field(spec.item)
        )
        return serializers.ListField(
            child=child,
            min_length=spec.min_length,
            max_length=_int(resolve(spec.max_length)),
            **common,
        )
    if kind == "object":
        assert spec.body is not None
        return serializer_for(spec.body)(**common)
    raise ValueError(f"unknown field kind {kind}")


def _int(value: float | None) -> int | None:
    return None if value is None else int(value)


def serializer_for(body: Body) -> type[serializers.Serializer]:
    """A serializer describing ``body`` for ``/api/schema``, made from the contract."""
    attrs: dict[str, Any] = {spec.name: _field(spec) for spec in body.fields}
    attrs["__doc__"] = body.description or body.name
    return type(f"{body.name}Serializer", (serializers.Serializer,), attrs)


PostItemSerializer = serializer_for(contract.POST_ITEM)
PostBatchSerializer = serializer_for(contract.POST_BATCH)
ClaimSerializer = serializer_for(contract.CLAIM)
ResultSerializer = serializer_for(contract.RESULT)
FailSerializer = serializer_for(contract.FAIL)
ExtendSerializer = serializer_for(contract.EXTEND)
BulkDeleteSerializer = serializer_for(contract.BULK_DELETE)


class QueueSettingsSerializer(serializers.Serializer):
    """Queue settings as sent and returned (validated by the engine, shared with the admin)."""

    leaseSeconds = serializers.FloatField(required=False)
    queueSeconds = serializers.FloatField(required=False)
    retainSeconds = serializers.FloatField(required=False)
    retainFrom = serializers.ChoiceField(choices=["finished", "fetched"], required=False)
    maxAttempts = serializers.IntegerField(required=False, allow_null=True)
    backoffSeconds = serializers.FloatField(required=False)
    backoffMaxSeconds = serializers.FloatField(required=False)
    deadLetterQueue = serializers.CharField(required=False, allow_null=True)


class QueueSerializer(QueueSettingsSerializer):
    name = serializers.CharField()
    counts = serializers.DictField(child=serializers.IntegerField())


class ItemSerializer(serializers.Serializer):
    """An item as returned (schema only; ``engine.item_json`` builds it)."""

    id = serializers.CharField()
    queue = serializers.CharField()
    status = serializers.ChoiceField(choices=[s.value for s in Status])
    payload = serializers.JSONField(required=False)
    threadId = serializers.CharField(allow_null=True)
    scheduledAt = serializers.CharField()
    postedAt = serializers.CharField()
    attempts = serializers.IntegerField()
    leaseExpiresAt = serializers.CharField(allow_null=True)
    finishedAt = serializers.CharField(allow_null=True)
    result = serializers.JSONField(required=False)
    error = serializers.CharField(allow_null=True)
    key = serializers.CharField(allow_null=True)
    origin = serializers.JSONField(required=False)
    deadLetter = serializers.CharField(required=False)


class ClaimedItemSerializer(ItemSerializer):
    lease = serializers.CharField()


class ItemListSerializer(serializers.Serializer):
    items = ItemSerializer(many=True)


class ItemPageSerializer(ItemListSerializer):
    next = serializers.CharField(allow_null=True)


class ClaimAnswerSerializer(serializers.Serializer):
    items = ClaimedItemSerializer(many=True)


class VerdictSerializer(serializers.Serializer):
    accepted = serializers.BooleanField()
    status = serializers.CharField(allow_null=True)


class ExtendAnswerSerializer(serializers.Serializer):
    accepted = serializers.BooleanField()
    leaseExpiresAt = serializers.CharField(allow_null=True)


class DeletedSerializer(serializers.Serializer):
    deleted = serializers.IntegerField()


class ErrorSerializer(serializers.Serializer):
    error = serializers.DictField(child=serializers.CharField())


def check_item_id(item_id: str) -> str:
    if not is_valid_id(item_id):
        raise InvalidInput(
            "an item id is 1-64 characters of letters, digits, '_' and '-'", code="invalid_id"
        )
    return item_id
