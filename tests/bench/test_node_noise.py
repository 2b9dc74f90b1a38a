"""bench/node_noise.py: a virtual rank's node-by-node noise beside its sandbox peer's, from a kept pair."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from node_noise import deviations, read_pair  # noqa: E402

from prism_core.trace.schema import COMPUTE  # noqa: E402
from tests.replay.test_steady import _two_ranks  # noqa: E402

STEPS = 41
rng = np.random.default_rng(7)
SHARED = rng.normal(0.0, 1e-4, size=(STEPS - 1, 2))     # the machine's noise, both real ranks at once
DRAWN = rng.normal(0.0, 1e-4, size=(STEPS - 1, 2))      # the timing run's, another moment


def test_deviations_are_against_the_positions_median_and_clipped():
    spans = np.array([[1.0e-3, 2.0e-3], [1.2e-3, 2.0e-3], [0.9e-3, 9.0e-3]])
    assert deviations(spans) == pytest.approx(np.array([[0.0, 0.0], [0.2e-3, 0.0], [-0.1e-3, 1e-3]]))


def _write_part(run: Path, rank: int, spans: np.ndarray) -> None:
    (run / "trace_parts").mkdir(parents=True, exist_ok=True)
    end = np.cumsum(spans)
    np.savez(run / "trace_parts" / f"{rank}.npz", t_start=end - spans, t_end=end)
    (run / "config.json").write_text(json.dumps({"job": {"warmup": 1}}))


def _spans(trace, model, rank: int, noise: np.ndarray) -> np.ndarray:
    """The rank's spans with `noise` [step, position] added to its compute nodes after step 0."""
    local = model.span[trace.rank_slice(rank)].copy()
    compute = np.flatnonzero(trace.rank(rank)["kind"] == COMPUTE)
    local[compute[2:]] += noise.ravel()
    return local


def test_real_ranks_sharing_their_noise_wait_for_none_and_a_timed_virtual_rank_does(tmp_path):
    trace, model = _two_ranks([[0.010, 0.020]] * STEPS)
    for r in range(2):
        _write_part(tmp_path / "record_e", r, _spans(trace, model, r, SHARED))
    _write_part(tmp_path / "emulate_0", 0, _spans(trace, model, 0, SHARED))
    span = model.span.copy()
    span[trace.rank_slice(1)] = _spans(trace, model, 1, DRAWN)
    (tmp_path / "calibrate").mkdir()
    np.savez(tmp_path / "calibrate" / "timeline.npz", span=span)
    (row,) = read_pair("ep2", tmp_path, trace)           # no emulate_1: rank 1 was not emulated
    assert row.rank == 0
    assert row.rho_real == pytest.approx(1.0)
    assert abs(row.rho_timed) < 0.3                        # a draw of another moment says little
    assert row.real == pytest.approx((0.0, 0.0), abs=1e-12) and row.wait["real"] == pytest.approx(0.0, abs=1e-12)
    own = SHARED - np.median(SHARED, axis=0)
    timed = DRAWN - np.median(DRAWN, axis=0)
    assert row.wait["timed"] == pytest.approx(np.clip(timed - own, 0, None).mean())
    assert row.wait["steady"] == pytest.approx(np.clip(-own, 0, None).mean())
    assert row.wait["real"] < row.wait["steady"] < row.wait["timed"]
    assert row.timed[0] < 0 < row.timed[1]


def test_a_matched_emulation_is_read_beside_the_others(tmp_path):
    trace, model = _two_ranks([[0.010, 0.020]] * STEPS)
    for r in range(2):
        _write_part(tmp_path / "record_e", r, _spans(trace, model, r, SHARED))
    for run, way in (("emulate_0", "matched"), ("emulate_0_spans", "paired")):
        _write_part(tmp_path / run, 0, _spans(trace, model, 0, SHARED))
        (tmp_path / run / "replay").mkdir()
        (tmp_path / run / "replay" / "stats.json").write_text(json.dumps({"virtual_spans": way}))
    span = model.span.copy()
    span[trace.rank_slice(1)] = _spans(trace, model, 1, DRAWN)
    span[trace.rank_slice(0)] = _spans(trace, model, 0, SHARED + 0.4 * DRAWN)   # rank 0 shares some of it
    (tmp_path / "calibrate").mkdir()
    np.savez(tmp_path / "calibrate" / "timeline.npz", span=span)
    (row,) = read_pair("pp2", tmp_path, trace)
    assert row.wait["timed"] > row.wait["matched"] > row.wait["steady"]   # about half its draw
