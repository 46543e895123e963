"""A JSON parser that refuses oversized bodies (413) and anything but strict JSON (400).

Its messages say what is wrong with the body in the client's terms (where, and what to send
instead), never Python's decoder internals; the code of a body that is no JSON is
``bad_json``, as the schema and the socket say.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import IO, Any

from rest_framework import exceptions, status
from rest_framework.parsers import BaseParser

from ..conf import get_conf
from ..contract import check_depth, holds_lone_surrogate
from ..errors import InvalidInput


class BodyTooLarge(exceptions.APIException):
    status_code = status.HTTP_413_REQUEST_ENTITY_TOO_LARGE
    default_detail = "the request body is too large"
    default_code = "too_large"


class BadJSON(exceptions.ParseError):
    default_detail = "the body is not valid JSON"
    default_code = "bad_json"


class _NotJSON(ValueError):
    """A value Python's decoder would take but JSON has not (NaN, Infinity, 1e999)."""


def _refuse_constant(name: str) -> Any:
    raise _NotJSON(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NotJSON(f"the number {text[:40]} is too large")
    return value


def _where(text: str, position: int) -> str:
    line = text.count("\n", 0, position) + 1
    column = position - (text.rfind("\n", 0, position) + 1) + 1
    return f"line {line}, column {column}"


class StrictJSONParser(BaseParser):
    media_type = "application/json"

    def parse(
        self,
        stream: IO[bytes] | None,
        media_type: str | None = None,
        parser_context: Mapping[str, Any] | None = None,
    ) -> Any:
        limit = get_conf().max_body_bytes
        if stream is None:
            return None
        data = stream.read(limit + 1)
        if len(data) > limit:
            raise BodyTooLarge(f"the request body is larger than {limit} bytes")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise BadJSON(
                f"the body is not UTF-8 text (byte {exc.start} is not UTF-8): send JSON "
                "encoded as UTF-8"
            ) from None
        try:
            value = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
        except json.JSONDecodeError as exc:
            what = exc.msg[:1].lower() + exc.msg[1:]
            raise BadJSON(
                f"the body is not valid JSON: {what} at {_where(text, exc.pos)}"
            ) from None
        except _NotJSON as exc:
            raise BadJSON(f"the body is not valid JSON: {exc}") from None
        except RecursionError:
            most = get_conf().max_json_depth
            raise InvalidInput(
                f"the JSON is nested more than {most} levels deep", code="too_deep"
            ) from None
        except ValueError:
            # Python's limit on the digits of an integer (4300): none of JSON's, but a number
            # that long is no work item's.
            raise BadJSON("the body holds a number with too many digits") from None
        if isinstance(value, dict | list):
            check_depth(text, value)
        if holds_lone_surrogate(text, value):
            raise BadJSON(
                "the body holds a lone surrogate escape (\\ud800-\\udfff without its "
                "pair), which is no Unicode text"
            )
        return value
