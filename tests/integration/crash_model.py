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

A file created and never flushed may be present with no data at all (its entry reached the
disk, its data did not). Each crash state is a choice for every operation not yet durable;
``CrashPoint.count`` says how many there are and ``CrashPoint.state`` builds the n-th, so a
test may enumerate every state or a seeded sample of them, counted.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Recorded operations (relative paths): ("create", path, data), ("append", path, data),
# ("truncate", path, size), ("rename", src, dst), ("unlink", path), ("fsync", path),
# ("fsync-dir", path), ("barrier",); anything else (acknowledgements) is not a file operation.


@dataclass
class Inode:
    durable: bytes  # what a power cut keeps for certain
    pending: list[tuple[str, Any]] = field(default_factory=list)  # ("write", b) / ("size", n)
    current: bytes = b""

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
    create has no ``src``, an unlink no ``dst``, a rename both)."""

    inode: int
    src: str | None
    dst: str | None
    src_durable: bool = False
    dst_durable: bool = False

    def flushed(self, directory: str) -> None:
        src = self.src is not None and os.path.dirname(self.src) == directory
        dst = self.dst is not None and os.path.dirname(self.dst) == directory
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

    def apply(self, names: dict[str, int], choice: int) -> None:
        if not (self.durable or choice == 1):
            return
        if self.src is not None and names.get(self.src) == self.inode:
            del names[self.src]
        if self.dst is not None:
            names[self.dst] = self.inode


@dataclass
class CrashPoint:
    """The disk as a power cut at one instant may leave it."""

    names: dict[str, int]  # what is durable for certain: path -> inode
    inodes: dict[int, Inode]
    entries: list[Entry]  # directory operations not yet durable on both sides, in order

    def live_inodes(self) -> list[int]:
        """Inodes with writes not yet durable that some state names."""
        named = set(self.names.values()) | {e.inode for e in self.entries if e.dst is not None}
        return [n for n in sorted(named) if self.inodes[n].pending]

    def count(self) -> int:
        total = 1
        for entry in self.entries:
            total *= entry.choices()
        for number in self.live_inodes():
            total *= self.inodes[number].choices()
        return total

    def state(self, number: int) -> dict[str, bytes]:
        """The ``number``-th state (0 <= number < count()): path -> content."""
        names = dict(self.names)
        for entry in self.entries:
            number, choice = divmod(number, entry.choices())
            entry.apply(names, choice)
        chosen: dict[int, int] = {}
        for ino in self.live_inodes():
            number, chosen[ino] = divmod(number, self.inodes[ino].choices())
        return {path: self.inodes[ino].content(chosen.get(ino, 0)) for path, ino in names.items()}


class Disk:
    """Plays recorded operations against the model, from a starting tree that is durable."""

    def __init__(self, base: Path) -> None:
        self.names: dict[str, int] = {}  # the namespace as the running program sees it
        self.inodes: dict[int, Inode] = {}
        self.entries: list[Entry] = []
        for directory, _dirs, files in os.walk(base):
            for name in files:
                path = os.path.relpath(os.path.join(directory, name), base)
                data = Path(directory, name).read_bytes()
                self.names[path] = self._new_inode(data)
        self.durable_names = dict(self.names)  # with every entry folded in so far

    def _new_inode(self, data: bytes) -> int:
        number = len(self.inodes) + 1
        self.inodes[number] = Inode(durable=data, current=data)
        return number

    def play(self, op: tuple[Any, ...]) -> None:
        kind = op[0]
        if kind == "create":
            ino = self._new_inode(b"")
            inode = self.inodes[ino]
            inode.current = op[2]
            inode.pending.append(("write", op[2]))
            self.names[op[1]] = ino
            self.entries.append(Entry(inode=ino, src=None, dst=op[1]))
        elif kind == "append":
            inode = self.inodes[self.names[op[1]]]
            inode.current += op[2]
            inode.pending.append(("write", op[2]))
        elif kind == "truncate":
            inode = self.inodes[self.names[op[1]]]
            inode.current = inode.current[: op[2]]
            inode.pending.append(("size", op[2]))
        elif kind == "rename":
            ino = self.names.pop(op[1])
            self.names[op[2]] = ino
            self.entries.append(Entry(inode=ino, src=op[1], dst=op[2]))
        elif kind == "unlink":
            ino = self.names.pop(op[1])
            self.entries.append(Entry(inode=ino, src=op[1], dst=None))
        elif kind == "fsync":
            if op[1] in self.names:
                self.inodes[self.names[op[1]]].persist()
        elif kind == "fsync-dir":
            for entry in self.entries:
                entry.flushed(op[1])
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
                n: Inode(durable=i.durable, pending=list(i.pending), current=i.current)
                for n, i in self.inodes.items()
            },
            entries=[Entry(**vars(e)) for e in self.entries],
        )


def write_tree(base: Path, target: Path, contents: dict[str, bytes]) -> None:
    """``target``: the directories of ``base``, and the files ``contents`` names."""
    for directory, _dirs, _files in os.walk(base):
        (target / os.path.relpath(directory, base)).mkdir(parents=True, exist_ok=True)
    for path, data in contents.items():
        (target / path).parent.mkdir(parents=True, exist_ok=True)
        (target / path).write_bytes(data)
