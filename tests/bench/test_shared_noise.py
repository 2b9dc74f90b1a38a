"""bench/shared_noise.py: the records' shared noise against what the calibration reads, from a kept pair."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from shared_noise import read_pair  # noqa: E402

from prism_core.replay.steady import shared_noise  # noqa: E402
from prism_core.trace.schema import COMPUTE  # noqa: E402
from tests.bench.test_node_noise import STEPS, _spans, _write_part  # noqa: E402
from tests.replay.test_steady import _two_ranks  # noqa: E402

rng = np.random.default_rng(11)
COMMON = rng.normal(0.0, 1e-4, size=(STEPS - 1, 2))
OWN = rng.normal(0.0, 1e-4, size=(2, STEPS - 1, 2))


def _kept_pair(tmp_path: Path, shift: float | None, waits: bool = False):
    """A kept pair whose records share half of each rank's noise; its timeline's spans share it
    too, measured with rank 1 `shift` of each node after rank 0 (None: no measured times kept).
    `waits`: the timeline's compute spans hold waits for a core, each rank's apart (kept beside them)."""
    trace, model = _two_ranks([[0.010, 0.020]] * STEPS)
    noise = [np.sqrt(0.5) * COMMON + np.sqrt(0.5) * OWN[r] for r in range(2)]
    for run in ("record", "record_e"):
        for r in range(2):
            _write_part(tmp_path / run, r, _spans(trace, model, r, noise[r]))
    span = model.span.copy()
    for r in range(2):
        span[trace.rank_slice(r)] = _spans(trace, model, r, noise[r])
    queued = np.zeros(len(span))
    if waits:
        compute = trace.columns["kind"] == COMPUTE
        queued[compute] = np.where(rng.random(compute.sum()) < 0.3, rng.exponential(2e-4, compute.sum()), 0.0)
        span = span + queued
    start = np.concatenate([np.cumsum(span[trace.rank_slice(r)]) - span[trace.rank_slice(r)] for r in range(2)])
    times = {}
    if shift is not None:
        measured = start.copy()
        measured[trace.rank_slice(1)] += shift * span[trace.rank_slice(1)]
        times = {"start": start, "end": start + span, "measured_start": measured, "measured_end": measured + span,
                 "measured_queued": queued}
    (tmp_path / "calibrate").mkdir()
    np.savez(tmp_path / "calibrate" / "timeline.npz", span=span, **times)
    return trace, span


def test_the_read_shared_noise_counts_how_far_the_measured_nodes_ran_at_once(tmp_path):
    trace, span = _kept_pair(tmp_path, shift=0.5)
    (row,) = read_pair("ep2", trace, tmp_path)
    assert row.record[0] == pytest.approx(row.record[1]) and row.record[0] == pytest.approx(row.as_read)
    assert row.timeline > 0.9 and row.measured < row.timeline       # the timeline's nodes at once, not the measured
    assert row.read == pytest.approx(min(1.0, row.as_read * row.timeline / row.measured))
    assert row.as_read == shared_noise(trace, span, 1, 0, 1)


def test_the_read_leaves_out_the_waits_for_a_core_the_timelines_spans_hold(tmp_path):
    trace, span = _kept_pair(tmp_path, shift=0.0, waits=True)
    (row,) = read_pair("ep2", trace, tmp_path)
    assert row.as_read < row.record[0] - 0.1                 # each rank's waits: the spans share less
    assert row.waits_out == pytest.approx(row.record[0]) and row.read == pytest.approx(row.waits_out)
    assert not row.again


def test_a_timeline_without_measured_times_is_read_as_it_is(tmp_path):
    trace, span = _kept_pair(tmp_path, shift=None)
    (row,) = read_pair("ep2", trace, tmp_path)
    assert row.read is None and row.measured is None and row.as_read is not None


def test_the_slope_reads_noise_shared_only_where_the_measured_nodes_overlapped(tmp_path):
    trace, model = _two_ranks([[0.010, 0.020]] * STEPS)
    overlapped = np.zeros((STEPS - 1, 2), dtype=bool)
    overlapped[:, 0] = True                     # each step's first node at once, its second a node apart
    noise = [OWN[0], np.where(overlapped, OWN[0], OWN[1])]
    span = model.span.copy()
    for r in range(2):
        span[trace.rank_slice(r)] = _spans(trace, model, r, noise[r])
        for run in ("record", "record_e"):
            _write_part(tmp_path / run, r, _spans(trace, model, r, noise[r]))
    start = np.concatenate([np.cumsum(span[trace.rank_slice(r)]) - span[trace.rank_slice(r)] for r in range(2)])
    measured = start.copy()
    compute = np.flatnonzero(trace.rank(1)["kind"] == COMPUTE)[2:].reshape(STEPS - 1, 2)
    measured[trace.offsets[1] + compute[~overlapped]] += 1.0       # rank 1's second nodes measured elsewhere
    (tmp_path / "calibrate").mkdir()
    np.savez(tmp_path / "calibrate" / "timeline.npz", span=span, start=start, end=start + span,
             measured_start=measured, measured_end=measured + span)
    (row,) = read_pair("tp2", trace, tmp_path)
    assert row.measured == pytest.approx(row.timeline / 2, abs=0.05) and row.timeline > 0.8
    assert row.slope == pytest.approx(1.0, abs=0.25)      # all of it where they overlapped, none elsewhere


def _emulations(tmp_path: Path, trace, model, noise) -> None:
    """Each rank emulated beside a steady peer, computing with `noise[rank]`."""
    for r in range(2):
        run = tmp_path / f"emulate_{r}_spans"
        _write_part(run, r, _spans(trace, model, r, noise[r]))
        (run / "replay").mkdir()
        (run / "replay" / "stats.json").write_text('{"virtual_spans": "paired"}')


@pytest.mark.parametrize("shared, needed", [(0.0, 1.0), (0.5, 0.0)])
def test_the_needed_share_leaves_an_emulated_rank_as_far_from_its_peer_as_the_records(tmp_path, shared, needed):
    trace, model = _two_ranks([[0.010, 0.020]] * STEPS)
    _kept_pair(tmp_path, shift=0.0)
    noise = [np.sqrt(shared) * COMMON + np.sqrt(1 - shared) * OWN[r] for r in range(2)]
    for r in range(2):
        _write_part(tmp_path / "record_e", r, _spans(trace, model, r, noise[r]))
    (row,) = read_pair("ep2", trace, tmp_path)
    assert row.needed is None                                   # no emulation beside a steady peer
    _emulations(tmp_path, trace, model, noise)
    (row,) = read_pair("ep2", trace, tmp_path)
    assert row.needed == pytest.approx(needed, abs=0.2)              # 80 nodes a rank: a sample
