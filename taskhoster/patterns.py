"""The patterns of the wire's strings, written once for Python's ``re`` (used with
``fullmatch``) and for ECMAScript regular expressions (what JSON Schema tools use), so that
``/api/schema`` and the socket's AsyncAPI document say exactly what the server checks."""

from __future__ import annotations

import re

# An item id: letters, digits, '_' and '-' (``ids``).
ID = "^[A-Za-z0-9_-]{1,64}$"
# A queue name: starts with a letter or digit (``store``).
QUEUE = "^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
# Text a file and the database keep intact: no NUL.
TEXT = "^[^\\u0000]*$"
# A producer's idempotency key: text, but not beginning with ``schedule:``, which names a
# schedule's slots (SPEC section 8.3; a producer's item there would stand in for a slot's).
KEY = "^(?!schedule:)[^\\u0000]*$"
# Printable text (a threadId): no control character (C0, DEL, C1). (A lone surrogate is
# refused too, but no request can carry one: the JSON parser refuses them, and a path or
# query string is UTF-8.)
PRINTABLE = "^[^\\u0000-\\u001f\\u007f-\\u009f]*$"
# An ISO-8601 time with ``Z`` or an offset, years 0001-9999 (``timeutil.parse_wire``).
TIME = (
    "^(?!0000)[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])[Tt]([01][0-9]|2[0-3])"
    ":[0-5][0-9]:[0-5][0-9](\\.[0-9]+)?([Zz]|[+-]([01][0-9]|2[0-3]):[0-5][0-9])$"
)
# A time as the server sends it: UTC with ``Z`` (``timeutil.to_wire``).
SENT_TIME = "^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(\\.[0-9]+)?Z$"
# A page cursor: base64url without padding (``api.cursors``).
CURSOR = "^[A-Za-z0-9_-]*$"

_PRINTABLE = re.compile(PRINTABLE)
_KEY = re.compile(KEY)
_TIME = re.compile(TIME)
_SURROGATE = re.compile("[\\ud800-\\udfff]")


def is_printable(text: str) -> bool:
    return _PRINTABLE.fullmatch(text) is not None and _SURROGATE.search(text) is None


def is_wire_time(text: str) -> bool:
    return _TIME.fullmatch(text) is not None


def is_producer_key(text: str) -> bool:
    return _KEY.fullmatch(text) is not None
