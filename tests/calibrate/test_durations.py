"""What a slice's times say about one sandbox rank's nodes (`prism_core.calibrate.durations`).

Hand-built: rank 0 posts an asynchronous receive, computes, then waits for it; rank 1 (the peer)
sends. The receive's completion is only seen at the wait (gloo p2p works have no callback).
Then the pooling of collectives whose members were timed in different runs.
"""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from prism_core.calibrate.durations import (REPLICA_ORDERS, SAME_WAIT_S, RankTiming, _rank_timing, alone_factor,
                                            pool_member_noise, replica_noise, replica_orders, with_loaded_compute)
from prism_core.calibrate.timeline import solve
from prism_core.trace.matching import match_ops
from prism_core.trace.schema import COMM, COMPUTE

from tests.calibrate.test_timeline import allreduce, build, comm, compute, recv, send, wait


def _timing(tmp_path, peer_arrives: float, wait_from: float, wait_to: float):
    trace, _ = build([[recv(1, 0.0, async_=True), compute(1.0), wait(0, 0.0), compute(0.5)],
                      [send(0, 0.1)]], [(0, 1)])
    cols = {k: v.copy() for k, v in trace.rank(0).items()}
    cols["t_start"] = np.array([1.0, 1.01, wait_from, wait_to])
    cols["t_end"] = np.array([wait_to, wait_from, wait_to, wait_to + 0.5])   # the recv's end: seen at the wait
    match = match_ops(trace)
    last = np.full(match.n_ops, -np.inf)
    last[match.op_id[0]] = max(1.0, peer_arrives)             # the op's last member's arrival
    (tmp_path / "results").mkdir(exist_ok=True)
    (tmp_path / "results" / "0.json").write_text(json.dumps({"step_times_s": [wait_to + 0.5 - 1.0]}))
    return _rank_timing(trace, match, 0, cols, last, tmp_path)


def test_a_peer_there_before_the_wait_makes_the_wait_take_the_time(tmp_path):
    # the peer arrived at 1.5, while rank 0 computed; the wait ran 3.0 -> 3.2: the 1.5 s between
    # was rank 0's own work (a bound rank moves the bytes only once it blocks), and the 0.2 s the
    # wait's, so a timeline with the peer later or earlier moves the op, not rank 0's work
    t = _timing(tmp_path, peer_arrives=1.5, wait_from=3.0, wait_to=3.2)
    assert t.transfer[0] == 0.0 and t.completes_synced[0]
    assert t.span[2] == pytest.approx(0.2)


def test_a_peer_later_than_the_wait_counts_from_its_arrival(tmp_path):
    t = _timing(tmp_path, peer_arrives=3.1, wait_from=3.0, wait_to=3.2)
    assert t.transfer[0] == pytest.approx(0.1)
    assert t.span[2] == pytest.approx(0.0)


def test_a_wait_on_a_finished_op_takes_nothing(tmp_path):
    t = _timing(tmp_path, peer_arrives=1.5, wait_from=3.0, wait_to=3.0)
    assert t.transfer[0] == 0.0 and t.span[2] == pytest.approx(0.0)


# ---------------------------------------------------------------- members timed in different runs

def _pooled(transfers: list[list[float]], runs: list[str], ops):
    """Two ranks, op k made by `ops[k](rank, k, transfer)` after a compute; rank r's transfers
    `transfers[r]`, timed in run `runs[r]`."""
    ranks = [[node for k, t in enumerate(ts) for node in (compute(1.0), ops[k](r, k, t))] for r, ts in enumerate(transfers)]
    trace, model = build(ranks, [(0, 1)])
    timings = _timings(trace, model, runs)
    match = match_ops(trace)
    return trace, match, model, pool_member_noise(trace, match, model, timings, np.arange(2))


def _timings(trace, model, runs: list[str]) -> dict[int, RankTiming]:
    """Each rank's part of `model` as what it measured in run `runs[r]`."""
    return {r: RankTiming(span=model.span[trace.rank_slice(r)], release=model.release[trace.rank_slice(r)],
                          completes_synced=model.completes_synced[trace.rank_slice(r)],
                          transfer=model.transfer[trace.rank_slice(r)], step_times=[], gaps=[], peaks=[],
                          run=runs[r]) for r in range(len(runs))}


def _allreduce(rank: int, seq: int, t: float) -> dict:
    return allreduce(0, seq, t)


def test_members_timed_in_different_runs_take_the_ops_mean():
    trace, match, model, pooled = _pooled([[0.10, 0.30, 0.20], [0.30, 0.10, 0.26]], ["slice_0", "slice_1"],
                                          [_allreduce] * 3)
    comm = trace.columns["kind"] == COMM
    assert pooled.transfer[comm] == pytest.approx([0.20, 0.20, 0.23, 0.20, 0.20, 0.23])
    assert pooled.span[comm] == pytest.approx(pooled.transfer[comm])        # a blocking op's span follows it
    assert np.array_equal(pooled.span[~comm], model.span[~comm])
    end, _, _ = solve(pooled, match, trace.offsets)
    gaps = end[trace.rank_slice(1)][comm[trace.rank_slice(1)]] - end[trace.rank_slice(0)][comm[trace.rank_slice(0)]]
    assert gaps == pytest.approx([0.0, 0.0, 0.0])          # members leave together


def test_members_timed_in_one_run_keep_their_own_times():
    _, _, model, pooled = _pooled([[0.10, 0.30], [0.30, 0.10]], ["record", "record"], [_allreduce] * 2)
    assert pooled is model


def test_point_to_point_and_unequal_sizes_keep_their_own_times():
    def p2p(rank, seq, t):
        return send(1, t, seq=seq) if rank == 0 else recv(0, t, seq=seq)
    _, _, model, pooled = _pooled([[0.10, 0.30], [0.30, 0.10]], ["slice_0", "slice_1"], [p2p] * 2)
    assert np.array_equal(pooled.transfer, model.transfer)
    trace, match, model, _ = _pooled([[0.10], [0.30]], ["slice_0", "slice_1"], [_allreduce])
    trace.columns["bytes"][trace.offsets[1] + 1] = 2048          # rank 1's part is larger: not one collective
    timings = _timings(trace, model, ["slice_0", "slice_1"])
    assert np.array_equal(pool_member_noise(trace, match, model, timings, np.arange(2)).transfer, model.transfer)


def test_an_all_to_all_of_unequal_parts_takes_the_ops_mean():
    # each member of an all-to-all returns once all its parts are in: they leave together
    def a2a(rank, seq, t):
        return comm("all_to_all_single", t, seq=seq)
    trace, match, model, _ = _pooled([[0.10, 0.30], [0.30, 0.10]], ["slice_0", "slice_1"], [a2a] * 2)
    trace.columns["bytes"][trace.offsets[1] + 1] = 2048          # rank 1 sends more in the first
    timings = _timings(trace, model, ["slice_0", "slice_1"])
    pooled = pool_member_noise(trace, match, model, timings, np.arange(2))
    comm_nodes = trace.columns["kind"] == COMM
    assert pooled.transfer[comm_nodes] == pytest.approx([0.20, 0.20, 0.20, 0.20])


# ---------------------------------------------------------------- DP replicas of one timed rank

def _replicas(copies: int, spans: list[float]):
    """`copies` DP replicas of rank 0, which computed `spans[k]` in step k then all-reduced over all."""
    ranks = [[node for k, t in enumerate(spans) for node in (dict(compute(t), step=k), dict(allreduce(0, k, 0.01), step=k))]
             for _ in range(copies)]
    return build(ranks, [tuple(range(copies))])


def test_replicas_compute_the_timed_ranks_steps_in_other_orders_and_wait_for_the_slowest():
    copies, spans = REPLICA_ORDERS + 1, [1.0, 0.1, 0.3, 0.2, 0.4]
    trace, model = _replicas(copies, spans)
    source = np.zeros(copies, dtype=np.int64)
    noisy, shares = replica_noise(trace, model, source, first_step=1, orders=replica_orders(copies))
    compute_of = lambda m, r: m.span[trace.rank_slice(r)][trace.rank(r)["kind"] == COMPUTE].tolist()
    assert compute_of(noisy, 0) == spans                                   # the timed rank itself: as measured
    assert compute_of(noisy, 1) == [1.0, 0.4, 0.1, 0.3, 0.2]               # steps from 1 rolled by one
    assert compute_of(noisy, 2) == [1.0, 0.2, 0.4, 0.1, 0.3]
    assert shares.tolist() == [0, 1, 2, 3, 0]                              # the fifth repeats the first order
    assert compute_of(noisy, REPLICA_ORDERS) == spans
    for r in range(copies):
        assert sum(compute_of(noisy, r)) == pytest.approx(sum(spans))
    match = match_ops(trace)
    end, _, _ = solve(noisy, match, trace.offsets)
    quotient, _, _ = solve(noisy, match, trace.offsets, source=shares)
    assert quotient == pytest.approx(end)                                 # the quotient solver stays exact
    step_end = end[trace.rank_slice(0)][1::2]
    # every step waits for the slowest replica: here each step has a replica computing 0.4
    assert np.diff(step_end) == pytest.approx([0.41, 0.41, 0.41, 0.41])
    same, _, _ = solve(model, match, trace.offsets)
    assert np.diff(same[trace.rank_slice(0)][1::2]) == pytest.approx([0.11, 0.31, 0.21, 0.41])   # copies never wait


def test_a_replica_measured_beside_its_timed_rank_keeps_its_own_compute():
    spans = [1.0, 0.1, 0.3, 0.2, 0.4]
    trace, model = _replicas(3, spans)
    compute = trace.rank(1)["kind"] == COMPUTE
    own = model.span[trace.rank_slice(1)].copy()
    own[compute] = [0.9, 0.15, 0.35, 0.25, 0.45]
    own[~compute] = 99.0                                   # only its compute is taken
    noisy, shares = replica_noise(trace, model, np.zeros(3, dtype=np.int64), first_step=1, orders=3,
                                  measured={1: own})
    compute_of = lambda r: noisy.span[trace.rank_slice(r)][trace.rank(r)["kind"] == COMPUTE].tolist()
    assert compute_of(0) == spans
    assert compute_of(1) == [0.9, 0.15, 0.35, 0.25, 0.45]
    assert compute_of(2) == [1.0, 0.2, 0.4, 0.1, 0.3]     # not measured: a reordering, as before
    assert np.array_equal(noisy.span[trace.rank_slice(1)][~compute], model.span[trace.rank_slice(1)][~compute])
    assert shares.tolist() == [0, 1, 2]
    # the same replica measured, two orders: replica 2 shares replica 0's order, so its timeline too
    noisy, shares = replica_noise(trace, model, np.zeros(3, dtype=np.int64), first_step=1, orders=2,
                                  measured={1: own})
    assert compute_of(1) == [0.9, 0.15, 0.35, 0.25, 0.45] and compute_of(2) == spans
    match = match_ops(trace)
    end, _, _ = solve(noisy, match, trace.offsets)
    quotient, _, _ = solve(noisy, match, trace.offsets, source=shares)
    assert quotient == pytest.approx(end)
    # each step waits for the slower of rank 0 and its measured replica
    assert np.diff(end[trace.rank_slice(0)][1::2]) == pytest.approx([0.16, 0.36, 0.26, 0.46])


def test_replica_orders_spread_over_the_measured_steps():
    """Two replicas over six measured steps: the second takes the step three before, not the one
    before (neighbouring steps are alike on a machine whose speed holds for seconds)."""
    spans = [1.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6]
    trace, model = _replicas(2, spans)
    noisy, shares = replica_noise(trace, model, np.zeros(2, dtype=np.int64), first_step=1, orders=replica_orders(2))
    compute_of = lambda r: noisy.span[trace.rank_slice(r)][trace.rank(r)["kind"] == COMPUTE].tolist()
    assert compute_of(0) == spans
    assert compute_of(1) == [1.0, 0.4, 0.5, 0.6, 0.1, 0.2, 0.3]
    assert shares.tolist() == [0, 1]


def test_ranks_timed_themselves_keep_their_spans():
    trace, model = _replicas(3, [0.1, 0.3, 0.2])
    noisy, shares = replica_noise(trace, model, np.arange(3), first_step=0)
    assert np.array_equal(noisy.span, model.span)
    assert shares.tolist() == [0, 1, 2]


def _expert_layout(dp: int, ep: int, spans: list[float]):
    """dp replicas of rank 0 (tp = pp = 1) whose steps all-reduce over their expert-parallel group
    (ep consecutive replicas), then over their expert-data-parallel group (every ep-th)."""
    ep_groups = [tuple(range(g, g + ep)) for g in range(0, dp, ep)]
    edp_groups = [tuple(range(i, dp, ep)) for i in range(ep)]
    ranks = []
    for d in range(dp):
        g_ep, g_edp = d // ep, len(ep_groups) + d % ep
        ranks.append([node for k, t in enumerate(spans)
                      for node in (dict(compute(t * (1 + 0.1 * (d % 2))), step=k),
                                   dict(allreduce(g_ep, k, 0.01), step=k), dict(allreduce(g_edp, k, 0.02), step=k))])
    return build(ranks, ep_groups + edp_groups)


@pytest.mark.parametrize("dp,ep,orders", [(6, 3, 3), (12, 3, 3), (8, 2, 4), (8, 4, 4), (32, 8, 4), (2, 1, 2), (5, 1, 4), (10, 5, 2), (7, 7, 4)])
def test_replica_orders_keep_the_quotient_exact_across_expert_groups(dp, ep, orders):
    assert replica_orders(dp, ep) == orders
    trace, model = _expert_layout(dp, ep, [1.0, 0.1, 0.5, 0.2, 0.4, 0.3])
    noisy, shares = replica_noise(trace, model, np.zeros(dp, dtype=np.int64), first_step=1, orders=orders)
    assert len(np.unique(shares)) == min(orders, dp)
    match = match_ops(trace)
    end, _, _ = solve(noisy, match, trace.offsets)
    quotient, _, _ = solve(noisy, match, trace.offsets, source=shares)
    assert quotient == pytest.approx(end, abs=1e-12)


def test_four_orders_would_break_the_quotient_where_expert_groups_are_three_wide():
    trace, model = _expert_layout(6, 3, [1.0, 0.1, 0.5, 0.2, 0.4, 0.3])
    noisy, shares = replica_noise(trace, model, np.zeros(6, dtype=np.int64), first_step=1, orders=4)
    match = match_ops(trace)
    end, _, _ = solve(noisy, match, trace.offsets)
    quotient, _, _ = solve(noisy, match, trace.offsets, source=shares)
    assert np.abs(quotient - end).max() > 1e-3       # why replica_orders(6, 3) is 3


def test_steps_running_other_nodes_are_not_reordered():
    trace, model = _replicas(2, [1.0, 0.1, 0.3, 0.2])
    trace.columns["label"][trace.offsets[1] + 4] = 1          # step 2 ran another kernel
    noisy, _ = replica_noise(trace, model, np.zeros(2, dtype=np.int64), first_step=1)
    compute_of = [noisy.span[trace.rank_slice(1)][trace.rank(1)["kind"] == COMPUTE].tolist()]
    assert compute_of == [[1.0, 0.2, 0.3, 0.1]]               # steps 1 and 3 swapped, step 2 kept


# ---------------------------------------------------------------- waits for the core (run delay)

def _slice_with_waits(tmp_path, arrivals: bool, own: tuple[float, float] | None = None,
                      helper: tuple[float, float] | None = None):
    """Two ranks: compute 1 s, an all-reduce 0.1 s, compute 0.9 s; within their compute the ranks'
    threads waited 0.25 s and 0.5 s for their core (`own`: their other threads ran this much
    meanwhile, `helper`: the assistant; a part written without the figures where None)."""
    from prism_core.trace import merge_parts
    from prism_core.trace.recorder import Recorder
    from tests.trace._build import blocking

    parts = tmp_path / "trace_parts"
    for r in (0, 1):
        rec = Recorder(r)
        blocking(rec, "allreduce", "world", (0, 1), 64)
        path = rec.write_part(parts)
        with np.load(path) as data:
            cols = {k: data[k] for k in data.files}
        assert cols["kind"].tolist() == [COMPUTE, COMM, COMPUTE]
        cols["t_start"], cols["t_end"] = np.array([0.0, 1.0, 1.1]), np.array([1.0, 1.1, 2.0])
        cols["queued_node"], cols["queued_s"] = np.array([0, 2]), np.array([0.25, 0.5])
        for key, value in (("queued_own_s", own), ("queued_helper_s", helper)):
            if value is None:
                del cols[key]
            else:
                cols[key] = np.array(value)
        np.savez(path, **cols)
        (tmp_path / "results").mkdir(exist_ok=True)
        (tmp_path / "results" / f"{r}.json").write_text(json.dumps({"step_times_s": [2.0]}))
    bare = merge_parts(parts, 2)
    if arrivals:
        (tmp_path / "replay").mkdir()
        np.save(tmp_path / "replay" / "arrivals.npy", np.array([0.0, 1.0, 1.1] * 2))
    return bare, match_ops(bare)


def test_a_run_noted_before_the_assistants_part_takes_every_wait_out_of_compute(tmp_path):
    from prism_core.calibrate.durations import slice_timings

    bare, match = _slice_with_waits(tmp_path, arrivals=True)       # neither figure in the part
    t = slice_timings(bare, match, tmp_path, [0])[0]
    assert t.span[[0, 2]] == pytest.approx([0.75, 0.4])
    assert t.transfer[1] == pytest.approx(0.1)                # communication keeps its times
    kept = slice_timings(bare, match, tmp_path, [0], waits_out="none")[0]
    assert kept.span[[0, 2]] == pytest.approx([1.0, 0.9])
    with pytest.raises(ValueError, match="waits_out"):
        slice_timings(bare, match, tmp_path, [0], waits_out="some")


def test_only_the_part_of_a_wait_the_assistant_ran_leaves_the_compute(tmp_path):
    from prism_core.calibrate.durations import slice_timings

    # the first wait: 0.1 s the rank's own threads', the assistant ran 0.05 s; the second: the
    # assistant ran longer than the rank waited (it had the core while the rank did not want it)
    bare, match = _slice_with_waits(tmp_path, arrivals=True, own=(0.1, 0.0), helper=(0.05, 0.8))
    t = slice_timings(bare, match, tmp_path, [0])[0]
    assert t.span[[0, 2]] == pytest.approx([0.95, 0.4])
    assert t.queued.tolist() == pytest.approx([0.2, 0.0, 0.0])      # the rest of each wait, still in the span
    foreign = slice_timings(bare, match, tmp_path, [0], waits_out="foreign")[0]
    assert foreign.span[[0, 2]] == pytest.approx([0.85, 0.4])
    assert foreign.queued.tolist() == pytest.approx([0.1, 0.0, 0.0])
    every = slice_timings(bare, match, tmp_path, [0], waits_out="all")[0]
    assert every.span[[0, 2]] == pytest.approx([0.75, 0.4])
    assert every.queued.tolist() == [0.0, 0.0, 0.0]
    whole = slice_timings(bare, match, tmp_path, [0], waits_out="none")[0]
    assert whole.queued.tolist() == pytest.approx([0.25, 0.0, 0.5])
    with pytest.raises(ValueError, match="waits_out"):
        slice_timings(bare, match, tmp_path, [0], waits_out="some")


def test_a_run_whose_assistant_shared_no_core_with_the_rank_keeps_its_compute_whole(tmp_path):
    from prism_core.calibrate.durations import slice_timings

    bare, match = _slice_with_waits(tmp_path, arrivals=True, own=(0.0, 0.0), helper=(0.0, 0.0))
    assert slice_timings(bare, match, tmp_path, [0])[0].span[[0, 2]] == pytest.approx([1.0, 0.9])


def test_a_real_run_of_every_rank_keeps_its_compute_whole(tmp_path):
    from prism_core.calibrate.durations import slice_timings

    bare, match = _slice_with_waits(tmp_path, arrivals=False)   # no assistant: `prism record`
    timings = slice_timings(bare, match, tmp_path, [0, 1])
    for r in (0, 1):
        assert timings[r].span[[0, 2]] == pytest.approx([1.0, 0.9])
        assert timings[r].queued.tolist() == pytest.approx([0.25, 0.0, 0.5])    # every wait still in it


def _run(span: list[float], gap: list[float]) -> RankTiming:
    n = len(span)
    return RankTiming(span=np.array(span), release=np.zeros(n, dtype=np.int8), completes_synced=np.zeros(n, dtype=bool),
                      transfer=np.zeros(n), step_times=[1.0], gaps=[0.0], peaks=[None], resume_gap=np.array(gap))


def test_alone_factor_counts_only_nodes_waited_for_alike_in_both_runs():
    plain = _run([1.0, 1.0, 2.0, 5.0], [0.0, 10e-6, 0.0, 0.0])
    # node 3 waited 1 ms longer in the loaded run (what a wait costs is calibrate/resume.py's), and
    # node 2 is not among the nodes asked for; nodes 0 and 1 (waited for alike) took 1.25 s each
    loaded = _run([1.25, 1.25, 4.0, 9.0], [0.0, 10e-6 + SAME_WAIT_S / 2, 0.0, 1e-3])
    nodes = np.array([True, True, False, True])
    assert alone_factor(plain, loaded, nodes) == pytest.approx(2.0 / (1.25 + 1.25))
    assert alone_factor(plain, loaded, np.array([False, False, False, True])) is None   # none waited alike
    assert alone_factor(replace(plain, resume_gap=None), loaded, nodes) is None         # waits unknown


def test_loaded_compute_keeps_how_much_of_it_the_rank_took_alone(tmp_path):
    trace, _ = build([[dict(compute(1.0), step=0), dict(compute(1.0), step=1), dict(compute(2.0), step=1)]], [])
    plain = {0: _run([5.0, 1.0, 2.0], [0.0, 0.0, 0.0])}
    loaded = {0: _run([1.0, 1.5, 2.5], [0.0, 0.0, 0.0])}
    out = with_loaded_compute(trace, plain, loaded, warmup=1)[0]
    assert out.span.tolist() == [1.0, 1.5, 2.5]
    assert out.alone_factor == pytest.approx(3.0 / 4.0)      # the warm-up step left out


def test_loaded_compute_keeps_when_it_was_measured():
    trace, _ = build([[dict(compute(1.0), step=0), dict(allreduce(0, 0, 0.1), step=0), dict(compute(2.0), step=0)]],
                     [(0,)])
    plain = {0: replace(_run([1.0, 0.1, 2.0], [0.0] * 3), began=np.array([0.0, 1.0, 1.1]), ended=np.array([1.0, 1.1, 3.1]))}
    loaded = {0: replace(_run([1.5, 0.1, 2.5], [0.0] * 3), began=np.array([50.0, 51.5, 51.6]),
                         ended=np.array([51.5, 51.6, 54.1]))}
    plain[0].queued, loaded[0].queued = np.array([0.1, 0.0, 0.2]), np.array([0.3, 0.0, 0.4])
    out = with_loaded_compute(trace, plain, loaded)[0]
    assert out.began.tolist() == [50.0, 1.0, 51.6] and out.ended.tolist() == [51.5, 1.1, 54.1]
    assert out.queued.tolist() == [0.3, 0.0, 0.4]          # the waits the loaded spans hold come with them
    unknown = with_loaded_compute(trace, plain, {0: replace(loaded[0], began=None, ended=None)})[0]
    assert np.isnan(unknown.began[[0, 2]]).all() and unknown.began[1] == 1.0
