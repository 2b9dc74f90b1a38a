"""bench/emulated_pace.py: per emulation, its error, pace, flight-record compute, s and a."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from emulated_pace import alone_factor, compute_per_step, read_pair  # noqa: E402

from prism_core.trace.flight import COMPUTE_NS_FIELD  # noqa: E402
from prism_core.trace.schema import COMM, COMPUTE  # noqa: E402


def _rank(steps: int, compute_s: float, comm_s: float = 0.01):
    """A rank's trace part: per step one compute node of `compute_s` and one comm node."""
    kind, step, t0, t1, t = [], [], [], [], 0.0
    for i in range(steps):
        for k, d in ((COMPUTE, compute_s), (COMM, comm_s)):
            kind.append(k), step.append(i), t0.append(t), t1.append(t + d)
            t += d
    return {"kind": np.array(kind, np.int8), "step": np.array(step, np.int32), "t_start": np.array(t0),
            "t_end": np.array(t1)}


def test_compute_per_step_is_the_median_over_the_measured_steps_without_the_last():
    part = _rank(8, 0.1)
    part["t_end"][0] += 5.0           # a slow warm-up step, left out
    last = np.flatnonzero(part["step"] == 7)[0]
    part["t_end"][last] += 3.0        # the last step, which the run's end closes, left out
    assert compute_per_step(**part, warmup=2) == pytest.approx(0.1)


def test_alone_factor_sums_the_compute_nodes_only():
    span = np.array([1.0, 9.0, 3.0])
    alone = np.array([0.9, 0.0, 2.7])
    assert alone_factor(span, alone, np.array([True, False, True])) == pytest.approx(0.9)


def _run(directory: Path, rank: int, part: dict, step_s: float, pace: dict | None = None, flight_s: float = 0.0):
    (directory / "trace_parts").mkdir(parents=True, exist_ok=True)
    np.savez(directory / "trace_parts" / f"{rank}.npz", **part)
    (directory / "results").mkdir(exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"job": {"warmup": 2}}))
    (directory / "results" / f"{rank}.json").write_text(json.dumps({"step_times_s": [step_s] * 10}))
    if pace is not None:
        (directory / "replay").mkdir()
        (directory / "replay" / "stats.json").write_text(json.dumps({"follow_pace": pace}))
        (directory / "flight").mkdir()
        flight = np.zeros(10, dtype=np.int64)
        flight[COMPUTE_NS_FIELD] = int(flight_s * 1e9)
        flight.tofile(directory / "flight" / f"{rank}.bin")


def test_a_pair_reads_each_emulation_against_its_second_record(tmp_path):
    steps, nodes = 6, 12
    for r in range(2):
        _run(tmp_path / "record_e", r, _rank(steps, 0.10), 0.20)
    _run(tmp_path / "emulate_0", 0, _rank(steps, 0.099), 0.204, {"median": 1.04, "max": 1.2}, 6 * 0.099 * 1.1)
    _run(tmp_path / "emulate_0_against", 0, _rank(steps, 0.099), 0.199, {"median": 0.99, "max": 1.0}, 0.6)
    (tmp_path / "calibrate").mkdir()
    span = np.full(2 * nodes, 0.1)
    np.savez(tmp_path / "calibrate" / "timeline.npz", span=span, alone_span=span * 0.95)
    offsets = np.array([0, nodes, 2 * nodes])
    compute = np.tile([True, False], nodes)
    (e,) = read_pair("pp2", tmp_path, offsets, compute)     # rank 1 was not emulated: no emulate_1
    assert (e.config, e.pair, e.rank) == ("pp2", tmp_path.name, 0)
    assert e.error == pytest.approx(0.02)
    assert (e.pace, e.pace_max) == (1.04, 1.2)
    assert e.flight == pytest.approx(1.1, rel=1e-6)            # a stop counted as compute reads above 1
    assert e.s == pytest.approx(0.99)
    assert e.a == pytest.approx(0.95)
    assert e.others["against"][0] == pytest.approx(-0.005) and e.others["against"][1] == 0.99
