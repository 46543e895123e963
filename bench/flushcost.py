"""The disk's own cost of making a write durable, to set every other figure beside.

A measurement, not a test. In ``--dir`` (default: a temporary directory under ``--tmpdir``,
so on that filesystem), ``--rounds`` times each, it times what a post and a verdict need
durable, the way the store could make them so:

- ``create+fdatasync+dirfsync``: a new file with a 200-byte line, its data flushed, its
  directory flushed (a post's file and its entry);
- ``create+syncfs``: the same file, flushed by one ``syncfs`` of the whole filesystem (what a
  group's barrier does with ``FLUSH = "syncfs"``);
- ``create (no flush)``: the same file, not flushed: the kernel's own CPU for a new file,
  which is what a post pays on top of its flush. On ext4 without a journal (this machine's
  root) it is tens of µs, but up to a millisecond for minutes after many files were deleted:
  a new inode is searched for past the recently freed ones (``recently_deleted``), which a
  journaled ext4 does not do. Taskhoster makes a file per item, the peers none;
- ``append+fdatasync``: 200 bytes appended to an open file and flushed (a journal's way, and
  beanstalkd's with ``-f0``);
- ``rename+dirfsync``: a file renamed into another directory, that directory flushed (a
  verdict's move, with its line);
- ``append+rename+fdatasync+dirfsync``: a verdict as the store makes one durable;
- ``group of N: fdatasync each``/``group of N: syncfs``: N new files in one directory made
  durable the two ways a group's barrier can (each file's ``fdatasync`` then the directory's
  ``fsync``, or one ``syncfs``), for N in ``--group-sizes``: where the store's ``FLUSH =
  "auto"`` should switch from the one to the other (``FLUSH_FILES``).

``--images`` repeats all of it on a journaled ext4 and an xfs filesystem, each made in a file
of the same disk and mounted through a loop device (root, ``mkfs.ext4``/``mkfs.xfs``): what
the store's flush costs on the filesystems production runs on, beside this machine's.

It prints p50, p90 and p99 in microseconds, and, with ``--json``, writes them. Other
benchmarks compare their per-item times with ``create+fdatasync+dirfsync`` p50 measured in
the same run (``measure`` returns the table).

::

    .venv/bin/python bench/flushcost.py
    .venv/bin/python bench/flushcost.py --dir /mnt/ext4-image --rounds 2000
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

LINE = b"x" * 199 + b"\n"
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def syncfs(fd: int) -> None:
    if _libc.syncfs(fd) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"p50": pick(0.5) * 1e6, "p90": pick(0.9) * 1e6, "p99": pick(0.99) * 1e6}


def measure(
    directory: Path, rounds: int, group_sizes: tuple[int, ...] = ()
) -> dict[str, dict[str, float]]:
    """Each way's p50/p90/p99 in microseconds, in ``directory``."""
    a, b = directory / "a", directory / "b"
    a.mkdir(exist_ok=True)
    b.mkdir(exist_ok=True)
    fsync_dir(directory)
    results: dict[str, dict[str, float]] = {}

    def timed(name: str, step: Callable[[int], None]) -> None:
        samples = []
        for n in range(rounds):
            started = time.perf_counter()
            step(n)
            samples.append(time.perf_counter() - started)
        results[name] = percentiles(samples)

    def create_fdatasync(n: int) -> None:
        fd = os.open(a / f"c{n}.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640)
        try:
            os.write(fd, LINE)
            os.fdatasync(fd)
        finally:
            os.close(fd)
        fsync_dir(a)

    def create_only(n: int) -> None:
        fd = os.open(a / f"n{n}.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640)
        try:
            os.write(fd, LINE)
        finally:
            os.close(fd)

    def create_syncfs(n: int) -> None:
        fd = os.open(a / f"s{n}.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640)
        try:
            os.write(fd, LINE)
            syncfs(fd)
        finally:
            os.close(fd)

    journal = os.open(directory / "journal", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)

    def append_fdatasync(_n: int) -> None:
        os.write(journal, LINE)
        os.fdatasync(journal)

    def rename_dirfsync(n: int) -> None:
        os.rename(a / f"c{n}.json", b / f"c{n}.json")
        fsync_dir(b)

    def verdict(n: int) -> None:
        src, dst = b / f"c{n}.json", a / f"c{n}.json"
        fd = os.open(src, os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, LINE)
            os.rename(src, dst)
            os.fdatasync(fd)
        finally:
            os.close(fd)
        fsync_dir(a)

    def group(size: int, way: str) -> Callable[[int], None]:
        def step(n: int) -> None:
            fds = []
            try:
                for k in range(size):
                    fd = os.open(
                        a / f"g{way}{size}-{n}-{k}.json",
                        os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                        0o640,
                    )
                    fds.append(fd)
                    os.write(fd, LINE)
                if way == "syncfs":
                    syncfs(fds[0])
                else:
                    for fd in fds:
                        os.fdatasync(fd)
                    fsync_dir(a)
            finally:
                for fd in fds:
                    os.close(fd)

        return step

    try:
        timed("create+fdatasync+dirfsync", create_fdatasync)
        timed("create+syncfs", create_syncfs)
        timed("create (no flush)", create_only)
        timed("append+fdatasync", append_fdatasync)
        timed("rename+dirfsync", rename_dirfsync)
        timed("append+rename+fdatasync+dirfsync", verdict)
        for size in group_sizes:
            group_rounds = max(20, rounds // max(1, size // 4))
            for way in ("fdatasync each", "syncfs"):
                samples = []
                step = group(size, way.split()[0])
                for n in range(group_rounds):
                    started = time.perf_counter()
                    step(n)
                    samples.append(time.perf_counter() - started)
                results[f"group of {size}: {way}"] = percentiles(samples)
    finally:
        os.close(journal)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=None, help="measure here (kept); default: a temp dir")
    parser.add_argument("--tmpdir", default=None, help="where the temp dir goes")
    parser.add_argument("--rounds", type=int, default=500)
    parser.add_argument("--json", default=None, help="also write the figures here")
    parser.add_argument(
        "--group-sizes",
        default="1,2,4,8,16,64",
        help="comma-separated group sizes for the group flushes ('' for none)",
    )
    parser.add_argument(
        "--images",
        action="store_true",
        help="also measure on a journaled ext4 and an xfs image through loop devices (root)",
    )
    args = parser.parse_args()
    sizes = tuple(int(x) for x in args.group_sizes.split(",") if x.strip())
    made = args.dir is None
    directory = Path(args.dir or tempfile.mkdtemp(prefix="taskhoster-flush-", dir=args.tmpdir))
    directory.mkdir(parents=True, exist_ok=True)
    tables: dict[str, dict[str, dict[str, float]]] = {}
    try:
        tables[f"{directory} ({filesystem_of(directory)})"] = measure(directory, args.rounds, sizes)
        if args.images:
            for kind in ("ext4", "xfs"):
                with loop_filesystem(directory, kind) as mounted:
                    tables[f"{kind} image on a loop device"] = measure(mounted, args.rounds, sizes)
    finally:
        if made:
            shutil.rmtree(directory, ignore_errors=True)
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    for where, results in tables.items():
        print(f"flush cost in {where} ({args.rounds} rounds each; load average {load}), µs:")
        print(f"  {'what':36} {'p50':>8} {'p90':>8} {'p99':>8}")
        for name, values in results.items():
            print(f"  {name:36} {values['p50']:8.0f} {values['p90']:8.0f} {values['p99']:8.0f}")
    if args.json:
        Path(args.json).write_text(
            json.dumps(tables if args.images else next(iter(tables.values())), indent=2)
        )
    sys.stdout.flush()


def filesystem_of(path: Path) -> str:
    """The type of the filesystem ``path`` is on, from /proc/mounts (longest mount point)."""
    best, kind = "", "?"
    with contextlib.suppress(OSError), open("/proc/mounts") as mounts:
        for line in mounts:
            fields = line.split()
            if len(fields) > 2 and str(path).startswith(fields[1]) and len(fields[1]) > len(best):
                best, kind = fields[1], fields[2]
    return kind


@contextlib.contextmanager
def loop_filesystem(beside: Path, kind: str, size_mb: int = 512) -> Iterator[Path]:
    """A fresh ``kind`` filesystem in a file under ``beside``, mounted on a loop device; gone
    afterwards."""
    image = beside / f"{kind}.img"
    mount = beside / f"{kind}-mnt"
    mount.mkdir()
    with open(image, "wb") as handle:
        handle.truncate(size_mb << 20)
    mkfs = ["mkfs.ext4", "-q", "-F"] if kind == "ext4" else ["mkfs.xfs", "-q", "-f"]
    subprocess.run([*mkfs, str(image)], check=True)
    subprocess.run(["mount", "-o", "loop", str(image), str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)
        image.unlink(missing_ok=True)
        mount.rmdir()


if __name__ == "__main__":
    main()
