"""Our threads carry their names to the operating system (``top -H``, py-spy, /proc)."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from taskhoster.osthread import MAX_BYTES, name_os_thread, os_name

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc")


def _comm_of(native_id: int) -> str:
    return Path(f"/proc/self/task/{native_id}/comm").read_text().strip()


def test_os_name_shortens_our_prefix_and_keeps_what_linux_keeps() -> None:
    assert os_name("taskhoster-http-3") == "th-http-3"
    assert os_name("taskhoster-from-committer") == "th-from-committ"
    assert len(os_name("x" * 40).encode()) == MAX_BYTES
    assert os_name("Thread-7 (run)") == "Thread-7 (run)"
    # A name cut inside a multi-byte character loses that character, not the name.
    assert os_name("a" * 14 + "é") == "a" * 14


@linux_only
def test_a_thread_that_names_itself_shows_that_name_to_the_os() -> None:
    seen: dict[str, str] = {}

    def run() -> None:
        before = _comm_of(threading.get_native_id())
        name_os_thread()
        seen["before"] = before
        seen["after"] = _comm_of(threading.get_native_id())

    thread = threading.Thread(target=run, name="taskhoster-test-7")
    thread.start()
    thread.join()
    assert seen["after"] == "th-test-7"
    assert seen["before"] != seen["after"]


@linux_only
def test_naming_one_thread_leaves_the_calling_thread_alone() -> None:
    mine = _comm_of(threading.get_native_id())
    thread = threading.Thread(target=name_os_thread, args=("taskhoster-other",))
    thread.start()
    thread.join()
    assert _comm_of(threading.get_native_id()) == mine
