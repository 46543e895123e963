"""``scripts/test`` installs Debian's Chromium when it is missing and it runs as root: one line
on the terminal, apt's output in a log file, and on failure the log's tail and a non-zero exit.

The machine's real apt-get and Chromium are left alone: the script runs with a PATH of its own
holding the few tools it uses, a stand-in ``apt-get`` that prints as much as a real install
does, and a stand-in ``id`` that says root.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from ..conftest import REPO

TOOLS = ("bash", "env", "dirname", "mkdir", "tail", "touch", "cat")
APT_LINES = 550


def fake_bin(tmp_path: Path, *, apt_status: int) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in TOOLS:
        found = shutil.which(tool)
        assert found, tool
        (bin_dir / tool).symlink_to(found)
    (bin_dir / "id").write_text("#!/bin/sh\necho 0\n")
    (bin_dir / "apt-get").write_text(
        "#!/bin/sh\n"
        f'i=0; while [ $i -lt {APT_LINES} ]; do echo "apt $* line $i"; i=$((i+1)); done\n'
        f"exit {apt_status}\n"
    )
    for name in ("id", "apt-get"):
        (bin_dir / name).chmod(0o755)
    return bin_dir


def run_scripts_test(tmp_path: Path, bin_dir: Path) -> subprocess.CompletedProcess[str]:
    env = {
        # (Without PostgreSQL's URL: with it, a missing PgBouncer is installed too.)
        **{k: v for k, v in os.environ.items() if k != "DATABASE_URL"},
        "PATH": str(bin_dir),
        "TASKHOSTER_VAR": str(tmp_path / "var"),
    }
    return subprocess.run(
        [str(bin_dir / "bash"), str(REPO / "scripts" / "test"), "--version"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_missing_chromium_is_installed_with_one_line_and_apt_output_in_a_log(tmp_path):
    answer = run_scripts_test(tmp_path, fake_bin(tmp_path, apt_status=0))
    assert answer.returncode == 0, answer.stderr
    lines = answer.stdout.splitlines()
    log = tmp_path / "var" / "apt-chromium.log"
    # One line of its own, then pytest's (--version here).
    assert lines[0] == (
        f"scripts/test: installing Debian's chromium for the browser tests (apt-get; log: {log})"
    )
    assert lines[1:] == ["pytest " + lines[1].split()[-1]]
    assert "apt line" not in answer.stderr
    logged = log.read_text().splitlines()
    assert logged[0] == "apt update line 0"
    assert logged[-1] == f"apt install -y chromium line {APT_LINES - 1}"
    assert len(logged) == 2 * APT_LINES


def test_a_failed_chromium_install_shows_the_logs_tail_and_stops(tmp_path):
    answer = run_scripts_test(tmp_path, fake_bin(tmp_path, apt_status=100))
    assert answer.returncode == 1
    assert "installing chromium failed" in answer.stderr
    assert f"apt update line {APT_LINES - 1}" in answer.stderr  # the tail of the log
    assert "apt update line 0\n" not in answer.stderr
