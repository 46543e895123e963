"""One index for one state root: a server never serves files another database indexes.

Two servers with different databases must never share a state root: one would index the
other's items (``sweep --repair`` at its start), re-queue what the other's workers hold, and
hand the same items out twice. So the database holds an identity (``models.Installation``)
and the state root holds the same one in ``<root>/.identity``; every server start, the sweep
and ``bootstrap`` compare the two (``check``):

- neither has one (a new installation, or one from before identities): one is made for both;
- only the database has one: written into the state root, if the state root holds no queue
  yet; a state root full of files that name no index is refused;
- only the state root has one: taken into the database if the state root holds no queue;
  otherwise refused (a new database pointed at another index's files: the trap of starting
  ``serve-many`` where ``serve`` keeps its state);
- both, the same: nothing to do; different: refused.

A refusal (``StateRootTaken``) says what to do: point ``TASKHOSTER_ROOT`` at this database's
own state root, or, when this database really is to index these files (its own index was
lost, and the files are to rebuild it), run ``manage.py sweep --repair --adopt-state-root``.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.db import transaction

from .conf import get_conf
from .store import QUEUE_NAME_PATTERN

FILE = ".identity"


class StateRootTaken(ImproperlyConfigured):
    """The state root belongs to another index."""


def read_file(root: Path) -> str | None:
    """The identity the state root holds (None: none yet); ``StateRootTaken`` if unreadable."""
    try:
        data = json.loads((root / FILE).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise StateRootTaken(f"{root / FILE} cannot be read ({exc}); fix or remove it") from exc
    value = data.get("identity") if isinstance(data, dict) else None
    if not isinstance(value, str) or not value:
        raise StateRootTaken(f"{root / FILE} names no identity; fix or remove it")
    return value


def _write_file(root: Path, identity: str) -> None:
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".identity.{secrets.token_hex(4)}.tmp"
    body: dict[str, Any] = {"identity": identity}
    with open(tmp, "w") as handle:
        json.dump(body, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, root / FILE)
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _has_queues(root: Path) -> bool:
    """Whether the state root holds any queue's directory."""
    try:
        with os.scandir(root) as entries:  # closed, though ``any`` stops at the first
            return any(
                entry.is_dir() and QUEUE_NAME_PATTERN.fullmatch(entry.name) for entry in entries
            )
    except FileNotFoundError:
        return False


def _refusal(root: Path, why: str) -> StateRootTaken:
    return StateRootTaken(
        f"the state root {root} {why}. Two databases must never share one state root: set "
        f"TASKHOSTER_ROOT to this database's own state root (or DATABASE_URL to the database "
        f"of these files). If this database is to index these files (its own index was lost "
        f"and is to be rebuilt from them), run: manage.py sweep --repair --adopt-state-root"
    )


def check(*, adopt: bool = False) -> str:
    """Compare (or with ``adopt``, join) the identities of the database and the state root;
    return the identity, or raise ``StateRootTaken``. Idempotent; cheap (a row, a file)."""
    from .models import Installation

    root = get_conf().root.resolve()
    on_disk = read_file(root)
    with transaction.atomic():
        row = Installation.objects.select_for_update().first()
        in_db = row.identity if row is not None else None
        if in_db is not None and on_disk == in_db:
            return in_db
        if adopt:
            identity = on_disk or in_db or secrets.token_hex(16)
        elif in_db is None and on_disk is None:
            identity = secrets.token_hex(16)
        elif in_db is None:
            if _has_queues(root):
                raise _refusal(root, "belongs to another database's index")
            identity = on_disk  # type: ignore[assignment]
        elif on_disk is None:
            if _has_queues(root):
                raise _refusal(root, "holds queues that no index has claimed")
            identity = in_db
        else:
            raise _refusal(root, "belongs to another database's index")
        if row is None:
            Installation.objects.create(identity=identity)
        elif row.identity != identity:
            row.identity = identity
            row.save(update_fields=["identity"])
    if on_disk != identity:
        _write_file(root, identity)
    return identity
