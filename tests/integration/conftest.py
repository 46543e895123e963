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


@pytest.fixture
def nothing_left_to_write_again(transactional_db: None) -> Iterator[None]:
    """After each test, before its tables are emptied: no row marked, nothing taken up, and
    this process's committer past any rewrite it was making (one operation through it,
    answered after whatever it was doing), so that no rewrite's transaction meets the
    emptying (on PostgreSQL, a deadlock with the TRUNCATE). A row a server's failed flush
    marked is this process's committer's too: it takes marked rows up every 30 s."""
    from taskhoster import engine
    from taskhoster.engine.common import store
    from taskhoster.models import Item

    yield
    Item.objects.filter(unflushed=True).update(unflushed=None)
    st = store()
    with st.unflushed_lock:
        st.taken_up.clear()
        st.unflushed.clear()
    engine.mark_fetched(item_id="0661f0000000000000ff")
