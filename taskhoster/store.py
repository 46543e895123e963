"""The state directories: one JSON file per item, the directory it is in being its state.

Layout: ``<root>/<queue>/{pending,processing,done}/<id>.json``. Plain Python, no Django.

Every write goes to a temporary file in the target directory and is renamed into place, so a
reader never sees half a file. While ``fsync`` is on, a durable write flushes the file and then
its directory entry before returning; a batch shares one flush (``syncfs`` where Linux offers it).
A move between states is one ``rename``: atomic, so of two processes moving the same file, one
wins and the other gets ``FileMissing``.

Each record carries ``rev``, raised on every rewrite, so that when a crash leaves one id in two
directories, the newer file is known (``repair`` keeps the highest ``rev``).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import json
import os
import re
import secrets
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import StoreError
from .ids import ID_PATTERN
from .status import State

QUEUE_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
SUFFIX = ".json"
TMP_SUFFIX = ".tmp"
BATCH_SYNCFS_THRESHOLD = 8

Record = dict[str, Any]


class FileMissing(StoreError):
    """The item's file is not where it was looked for."""

    code = "file_missing"


def _load_syncfs() -> Any:
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        return libc.syncfs
    except (OSError, AttributeError):
        return None


_syncfs = _load_syncfs()


@dataclass(frozen=True)
class Staged:
    tmp: Path
    final: Path


@dataclass(frozen=True)
class FoundFile:
    queue: str
    state: State
    item_id: str
    path: Path


class StateStore:
    """Reads and writes item files under one root."""

    def __init__(self, root: Path | str, *, fsync: bool = True) -> None:
        self.root = Path(root).resolve()
        self.fsync = fsync

    # -- paths ---------------------------------------------------------------------------

    def queue_dir(self, queue: str) -> Path:
        if not isinstance(queue, str) or QUEUE_NAME_PATTERN.fullmatch(queue) is None:
            raise StoreError(f"invalid queue name {queue!r}", code="invalid_queue_name")
        if queue in (".", ".."):
            raise StoreError(f"invalid queue name {queue!r}", code="invalid_queue_name")
        path = self.root / queue
        if path.parent != self.root:
            raise StoreError("queue path escapes the state root", code="invalid_queue_name")
        return path

    def state_dir(self, queue: str, state: State) -> Path:
        return self.queue_dir(queue) / State(state).value

    def item_path(self, queue: str, state: State, item_id: str) -> Path:
        if not isinstance(item_id, str) or ID_PATTERN.fullmatch(item_id) is None:
            raise StoreError(f"invalid item id {item_id!r}", code="invalid_id")
        return self.state_dir(queue, state) / f"{item_id}{SUFFIX}"

    def ensure_queue(self, queue: str) -> None:
        for state in State:
            self.state_dir(queue, state).mkdir(parents=True, exist_ok=True)

    # -- writing -------------------------------------------------------------------------

    def write(self, queue: str, state: State, records: Sequence[Record], *, durable: bool) -> None:
        """Write (or replace) each record as ``<state>/<id>.json``, atomically.

        With ``durable`` and fsync on, nothing returns before the files and their directory
        entries are on disk.
        """
        if not records:
            return
        directory = self.state_dir(queue, state)
        flush = durable and self.fsync
        staged: list[tuple[Path, Path]] = []
        try:
            for record in records:
                final = self.item_path(queue, state, record["id"])
                data = json.dumps(record, separators=(",", ":"), ensure_ascii=False).encode()
                tmp = directory / f".{record['id']}.{secrets.token_hex(4)}{TMP_SUFFIX}"
                try:
                    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640)
                except FileNotFoundError:
                    self.ensure_queue(queue)
                    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640)
                staged.append((tmp, final))
                try:
                    view = memoryview(data)
                    while view:
                        written = os.write(fd, view)
                        view = view[written:]
                    if flush and len(records) < BATCH_SYNCFS_THRESHOLD:
                        os.fsync(fd)
                finally:
                    os.close(fd)
            if flush and len(records) >= BATCH_SYNCFS_THRESHOLD:
                self._sync_filesystem(directory)
            for tmp, final in staged:
                os.replace(tmp, final)
            staged.clear()
            if flush:
                self._fsync_dir(directory)
        except OSError as exc:
            raise StoreError(f"could not write item files: {exc}") from exc
        finally:
            for tmp, _final in staged:
                with contextlib.suppress(OSError):
                    tmp.unlink()

    def stage(self, queue: str, state: State, record: Record, *, durable: bool) -> Staged:
        """Write ``record`` to a temporary file beside its final place, flushed if
        ``durable``; ``install`` renames it into place, ``discard`` drops it.

        This lets the slow part of a durable write happen before a lock is taken.
        """
        final = self.item_path(queue, state, record["id"])
        data = json.dumps(record, separators=(",", ":"), ensure_ascii=False).encode()
        tmp = final.parent / f".{record['id']}.{secrets.token_hex(4)}{TMP_SUFFIX}"
        try:
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640)
            except FileNotFoundError:
                self.ensure_queue(queue)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                if durable and self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise StoreError(f"could not write item file: {exc}") from exc
        return Staged(tmp=tmp, final=final)

    def install(self, staged: Staged, *, durable: bool) -> None:
        """Rename a staged file into place; with ``durable``, flush the directory entry."""
        try:
            os.replace(staged.tmp, staged.final)
        except OSError as exc:
            raise StoreError(f"could not install item file: {exc}") from exc
        if durable and self.fsync:
            self._fsync_dir(staged.final.parent)

    @staticmethod
    def discard(staged: Staged) -> None:
        with contextlib.suppress(OSError):
            staged.tmp.unlink()

    def move(
        self, queue: str, item_id: str, src: State, dst: State, *, durable: bool = False
    ) -> None:
        """Rename the item's file from ``src`` to ``dst``: the atomic step of a claim.

        Raises ``FileMissing`` if the file is not in ``src``, unless it is already in ``dst``
        (a move repeated after a crash is not an error).
        """
        source = self.item_path(queue, src, item_id)
        target = self.item_path(queue, dst, item_id)
        try:
            os.rename(source, target)
        except FileNotFoundError:
            if target.exists():
                return
            raise FileMissing(f"item {item_id} has no file in {queue}/{src.value}") from None
        except OSError as exc:
            raise StoreError(f"could not move item file: {exc}") from exc
        if durable and self.fsync:
            self._fsync_dir(target.parent)
            self._fsync_dir(source.parent)

    def unlink(self, queue: str, item_id: str, states: Sequence[State] = tuple(State)) -> bool:
        """Remove the item's file from each of ``states``; True if any was there."""
        removed = False
        for state in states:
            try:
                os.unlink(self.item_path(queue, state, item_id))
                removed = True
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise StoreError(f"could not remove item file: {exc}") from exc
        return removed

    def remove_queue(self, queue: str) -> None:
        shutil.rmtree(self.queue_dir(queue), ignore_errors=True)

    # -- reading -------------------------------------------------------------------------

    def read(self, queue: str, state: State, item_id: str) -> Record:
        path = self.item_path(queue, state, item_id)
        try:
            with open(path, "rb") as handle:
                return dict(json.loads(handle.read()))
        except FileNotFoundError:
            raise FileMissing(f"item {item_id} has no file in {queue}/{state.value}") from None
        except (OSError, ValueError) as exc:
            raise StoreError(f"could not read item file {path.name}: {exc}") from exc

    def read_any(self, queue: str, item_id: str, first: State) -> tuple[State, Record]:
        """Read the item's file, looking in ``first`` and then in the other states."""
        order = [first, *(s for s in State if s is not first)]
        for state in order:
            try:
                return state, self.read(queue, state, item_id)
            except FileMissing:
                continue
        raise FileMissing(f"item {item_id} has no file in queue {queue}")

    # -- scanning (repair only: never on a hot path) -------------------------------------

    def queues(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(
            entry.name
            for entry in os.scandir(self.root)
            if entry.is_dir(follow_symlinks=False) and QUEUE_NAME_PATTERN.fullmatch(entry.name)
        )

    def scan(self, queue: str) -> Iterator[FoundFile]:
        for state in State:
            directory = self.state_dir(queue, state)
            if not directory.is_dir():
                continue
            for entry in os.scandir(directory):
                name = entry.name
                if not name.endswith(SUFFIX) or name.startswith("."):
                    continue
                item_id = name[: -len(SUFFIX)]
                if ID_PATTERN.fullmatch(item_id):
                    yield FoundFile(queue, state, item_id, Path(entry.path))

    def stale_temporaries(self, queue: str) -> Iterator[Path]:
        for state in State:
            directory = self.state_dir(queue, state)
            if directory.is_dir():
                for entry in os.scandir(directory):
                    if entry.name.endswith(TMP_SUFFIX):
                        yield Path(entry.path)

    # -- flushing ------------------------------------------------------------------------

    @staticmethod
    def _fsync_dir(directory: Path) -> None:
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    @staticmethod
    def _sync_filesystem(directory: Path) -> None:
        """Flush every dirty file of the filesystem holding ``directory`` in one call."""
        fd = os.open(directory, os.O_RDONLY)
        try:
            if _syncfs is None or _syncfs(fd) != 0:
                os.sync()
        finally:
            os.close(fd)


def write_queue_settings(store: StateStore, queue: str, settings: dict[str, Any]) -> None:
    """Keep a queue's settings beside its items, so a lost database loses no settings."""
    store.ensure_queue(queue)
    path = store.queue_dir(queue) / "queue.json"
    tmp = path.with_name(f".queue.{secrets.token_hex(4)}{TMP_SUFFIX}")
    data = json.dumps(settings, sort_keys=True).encode()
    with open(tmp, "wb") as handle:
        handle.write(data)
        if store.fsync:
            handle.flush()
            os.fsync(handle.fileno())
    os.replace(tmp, path)
    if store.fsync:
        StateStore._fsync_dir(path.parent)


def read_queue_settings(store: StateStore, queue: str) -> dict[str, Any] | None:
    try:
        with open(store.queue_dir(queue) / "queue.json", "rb") as handle:
            value = json.loads(handle.read())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None
