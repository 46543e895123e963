"""The state root's write probe (``taskhoster.health``): the health monitor's thread and a
request's thread (Django's ``/healthz`` view, before the monitor's first report) may probe
the same root at the same moment, and neither may see the other's file as its own failure."""

from __future__ import annotations

import threading
from pathlib import Path

from taskhoster.health import _write_probe


def test_write_probes_at_once_in_one_process_do_not_fail_each_other(tmp_path: Path) -> None:
    threads, rounds = 4, 400
    failures: list[str] = []
    start = threading.Barrier(threads)

    def probe() -> None:
        start.wait()
        for _ in range(rounds):
            failed = _write_probe(tmp_path)
            if failed is not None:
                failures.append(failed)

    running = [threading.Thread(target=probe) for _ in range(threads)]
    for thread in running:
        thread.start()
    for thread in running:
        thread.join()
    assert failures == [], f"{len(failures)} of {threads * rounds} probes failed: {failures[:3]}"
    assert list(tmp_path.iterdir()) == [], "every probe removes its file"
