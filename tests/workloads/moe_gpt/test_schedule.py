"""Pipeline orders: Megatron's warm-up counts, completeness, and deadlock freedom across ranks."""

from __future__ import annotations

import itertools

import pytest

from prism_core.workloads.moe_gpt.schedule import Step, pipeline_order

LAYOUTS = [(pp, vpp, m) for pp in (1, 2, 3, 4) for vpp in (1, 2, 3) for m in range(1, 13)
           if not (vpp > 1 and (pp == 1 or m % pp)) and not (vpp == 1 and 1 < pp and m < pp)]


@pytest.mark.parametrize("pp,vpp,m", LAYOUTS)
def test_every_microbatch_runs_forward_then_backward_once_per_chunk(pp, vpp, m):
    for rank in range(pp):
        order = pipeline_order(pp, vpp, m, rank)
        assert len(order) == 2 * m * vpp
        seen = {}
        for i, s in enumerate(order):
            assert (s.kind, s.chunk, s.mb) not in seen
            seen[(s.kind, s.chunk, s.mb)] = i
        for c, mb in itertools.product(range(vpp), range(m)):
            assert seen[("F", c, mb)] < seen[("B", c, mb)]


def _warmup(order):
    return next(i for i, s in enumerate(order) if s.kind == "B")


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 4), (4, 8), (3, 5)])
def test_1f1b_warmup_matches_megatron(pp, m):
    for rank in range(pp):
        order = pipeline_order(pp, 1, m, rank)
        assert _warmup(order) == min(pp - rank - 1, m) + 1  # warm-up forwards, then the first steady forward
        steady = order[_warmup(order) - 1:2 * m - min(pp - rank - 1, m)]
        assert [s.kind for s in steady] == ["F", "B"] * (len(steady) // 2)


@pytest.mark.parametrize("pp,vpp,m", [(2, 2, 4), (4, 2, 8), (2, 3, 6), (2, 2, 2)])
def test_interleaved_warmup_and_chunk_order_match_megatron(pp, vpp, m):
    for rank in range(pp):
        order = pipeline_order(pp, vpp, m, rank)
        expected = m * vpp if m == pp else min((pp - rank - 1) * 2 + (vpp - 1) * pp, m * vpp)
        assert all(s.kind == "F" for s in order[:expected])
        # forwards visit chunks in groups of pp microbatches: chunk 0 for mb 0..pp-1, then chunk 1, ...
        forwards = [s for s in order if s.kind == "F"]
        assert forwards[:pp] == [Step("F", 0, i) for i in range(pp)]
        backwards = [s for s in order if s.kind == "B"]
        assert backwards[0] == Step("B", vpp - 1, 0)


def _simulate(orders, pp, vpp):
    """Run all ranks' orders against each other: a step can run once its input was produced.

    Sends never block (the executor's sends are asynchronous), so the schedule deadlocks
    exactly when no rank's next step has its input available.
    """
    n_chunks = pp * vpp
    done, pos = set(), [0] * pp

    def global_chunk(rank, chunk):
        return chunk * pp + rank

    def ready(rank, s):
        g = global_chunk(rank, s.chunk)
        if s.kind == "F":
            return g == 0 or ("F", g - 1, s.mb) in done
        return g == n_chunks - 1 or ("B", g + 1, s.mb) in done

    while any(pos[r] < len(orders[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            if pos[r] < len(orders[r]) and ready(r, orders[r][pos[r]]):
                s = orders[r][pos[r]]
                done.add((s.kind, global_chunk(r, s.chunk), s.mb))
                pos[r] += 1
                progressed = True
        if not progressed:
            return False
    return True


@pytest.mark.parametrize("pp,vpp,m", LAYOUTS)
def test_schedules_are_deadlock_free(pp, vpp, m):
    assert _simulate([pipeline_order(pp, vpp, m, r) for r in range(pp)], pp, vpp)


def test_simulation_detects_a_deadlocking_order():
    orders = [pipeline_order(2, 1, 4, r) for r in range(2)]
    # the first stage waiting for gradients before sending any activation can never proceed
    bad_first = [s for s in orders[0] if s.kind == "B"] + [s for s in orders[0] if s.kind == "F"]
    assert not _simulate([bad_first, orders[1]], 2, 1)


def _text(order):
    return " ".join(f"{s.kind}{s.chunk}.{s.mb}" for s in order)


def test_interleaved_order_pinned_to_megatron_for_pp2_vpp2_m4():
    # Megatron's forward_backward_pipelining_with_interleaving, written out by hand
    assert _text(pipeline_order(2, 2, 4, 0)) == (
        "F0.0 F0.1 F1.0 F1.1 F0.2 B1.0 F0.3 B1.1 F1.2 B0.0 F1.3 B0.1 B1.2 B1.3 B0.2 B0.3")
    assert _text(pipeline_order(2, 2, 4, 1)) == (
        "F0.0 F0.1 F1.0 B1.0 F1.1 B1.1 F0.2 B0.0 F0.3 B0.1 F1.2 B1.2 F1.3 B1.3 B0.2 B0.3")


@pytest.mark.parametrize("pp,vpp,m", [(2, 2, 4), (4, 2, 8), (2, 3, 6), (4, 3, 8)])
def test_interleaved_steady_state_starts_right_after_warmup(pp, vpp, m):
    for rank in range(pp):
        order = pipeline_order(pp, vpp, m, rank)
        warmup = min((pp - rank - 1) * 2 + (vpp - 1) * pp, m * vpp)
        if warmup < m * vpp:
            assert [s.kind for s in order[warmup:warmup + 2]] == ["F", "B"]


def test_1f1b_order_pinned_for_pp4_m6():
    assert _text(pipeline_order(4, 1, 6, 0)) == "F0.0 F0.1 F0.2 F0.3 B0.0 F0.4 B0.1 F0.5 B0.2 B0.3 B0.4 B0.5"
    assert _text(pipeline_order(4, 1, 6, 3)) == "F0.0 B0.0 F0.1 B0.1 F0.2 B0.2 F0.3 B0.3 F0.4 B0.4 F0.5 B0.5"
