"""What a power cut may leave of a run of file operations: a model that persists per file and per
directory, as the ALICE and CrashMonkey studies model a POSIX filesystem.

- A file's data (its inode's, whatever its name now) is durable up to its last ``fsync`` (or
  ``syncfs``). Of its later writes, a power cut keeps a prefix, the last one of which may be
  cut short or left as zeros of its length.
- A directory's entries (a create, an unlink, a rename in or out) are durable once that
  directory is ``fsync``-ed (or after ``syncfs``). Of the later entry operations, a power cut
  keeps any subset: each is kept or lost on its own, whatever the order they were made in.
- A rename is atomic: after a power cut the file is at its old name or at its new one, never
  at both or neither, and a flush of either directory makes it durable. This is what the
  journaling filesystems give (ext4 and XFS commit a rename, both directories at once, in one
  journal transaction, and a directory's ``fsync`` commits it), and what the store relies on:
  with renames persisted per directory, no order of directory flushes keeps a group that moves
  files both ways between two states (a claim beside a re-queue) from leaving a file in
  neither, and a filesystem like that is not supported.
- ``syncfs`` makes everything durable. Nothing else is.

Directories are inodes too: a ``mkdir``, an ``rmdir`` and a directory's rename are entries of
its parent, durable as any other, and a file is found by walking from the root through the
entries a state kept, so a file whose directory's own entry was lost is lost with it, and a
directory renamed (a queue moved into the trash) takes its files along whatever their names
were when they were made. A directory is flushed as the inode it is, whatever it is called
now.

A file created and never flushed may be present with no data at all (its entry reached the
disk, its data did not). Each crash state is a choice for every operation not yet durable;
``CrashPoint.count`` says how many there are and ``CrashPoint.state`` builds the n-th, so a
test may enumerate every state or a seeded sample of them, counted.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Recorded operations (relative paths, the root being "."): ("create", path, data),
# ("append", path, data), ("truncate", path, size), ("rename", src, dst), ("unlink", path),
# ("mkdir", path), ("rmdir", path), ("fsync", path), ("fsync-dir", path), ("barrier",);
# anything else (acknowledgements) is not a file operation.

ROOT = 0  # the root directory's inode: always there
Name = tuple[int, str]  # (the directory's inode, the name in it)


@dataclass
class Inode:
    durable: bytes  # what a power cut keeps for certain
    pending: list[tuple[str, Any]] = field(default_factory=list)  # ("write", b) / ("size", n)
    current: bytes = b""
    directory: bool = False

    def persist(self) -> None:
        self.durable = self.current
        self.pending.clear()

    def choices(self) -> int:
        """Keep 0..n of the pending writes, the last kept one whole, cut in half or zeroed."""
        return 1 + 3 * len(self.pending)

    def content(self, choice: int) -> bytes:
        data = self.durable
        if choice == 0:
            return data
        kept, how = divmod(choice - 1, 3)
        for n, (kind, value) in enumerate(self.pending[: kept + 1]):
            last = n == kept
            if kind == "size":
                data = data[:value] + b"\0" * max(0, value - len(data))
            elif not last or how == 0:
                data = data + value
            elif how == 1:
                data = data + value[: len(value) // 2]
            else:
                data = data + b"\0" * len(value)
        return data


@dataclass
class Entry:
    """One directory operation: ``src`` leaves its directory, ``dst`` enters its own (a
    create or mkdir has no ``src``, an unlink or rmdir no ``dst``, a rename both)."""

    inode: int
    src: Name | None
    dst: Name | None
    src_durable: bool = False
    dst_durable: bool = False

    def flushed(self, directory: int) -> None:
        src = self.src is not None and self.src[0] == directory
        dst = self.dst is not None and self.dst[0] == directory
        if self.src is not None and self.dst is not None and (src or dst):
            self.src_durable = self.dst_durable = True  # a rename: atomic (see the module)
        self.src_durable |= src
        self.dst_durable |= dst

    @property
    def durable(self) -> bool:
        return (self.src is None or self.src_durable) and (self.dst is None or self.dst_durable)

    def choices(self) -> int:
        """Kept or lost."""
        return 1 if self.durable else 2

    def apply(self, names: dict[Name, int], choice: int) -> None:
        if not (self.durable or choice == 1):
            return
        if self.src is not None and names.get(self.src) == self.inode:
            del names[self.src]
        if self.dst is not None:
            names[self.dst] = self.inode


def _walk(names: dict[Name, int], inodes: dict[int, Inode]) -> tuple[dict[str, int], set[str]]:
    """The files (path: inode) and directories reachable from the root through ``names``."""
    children: dict[int, list[tuple[str, int]]] = {}
    for (parent, name), ino in names.items():
        children.setdefault(parent, []).append((name, ino))
    files: dict[str, int] = {}
    directories: set[str] = set()
    todo = [(ROOT, "")]
    seen = {ROOT}
    while todo:
        directory, prefix = todo.pop()
        for name, ino in children.get(directory, []):
            path = f"{prefix}{name}"
            if inodes[ino].directory:
                if ino not in seen:  # (a directory is entered once, whatever a state kept)
                    seen.add(ino)
                    directories.add(path)
                    todo.append((ino, f"{path}/"))
            else:
                files[path] = ino
    return files, directories


@dataclass
class CrashPoint:
    """The disk as a power cut at one instant may leave it."""

    names: dict[Name, int]  # what is durable for certain
    inodes: dict[int, Inode]
    entries: list[Entry]  # directory operations not yet durable on both sides, in order

    def live_inodes(self) -> list[int]:
        """Files with writes not yet durable that some state names."""
        named = set(self.names.values()) | {e.inode for e in self.entries if e.dst is not None}
        return [n for n in sorted(named) if self.inodes[n].pending]

    def count(self) -> int:
        total = 1
        for entry in self.entries:
            total *= entry.choices()
        for number in self.live_inodes():
            total *= self.inodes[number].choices()
        return total

    def tree(self, number: int) -> tuple[dict[str, bytes], set[str]]:
        """The ``number``-th state (0 <= number < count()): its files (path: content) and
        its directories."""
        names = dict(self.names)
        for entry in self.entries:
            number, choice = divmod(number, entry.choices())
            entry.apply(names, choice)
        chosen: dict[int, int] = {}
        for ino in self.live_inodes():
            number, chosen[ino] = divmod(number, self.inodes[ino].choices())
        files, directories = _walk(names, self.inodes)
        contents = {
            path: self.inodes[ino].content(chosen.get(ino, 0)) for path, ino in files.items()
        }
        return contents, directories

    def state(self, number: int) -> dict[str, bytes]:
        """The files of the ``number``-th state: path -> content."""
        return self.tree(number)[0]


class Disk:
    """Plays recorded operations against the model, from a starting tree that is durable."""

    def __init__(self, base: Path) -> None:
        self.names: dict[Name, int] = {}  # the namespace as the running program sees it
        self.inodes: dict[int, Inode] = {ROOT: Inode(durable=b"", directory=True)}
        self.entries: list[Entry] = []
        for directory, subdirectories, files in os.walk(base):
            parent = self.resolve(os.path.relpath(directory, base))
            for name in subdirectories:
                self.names[(parent, name)] = self._new_inode(b"", directory=True)
            for name in files:
                self.names[(parent, name)] = self._new_inode(Path(directory, name).read_bytes())
        self.durable_names = dict(self.names)  # with every entry folded in so far

    def _new_inode(self, data: bytes, *, directory: bool = False) -> int:
        number = len(self.inodes)
        self.inodes[number] = Inode(durable=data, current=data, directory=directory)
        return number

    def resolve(self, path: str) -> int:
        """The inode a path names now (the root is "." or "")."""
        ino = ROOT
        for part in path.split("/"):
            if part not in ("", "."):
                ino = self.names[(ino, part)]
        return ino

    def name(self, path: str) -> Name:
        """(the inode of the directory it is in, its name) for a path."""
        parent, _, name = path.rpartition("/")
        return self.resolve(parent), name

    def play(self, op: tuple[Any, ...]) -> None:
        kind = op[0]
        if kind in ("create", "mkdir"):
            ino = self._new_inode(b"", directory=kind == "mkdir")
            if kind == "create":
                inode = self.inodes[ino]
                inode.current = op[2]
                inode.pending.append(("write", op[2]))
            name = self.name(op[1])
            self.names[name] = ino
            self.entries.append(Entry(inode=ino, src=None, dst=name))
        elif kind == "append":
            inode = self.inodes[self.resolve(op[1])]
            inode.current += op[2]
            inode.pending.append(("write", op[2]))
        elif kind == "truncate":
            inode = self.inodes[self.resolve(op[1])]
            inode.current = inode.current[: op[2]]
            inode.pending.append(("size", op[2]))
        elif kind == "rename":
            src, dst = self.name(op[1]), self.name(op[2])
            ino = self.names.pop(src)
            self.names[dst] = ino
            self.entries.append(Entry(inode=ino, src=src, dst=dst))
        elif kind in ("unlink", "rmdir"):
            name = self.name(op[1])
            ino = self.names.pop(name)
            self.entries.append(Entry(inode=ino, src=name, dst=None))
        elif kind == "fsync":
            # A name that is gone (a flush aimed at a file's old name) flushes nothing.
            with contextlib.suppress(KeyError):
                self.inodes[self.resolve(op[1])].persist()
        elif kind == "fsync-dir":
            directory = self.resolve(op[1])
            for entry in self.entries:
                entry.flushed(directory)
            self._fold()
        elif kind == "barrier":
            for inode in self.inodes.values():
                inode.persist()
            for entry in self.entries:
                entry.src_durable = entry.dst_durable = True
            self._fold()

    def _fold(self) -> None:
        """Fold the leading entries durable on both sides into ``durable_names`` (only the
        leading ones: a later durable entry may follow one that is not)."""
        while self.entries and self.entries[0].durable:
            self.entries.pop(0).apply(self.durable_names, 1)

    def crash_point(self) -> CrashPoint:
        return CrashPoint(
            names=dict(self.durable_names),
            inodes={
                n: Inode(
                    durable=i.durable,
                    pending=list(i.pending),
                    current=i.current,
                    directory=i.directory,
                )
                for n, i in self.inodes.items()
            },
            entries=[Entry(**vars(e)) for e in self.entries],
        )


def write_tree(target: Path, contents: dict[str, bytes], directories: set[str]) -> None:
    """``target``: the directories and files of a state."""
    target.mkdir(parents=True, exist_ok=True)
    for path in sorted(directories):
        (target / path).mkdir(parents=True, exist_ok=True)
    for path, data in contents.items():
        (target / path).write_bytes(data)
