"""bench/turn_length.py: what it refuses before it starts anything."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "turn_length.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


def test_a_keep_that_is_not_a_directory_is_refused(tmp_path: Path):
    got = _run(str(tmp_path / "none"))
    assert got.returncode != 0 and "not a directory" in got.stderr


def test_fewer_than_two_lengths_or_a_length_of_zero_is_refused(tmp_path: Path):
    for lengths in ("0.3", "0.3,0"):
        got = _run(str(tmp_path), "--lengths", lengths)
        assert got.returncode != 0 and "two or more turn lengths" in got.stderr


def test_a_keep_without_kept_pairs_is_refused(tmp_path: Path):
    got = _run(str(tmp_path))
    assert got.returncode != 0 and "no kept pair" in got.stderr
