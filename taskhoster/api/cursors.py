"""Opaque page cursors: the position to continue after, base64url-encoded."""

from __future__ import annotations

import base64
import binascii
import re

from .. import patterns
from ..errors import InvalidInput

_ALPHABET = re.compile(patterns.CURSOR)


def encode_cursor(position: str | None) -> str | None:
    if position is None:
        return None
    return base64.urlsafe_b64encode(position.encode()).decode().rstrip("=")


def decode_cursor(cursor: str | None) -> str | None:
    if not cursor:
        return None
    if len(cursor) > 400 or _ALPHABET.fullmatch(cursor) is None:
        raise InvalidInput("invalid cursor", code="invalid_cursor")
    try:
        padded = cursor.encode("ascii") + b"=" * (-len(cursor) % 4)
        return base64.urlsafe_b64decode(padded).decode()
    except (binascii.Error, UnicodeError, ValueError):
        raise InvalidInput("invalid cursor", code="invalid_cursor") from None
