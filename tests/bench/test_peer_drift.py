"""bench/peer_drift.py: the pace a virtual peer got against the one its real counterpart needed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from peer_drift import PeerDrift, read_pair, timeline_per_step  # noqa: E402

from prism_core.trace import Trace  # noqa: E402
from prism_core.trace.schema import COLUMNS, COMM, COMPUTE  # noqa: E402

STEPS = 8


def _part(compute_s: float) -> dict:
    """One rank's trace part: per step a compute node of `compute_s` and a comm node of 10 ms; the
    first step (the warm-up) slow."""
    kind, step, t0, t1, t = [], [], [], [], 0.0
    for i in range(STEPS):
        for k, d in ((COMPUTE, compute_s * (5 if i == 0 else 1)), (COMM, 0.01)):
            kind.append(k), step.append(i), t0.append(t), t1.append(t + d)
            t += d
    return {"kind": np.array(kind, np.int8), "step": np.array(step, np.int32), "t_start": np.array(t0),
            "t_end": np.array(t1)}


def _graph() -> Trace:
    n = 2 * STEPS
    columns = {name: np.zeros(2 * n, dtype=dtype) for name, dtype in COLUMNS.items()}
    columns["kind"] = np.tile(np.array([COMPUTE, COMM], np.int8), 2 * STEPS)
    columns["step"] = np.tile(np.repeat(np.arange(STEPS, dtype=columns["step"].dtype), 2), 2)
    return Trace(world_size=2, columns=columns, offsets=np.array([0, n, 2 * n], dtype=np.int64), groups=[(0, 1)],
                 group_names=["0"], labels=[""], dtypes=[""], step_peaks=[[], []])


def _run(directory: Path, parts: dict[int, dict], step_s: float) -> None:
    (directory / "trace_parts").mkdir(parents=True)
    (directory / "results").mkdir()
    (directory / "config.json").write_text(json.dumps({"job": {"warmup": 1}}))
    for rank, part in parts.items():
        np.savez(directory / "trace_parts" / f"{rank}.npz", **part)
        (directory / "results" / f"{rank}.json").write_text(json.dumps({"step_times_s": [step_s] * STEPS}))


def test_the_peer_is_set_as_far_off_as_the_two_ranks_moved_apart(tmp_path):
    graph = _graph()
    _run(tmp_path / "record", {0: _part(0.100), 1: _part(0.100)}, 0.2)
    _run(tmp_path / "record_e", {0: _part(0.090), 1: _part(0.099)}, 0.2)     # rank 1 slowed against rank 0
    _run(tmp_path / "emulate_0", {0: _part(0.090)}, 0.196)                    # rank 0 as in the second record
    (tmp_path / "calibrate").mkdir()
    span = np.where(graph.columns["kind"] == COMPUTE, 0.1, 0.01)
    span[graph.columns["step"] == 0] *= 5
    np.savez(tmp_path / "calibrate" / "timeline.npz", span=span)
    (d,) = read_pair("tp2", graph, tmp_path)              # no emulate_1: one emulation
    assert (d.config, d.pair, d.rank) == ("tp2", tmp_path.name, 0)
    assert d.record == pytest.approx((0.1, 0.1)) and d.second == pytest.approx((0.09, 0.099))
    assert d.timeline == pytest.approx((0.1, 0.1)) and d.emulated == pytest.approx(0.09)
    assert d.pace == pytest.approx(0.9) and d.needed == pytest.approx(0.99)
    assert d.peer == pytest.approx(0.9 / 0.99 - 1)        # the virtual rank 1 computed 9% too fast
    assert d.apart == pytest.approx(0.1)
    assert d.peer == pytest.approx(1 / (1 + d.apart) - 1)
    assert d.error == pytest.approx(-0.02)


def test_timeline_per_step_leaves_out_the_warm_up_and_the_last_step():
    graph = _graph()
    span = np.where(graph.columns["kind"] == COMPUTE, 0.1, 0.01)
    span[graph.columns["step"] == 0] = 3.0
    span[STEPS * 2 - 2] = 9.0                               # rank 0's last compute node
    assert timeline_per_step(graph, span, 0, warmup=1) == pytest.approx(0.1)
    assert timeline_per_step(graph, span, 1, warmup=1) == pytest.approx(0.1)


def test_a_pair_of_another_world_size_is_left_out(tmp_path):
    graph = _graph()
    graph.world_size = 4
    assert read_pair("tp2", graph, tmp_path) == []


def test_peer_drift_reads_the_pace_against_the_peers_need():
    d = PeerDrift("pp2", "pair0", 1, (0.1, 0.1), (0.2, 0.1), (0.1, 0.1), 0.11, 0.0)
    assert d.pace == pytest.approx(1.1) and d.needed == pytest.approx(2.0)
    assert d.peer == pytest.approx(-0.45)
