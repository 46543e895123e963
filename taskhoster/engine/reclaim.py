"""Unlinking, behind the groups that removed them, the files listed by ``FileBatch``.

A group that removes many items (a delete by status, retention of many finished items) lists
their files in one durable file instead of unlinking each inside the group (see
``FileBatch.apply_unlinks``). Once the group is durable, ``later`` hands its lists to one
thread of this process, which unlinks the files and then removes the list. A list left by a
process that died is finished by the sweep (``leftovers``, for lists older than the repair
grace) and by repair, which also never indexes a file a list names.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from pathlib import Path

from ..osthread import name_os_thread
from .common import store
from .pacing import Pacer

log = logging.getLogger(__name__)

_lists: queue.SimpleQueue[Path] = queue.SimpleQueue()
_started = threading.Lock()
_thread: threading.Thread | None = None


def later(paths: list[str]) -> None:
    """Reclaim these lists (of a group now durable) in this process's reclaim thread."""
    global _thread
    for path in paths:
        _lists.put(Path(path))
    with _started:
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_run, name="taskhoster-unlink", daemon=True)
            _thread.start()


def _run() -> None:
    name_os_thread()
    while True:
        path = _lists.get()
        try:
            store().reclaim_list(path, pace=Pacer(start=200).run)
        except Exception:
            log.exception("could not reclaim %s; the sweep will finish it", path)


def leftovers(grace_seconds: float) -> int:
    """Finish the lists older than ``grace_seconds`` (their process died, or is slow);
    returns the files removed."""
    st = store()
    removed = 0
    for path in st.unlink_lists(older_than=time.time() - grace_seconds):
        removed += st.reclaim_list(path, pace=Pacer(start=200).run)
    return removed
