"""The first step of a server process's start: the state root and the committer process.

Light to import once Django is set up (the engine, the identity check and the settings are
loaded by then), so that an ASGI module can start the committer process before it imports
the rest of the server (the REST framework, the views, the handler: some 0.2 s of CPU), and
the committer's own start goes on beside those imports rather than after them: the server
is ready sooner. ``taskhoster.asgi.start`` calls it too, and finds it done.
"""

from __future__ import annotations

import contextlib
import logging
import threading

from django.db import DatabaseError

from . import engine, identity
from .conf import get_conf

log = logging.getLogger(__name__)

_lock = threading.Lock()
_started = False


def start_engine() -> None:
    """Make the state root, refuse one that another database indexes
    (``taskhoster.identity``: raised), and start this process's committer; once a process.
    Nothing while the system checks import the ASGI module (``engine.hold_start``)."""
    global _started
    if engine.start_is_held():
        return  # the system checks are importing the ASGI module: nothing is started
    with _lock:
        if _started:
            return
        # A root that cannot be made is reported by /healthz, not raised here.
        with contextlib.suppress(OSError):
            get_conf().root.mkdir(parents=True, exist_ok=True)
        if get_conf().root.is_dir():
            try:
                identity.check()  # a state root another database indexes: refuse to start
            except DatabaseError as exc:
                # The database is away: /healthz says so; the committer checks before it
                # writes.
                log.warning("could not compare the state root's identity with the index: %s", exc)
        engine.start_committer()
        _started = True
