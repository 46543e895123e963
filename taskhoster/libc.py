"""The C library's functions that the standard library does not wrap (``syncfs``, ``prctl``),
loaded once a process.

``ctypes.util.find_library("c")`` starts a process (``ldconfig -p``, or a compiler) on each
call: one each time a thread was named. The process's own symbols, which include the C
library it runs on, are what is needed (where ``find_library`` found nothing, a musl image
without a compiler, ``syncfs`` and the threads' names are now used too).
"""

from __future__ import annotations

import ctypes
import functools


@functools.cache
def libc() -> ctypes.CDLL | None:
    """The C library this process runs on (``errno`` kept for ``ctypes.get_errno``); None
    where it cannot be opened this way (Windows). A function it lacks raises
    ``AttributeError`` when looked up, as ``syncfs`` does outside Linux."""
    try:
        return ctypes.CDLL(None, use_errno=True)
    except (OSError, TypeError):  # (Windows: a library needs a name)
        return None
