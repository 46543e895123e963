"""Our threads carry their names to the operating system (``top -H``, py-spy, /proc)."""

from __future__ import annotations

import subprocess
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


# In a fresh interpreter: the store (``syncfs``) and a thread naming itself, with every
# process started meanwhile seen by Python's audit hook.
_LOAD_THE_C_LIBRARY = """
import sys, threading
started = []
sys.addaudithook(lambda event, args: started.append(args) if event == "subprocess.Popen" else None)
from taskhoster import store
from taskhoster.osthread import name_os_thread
for n in range(3):
    thread = threading.Thread(target=name_os_thread, args=(f"taskhoster-x-{n}",))
    thread.start()
    thread.join()
print(store._syncfs is not None, started)
"""


@linux_only
def test_the_c_library_is_loaded_without_starting_a_process() -> None:
    """``syncfs`` and ``prctl`` come from the process's own C library, loaded once
    (``taskhoster.libc``): ``ctypes.util.find_library`` ran ``ldconfig`` in a subprocess at
    each use, a fork of the whole server each time a thread was named."""
    done = subprocess.run(
        [sys.executable, "-c", _LOAD_THE_C_LIBRARY],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "True []", done.stdout + done.stderr
