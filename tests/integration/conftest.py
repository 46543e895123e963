"""Fixtures the integration tests share: a full-scope key and an HTTP client holding it for
the module's ``server`` (each module starts its server as its tests need)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest


@pytest.fixture
def key(make_key: Callable[..., str]) -> str:
    return make_key()


@pytest.fixture
def http(server: Any, key: str) -> Iterator[httpx.Client]:
    with httpx.Client(
        base_url=server.url, headers={"Authorization": f"Token {key}"}, timeout=30
    ) as client:
        yield client


@pytest.fixture
def staff(db: None) -> Any:
    """A superuser's admin client, logged in (a module may define its own)."""
    from .admin_users import staff_client

    return staff_client()
