"""bench/resume_cost.py: a loaded run's compute against the record's by how much longer it waited."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from resume_cost import EDGES, excess_by_wait, moved  # noqa: E402

from prism_core.calibrate.resume import ResumeCost  # noqa: E402


def test_excess_is_binned_by_the_extra_wait_with_a_median_per_bin():
    extra = np.array([-300e-6] * 20 + [100e-6] * 25 + [5e-3] * 3)
    excess = np.concatenate([np.full(20, -50e-6), np.linspace(0, 20e-6, 25), np.full(3, 1e-3)])
    cells = excess_by_wait(extra, excess)
    assert len(cells) == len(EDGES) - 1
    assert cells[0] == (20, pytest.approx(-50e-6))
    assert cells[2] == (25, pytest.approx(10e-6))
    assert cells[-1][0] == 3 and np.isnan(cells[-1][1])          # too few nodes for a median
    assert sum(n for n, _ in cells) == 48


def test_moved_spans_follow_the_cost_of_the_new_waits_and_keep_half_themselves():
    cost = ResumeCost(tau_s=1e-3, cost_s=200e-6, share=0.0, nodes=1000)
    span = np.array([1e-3, 1e-3, 50e-6])
    out = moved(span, np.array([np.nan, 3e-3, 3e-3]), np.array([0.5e-3, 0.5e-3, 0.5e-3]), cost)
    assert out[0] == span[0]                                      # its wait unknown: as measured
    assert out[1] == pytest.approx(1e-3 - 200e-6 * (np.exp(-0.5) - np.exp(-3)))
    assert out[2] == pytest.approx(25e-6)
    assert moved(span, span, span, None) is span
