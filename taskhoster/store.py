"""The state directories: one file per item, the directory it is in being its state.

Layout: ``<root>/<queue>/{pending,processing,done}/<id>.json``. Plain Python, no Django.

An item's file is a short log of JSON lines. The first line is the whole record as posted;
each transition that changes what the file must remember (a verdict, a re-queue, a restart)
appends one line with the fields it changes and the new ``rev``, and the record is the first
line updated by the others in order. A transition then moves the same file to its new
state's directory with one ``rename``. So after the post, no transition creates a file: on
Linux, creating an inode costs far more than appending to one or renaming it.

Durability comes from one barrier per group (``FileBatch.flush``): ``syncfs`` where Linux
offers it, else an fsync of every written file and touched directory; with ``FLUSH = "auto"``
(the default) a group that wrote one file and touched two directories at most takes
whichever of the two a measurement on this filesystem found cheaper for one file
(``StateStore.one_file_flush``). Before the barrier a
power cut may leave any subset of the group's writes, renames and unlinks; ``read`` ignores a
torn last line, and ``repair`` puts a file whose last line disagrees with its directory where
that line says, so nothing acknowledged (acknowledged only after the barrier) is undone.

Every syscall that changes the disk goes through ``Syscalls``, so a test can record them and
enumerate what a power cut could leave.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import shutil
import statistics
import threading
import time
from collections.abc import Callable, Collection, Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import patterns
from .errors import StoreError as StoreError  # re-exported: engine.removal, engine.repair
from .errors import StoreWriteFailed
from .faults import crash_point
from .ids import ID_PATTERN
from .libc import libc
from .status import State

QUEUE_NAME_PATTERN = re.compile(patterns.QUEUE)
SUFFIX = ".json"
# Each state's directory name, looked up (an enum's ``value`` is a slow property).
_DIRECTORY = {state: state.value for state in State}
TMP_SUFFIX = ".tmp"
TRASH = ".trash"
# A group that removes at least this many files lists them in one file under the trash
# directory instead of unlinking each inside the group; they are unlinked behind it.
DEFER_UNLINKS_AT = 64
UNLINK_LIST_SUFFIX = ".unlink"
QUARANTINE = ".quarantine"
# How a group's files may be made durable (``FLUSH``); see ``StateStore.barrier``.
FLUSH_WAYS = ("auto", "syncfs", "fsync")
# Where ``StateStore.one_file_flush`` measures, under the root (so on its filesystem).
FLUSH_PROBE = ".flush-probe-"
FLUSH_PROBE_ROUNDS = 9
FLUSH_PROBE_NAME = re.compile(rf"{re.escape(FLUSH_PROBE)}.*")

log = logging.getLogger(__name__)

Record = dict[str, Any]


def _unpaced(chunk: Callable[[int], int]) -> int:
    """Run ``chunk`` over everything at once (``reclaim_list`` without a pacer)."""
    return chunk(1 << 62)


class FileMissing(StoreError):
    """The item's file is not where it was looked for."""

    code = "file_missing"


def _load_syncfs() -> Any:
    found = libc()
    return getattr(found, "syncfs", None) if found is not None else None


_syncfs = _load_syncfs()


def remove_left_behind(root: Path, name: re.Pattern[str], *, older_than: float) -> int:
    """Remove the root's own entries whose whole name matches ``name`` and that are
    ``older_than`` seconds old or more (a directory with what it holds), and say how many:
    what a process killed while probing left (the flush's measurement here, the health
    monitor's write probe). A younger one may be another process's, probing now (of another
    host too, whose clock, or a network filesystem server's, differs). Symlinks are left,
    as is what cannot be listed or removed (logged)."""
    try:
        with os.scandir(root) as entries:
            left = [e for e in entries if name.fullmatch(e.name) and not e.is_symlink()]
    except FileNotFoundError:
        return 0
    except OSError as exc:
        log.warning("could not look for what probes left in %s: %s", root, exc)
        return 0
    removed = 0
    for entry in left:
        try:
            if entry.stat(follow_symlinks=False).st_mtime > time.time() - older_than:
                continue
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
            removed += 1
        except FileNotFoundError:
            continue  # another process removed it first
        except OSError as exc:
            log.warning("could not remove %s, which a probe left: %s", entry.path, exc)
    return removed


def free_space(root: Path) -> tuple[int, int] | None:
    """(free bytes, free inodes) of the filesystem holding ``root``, as an unprivileged
    process may use them (what is reserved for root is not counted); None if unknown.
    ``/metrics`` shows them, and the readiness of ``/healthz`` holds them against its
    thresholds."""
    try:
        stat = os.statvfs(root)
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize, stat.f_favail


def filesystem_type(path: Path) -> str | None:
    """The type of the filesystem ``path`` (or its nearest existing parent) is on, from
    ``/proc/self/mountinfo`` (Linux); None where that cannot be read."""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return None
    target = path.resolve()
    while not target.exists() and target != target.parent:
        target = target.parent
    best, best_type = "", None
    for line in lines:
        fields, _, after = line.partition(" - ")
        parts = fields.split()
        if len(parts) < 5 or not after:
            continue
        # (mount points escape a space, a tab, a newline and a backslash as octal)
        mount = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), parts[4])
        inside = str(target) == mount or str(target).startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
            best, best_type = mount, after.split()[0]
    return best_type


def _syncfs_reaches_storage(root: Path) -> bool:
    """Whether ``syncfs`` on ``root`` makes its files durable. Linux does not pass it to a
    FUSE filesystem (it returns 0 having done nothing there), so there each file and
    directory is flushed instead."""
    kind = filesystem_type(root)
    return not (kind and kind.startswith("fuse"))


def encode_line(fields: Record) -> bytes:
    return json.dumps(fields, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"


def decode(data: bytes, *, name: str = "") -> tuple[Record, int]:
    """Fold a file's lines into its record; also return the length of the lines used.

    The record ends at the first line that is not a whole JSON object: a write a power cut
    cut short, or tore (and what was appended after it, which no flush covered either: a
    flush covers every earlier write, so nothing acknowledged ever lies past a torn line).
    A file whose first line is not whole is unreadable.
    """
    record: Record | None = None
    end = 0
    for fields, past in _whole_lines(data):
        if record is None:
            record = fields
        else:
            record.update(fields)
        end = past
    if record is None:
        raise StoreError(f"item file {name} has no whole first line")
    return record, end


def decode_lines(data: bytes, *, name: str = "") -> list[Record]:
    """A file's whole lines, each as written (``decode`` folds them into one record)."""
    lines = [fields for fields, _end in _whole_lines(data)]
    if not lines:
        raise StoreError(f"item file {name} has no whole first line")
    return lines


def _whole_lines(data: bytes) -> Iterator[tuple[Record, int]]:
    """Each whole JSON-object line with the offset just past it, up to the first that is
    not one."""
    end = 0
    while True:
        stop = data.find(b"\n", end)
        if stop < 0:
            return
        try:
            fields = json.loads(data[end:stop])
        except ValueError:
            return
        if not isinstance(fields, dict):
            return
        end = stop + 1
        yield fields, end


class Syscalls:
    """The file operations the store makes; a test may record them (see
    tests/integration/test_power_cut.py)."""

    def read(self, path: str) -> bytes:
        """A whole file's bytes (changes nothing)."""
        with open(path, "rb") as handle:
            return handle.read()

    def create(self, path: str, data: bytes) -> None:
        """A new file holding ``data``, or none: a write that fails (a full disk) takes the
        file it made away again, as ``append`` cuts back what it added. Left, it was a file
        without a row (no undo was recorded for a create that raised)."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640)
        try:
            self._write_all(fd, data)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        finally:
            os.close(fd)

    def append(self, path: str, data: bytes) -> int:
        """Append ``data``; return the size before, to cut back to if the group fails."""
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        try:
            size = os.fstat(fd).st_size
            try:
                self._write_all(fd, data)
            except OSError:
                os.ftruncate(fd, size)
                raise
            return size
        finally:
            os.close(fd)

    def truncate(self, path: str, size: int) -> None:
        os.truncate(path, size)

    def rename(self, src: str, dst: str) -> None:
        os.rename(src, dst)

    def unlink(self, path: str) -> None:
        os.unlink(path)

    def mkdir(self, path: str) -> None:
        os.mkdir(path, 0o750)

    def rmdir(self, path: str) -> None:
        os.rmdir(path)

    def fsync(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def syncfs(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            if _syncfs is None or _syncfs(fd) != 0:
                os.sync()
        finally:
            os.close(fd)

    @staticmethod
    def _write_all(fd: int, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]


def why(exc: OSError) -> str:
    """What an ``OSError`` says, without the paths it names: an error's message reaches API
    clients, who have no business with where the state root is."""
    if exc.strerror:
        return f"{exc.strerror} (errno {exc.errno})" if exc.errno else exc.strerror
    return type(exc).__name__


@dataclass(frozen=True)
class FoundFile:
    queue: str
    state: State
    item_id: str
    path: Path


def item_of(path: str) -> tuple[str, State, str] | None:
    """The queue, state and id of the item file at ``path`` (one of ``item_file``'s
    paths); None for any other file."""
    directory, name = os.path.split(path)
    queue_dir, state_name = os.path.split(directory)
    if state_name not in _DIRECTORY.values() or not name.endswith(SUFFIX):
        return None
    item_id = name[: -len(SUFFIX)]
    if ID_PATTERN.fullmatch(item_id) is None:
        return None
    return os.path.basename(queue_dir), State(state_name), item_id


class StateStore:
    """Reads and writes item files under one root."""

    def __init__(self, root: Path | str, *, fsync: bool = True, flush: str = "syncfs") -> None:
        if flush not in FLUSH_WAYS:
            raise ValueError(f"flush must be one of {FLUSH_WAYS}, not {flush!r}")
        self.root = Path(root).resolve()
        self.fsync = fsync
        self.flush_mode = flush
        if flush != "fsync" and (_syncfs is None or not _syncfs_reaches_storage(self.root)):
            self.flush_mode = "fsync"
        # With "auto": how a group that wrote one file is flushed ("fsync" or "syncfs"),
        # measured once (``one_file_flush``): as a committer process starts, or at the first
        # such group.
        self.one_file_way: str | None = None
        self._measuring = threading.Lock()
        self.sys = Syscalls()
        self._queue_paths: dict[str, str] = {}
        # The items whose files a flush failed to make durable after their group committed:
        # written again as new files before this process changes anything else
        # (``engine.runner``; ``FileBatch.rewrite``); their rows are marked too, for the
        # other processes (``Item.unflushed``).
        self.unflushed: set[str] = set()
        # Items met marked (another process's failed flush, or one gone since): written
        # again here too, but this process's own flushes did not fail, so it goes on with
        # everything else meanwhile (``take_up``).
        self.taken_up: set[str] = set()
        self.unflushed_lock = threading.Lock()
        self.unflushed_said: set[str] = set()  # those whose file no longer read whole, logged
        # Told how many there are whenever that changes (a committer process tells its
        # server, whose /healthz says so).
        self.on_unflushed: Callable[[int], None] | None = None

    # -- paths ---------------------------------------------------------------------------

    def queue_dir(self, queue: str) -> Path:
        if (
            not isinstance(queue, str)
            or QUEUE_NAME_PATTERN.fullmatch(queue) is None
            or queue in (".", "..")
        ):
            raise StoreError(f"invalid queue name {queue!r}", code="invalid_queue_name")
        path = self.root / queue
        if path.parent != self.root:
            raise StoreError("queue path escapes the state root", code="invalid_queue_name")
        return path

    def state_dir(self, queue: str, state: State) -> Path:
        return self.queue_dir(queue) / State(state).value

    def item_path(self, queue: str, state: State, item_id: str) -> Path:
        return Path(self.item_file(queue, state, item_id))

    def item_file(self, queue: str, state: State, item_id: str) -> str:
        """``item_path`` as a string, without building paths on the hot path (each queue's
        directory is checked once)."""
        if not isinstance(item_id, str) or ID_PATTERN.fullmatch(item_id) is None:
            raise StoreError(f"invalid item id {item_id!r}", code="invalid_id")
        base = self._queue_paths.get(queue)
        if base is None:
            base = str(self.queue_dir(queue))
            if len(self._queue_paths) < 10_000:
                self._queue_paths[queue] = base
        return f"{base}/{_DIRECTORY[state]}/{item_id}{SUFFIX}"

    @property
    def trash_dir(self) -> Path:
        return self.root / TRASH

    def ensure_queue(self, queue: str) -> None:
        """The queue's directory and its state directories, made durable when any was new
        (a file flushed into a directory whose own entry a power cut takes is lost too)."""
        base = self.queue_dir(queue)
        self.make_dirs([base, *(base / state.value for state in State)])

    def make_dirs(self, paths: list[Path]) -> None:
        """Make each missing directory (parents first, in order), then, with fsync on, flush
        each new directory itself (its own block: on a filesystem without a journal, its
        parent's flush does not write it, and a power cut left an entry naming a directory
        that cannot be read) and the directories that gained an entry."""
        made: list[str] = []
        ours: list[str] = []  # (not another process's, a moment ago)
        parents: set[str] = set()
        for path in paths:
            if path.is_dir():
                continue
            if not path.parent.is_dir():
                path.parent.mkdir(parents=True, exist_ok=True)  # the root itself: not ours
            # Made here or, a moment ago, by another process that may not have flushed its
            # parent yet: flushed here either way before anything is written into it.
            with contextlib.suppress(FileExistsError):
                self.sys.mkdir(str(path))
                ours.append(str(path))
            made.append(str(path))
            parents.add(str(path.parent))
        if not self.fsync:
            return
        try:
            for directory in [*made, *sorted(parents - set(made))]:
                self.sys.fsync(directory)
        except OSError:
            # Not durable: taken away again (empty), so that the next try makes and flushes
            # them, rather than find them and flush nothing.
            for directory in reversed(ours):
                with contextlib.suppress(OSError):
                    self.sys.rmdir(directory)
            raise

    # -- reading -------------------------------------------------------------------------

    def read(self, queue: str, state: State, item_id: str) -> Record:
        return self.read_path(self.item_file(queue, state, item_id))

    def read_path(self, path: Path | str) -> Record:
        return decode(self._read_bytes(path), name=os.path.basename(path))[0]

    def read_lines(self, queue: str, item_id: str, first: State) -> list[Record]:
        """The item's file's lines, each as written (looking in ``first``, then the other
        states)."""
        for state in (first, *(s for s in State if s is not first)):
            path = self.item_file(queue, state, item_id)
            try:
                return decode_lines(self._read_bytes(path), name=os.path.basename(path))
            except FileMissing:
                continue
        raise FileMissing(f"item {item_id} has no file in queue {queue}")

    def _read_bytes(self, path: Path | str) -> bytes:
        name = os.path.basename(path)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise FileMissing(f"item file {name} is missing") from None
        except OSError as exc:
            raise StoreError(f"could not read item file {name}: {why(exc)}") from exc
        try:
            chunks = [os.read(fd, 1 << 16)]
            while len(chunks[-1]) == 1 << 16:
                chunks.append(os.read(fd, 1 << 20))
        except OSError as exc:
            raise StoreError(f"could not read item file {name}: {why(exc)}") from exc
        finally:
            os.close(fd)
        return b"".join(chunks)

    def read_any(self, queue: str, item_id: str, first: State) -> tuple[State, Record]:
        """Read the item's file, looking in ``first`` and then in the other states."""
        for state in (first, *(s for s in State if s is not first)):
            try:
                return state, self.read(queue, state, item_id)
            except FileMissing:
                continue
        raise FileMissing(f"item {item_id} has no file in queue {queue}")

    def locate(self, queue: str, item_id: str, first: State) -> State | None:
        for state in (first, *(s for s in State if s is not first)):
            if os.path.exists(self.item_file(queue, state, item_id)):
                return state
        return None

    # -- whole queues ----------------------------------------------------------------------

    def move_queue_to_trash(self, queue: str, token: str) -> Path | None:
        """Take a deleted queue's directory out of the namespace at once (one rename); its
        files are removed later by ``remove_trash``. None if it had no directory."""
        source = self.queue_dir(queue)
        target = self.trash_dir / f"{queue}.{token}"
        try:
            self.make_dirs([self.trash_dir])
            self.sys.rename(str(source), str(target))
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreError(f"could not remove queue directory: {why(exc)}") from exc
        if self.fsync:
            self.sys.fsync(str(self.root))
        return target

    def trash_entries(self) -> list[Path]:
        if not self.trash_dir.is_dir():
            return []
        return sorted(p for p in self.trash_dir.iterdir() if p.is_dir())

    def remove_trash(self, path: Path, *, limit: int | None = None) -> int:
        """Remove up to ``limit`` files of a trashed queue (all without a limit); the
        directory goes when it is empty. Returns how many files were removed."""
        if path.parent != self.trash_dir:
            raise StoreError("not a trashed queue", code="invalid_path")
        removed = 0
        for state in (*(s.value for s in State),):
            directory = path / state
            if not directory.is_dir():
                continue
            with os.scandir(directory) as entries:
                for entry in entries:
                    if limit is not None and removed >= limit:
                        return removed
                    with contextlib.suppress(FileNotFoundError):
                        self.sys.unlink(entry.path)
                        removed += 1
        # What is left: the (now empty) state directories, queue.json, temporaries.
        for where, subdirectories, files in os.walk(path, topdown=False):
            for name in files:
                with contextlib.suppress(FileNotFoundError):
                    self.sys.unlink(os.path.join(where, name))
            for name in subdirectories:
                with contextlib.suppress(OSError):
                    self.sys.rmdir(os.path.join(where, name))
        with contextlib.suppress(OSError):
            self.sys.rmdir(str(path))
        return removed

    def unlink_trashed(self, path: Path, state: State, item_id: str) -> bool:
        """Unlink one item's file in a trashed queue's directory (looked for in ``state``,
        then the others); False if it was nowhere."""
        if path.parent != self.trash_dir:
            raise StoreError("not a trashed queue", code="invalid_path")
        if not isinstance(item_id, str) or ID_PATTERN.fullmatch(item_id) is None:
            raise StoreError(f"invalid item id {item_id!r}", code="invalid_id")
        for where in (state, *(s for s in State if s is not state)):
            try:
                self.sys.unlink(f"{path}/{where.value}/{item_id}{SUFFIX}")
                return True
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise StoreWriteFailed(f"could not remove item file: {why(exc)}") from exc
        return False

    def unlink_item(self, queue: str, item_id: str, first: State) -> str | None:
        """Unlink an item's file, looked for in ``first`` and then the other states (a crash
        may have left it ahead of its row); the directory it was in, or None if it was
        nowhere."""
        for state in (first, *(s for s in State if s is not first)):
            path = self.item_file(queue, state, item_id)
            try:
                self.sys.unlink(path)
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise StoreWriteFailed(f"could not remove item file: {why(exc)}") from exc
            return os.path.dirname(path)
        return None

    @staticmethod
    def _listed(path: Path) -> list[tuple[str, State, str]]:
        """(queue, state, item id) of each valid line of a list; [] if it is gone."""
        try:
            names = path.read_text().splitlines()
        except FileNotFoundError:
            return []
        states = {s.value: s for s in State}
        found = []
        for name in names:
            parts = name.split("/")
            if len(parts) != 3:
                continue
            queue, state, item_id = parts
            if (
                QUEUE_NAME_PATTERN.fullmatch(queue)
                and state in states
                and ID_PATTERN.fullmatch(item_id)
            ):
                found.append((queue, states[state], item_id))
        return found

    def unlink_lists(self, *, older_than: float | None = None) -> list[Path]:
        """The lists of files to remove left in the trash directory (``FileBatch``), oldest
        first; with ``older_than`` (a time), only those last changed before it."""
        if not self.trash_dir.is_dir():
            return []
        found = []
        with os.scandir(self.trash_dir) as entries:
            for entry in entries:
                if not entry.name.endswith(UNLINK_LIST_SUFFIX) or not entry.is_file():
                    continue
                with contextlib.suppress(FileNotFoundError):
                    mtime = entry.stat().st_mtime
                    if older_than is None or mtime < older_than:
                        found.append((mtime, Path(entry.path)))
        return [path for _mtime, path in sorted(found)]

    def listed_for_removal(self) -> set[tuple[str, str]]:
        """(queue, item id) of every file some list still names."""
        return {
            (queue, item_id)
            for path in self.unlink_lists()
            for queue, _state, item_id in self._listed(path)
        }

    def reclaim_list(
        self, path: Path, *, pace: Callable[[Callable[[int], int]], int] | None = None
    ) -> int:
        """Unlink every file a list names, make that durable, then remove the list; returns
        the files removed. Idempotent: a file already gone is skipped, so two reclaimers (or
        a crash half-way) do no harm."""
        if path.parent != self.trash_dir or not path.name.endswith(UNLINK_LIST_SUFFIX):
            raise StoreError("not a list of files to remove", code="invalid_path")
        removed = 0
        directories: set[str] = set()
        listed = self._listed(path)
        done = 0

        def chunk(size: int) -> int:
            nonlocal removed, done
            part = listed[done : done + size]
            for queue, state, item_id in part:
                directory = self.unlink_item(queue, item_id, state)
                if directory is not None:
                    directories.add(directory)
                    removed += 1
            done += len(part)
            return len(part)

        (pace or _unpaced)(chunk)
        # The unlinks reach the disk before the list that vouches for them goes.
        self.barrier(set(), directories or {str(self.trash_dir)})
        with contextlib.suppress(FileNotFoundError):
            self.sys.unlink(str(path))
        return removed

    # -- scanning (repair only: never on a hot path) -------------------------------------

    def queues(self) -> list[str]:
        if not self.root.is_dir():
            return []
        with os.scandir(self.root) as entries:
            return sorted(
                entry.name
                for entry in entries
                if entry.is_dir(follow_symlinks=False) and QUEUE_NAME_PATTERN.fullmatch(entry.name)
            )

    def scan(self, queue: str) -> Generator[FoundFile, None, None]:
        for state in State:
            directory = self.state_dir(queue, state)
            if not directory.is_dir():
                continue
            # (Closed when the caller stops early, too: the generator's close ends the
            # ``with``.)
            with os.scandir(directory) as entries:
                for entry in entries:
                    name = entry.name
                    if not name.endswith(SUFFIX) or name.startswith("."):
                        continue
                    item_id = name[: -len(SUFFIX)]
                    if ID_PATTERN.fullmatch(item_id):
                        yield FoundFile(queue, state, item_id, Path(entry.path))

    def stale_temporaries(self, queue: str) -> Generator[Path, None, None]:
        directories = [self.state_dir(queue, s) for s in State] + [self.queue_dir(queue)]
        for directory in directories:
            if directory.is_dir():
                with os.scandir(directory) as entries:
                    for entry in entries:
                        if entry.name.endswith(TMP_SUFFIX):
                            yield Path(entry.path)

    def quarantine(self, path: Path) -> Path:
        """Move an unreadable file out of the way (kept for an operator to look at)."""
        target_dir = self.root / QUARANTINE
        target_dir.mkdir(parents=True, exist_ok=True)
        target = target_dir / f"{path.parent.parent.name}.{path.parent.name}.{path.name}"
        os.rename(path, target)
        return target

    def truncate_torn(self, path: Path) -> bool:
        """Cut what follows a file's last whole line (see ``decode``); True if anything was
        cut. Later appends then start after a whole line."""
        data = path.read_bytes()
        try:
            _record, end = decode(data, name=path.name)
        except StoreError:
            return False
        if end < len(data):
            self.sys.truncate(str(path), end)
            return True
        return False

    # -- groups of changes ---------------------------------------------------------------

    def batch(self) -> FileBatch:
        return FileBatch(self)

    def replace(self, path: str, data: bytes) -> None:
        """Put ``data`` at ``path`` whole or not at all: written as a temporary beside it,
        its data flushed (fsync on) before it takes the name, so that a power cut finds the
        old file or the new one, whole (a temporary left, repair removes). The directory is
        the caller's to flush. ``OSError`` if the state root refuses it."""
        directory, name = path.rpartition("/")[::2]
        tmp = f"{directory}/.{name.removesuffix(SUFFIX)}.{secrets.token_hex(4)}{TMP_SUFFIX}"
        self.sys.create(tmp, data)
        try:
            if self.fsync:
                self.sys.fsync(tmp)
            self.sys.rename(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                self.sys.unlink(tmp)
            raise

    def add_unflushed(self, ids: Collection[str]) -> None:
        """Items whose files a failed flush left (``FileBatch.rewrite``)."""
        with self.unflushed_lock:  # (told under it: two threads' numbers never cross)
            self.unflushed.update(ids)
            self._tell_unflushed(len(self.unflushed))

    def take_up(self, ids: Collection[str]) -> None:
        """Items met marked ``unflushed``: to be written again here too (``taken_up``)."""
        with self.unflushed_lock:
            self.taken_up.update(i for i in ids if i not in self.unflushed)

    def set_aside(self, ids: Collection[str]) -> None:
        """Items taken up whose files do not read as their rows say: not tried again until
        a later look finds them still marked (``unflushed_said`` keeps them from being
        said again)."""
        with self.unflushed_lock:
            self.taken_up.difference_update(ids)

    def forget_unflushed(self, ids: Collection[str]) -> int:
        """Those of ``ids`` are written again (or gone): how many are left (of this
        process's own)."""
        with self.unflushed_lock:
            self.unflushed.difference_update(ids)
            self.taken_up.difference_update(ids)
            self.unflushed_said.difference_update(ids)
            left = len(self.unflushed)
            self._tell_unflushed(left)
        return left

    def _tell_unflushed(self, left: int) -> None:
        if self.on_unflushed is not None:
            try:
                self.on_unflushed(left)
            except Exception:  # (a server gone: nothing to tell)
                log.exception("could not say how many files wait to be written again")

    def barrier(self, written: set[str], directories: set[str]) -> None:
        """Make every write, rename and unlink made so far durable (fsync on)."""
        if not self.fsync or not (written or directories):
            return
        way = self.flush_mode
        if way == "auto":
            way = "syncfs" if len(written) > 1 or len(directories) > 2 else self.one_file_flush()
        try:
            if way == "syncfs":
                self.sys.syncfs(str(self.root))
                return
            moved_to: set[str] = set()
            for path in sorted(written):
                self._fsync_file(path, moved_to)
            crash_point("barrier.after_files")
            for directory in sorted(directories | moved_to):
                with contextlib.suppress(FileNotFoundError):
                    self.sys.fsync(directory)
                crash_point("barrier.after_directory")
        except OSError as exc:
            raise StoreWriteFailed(f"could not flush item files: {why(exc)}") from exc

    def _fsync_file(self, path: str, moved_to: set[str]) -> None:
        """Flush a written file's data, wherever it is now. Between a group's commit and its
        flush another process may move the file on (a server process's claim takes a post's
        file from ``pending/`` the moment its news comes): its data is then flushed under
        its new name, and that directory is added to ``moved_to``, to be flushed too. A file
        that is nowhere was removed: nothing of it is left to keep."""
        for _attempt in range(len(State) + 1):
            try:
                self.sys.fsync(path)
                return
            except FileNotFoundError:
                found = self._moved(path)
                if found is None:
                    return
                log.debug("flushing %s where another process moved it: %s", path, found)
                path = found
                moved_to.add(os.path.dirname(found))

    def _moved(self, path: str) -> str | None:
        """Where the item file written at ``path`` is now (``locate``), if it is anywhere."""
        item = item_of(path)
        if item is None:
            return None  # not an item's file (a list of files to remove)
        queue, state, item_id = item
        found = self.locate(queue, item_id, state)
        return None if found is None else self.item_file(queue, found, item_id)

    def one_file_flush(self) -> str:
        """How this filesystem makes one new file durable sooner, an ``fsync`` of the file
        and of its directory or one ``syncfs``, measured once here, on the root's own
        filesystem, and kept for the store's life.

        The two differ by filesystem, so neither is right everywhere: on a journaled ext4
        ``syncfs`` costs about half again as much for one file, on an ext4 without a journal
        about half as much, and on XFS the two are even (``bench/flushcost.py``). From two
        files on, one ``syncfs`` is the cheaper everywhere measured, so only a group that
        wrote one file at most and touched two directories at most asks (a lone post, a
        lone result, a single delete). The measurement is some 20 ms, once (a committer process
        makes it as it starts: ``runner.measure_flush_ahead``): both ways in turn,
        ``FLUSH_PROBE_ROUNDS`` times, the medians compared. Either way makes the group's
        files durable, so the choice is only one of speed."""
        way = self.one_file_way
        if way is None:
            with self._measuring:  # (the committer and a reclaiming thread may both ask)
                if self.one_file_way is None:
                    self.one_file_way = self._choose_one_file_way()
                way = self.one_file_way
        return way

    def _choose_one_file_way(self) -> str:
        try:
            per_file, whole = self._measure_one_file_flush()
        except OSError as exc:
            log.warning("could not measure the flush of one file (%s): syncfs it is", exc)
            return "syncfs"
        way = "fsync" if per_file < whole else "syncfs"
        log.info(
            "a group that wrote one file is flushed by %s on %s (one file: fsync of it and "
            "its directory %.0f µs, syncfs %.0f µs, medians of %d)",
            way,
            self.root,
            per_file * 1e6,
            whole * 1e6,
            FLUSH_PROBE_ROUNDS,
        )
        return way

    def _measure_one_file_flush(self) -> tuple[float, float]:
        """(per file, syncfs): the median seconds to make one new file durable each way,
        in a directory of its own under the root (not an item's: the syscalls are the
        disk's, not the store's, and none is recorded). A probe a crash left is removed by
        a later measurement once it is an hour old (a younger one may be another process's,
        measuring now)."""
        self.root.mkdir(parents=True, exist_ok=True)
        remove_left_behind(self.root, FLUSH_PROBE_NAME, older_than=3600)
        probe = f"{self.root}/{FLUSH_PROBE}{os.getpid()}-{secrets.token_hex(4)}"
        os.mkdir(probe, 0o750)
        line = b'{"probe":"' + b"x" * 180 + b'"}\n'  # an item's first line, roughly
        samples: dict[str, list[float]] = {"fsync": [], "syncfs": []}
        disk = Syscalls()
        try:
            for n in range(FLUSH_PROBE_ROUNDS):
                ways = ("fsync", "syncfs") if n % 2 == 0 else ("syncfs", "fsync")
                for way in ways:
                    path = f"{probe}/{way}-{n}.json"
                    started = time.perf_counter()
                    disk.create(path, line)
                    if way == "fsync":
                        disk.fsync(path)
                        disk.fsync(probe)
                    else:
                        disk.syncfs(probe)
                    samples[way].append(time.perf_counter() - started)
        finally:
            shutil.rmtree(probe, ignore_errors=True)
        return statistics.median(samples["fsync"]), statistics.median(samples["syncfs"])


@dataclass
class FileBatch:
    """The file side of one group commit: every change is applied at once and can be undone
    until ``flush``; removals wait for ``apply_unlinks`` (a removal cannot be undone)."""

    store: StateStore
    # What undoes each change, newest last: (kind, path, what it needs, the item it is of;
    # None for a list of removals).
    undo: list[tuple[str, str, Any, str | None]] = field(default_factory=list)
    unlinks: list[tuple[str, str, State]] = field(default_factory=list)
    written: set[str] = field(default_factory=set)
    directories: set[str] = field(default_factory=set)
    # Each item ``rewrite`` left as it is (None), and why.
    not_rewritten: dict[str, str] = field(default_factory=dict)
    # Lists of files to unlink once the group is durable (see ``apply_unlinks``).
    deferred: list[str] = field(default_factory=list)

    def create(self, queue: str, item_id: str, line: bytes, *, replace: bool = False) -> None:
        """A new item: its file in ``pending/``, holding its first line.

        ``replace``: a file already at that name is taken as the leftover of an attempt that
        never committed (an id made the same by every attempt, as a schedule's slot's is),
        and moved to ``<root>/.quarantine/`` rather than refused; should the group fail (a
        row did hold it: its insert conflicts), the rollback puts it back."""
        target = self.store.item_file(queue, State.PENDING, item_id)
        try:
            try:
                self.store.sys.create(target, line)
            except FileNotFoundError:
                self.store.ensure_queue(queue)
                self.store.sys.create(target, line)
            except FileExistsError:
                if not replace:
                    raise
                aside_dir = self.store.root / QUARANTINE
                if not aside_dir.is_dir():
                    with contextlib.suppress(FileExistsError):
                        self.store.sys.mkdir(str(aside_dir))
                aside = str(aside_dir / f"{queue}.pending.{item_id}.{secrets.token_hex(4)}.json")
                self.store.sys.rename(target, aside)
                self.undo.append(("rename", aside, target, item_id))
                self.store.sys.create(target, line)
        except OSError as exc:
            raise StoreWriteFailed(f"could not write item file: {why(exc)}") from exc
        self.undo.append(("create", target, None, item_id))
        self.written.add(target)
        self.directories.add(os.path.dirname(target))

    def change(
        self, queue: str, item_id: str, src: State, dst: State, patch: Record | None
    ) -> bool:
        """Append ``patch`` (if any) to the item's file and move it from ``src`` to ``dst``.

        The file is looked for in the other states when it is not in ``src`` (a crash may
        have left it ahead of its row). False if it is nowhere: the item is gone.
        """
        for _attempt in range(2):
            path = self.store.item_file(queue, src, item_id)
            try:
                self._change(item_id, path, self.store.item_file(queue, dst, item_id), patch)
                return True
            except FileNotFoundError:
                found = self.store.locate(queue, item_id, src)
                if found is None or found is src:
                    return False
                src = found
            except OSError as exc:
                raise StoreWriteFailed(f"could not change item file: {why(exc)}") from exc
        return False

    def take(self, queue: str, item_id: str, src: State, dst: State) -> bool:
        """Move the item's file from ``src`` to ``dst`` without a line, or nothing: False
        when it is not in ``src``. A claim's guard: whoever renames the file out of
        ``pending/`` has it, so a claim whose file has already left has lost (it never
        looks for the file elsewhere, as ``change`` does for crash leftovers)."""
        path = self.store.item_file(queue, src, item_id)
        try:
            self._change(item_id, path, self.store.item_file(queue, dst, item_id), None)
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise StoreWriteFailed(f"could not change item file: {why(exc)}") from exc
        return True

    def _change(self, item_id: str, path: str, target: str, patch: Record | None) -> None:
        if patch is not None:
            size = self.store.sys.append(path, encode_line(patch))
            self.undo.append(("truncate", path, size, item_id))
            crash_point("file.after_append")
        if target != path:
            self.store.sys.rename(path, target)
            self.undo.append(("rename", target, path, item_id))
            # (``item_file``'s paths: the directory is all before the last "/".)
            self.directories.add(path.rpartition("/")[0])
            self.directories.add(target.rpartition("/")[0])
            if path in self.written:
                # Written earlier in this group (a post its claim joined, a failure claimed
                # again): its data is flushed under the name it has now.
                self.written.discard(path)
                self.written.add(target)
        if patch is not None:
            self.written.add(target)

    def rewrite(self, queue: str, item_id: str, first: State, rev: int) -> bool | None:
        """Write the item's file again as a new file holding the same bytes, its data
        flushed, then renamed over it, wherever it is (looked for in ``first``, its row's
        state, first): True; False when it is nowhere; None when it cannot be read, no
        longer reads whole (its pages left the cache after their write failed, and the
        disk's zeros are read now), or is not at the row's ``rev`` (an older copy is read
        now): left as it is, for repair.

        For a file a failed flush left: the kernel may have marked its pages written when
        their write failed (a flush of it then succeeds and writes nothing), and a
        filesystem without a journal may have dropped its inode's and directory's changes
        likewise; a new file's are written afresh (``tests/integration/test_flush_fails.py``).
        Nothing to undo: the bytes are the same; a crash before the rename leaves the old
        file (and a temporary, which repair removes), after it the new one, whole."""
        state = self.store.locate(queue, item_id, first)
        if state is None:
            return False
        path = self.store.item_file(queue, state, item_id)
        directory = path.rpartition("/")[0]
        try:
            data = self.store.sys.read(path)
        except FileNotFoundError:
            return False
        except OSError as exc:
            self.not_rewritten[item_id] = f"it cannot be read: {why(exc)}"
            return None
        try:
            record, whole = decode(data, name=os.path.basename(path))
        except StoreError as exc:
            self.not_rewritten[item_id] = f"{len(data)} bytes read, not a record: {exc}"
            return None
        found = record.get("rev")
        if whole != len(data) or found != rev:
            self.not_rewritten[item_id] = (
                f"{len(data)} bytes read, {whole} of them whole lines, at rev {found!r} "
                f"where its row is at {rev}"
            )
            return None
        try:
            # Its data durable before it takes the name: a power cut after the rename must
            # not find an empty new file where a durable one was (an item the failed group
            # only moved, posted and acknowledged long before).
            self.store.replace(path, data)
        except OSError as exc:
            raise StoreWriteFailed(f"could not write an item file again: {why(exc)}") from exc
        self.written.add(path)
        self.directories.add(directory)
        return True

    def remove(self, queue: str, item_id: str, state: State) -> None:
        """Remove the item's file (looked for in ``state`` first) when ``apply_unlinks``
        runs: a removal cannot be undone, so it waits until the group can no longer fail."""
        self.unlinks.append((queue, item_id, state))

    def apply_unlinks(self) -> None:
        """Remove the files of ``remove``: at once, or, for many, by a list.

        Unlinking a file costs about as much as the rest of a deleted item's work, so a group
        removing many files writes their names into one list file in the trash directory
        instead (made durable with the group's other files). The group's answer waits for
        that flush; the files are unlinked behind it (``StateStore.reclaim_list``), and a list
        left by a crash is finished by the sweep or by repair before it indexes any file, so
        a deleted item never comes back. A group that fails removes its list (``rollback``).
        """
        if len(self.unlinks) >= DEFER_UNLINKS_AT:
            self._defer_unlinks()
            return
        for queue, item_id, first in self.unlinks:
            directory = self.store.unlink_item(queue, item_id, first)
            if directory is not None:
                self.directories.add(directory)
        self.unlinks.clear()

    def _defer_unlinks(self) -> None:
        lines = "".join(f"{q}/{state.value}/{i}\n" for q, i, state in self.unlinks)
        trash = self.store.trash_dir
        target = str(trash / f"{secrets.token_hex(8)}{UNLINK_LIST_SUFFIX}")
        try:
            try:
                self.store.sys.create(target, lines.encode())
            except FileNotFoundError:
                self.store.make_dirs([trash])
                self.store.sys.create(target, lines.encode())
        except OSError as exc:
            raise StoreWriteFailed(
                f"could not write the list of files to remove: {why(exc)}"
            ) from exc
        self.undo.append(("create", target, None, None))
        self.written.add(target)
        self.directories.add(str(trash))
        self.deferred.append(target)
        self.unlinks.clear()

    def rollback(self, *, spare: Collection[str] = ()) -> None:
        """Undo every change, newest first (the group's transaction failed); but not those
        of the items in ``spare``, whose files are left as they are."""
        for kind, path, other, item_id in reversed(self.undo):
            if item_id is not None and item_id in spare:
                continue
            with contextlib.suppress(OSError):
                if kind == "rename":
                    self.store.sys.rename(path, other)
                elif kind == "truncate":
                    self.store.sys.truncate(path, other)
                elif kind == "create":
                    self.store.sys.unlink(path)
        self.undo.clear()
        self.unlinks.clear()
        self.deferred.clear()

    def flush(self) -> None:
        self.store.barrier(self.written, self.directories)

    def remember_unflushed(self) -> None:
        """This batch's flush failed after its group committed: every item whose file it
        made, changed or moved is to be written again (``StateStore.unflushed``)."""
        found = {
            item[2]
            for _kind, path, _other, item_id in self.undo
            if item_id is not None and (item := item_of(path)) is not None
        }
        if found:
            self.store.add_unflushed(found)
            log.error(
                "%d items' files may not be durable: nothing else is changed until they are "
                "written again, once the state root takes writes",
                len(found),
            )


def write_queue_settings(store: StateStore, queue: str, settings: dict[str, Any]) -> None:
    """Keep a queue's settings beside its items, so a lost database loses no settings."""
    _write_queue_file(store, queue, "queue.json", settings)


def read_queue_settings(store: StateStore, queue: str) -> dict[str, Any] | None:
    value = _read_queue_file(store, queue, "queue.json")
    return value if isinstance(value, dict) else None


def write_schedules(store: StateStore, queue: str, schedules: list[dict[str, Any]]) -> None:
    """Keep a queue's schedules' definitions beside its items (SPEC section 8.3), as queue
    settings are kept: a database that lost a change (it need not be durable) is put right by
    repair."""
    _write_queue_file(store, queue, "schedules.json", schedules)


def read_schedules(store: StateStore, queue: str) -> list[dict[str, Any]] | None:
    """The queue's schedules as last written; None when it never had one (or it is
    unreadable)."""
    value = _read_queue_file(store, queue, "schedules.json")
    if not isinstance(value, list):
        return None
    return [entry for entry in value if isinstance(entry, dict)]


def _write_queue_file(store: StateStore, queue: str, name: str, value: Any) -> None:
    """A whole file of the queue's directory replaced durably: written as a temporary,
    flushed, renamed into place, the directory flushed. ``StoreWriteFailed`` if the state
    root refuses it (the caller's transaction fails with it: 503, not 500)."""
    path = store.queue_dir(queue) / name
    try:
        store.ensure_queue(queue)
        store.replace(str(path), json.dumps(value, sort_keys=True).encode())
        if store.fsync:
            store.sys.fsync(str(path.parent))
    except OSError as exc:
        raise StoreWriteFailed(f"could not write the queue's {name}: {why(exc)}") from exc


def _read_queue_file(store: StateStore, queue: str, name: str) -> Any:
    try:
        with open(store.queue_dir(queue) / name, "rb") as handle:
            return json.loads(handle.read())
    except (OSError, ValueError):
        return None
