"""bench/co_run_step.py: how far two ranks' traces are from running in step."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from co_run_step import in_step, late_hand_over, main, on_cpu, overlap  # noqa: E402

from prism_core.trace.schema import COMM, COMPUTE, OP_CODE  # noqa: E402


def _rank(starts, ends, kinds, ops=None, steps=None, async_=None) -> dict:
    n = len(starts)
    return {"t_start": np.array(starts, float), "t_end": np.array(ends, float), "kind": np.array(kinds),
            "op": np.array(ops if ops is not None else [OP_CODE["allreduce"]] * n),
            "step": np.array(steps if steps is not None else [3] * n),   # the first step after the warm-up
            "async_": np.array(async_ if async_ is not None else [0] * n)}


def test_overlap_sums_the_intersections():
    assert overlap(np.array([0.0, 5.0]), np.array([2.0, 8.0]), np.array([1.0, 6.0]), np.array([6.0, 7.0])) == 3.0
    assert overlap(np.array([0.0]), np.array([1.0]), np.array([2.0]), np.array([3.0])) == 0.0


def test_ranks_in_step_and_out_of_step():
    kinds = [COMPUTE, COMM, COMPUTE, COMM]
    a = _rank([0, 10, 12, 22], [10, 12, 22, 24], kinds)
    same = in_step([a, a])
    assert same["skew_med"] == 0 and same["beside_compute"] == 1.0 and same["beside_comm"] == 0.0
    assert same["ops"] == 2.0
    # rank 1 two units late throughout: it leaves each collective 2 later and computes 2 of each 10 beside comm
    b = _rank([0, 12, 14, 24], [12, 14, 24, 26], kinds)
    late = in_step([a, b])
    assert late["skew_med"] == 2.0
    assert late["beside_comm"] == pytest.approx(np.mean([2 / 20, 4 / 22]))


def test_an_asynchronous_op_is_not_counted_as_waiting():
    kinds = [COMPUTE, COMM, COMPUTE]
    a = _rank([0, 1, 2], [1, 2, 3], kinds)
    b = _rank([0, 0, 2], [1, 3, 3], kinds, async_=[0, 1, 0])      # rank 1's op flies over rank 0's compute
    assert in_step([a, b])["beside_comm"] == pytest.approx(np.mean([0.0, 0.0]))


def test_late_hand_over_is_measured_from_the_late_ranks_issue():
    kinds = [COMM, COMM]
    r0 = _rank([0.0, 10.0], [1.0, 11.0], kinds)
    r1 = _rank([0.5, 9.0], [1.0, 11.0], kinds)
    # member r's assistant handed the peer's part: member 1 (rank 1 late at op 0) at 0.8, member 0 (rank 0 late at op 1) at 10.4
    handed = [np.array([0.6, 10.4]), np.array([0.8, 9.5])]
    assert late_hand_over([r0, r1], handed) == pytest.approx(np.median([0.3, 0.4]))


def test_a_directory_without_kept_runs_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["co_run_step.py", str(tmp_path)])
    with pytest.raises(SystemExit, match="no kept W=2 pair"):
        main()


def test_on_cpu_sums_the_compute_nodes_after_the_warm_up():
    rank = {"step": np.array([2, 3, 3, 4]), "oncpu_node": np.array([0, 2, 3]), "oncpu_s": np.array([5.0, 1.0, 2.0])}
    assert on_cpu(rank) == 3.0
    assert np.isnan(on_cpu({"step": np.array([3])}))
