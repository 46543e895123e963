"""Names for this package's threads as the operating system shows them.

Python names a thread only for itself; ``top -H``, ``ps -L``, py-spy and
``/proc/<pid>/task/<tid>/comm`` show every thread of a server as ``python``. A thread of
ours calls ``name_os_thread()`` as it starts, so each shows what it is (``th-http-3``,
``th-committer``, ``th-from-commit``): enough to tell, under load, which one spends the CPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
import threading

from .libc import libc

PR_SET_NAME = 15
MAX_BYTES = 15  # Linux keeps 15 bytes of a thread's name


def os_name(name: str) -> str:
    """The OS-level name for a thread named ``name``: ``taskhoster-`` shortened to ``th-``,
    cut to what Linux keeps."""
    if name.startswith("taskhoster-"):
        name = "th-" + name.removeprefix("taskhoster-")
    return name.encode("utf-8")[:MAX_BYTES].decode("utf-8", "ignore")


def name_os_thread(name: str | None = None) -> None:
    """Give the calling thread its OS-level name (default: from its Python name). Linux
    only; elsewhere, or if it fails, nothing happens."""
    if not sys.platform.startswith("linux"):
        return
    found = libc()
    if found is None:
        return
    wanted = os_name(name or threading.current_thread().name).encode("utf-8")
    with contextlib.suppress(OSError, AttributeError):
        found.prctl(PR_SET_NAME, ctypes.c_char_p(wanted), 0, 0, 0)
