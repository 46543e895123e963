"""A JSON parser that refuses oversized bodies (413) and anything but strict JSON (400)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import IO, Any

from rest_framework import exceptions, status
from rest_framework.parsers import BaseParser

from ..conf import get_conf


class BodyTooLarge(exceptions.APIException):
    status_code = status.HTTP_413_REQUEST_ENTITY_TOO_LARGE
    default_detail = "the request body is too large"
    default_code = "too_large"


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of range")
    return value


# A \uD800-\uDFFF escape: valid JSON syntax, but unpaired it is no Unicode text and cannot
# be stored (UTF-8 files, database text), so such a body is checked for encodability.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


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
            value = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
            if _SURROGATE_ESCAPE.search(text):
                json.dumps(value, ensure_ascii=False).encode("utf-8")
            return value
        except (ValueError, UnicodeDecodeError) as exc:
            raise exceptions.ParseError(f"malformed JSON: {exc}") from None
        except RecursionError:
            raise exceptions.ParseError("malformed JSON: nested too deeply") from None
