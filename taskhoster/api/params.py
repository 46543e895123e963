"""Query parameters, read as strictly as ``/api/schema`` declares them (``api.schema``).

A parameter that is given must be valid, even when empty: ``?limit=`` is refused rather
than taken for the default, so a request the schema calls invalid is never served.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

from .. import contract
from ..conf import get_conf
from ..errors import InvalidInput

INTEGER = re.compile(r"[+-]?[0-9]{1,18}")
NUMBER = re.compile(r"[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+)?")


def limit(params: Mapping[str, str]) -> int:
    """``limit``: the page size, 1..MAX_PAGE_SIZE (default PAGE_SIZE)."""
    conf = get_conf()
    text = params.get("limit")
    if text is None:
        return conf.page_size
    if INTEGER.fullmatch(text) is None or not 1 <= int(text) <= conf.max_page_size:
        raise InvalidInput(
            f"limit must be an integer 1..{conf.max_page_size}", code="invalid_limit"
        )
    return int(text)


def wait(params: Mapping[str, str]) -> float | None:
    """``wait``: seconds, 0..MAX_WAIT_SECONDS, or None when not given."""
    text = params.get("wait")
    if text is None:
        return None
    most = get_conf().max_wait_seconds
    value = float(text) if NUMBER.fullmatch(text) else math.nan
    if not 0 <= value <= most:
        raise InvalidInput(f"wait must be a number of seconds 0..{most:g}", code="invalid_wait")
    return value


def choice(params: Mapping[str, str], name: str, choices: set[str]) -> str | None:
    text = params.get(name)
    if text is not None and text not in choices:
        raise InvalidInput(
            f"{name} must be one of {', '.join(sorted(choices))}", code=f"invalid_{name}"
        )
    return text


def thread_id(text: str | None) -> str | None:
    """A threadId (``contract.THREAD_ID``), or None when not given."""
    return None if text is None else str(contract.check(contract.THREAD_ID, text, "threadId"))


def item_id(text: str) -> str:
    """An item id in a path (``contract.ITEM_ID``, as the socket's frames check it)."""
    return str(contract.check(contract.ITEM_ID, text, "the path's item id"))
