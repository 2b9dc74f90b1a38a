"""bench/compute_nodes.py: compute nodes classed by what came before them, compared node by node."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from compute_nodes import class_names, classify, compare, excess_per_mb, main  # noqa: E402

from prism_core.trace.schema import COMM, COMPUTE, WAIT  # noqa: E402


def test_compute_nodes_are_classed_by_the_time_in_the_node_before():
    kind = np.array([COMPUTE, COMM, COMPUTE, COMPUTE, WAIT, COMPUTE, COMM, COMPUTE, COMM, COMPUTE])
    before = np.array([0, 1, 100e-6, 1, 1, 2e-3, 1, 5e-3, 1, 300e-6])
    assert classify(kind, before).tolist() == [0, -1, 1, 0, -1, 2, -1, 3, -1, 2]
    names = class_names()
    assert names[0] == "after compute" and names[1] == "after comm/wait of 0-0.3 ms"
    assert names[3] == "after comm/wait of 3-inf ms"


def test_compare_gives_rates_and_sums_a_step():
    classes = np.array([0, 0, 1, 1, -1, 0, 0, 1, 1, -1])
    measured = np.array([False] * 5 + [True] * 5)     # the second step only
    record = np.array([1.0, 1.0, 1.0, 1.0, 9.0, 2.0, 4.0, 1.0, 3.0, 9.0])
    other = np.array([9.0, 9.0, 9.0, 9.0, 0.0, 3.0, 6.0, 1.0, 3.0, 0.0])
    out = compare(classes, measured, 1, record, other)
    assert out[0] == pytest.approx((2.0, 3.0, 1.5, 3.0))
    assert out[1] == pytest.approx((2.0, 2.0, 1.0, 0.0))


def test_a_directory_without_kept_runs_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["compute_nodes.py", str(tmp_path)])
    with pytest.raises(SystemExit, match="no kept config"):
        main()


def test_excess_per_mb_takes_medians_over_rows_and_skips_ranks_without_ops():
    ratio, mb, per = excess_per_mb([1.02, 1.04, 1.00], [0.1, 0.1, 0.1], [4.0, 8.0, 0.0])
    assert ratio == pytest.approx(1.02)
    assert mb == pytest.approx(4.0)
    # (0.02 * 100 ms) / 4 MB = 0.5, (0.04 * 100 ms) / 8 MB = 0.5; the rank without bytes is left out
    assert per == pytest.approx(0.5)
