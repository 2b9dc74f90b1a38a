"""What a wait costs the compute after it (`prism_core.calibrate.resume`) and its use in calibration.

The gaps a run's compute nodes followed, the fit of a known cost from two runs of the same nodes,
the spans moved to other waits, and `predict_from` solving hand-built graphs whose compute was
measured after longer waits than their timeline has, with answers worked out by hand.
"""

from __future__ import annotations

import numpy as np
import pytest

from prism_core.calibrate.durations import RankTiming
from prism_core.calibrate.predict import predict_from
from prism_core.calibrate.resume import (MAX_SHARE, ResumeCost, compute_gaps, fit_resume_cost, history,
                                         resumed_spans, timeline_gaps)
from prism_core.trace.matching import match_ops
from prism_core.trace.schema import COMM, COMPUTE, WAIT

from tests.calibrate.test_timeline import allreduce, build, compute

MS = 1e-3


def _cold(gap, tau):
    return 1 - np.exp(-np.asarray(gap) / tau)


def test_a_compute_nodes_gap_is_the_time_since_the_ranks_previous_compute_ended():
    kind = np.array([COMPUTE, COMM, COMPUTE, COMPUTE, WAIT, COMPUTE])
    t_start = np.array([0.0, 1.0, 1.5, 2.0, 3.0, 3.25])
    t_end = np.array([1.0, 1.5, 2.0, 3.0, 3.2, 4.0])
    gap = compute_gaps(kind, t_start, t_end)
    assert np.isnan(gap[[0, 1, 4]]).all()                  # the first compute node and the rest: unknown
    assert gap[[2, 3, 5]] == pytest.approx([0.5, 0.0, 0.25])


def test_a_timelines_gaps_do_not_reach_across_ranks():
    kind = np.array([COMPUTE, COMM, COMPUTE, COMPUTE, COMM, COMPUTE])
    start = np.array([0.0, 1.0, 1.2, 0.0, 2.0, 2.5])
    end = np.array([1.0, 1.2, 2.0, 2.0, 2.5, 3.0])
    gap = timeline_gaps(kind, start, end, np.array([0, 3, 6]))
    assert np.isnan(gap[[0, 1, 3, 4]]).all()               # rank 1's first compute node follows nothing of its own
    assert gap[[2, 5]] == pytest.approx([0.2, 0.5])


def test_history_sums_the_earlier_nodes_terms_within_a_rank():
    cold = np.array([1.0, 0.5, np.nan, 0.2, 1.0, 1.0])
    out = history(cold, 0.5, rank=np.array([0, 0, 0, 0, 1, 1]))
    assert out[0] == pytest.approx(1.0)
    assert out[1] == pytest.approx(0.5 + 0.5 * 1.0)
    assert np.isnan(out[2])                                   # its own wait unknown
    assert out[3] == pytest.approx(0.2 + 0.5 * 0 + 0.25 * 0.5 + 0.125 * 1.0)   # an unknown earlier term counts 0
    assert out[4] == pytest.approx(1.0)                       # rank 1's first: nothing of rank 0's
    assert out[5] == pytest.approx(1.5)
    assert np.array_equal(history(cold, 0.0), cold, equal_nan=True)


def _two_runs(rng, n: int, cost: ResumeCost, noise_s: float = 5e-6):
    """One rank's `n` compute nodes timed twice: after waits of 0.2-0.8 ms (plain) and up to 1.5 ms
    longer (loaded, its nodes also `cost.share` longer), each paying `cost` for its waits."""
    base = rng.uniform(0.3 * MS, 3 * MS, n)
    gap_b = rng.uniform(0.2 * MS, 0.8 * MS, n)
    gap_a = gap_b + rng.uniform(0.0, 1.5 * MS, n)
    span_b = base + cost(gap_b) + rng.normal(0, noise_s, n)
    span_a = base * (1 + cost.share) + cost(gap_a) + rng.normal(0, noise_s, n)
    return span_a, gap_a, span_b, gap_b


def test_the_fit_finds_a_known_cost_from_two_runs_of_the_same_nodes():
    rng = np.random.default_rng(0)
    true = ResumeCost(tau_s=2 * MS, cost_s=0.3 * MS, share=0.02, nodes=0, memory=0.5)
    fitted = fit_resume_cost([_two_runs(rng, 3000, true), _two_runs(rng, 3000, true)])
    assert fitted is not None
    assert fitted.tau_s == true.tau_s and fitted.memory == true.memory
    assert fitted.cost_s == pytest.approx(true.cost_s, rel=0.05)
    assert fitted.share == pytest.approx(true.share, abs=0.003)
    assert fitted.nodes == 6000
    assert ResumeCost.from_dict(fitted.as_dict()) == fitted


def test_no_fit_from_too_few_nodes_equal_waits_or_waits_that_cost_nothing():
    rng = np.random.default_rng(1)
    true = ResumeCost(tau_s=1 * MS, cost_s=0.2 * MS, share=0.0, nodes=0)
    assert fit_resume_cost([_two_runs(rng, 100, true)]) is None
    span_a, gap_a, span_b, _ = _two_runs(rng, 2000, true)
    assert fit_resume_cost([(span_a, gap_a, span_b, gap_a)]) is None            # the same waits in both runs
    cheaper = ResumeCost(tau_s=1 * MS, cost_s=-0.2 * MS, share=0.0, nodes=0)
    assert fit_resume_cost([_two_runs(rng, 2000, cheaper)]) is None             # longer waits cost less
    assert fit_resume_cost([]) is None


def test_spans_move_to_the_new_waits_by_at_most_half_themselves():
    cost = ResumeCost(tau_s=1 * MS, cost_s=0.2 * MS, share=0.0, nodes=0)
    kind = np.array([COMPUTE, COMM, COMPUTE, COMM, COMPUTE, COMPUTE])
    span = np.array([1.0, 0.1, 1.0, 0.1, 0.1, 1.0]) * MS
    measured = np.array([np.nan, np.nan, 5.0, np.nan, 5.0, np.nan]) * MS
    gap = np.array([np.nan, np.nan, 0.1, np.nan, 0.1, 0.1]) * MS
    out = resumed_spans(span, kind, np.array([0, 6]), measured, gap, cost)
    move = 0.2 * MS * (_cold(0.1 * MS, MS) - _cold(5 * MS, MS))
    assert out[2] == pytest.approx(1.0 * MS + move)
    assert out[4] == pytest.approx(0.1 * MS * (1 - MAX_SHARE))      # a short node gives back half itself at most
    assert out[[0, 1, 3, 5]] == pytest.approx(span[[0, 1, 3, 5]])  # unknown waits, and not compute: as measured


def _timed(trace, model, gap_s: float) -> dict[int, RankTiming]:
    """Each rank's part of `model` as measured in its own run, every compute node but the first
    after a wait of `gap_s`; one step."""
    out = {}
    for r in range(trace.world_size):
        s = trace.rank_slice(r)
        kind = trace.rank(r)["kind"]
        measured = np.where(kind == COMPUTE, gap_s, np.nan)
        measured[np.nonzero(kind == COMPUTE)[0][0]] = np.nan
        out[r] = RankTiming(span=model.span[s], release=model.release[s], completes_synced=model.completes_synced[s],
                            transfer=model.transfer[s], step_times=[0.0], gaps=[0.0], peaks=[], run=f"slice_{r}",
                            resume_gap=measured)
    return out


def _layers(spans: list[float], layers: int = 5):
    """Two ranks that compute `spans[r]` then all-reduce for 0.1 ms, `layers` times."""
    ranks = [[node for k in range(layers) for node in (compute(span), allreduce(0, k, 0.1 * MS))] for span in spans]
    return build(ranks, [(0, 1)])


def test_calibration_moves_compute_measured_after_long_waits_to_the_timelines_short_ones():
    trace, model = _layers([1.0 * MS, 1.0 * MS])
    timings = _timed(trace, model, 5 * MS)
    cost = ResumeCost(tau_s=1 * MS, cost_s=0.2 * MS, share=0.0, nodes=1000)
    as_measured = predict_from(trace, match_ops(trace), timings, np.arange(2))
    moved = predict_from(trace, match_ops(trace), timings, np.arange(2), resume=cost)
    assert as_measured.step_times[0] == pytest.approx([5 * 1.1 * MS])
    # every compute node but the first now follows the 0.1 ms all-reduce, not 5 ms of waiting
    delta = 0.2 * MS * (_cold(5 * MS, MS) - _cold(0.1 * MS, MS))
    for r in (0, 1):
        assert moved.step_times[r] == pytest.approx([5 * 1.1 * MS - 4 * delta], rel=1e-9)


def test_a_rank_that_waits_for_a_straggler_in_the_timeline_keeps_more_of_its_cost():
    trace, model = _layers([1.0 * MS, 1.5 * MS])
    timings = _timed(trace, model, 5 * MS)
    cost = ResumeCost(tau_s=1 * MS, cost_s=0.2 * MS, share=0.0, nodes=1000)
    moved = predict_from(trace, match_ops(trace), timings, np.arange(2), resume=cost)
    # rank 1 arrives last at every all-reduce, so its chain is the step: its nodes follow 0.1 ms
    delta = 0.2 * MS * (_cold(5 * MS, MS) - _cold(0.1 * MS, MS))
    expected = 1.5 * MS + 4 * (1.5 * MS - delta) + 5 * 0.1 * MS
    assert moved.step_times[0] == pytest.approx([expected], rel=1e-9)
    assert moved.step_times[1] == pytest.approx([expected], rel=1e-9)
    # rank 0 waits for it: its nodes follow longer gaps in the timeline and give back less
    compute_nodes = trace.rank(0)["kind"] == COMPUTE
    given_back = (model.span - moved.model.span)[trace.rank_slice(0)][compute_nodes][1:]
    assert np.all(given_back < delta - 1e-6) and np.all(given_back > 0)


def test_when_a_replicas_spans_were_measured_moves_with_them():
    from dataclasses import replace

    from prism_core.calibrate.durations import replica_noise

    from tests.calibrate.test_durations import _replicas

    trace, model = _replicas(3, [1.0, 0.2, 0.4, 0.1, 0.3])
    compute_nodes = trace.columns["kind"] == COMPUTE
    model = replace(model, measured_start=100 * model.span, measured_end=200 * model.span)
    noisy, _ = replica_noise(trace, model, np.zeros(3, dtype=np.int64), first_step=1, orders=3)
    assert not np.array_equal(noisy.span, model.span)                      # the replicas' steps reordered
    assert noisy.measured_start[compute_nodes] == pytest.approx(100 * noisy.span[compute_nodes])
    assert noisy.measured_end[compute_nodes] == pytest.approx(200 * noisy.span[compute_nodes])
    own = model.span[trace.rank_slice(1)] * 2
    ones = compute_nodes[trace.rank_slice(1)]
    unknown, _ = replica_noise(trace, model, np.zeros(3, dtype=np.int64), first_step=1, orders=3, measured={1: own})
    assert np.isnan(unknown.measured_start[trace.rank_slice(1)][ones]).all()
    timed, _ = replica_noise(trace, model, np.zeros(3, dtype=np.int64), first_step=1, orders=3, measured={1: own},
                             measured_times={1: (7 * own, 8 * own)})
    assert timed.measured_start[trace.rank_slice(1)][ones] == pytest.approx(7 * own[ones])
    assert timed.measured_end[trace.rank_slice(1)][ones] == pytest.approx(8 * own[ones])


def test_a_replicas_waits_move_with_the_spans_it_takes():
    from dataclasses import replace

    from prism_core.calibrate.durations import replica_noise

    from tests.calibrate.test_durations import _replicas

    trace, model = _replicas(3, [1.0, 0.2, 0.4, 0.1, 0.3])
    compute_nodes = trace.columns["kind"] == COMPUTE
    model = replace(model, resume_gap=np.where(compute_nodes, 10 * model.span, np.nan))
    noisy, _ = replica_noise(trace, model, np.zeros(3, dtype=np.int64), first_step=1, orders=3)
    assert not np.array_equal(noisy.span, model.span)                      # the replicas' steps reordered
    assert noisy.resume_gap[compute_nodes] == pytest.approx(10 * noisy.span[compute_nodes])
    own = model.span[trace.rank_slice(1)] * 2
    measured, _ = replica_noise(trace, model, np.zeros(3, dtype=np.int64), first_step=1, orders=3, measured={1: own})
    assert np.isnan(measured.resume_gap[trace.rank_slice(1)][compute_nodes[trace.rank_slice(1)]]).all()
    with_gaps, _ = replica_noise(trace, model, np.zeros(3, dtype=np.int64), first_step=1, orders=3, measured={1: own},
                                 measured_gaps={1: 10 * own})
    ones = compute_nodes[trace.rank_slice(1)]
    assert with_gaps.resume_gap[trace.rank_slice(1)][ones] == pytest.approx(10 * own[ones])
