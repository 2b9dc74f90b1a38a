"""bench/replay_ab.py: the checkouts it accepts, the launch it builds from a kept emulation, its interval."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from replay_ab import Checkout, checkout, emulate_cmd, figure, interval  # noqa: E402

KEPT = {"job": {"iterations": 60, "warmup": 3},
        "emulation": {"sandbox": 1, "neighbours": "co_run", "virtual_spans": "matched"}}


def _fake_checkout(root: Path, venv: bool = True) -> Path:
    (root / "bench").mkdir(parents=True)
    (root / "bench" / "fidelity.py").write_text("")
    if venv:
        (root / ".venv" / "bin").mkdir(parents=True)
        (root / ".venv" / "bin" / "python").write_text("")
    subprocess.run(["git", "init", "-q", str(root)], check=True, timeout=30)
    return root


def test_a_checkout_needs_its_fidelity_script_and_its_venv(tmp_path):
    with pytest.raises(SystemExit, match="no bench/fidelity.py"):
        checkout("A", tmp_path)
    with pytest.raises(SystemExit, match=r"--b .*no \.venv \(run `make install` there\)"):
        checkout("B", _fake_checkout(tmp_path / "b", venv=False))
    got = checkout("A", _fake_checkout(tmp_path / "a"))
    assert got.python == (tmp_path / "a" / ".venv" / "bin" / "python").resolve()


def test_the_launch_runs_the_checkouts_own_fidelity_with_the_kept_settings(tmp_path):
    co = Checkout("B", tmp_path, "abc1234")
    cmd = emulate_cmd(co, "tp2", tmp_path / "run", tmp_path / "graph", tmp_path / "t.npz", 1, KEPT)
    assert cmd[:2] == [str(tmp_path / ".venv" / "bin" / "python"), str(tmp_path / "bench" / "fidelity.py")]
    assert cmd[2:8] == ["--launch", "emulate", str(tmp_path / "run"), str(tmp_path / "graph"),
                        str(tmp_path / "t.npz"), "1"]
    flags = dict(zip(cmd[8::2], cmd[9::2]))
    assert flags["--config"] == "tp2" and flags["--steps"] == "60" and flags["--sandbox"] == "1"
    assert flags["--neighbours"] == "co_run"
    assert cmd[-3:] == ["--no-join-late", "--virtual-spans", "matched"]


def test_a_kept_emulation_read_against_the_alone_spans_is_launched_so():
    co = Checkout("B", Path("/co"), "abc1234")
    alone = {**KEPT, "emulation": {**KEPT["emulation"], "pace_reference": "alone"}}
    cmd = emulate_cmd(co, "tp2", Path("run"), Path("graph"), Path("t.npz"), 1, alone)
    assert cmd[-2:] == ["--pace-reference", "alone"]
    loaded = {**KEPT, "emulation": {**KEPT["emulation"], "pace_reference": "loaded"}}
    assert "--pace-reference" not in emulate_cmd(co, "tp2", Path("run"), Path("graph"), Path("t.npz"), 1, loaded)


def test_a_runs_figure_is_its_median_step_after_the_warm_up(tmp_path):
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "1.json").write_text('{"step_times_s": [9.0, 9.0, 9.0, 0.2, 0.4, 0.3, 5.0]}')
    assert figure(tmp_path, 1, 3) == pytest.approx(0.35)


def test_the_interval_holds_the_median_and_narrows_with_agreeing_rounds():
    spread = [-0.04, -0.01, 0.0, 0.02, 0.05]
    lo, hi = interval(spread)
    assert lo <= 0.0 <= hi and lo >= -0.04 and hi <= 0.05
    lo2, hi2 = interval([0.01] * 5)
    assert lo2 == hi2 == pytest.approx(0.01)
