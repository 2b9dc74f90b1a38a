"""Pruned ring and tree collectives (paper §6.3, Appendix D): every sandbox rank ends with exactly the
full-scale result and sends and receives the same bytes at every step as in the unpruned algorithm.

Inputs are integer-valued floats where the result is compared with a plain reduction (sums exact
in any order); the pruned ring is compared with the full ring on any floats, bit for bit.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prism_core.backend.pruned import (
    REDUCE_OPS, chunk_bounds, ring_algorithm, ring_allgather, ring_allreduce, ring_allreduce_pruned, ring_members,
    ring_reduce_scatter, traffic_of, tree_broadcast, tree_members, tree_reduce,
)


@st.composite
def cases(draw, max_k: int = 64, integers: bool = True):
    """A collective's shape: group size, sandbox positions, element count, input seed, op. The
    tensors are made in the test (`_case`): torch may touch Python's `random` on a first call, which
    Hypothesis forbids inside a strategy."""
    k = draw(st.integers(2, max_k))
    sandbox = set(draw(st.lists(st.integers(0, k - 1), min_size=1, max_size=min(k, 6), unique=True)))
    numel = draw(st.integers(1, 3 * k + 5))
    seed = draw(st.integers(0, 2**31 - 1))
    op = draw(st.sampled_from(REDUCE_OPS))
    return k, sandbox, numel, seed, op, integers


def _case(case):
    """(k, sandbox, one input per rank, op) of a drawn case: integer-valued floats, or any floats."""
    k, sandbox, numel, seed, op, integers = case
    g = torch.Generator().manual_seed(seed)
    if integers:
        inputs = [torch.randint(-1000, 1000, (numel,), generator=g).to(torch.float32) for _ in range(k)]
    else:
        inputs = [torch.randn(numel, generator=g) * 10 ** torch.randint(-3, 4, (numel,), generator=g)
                  for _ in range(k)]
    return k, sandbox, inputs, op


def _full_result(inputs, op):
    out = inputs[0].clone()
    for t in inputs[1:]:
        out = out + t if op == "sum" else (torch.maximum(out, t) if op == "max" else torch.minimum(out, t))
    return out


@settings(max_examples=150, deadline=None)
@given(cases())
def test_full_ring_allreduce_is_the_reduction(case):
    k, _, inputs, op = _case(case)
    outputs, traffic = ring_allreduce(inputs, op)
    expected = _full_result(inputs, op)
    assert all(torch.equal(o, expected) for o in outputs)
    assert len(traffic) == 2 * (k - 1) * k        # every rank sends once per step of both phases


def _matches_the_full_ring(k, sandbox, outputs, traffic, full, full_traffic, what=""):
    """Each sandbox rank: the full ring's output to the bit and its bytes per step; only sandbox
    ranks and their ring neighbours on the wire, every message touching a sandbox rank."""
    assert set(outputs) == sandbox
    for i in sandbox:
        assert torch.equal(outputs[i], full[i]), f"rank {i} of {k}, sandbox {sorted(sandbox)} {what}"
        assert traffic_of(traffic, i) == traffic_of(full_traffic, i)
    members = ring_members(k, sandbox)
    assert all(src in members and dst in members and (src in sandbox or dst in sandbox)
               for (_, _, src, dst) in traffic)


@settings(max_examples=300, deadline=None)
@given(st.one_of(cases(), cases(integers=False)))
def test_pruned_ring_gives_each_sandbox_rank_the_full_result_with_the_same_traffic(case):
    k, sandbox, inputs, op = _case(case)
    full_out, full_traffic = ring_allreduce(inputs, op)
    outputs, traffic = ring_allreduce_pruned(k, sandbox, inputs, op)
    _matches_the_full_ring(k, sandbox, outputs, traffic, full_out, full_traffic, op)


def test_pruned_ring_keeps_only_neighbours():
    assert ring_members(64, {10, 11, 40}) == {9, 10, 11, 12, 39, 40, 41}
    assert chunk_bounds(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]


def test_a_pruned_ranks_value_reaches_the_sandbox_rank():
    # the virtual neighbour really carries the pruned ranks' values: change one far from the
    # sandbox rank and its output changes with it
    k, inputs = 8, [torch.full((8,), float(i)) for i in range(8)]
    expected = _full_result(inputs, "sum")
    outputs, _ = ring_allreduce_pruned(k, {3}, inputs, "sum")
    assert torch.equal(outputs[3], expected)
    inputs[6] = inputs[6] + 1
    outputs, _ = ring_allreduce_pruned(k, {3}, inputs, "sum")
    assert torch.equal(outputs[3], expected + 1)


def test_folding_in_ring_order_is_what_makes_floats_exact():
    # a plain reduction adds in another order than the ring: on these floats the two differ, and
    # the pruned ring matches the full ring, not the plain reduction
    k = 4
    inputs = [torch.tensor([1e8, 1.0, -1e8, 3e-8] * 2) * (i + 1) / 3 for i in range(k)]
    full_out, _ = ring_allreduce(inputs, "sum")
    outputs, _ = ring_allreduce_pruned(k, {2}, inputs, "sum")
    assert torch.equal(outputs[2], full_out[2])
    assert not torch.equal(full_out[2], _full_result(inputs, "sum"))


@settings(max_examples=200, deadline=None)
@given(cases(), st.integers(0, 63))
def test_pruned_tree_broadcast_and_reduce(case, root_seed):
    k, sandbox, inputs, op = _case(case)
    root = root_seed % k
    full_b, full_bt = tree_broadcast(inputs, root)
    out_b, bt = tree_broadcast(inputs, root, sandbox)
    assert set(out_b) == sandbox
    for i in sandbox:
        assert torch.equal(out_b[i], inputs[root])
        assert traffic_of(bt, i) == traffic_of(full_bt, i)
    full_r, full_rt = tree_reduce(inputs, root, op)
    assert torch.equal(full_r, _full_result(inputs, op))
    out_r, rt = tree_reduce(inputs, root, op, sandbox)
    if root in sandbox:
        assert torch.equal(out_r, full_r)
    for i in sandbox:
        assert traffic_of(rt, i) == traffic_of(full_rt, i)
    members = tree_members(k, root, sandbox)
    assert all(src in members and dst in members for (_, _, src, dst) in rt)


@settings(max_examples=200, deadline=None)
@given(st.one_of(cases(), cases(integers=False)))
def test_pruned_all_gather_gives_each_sandbox_rank_every_block_with_the_same_traffic(case):
    k, sandbox, inputs, _ = _case(case)
    full, full_traffic = ring_allgather(inputs)
    expected = torch.cat([t.reshape(-1) for t in inputs])
    assert all(torch.equal(full[i], expected) for i in range(k))
    assert len(full_traffic) == (k - 1) * k
    outputs, traffic = ring_allgather(inputs, sandbox)
    _matches_the_full_ring(k, sandbox, outputs, traffic, full, full_traffic)


@settings(max_examples=300, deadline=None)
@given(st.one_of(cases(), cases(integers=False)), st.integers(1, 4))
def test_pruned_reduce_scatter_gives_each_sandbox_rank_the_full_rings_block_with_the_same_traffic(case, n):
    k, sandbox, base, op = _case(case)
    integers = bool(torch.equal(base[0], base[0].round()))
    g = torch.Generator().manual_seed(k * 31 + n)
    inputs = [torch.randint(-1000, 1000, (k * n,), generator=g).float() if integers
              else torch.randn(k * n, generator=g) * 1e3 for _ in range(k)]
    full, full_traffic = ring_reduce_scatter(inputs, op)
    if integers:                    # sums exact in any order: compare with the plain reduction
        reduced = _full_result(inputs, op)
        assert all(torch.equal(full[i], reduced[i * n:(i + 1) * n]) for i in range(k))
    outputs, traffic = ring_reduce_scatter(inputs, op, sandbox)
    _matches_the_full_ring(k, sandbox, outputs, traffic, full, full_traffic, op)


def test_which_ops_run_as_a_ring_is_decided_from_what_the_graph_records():
    assert ring_algorithm("allreduce", "sum", 4, 4, "float32") == "allreduce"
    assert ring_algorithm("allreduce", "min", 9, 3, "bfloat16") == "allreduce"
    assert ring_algorithm("allreduce", "sum", 3, 4, "float32") is None         # a chunk would be empty
    assert ring_algorithm("allreduce", "product", 100, 4, "float32") is None
    assert ring_algorithm("allreduce", "sum", 100, 1, "float32") is None
    assert ring_algorithm("allreduce", "sum", 100, 4, "bool") is None
    assert ring_algorithm("all_gather_single", "", 1, 8, "float32") == "all_gather"
    assert ring_algorithm("allgather", "", 0, 8, "float32") is None
    assert ring_algorithm("reduce_scatter_single", "sum", 12, 4, "float32") == "reduce_scatter"
    assert ring_algorithm("reduce_scatter", "max", 10, 4, "float32") is None  # does not split evenly
    assert ring_algorithm("broadcast", "", 100, 4, "float32") is None
