"""bench/fidelity.py: the step noise of a run's figure."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from fidelity import _step_noise  # noqa: E402


def _run(tmp: Path, steps: list[list[float]]) -> Path:
    (tmp / "results").mkdir(parents=True)
    for r, times in enumerate(steps):
        (tmp / "results" / f"{r}.json").write_text(json.dumps({"step_times_s": times}))
    return tmp


def test_steady_steps_have_no_step_noise(tmp_path: Path):
    assert _step_noise(_run(tmp_path, [[9.0] * 3 + [0.25] * 30, [9.0] * 3 + [0.25] * 30]), 2, 3) == 0.0


def test_step_noise_is_the_figures_spread_and_shrinks_with_more_steps(tmp_path: Path):
    rng = np.random.default_rng(1)
    short = list(0.25 * (1 + 0.12 * rng.standard_normal(27)))
    long = list(0.25 * (1 + 0.12 * rng.standard_normal(27 * 9)))
    # both ranks step together (the same steps drawn for both), as a synchronised job's do
    a = _step_noise(_run(tmp_path / "a", [[1.0] * 3 + short, [1.0] * 3 + short]), 2, 3)
    b = _step_noise(_run(tmp_path / "b", [[1.0] * 3 + long, [1.0] * 3 + long]), 2, 3)
    # a median of n draws of 12% noise: about 1.25 * 12% / sqrt(n)
    assert 0.015 < a < 0.045
    assert 0.005 < b < 0.015
    assert b < a / 2
