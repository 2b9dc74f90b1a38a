"""Steady spans for virtual ranks (`prism_core.replay.steady`): each compute node of a steady step
takes its position's trimmed mean over those steps; warm-up steps, other steps and sandbox ranks
keep theirs."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from prism_core.replay.steady import (NodeMoments, kept_noise, matched_noise, node_moments, overlap, paired_ranks,
                                    sandbox_peers, shared_noise, steady_spans, trimmed_mean)
from prism_core.trace.schema import COMPUTE

from tests.calibrate.test_timeline import allreduce, build, compute


def _two_ranks(spans: list[list[float]]):
    """Two ranks that compute `spans[k]` (two nodes) in step k, all-reducing after each node."""
    ranks = [[node for k, (a, b) in enumerate(spans)
              for node in (dict(compute(a), step=k), dict(allreduce(0, 2 * k, 0.01), step=k),
                           dict(compute(b), step=k), dict(allreduce(0, 2 * k + 1, 0.01), step=k))]
             for _ in range(2)]
    return build(ranks, [(0, 1)])


def _compute_of(trace, span, r):
    return span[trace.rank_slice(r)][trace.rank(r)["kind"] == COMPUTE].tolist()


def test_trimmed_mean_leaves_out_each_end():
    values = np.array([[100.0]] + [[float(v)] for v in range(1, 10)])   # ten draws, one of them stalled
    assert trimmed_mean(values, 0.1).tolist() == [pytest.approx(5.5)]    # 2 ... 9: the 1 and the 100 left out
    assert trimmed_mean(values, 0.0).tolist() == [pytest.approx(14.5)]
    assert trimmed_mean(np.array([[5.0]]), 0.1).tolist() == [5.0]


def test_virtual_ranks_steady_steps_take_their_positions_trimmed_mean_scaled_to_the_median_step():
    # step 0 is the warm-up; steps 1-10 draw each position's span with noise, one draw stalled
    draws = [[0.010, 0.020], [0.011, 0.019], [0.009, 0.021], [0.012, 0.018], [0.008, 0.022],
             [0.010, 0.020], [0.011, 0.019], [0.009, 0.021], [0.010, 0.500], [0.010, 0.020]]
    trace, model = _two_ranks([[1.0, 1.0]] + draws)
    out = steady_spans(trace, model.span, ranks=[1], first_step=1)
    steady = _compute_of(trace, out, 1)
    assert steady[:2] == [1.0, 1.0]                                   # the warm-up step as timed
    first = np.sort(np.array(draws)[:, 0])[1:-1].mean()
    second = np.sort(np.array(draws)[:, 1])[1:-1].mean()             # the stall trimmed away
    median_step = np.median(np.array(draws).sum(axis=1))             # 0.030: what a steady step computes
    scale = median_step / (first + second)
    assert steady[2::2] == pytest.approx([first * scale] * 10)
    assert steady[3::2] == pytest.approx([second * scale] * 10)
    assert (np.array(steady[2::2]) + np.array(steady[3::2])) == pytest.approx([median_step] * 10)
    assert _compute_of(trace, out, 0) == _compute_of(trace, model.span, 0)     # rank 0 (sandbox) untouched
    comm = trace.columns["kind"] != COMPUTE
    assert np.array_equal(out[comm], model.span[comm])                 # only compute nodes move
    assert model.span[trace.rank_slice(1)][4] == 0.010                 # the input is not changed


def test_steps_running_other_nodes_keep_their_spans():
    trace, model = _two_ranks([[1.0, 1.0], [0.01, 0.02], [0.03, 0.04], [0.05, 0.06]])
    trace.columns["label"][trace.offsets[1] + 8] = 1                  # rank 1's step 2 ran another kernel
    out = _compute_of(trace, steady_spans(trace, model.span, ranks=[1], first_step=1), 1)
    assert out == pytest.approx([1.0, 1.0, 0.03, 0.04, 0.03, 0.04, 0.03, 0.04])   # steps 1 and 3: their middle
    assert _compute_of(trace, model.span, 1)[4:6] == pytest.approx([0.03, 0.04])


def test_a_rank_with_one_steady_step_keeps_its_spans():
    trace, model = _two_ranks([[1.0, 1.0], [0.01, 0.02]])
    assert np.array_equal(steady_spans(trace, model.span, ranks=[0, 1], first_step=1), model.span)


def _four_ranks():
    """Four ranks: pairs {0, 1} and {2, 3} (TP), {0, 2} and {1, 3} (DP)."""
    groups = [(0, 1), (2, 3), (0, 2), (1, 3)]
    tp, dp = {0: 0, 1: 0, 2: 1, 3: 1}, {0: 2, 2: 2, 1: 3, 3: 3}
    ranks = [[compute(0.01), allreduce(tp[r], 0, 0.01), compute(0.01), allreduce(dp[r], 0, 0.01)]
             for r in range(4)]
    return build(ranks, groups)[0]


def test_paired_ranks_are_the_virtual_ranks_whose_every_peer_is_a_sandbox_rank():
    trace = _four_ranks()                                                  # rank 0 real
    assert paired_ranks(trace, [1, 2, 3], sandbox=[0]) == []              # 1 and 2 also talk to 3
    assert paired_ranks(trace, [1, 2], sandbox=[0, 3]) == [1, 2]          # their peers all real
    two, _ = _two_ranks([[0.01, 0.02]] * 3)
    assert paired_ranks(two, [1], sandbox=[0]) == [1]                     # W=2: the one virtual rank


def _noisy_pair(shared: float, steps: int = 40, seed: int = 0):
    """Two ranks of two compute nodes a step whose spans' noise shares `shared` of itself (the
    rest each rank's own), each node 10 ms +- 0.2 ms; step 0 a warm-up."""
    rng = np.random.default_rng(seed)
    common = rng.normal(0.0, 2e-4, (steps, 2))
    own = rng.normal(0.0, 2e-4, (2, steps, 2))
    noise = [np.sqrt(shared) * common + np.sqrt(1 - shared) * own[r] for r in range(2)]
    trace, model = _two_ranks([[1.0, 1.0]] * steps)
    span = model.span.copy()
    for r in range(2):
        nodes = trace.offsets[r] + np.nonzero(trace.rank(r)["kind"] == COMPUTE)[0].reshape(steps, 2)
        span[nodes[1:]] = 0.010 + noise[r][1:]
    return trace, span


@pytest.mark.parametrize("shared", [0.0, 0.4, 0.8])
def test_shared_noise_reads_how_much_of_its_noise_a_rank_shares_with_its_peer(shared):
    trace, span = _noisy_pair(shared, steps=400)
    rho = shared_noise(trace, span, 1, 0, first_step=1)
    assert rho == pytest.approx(shared, abs=0.08)
    assert shared_noise(trace, span, 0, 1, first_step=1) == pytest.approx(rho)


def test_shared_noise_is_not_read_without_common_steady_steps_or_variation():
    trace, span = _noisy_pair(0.5)
    assert shared_noise(trace, span, 1, 0, first_step=39) is None       # one steady step
    flat = span.copy()
    flat[trace.rank_slice(0)][trace.rank(0)["kind"] == COMPUTE] = 0.010
    assert shared_noise(trace, flat, 1, 0, first_step=1) is None         # rank 0 does not vary
    trace.columns["label"][trace.offsets[1] + 4] = 1                     # rank 1's step 1 ran another kernel:
    assert shared_noise(trace, span, 1, 0, first_step=1) is not None     # read over the steps both ran steadily


def test_overlap_is_the_time_two_nodes_ran_at_once_over_their_lengths():
    assert overlap([0.0, 1.0], [1.0, 2.0], [0.0, 1.0], [1.0, 2.0]) == 1.0
    assert overlap([0.0], [1.0], [0.5], [1.5]) == 0.5
    assert overlap([0.0], [1.0], [2.0], [3.0]) == 0.0
    assert overlap([0.0], [4.0], [0.0], [1.0]) == pytest.approx(0.5)      # 1 s shared, sqrt(4 * 1) s long
    assert overlap([0.0, 1.0], [1.0, 1.0], [0.0, 1.0], [1.0, 1.0]) == 0.5  # a node of no length shares nothing
    assert overlap([np.nan], [1.0], [0.0], [1.0]) is None


def _moments(trace, shift: float, later: float = 0.0) -> NodeMoments:
    """Each rank's nodes 10 ms apart from 0, node for node at once in the timeline; where measured,
    rank 1's `shift` of a node after rank 0's and `later` seconds on."""
    n = trace.offsets[1]
    grid = np.concatenate([np.arange(n), np.arange(len(trace.columns["kind"]) - n)]) * 0.010
    measured = grid.copy()
    measured[n:] += (shift * 0.010) + later
    return NodeMoments(grid, grid + 0.010, measured, measured + 0.010)


def test_shared_noise_counts_the_nodes_measured_apart_as_far_as_the_timeline_runs_them_at_once():
    trace, span = _noisy_pair(0.4, steps=400)
    read = shared_noise(trace, span, 1, 0, first_step=1)
    # measured half a node apart, the two ranks' same nodes shared half the time they do in the timeline
    assert shared_noise(trace, span, 1, 0, 1, _moments(trace, 0.5)) == pytest.approx(2 * read)
    assert shared_noise(trace, span, 1, 0, 1, _moments(trace, 0.0)) == pytest.approx(read)
    assert shared_noise(trace, span, 1, 0, 1, _moments(trace, 0.9)) == 1.0          # at most 1
    # measured in runs that did not run at once, or at unknown moments: as read
    assert shared_noise(trace, span, 1, 0, 1, _moments(trace, 0.5, later=1000.0)) == pytest.approx(read)
    unknown = _moments(trace, 0.5)
    unknown.measured_start[trace.offsets[1] + 4] = np.nan             # a steady compute node of rank 1
    assert shared_noise(trace, span, 1, 0, 1, unknown) == pytest.approx(read)
    moments = _moments(trace, 0.5)
    assert matched_noise(trace, span, [1], [0], 1, moments)[1][0] == pytest.approx(2 * read)


def test_node_moments_are_read_from_a_timeline_that_kept_them():
    times = {"start": np.zeros(3), "end": np.ones(3), "measured_start": np.zeros(3), "measured_end": np.ones(3)}
    moments = node_moments(times)
    assert moments is not None and moments.end.tolist() == [1.0, 1.0, 1.0] and moments.measured_queued is None
    assert node_moments({k: v for k, v in times.items() if k != "measured_end"}) is None   # calibrated before
    assert node_moments(times | {"measured_queued": np.full(3, 0.5)}).measured_queued.tolist() == [0.5] * 3


def test_shared_noise_leaves_out_the_waits_for_a_core_the_spans_hold():
    trace, span = _noisy_pair(0.4, steps=400)
    read = shared_noise(trace, span, 1, 0, first_step=1)
    # each rank waited for a core at some nodes, apart from the other: the spans share less
    rng = np.random.default_rng(5)
    queued = np.where(rng.random(len(span)) < 0.3, rng.exponential(3e-4, len(span)), 0.0)
    queued[trace.columns["kind"] != COMPUTE] = 0.0
    waited = span + queued
    assert shared_noise(trace, waited, 1, 0, 1) < read - 0.1
    moments = replace(_moments(trace, 0.0), measured_queued=queued)
    assert shared_noise(trace, waited, 1, 0, 1, moments) == pytest.approx(read)
    unknown = queued.copy()
    unknown[trace.offsets[1] + 3] = np.nan                       # a wait not noted counts as none
    assert shared_noise(trace, waited, 1, 0, 1, replace(moments, measured_queued=unknown)) == pytest.approx(read, abs=0.02)


def test_kept_noise_leaves_a_live_and_a_virtual_rank_as_far_apart_as_two_real_ones():
    assert kept_noise(0.0) == pytest.approx(1.0)         # real ranks sharing nothing: the whole draw
    assert kept_noise(0.18) == pytest.approx(0.8)
    assert kept_noise(0.5) == 0.0 and kept_noise(0.7) == 0.0    # closer than a steady rank can be
    assert kept_noise(None) == 0.0 and kept_noise(float("nan")) == 0.0
    rng = np.random.default_rng(1)
    for rho in (0.0, 0.2, 0.4):                          # the spread of the two ranks' difference
        common, a, b = rng.normal(size=(3, 200_000))
        real = np.sqrt(rho) * common + np.sqrt(1 - rho) * a - (np.sqrt(rho) * common + np.sqrt(1 - rho) * b)
        emulated = a - kept_noise(rho) * b
        assert emulated.std() == pytest.approx(real.std(), rel=0.02)


def test_matched_ranks_keep_their_share_of_noise_around_the_trimmed_mean():
    trace, span = _noisy_pair(0.2)
    matched = matched_noise(trace, span, [1], sandbox=[0], first_step=1)
    rho, w = matched[1]
    assert rho == shared_noise(trace, span, 1, 0, 1) and w == kept_noise(rho) and 0 < w < 1
    out = steady_spans(trace, span, [1], first_step=1, kept={1: w})
    mean = steady_spans(trace, span, [1], first_step=1)
    nodes = trace.offsets[1] + np.nonzero(trace.rank(1)["kind"] == COMPUTE)[0][2:]
    assert out[nodes] == pytest.approx(mean[nodes] + w * (span[nodes] - mean[nodes]))
    steps = out[nodes].reshape(-1, 2).sum(axis=1)        # the median step as drawn, kept
    assert np.median(steps) == pytest.approx(np.median(span[nodes].reshape(-1, 2).sum(axis=1)))
    assert np.array_equal(steady_spans(trace, span, [1], first_step=1, kept={1: 0.0}), mean)
    assert np.array_equal(steady_spans(trace, span, [1], first_step=1, kept={1: 1.0}), span)
    assert np.array_equal(out[trace.rank_slice(0)], span[trace.rank_slice(0)])    # the sandbox rank as it was
    assert matched_noise(trace, span, [1], sandbox=[], first_step=1) == {1: (None, 0.0)}   # no sandbox peer


def test_sandbox_peers_are_the_sandbox_members_of_the_ranks_groups():
    trace = _four_ranks()
    assert sandbox_peers(trace, 1, sandbox=[0, 3]) == [0, 3]
    assert sandbox_peers(trace, 2, sandbox=[0]) == [0]
    assert sandbox_peers(trace, 2, sandbox=[1]) == []
