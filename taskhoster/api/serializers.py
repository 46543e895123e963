"""Request validation and the wire shape of items (SPEC section 5).

Every request serializer refuses unknown fields, so a misspelt option is an error rather than
silently ignored. The same serializers describe the API in ``/api/schema``.
"""

from __future__ import annotations

import json
from typing import Any

from rest_framework import serializers

from ..conf import get_conf
from ..errors import InvalidInput, TooLarge
from ..ids import is_valid_id
from ..status import Status
from ..timeutil import parse_wire, to_wire


class StrictSerializer(serializers.Serializer):
    def to_internal_value(self, data: Any) -> Any:
        if not isinstance(data, dict):
            raise serializers.ValidationError(
                {"non_field_errors": ["expected a JSON object"]}, code="invalid"
            )
        unknown = sorted(set(data) - set(self.fields))
        if unknown:
            raise serializers.ValidationError(
                {name: ["unknown field"] for name in unknown}, code="unknown_field"
            )
        return super().to_internal_value(data)


class AnyJSONField(serializers.JSONField):
    """Any JSON value, limited to ``MAX_PAYLOAD_BYTES`` when encoded."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("allow_null", True)
        super().__init__(**kwargs)

    def to_internal_value(self, data: Any) -> Any:
        limit = get_conf().max_payload_bytes
        size = len(json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode())
        if size > limit:
            raise TooLarge(f"{self.field_name} is {size} bytes of JSON; the limit is {limit}")
        return data


class WireTimeField(serializers.Field):
    def to_internal_value(self, data: Any) -> Any:
        try:
            return parse_wire(data)
        except (ValueError, OverflowError):
            raise serializers.ValidationError(
                "expected an ISO-8601 UTC time such as 2026-01-31T12:00:00Z"
            ) from None

    def to_representation(self, value: Any) -> Any:
        return to_wire(value)


class ThreadIdField(serializers.CharField):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(min_length=1, max_length=200, trim_whitespace=False, **kwargs)

    def to_internal_value(self, data: Any) -> Any:
        if not isinstance(data, str):
            raise serializers.ValidationError("threadId must be a string")
        value = super().to_internal_value(data)
        if not value.isprintable():
            raise serializers.ValidationError("threadId must be printable characters")
        return value


class StringField(serializers.CharField):
    """A string that is a string: numbers and booleans are refused, not coerced."""

    def to_internal_value(self, data: Any) -> Any:
        if not isinstance(data, str):
            raise serializers.ValidationError("must be a string")
        return super().to_internal_value(data)


class StrictIntegerField(serializers.IntegerField):
    def to_internal_value(self, data: Any) -> Any:
        if isinstance(data, bool) or not isinstance(data, int):
            raise serializers.ValidationError("must be an integer")
        return super().to_internal_value(data)


class StrictNumberField(serializers.FloatField):
    def to_internal_value(self, data: Any) -> Any:
        if isinstance(data, bool) or not isinstance(data, int | float):
            raise serializers.ValidationError("must be a number")
        return super().to_internal_value(data)


class StrictBooleanField(serializers.BooleanField):
    def to_internal_value(self, data: Any) -> Any:
        if not isinstance(data, bool):
            raise serializers.ValidationError("must be true or false")
        return data


class PostItemSerializer(StrictSerializer):
    payload = AnyJSONField(required=True)
    threadId = ThreadIdField(required=False, allow_null=True)
    scheduledAt = WireTimeField(required=False, allow_null=True)
    delaySeconds = StrictNumberField(
        required=False, allow_null=True, min_value=0, max_value=366 * 86400
    )
    key = StringField(
        required=False, allow_null=True, min_length=1, max_length=200, trim_whitespace=False
    )

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if attrs.get("scheduledAt") is not None and attrs.get("delaySeconds") is not None:
            raise serializers.ValidationError("give scheduledAt or delaySeconds, not both")
        return attrs


class PostBatchSerializer(StrictSerializer):
    items = PostItemSerializer(many=True, allow_empty=False)

    def to_internal_value(self, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("items"), list):
            limit = get_conf().max_batch
            if len(data["items"]) > limit:
                raise TooLarge(f"a batch holds at most {limit} items", code="batch_too_large")
        return super().to_internal_value(data)


class ClaimSerializer(StrictSerializer):
    max = StrictIntegerField(required=False, min_value=1, max_value=100, default=1)
    wait = StrictNumberField(required=False, min_value=0, max_value=60, default=0)


class ResultSerializer(StrictSerializer):
    result = AnyJSONField(required=True)


class FailSerializer(StrictSerializer):
    lease = StringField(max_length=64)
    error = StringField(
        required=False, allow_null=True, allow_blank=True, max_length=10_000, trim_whitespace=False
    )
    retry = StrictBooleanField(required=False, default=True)


class ExtendSerializer(StrictSerializer):
    lease = StringField(max_length=64)
    seconds = StrictNumberField(
        required=False, allow_null=True, min_value=0.001, max_value=7 * 86400
    )


class BulkDeleteSerializer(StrictSerializer):
    ids = serializers.ListField(child=StringField(max_length=64), required=False, max_length=10_000)
    status = serializers.ChoiceField(choices=[s.value for s in Status], required=False)

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if ("ids" in attrs) == ("status" in attrs):
            raise serializers.ValidationError("give either ids or status")
        return attrs


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


def validated(serializer_class: type[serializers.Serializer], data: Any) -> dict[str, Any]:
    serializer = serializer_class(data=data)
    serializer.is_valid(raise_exception=True)
    return dict(serializer.validated_data)


def check_item_id(item_id: str) -> str:
    if not is_valid_id(item_id):
        raise InvalidInput(
            "an item id is 1-64 characters of letters, digits, '_' and '-'", code="invalid_id"
        )
    return item_id
