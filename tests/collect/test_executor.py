"""The CPU collective executor against the definitions of each collective."""

from __future__ import annotations

import pytest
import torch

from prism_core.collect.executor import ExecutorError, run


def _ins(n, shape=(4,), dtype=torch.float32):
    return [[torch.arange(4, dtype=dtype).reshape(shape) + 10 * r] for r in range(n)]


@pytest.mark.parametrize("op,expect", [("sum", lambda xs: sum(xs)), ("max", lambda xs: torch.stack(xs).max(0).values),
                                       ("min", lambda xs: torch.stack(xs).min(0).values),
                                       ("avg", lambda xs: sum(xs) / len(xs))])
def test_allreduce(op, expect):
    ins = _ins(3)
    out = run("allreduce", [{"reduce": op}] * 3, ins)
    for o in out:
        torch.testing.assert_close(o[0], expect([i[0] for i in ins]))


def test_broadcast_scatter_gather_reduce():
    ins = _ins(3)
    assert all(torch.equal(o[0], ins[1][0]) for o in run("broadcast", [{"root": 1}] * 3, [[], ins[1], []]))
    pieces = [torch.full((2,), float(g)) for g in range(3)]
    out = run("scatter", [{"root": 0}] * 3, [pieces, [], []])
    assert [o[0].tolist() for o in out] == [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]]
    out = run("gather", [{"root": 2}] * 3, ins)
    assert out[0] == [] and out[1] == [] and [t[0].item() for t in out[2]] == [0, 10, 20]
    out = run("reduce", [{"root": 0, "reduce": "sum"}] * 3, ins)
    assert out[0][0].tolist() == [30, 33, 36, 39] and out[1] == []


def test_allgather_and_reduce_scatter_single():
    ins = _ins(2)
    out = run("all_gather_single", [{}] * 2, ins)
    assert out[0][0].tolist() == [0, 1, 2, 3, 10, 11, 12, 13]
    out = run("reduce_scatter_single", [{"reduce": "sum"}] * 2, ins)
    assert out[0][0].tolist() == [10, 12] and out[1][0].tolist() == [14, 16]
    out = run("allgather", [{}] * 2, ins)
    assert [t[0].item() for t in out[1]] == [0, 10]


def test_uneven_all_to_all_single():
    ins = [[torch.tensor([0.0, 1.0, 2.0])], [torch.tensor([10.0, 11.0, 12.0])]]
    metas = [{"in_splits": [1, 2]}, {"in_splits": [2, 1]}]
    out = run("all_to_all_single", metas, ins)
    assert out[0][0].tolist() == [0.0, 10.0, 11.0] and out[1][0].tolist() == [1.0, 2.0, 12.0]
    with pytest.raises(ExecutorError, match="splits"):
        run("all_to_all_single", [{"in_splits": [1, 1]}, {"in_splits": [2, 1]}], ins)


def test_mismatched_shapes_are_reported():
    with pytest.raises(ExecutorError, match="different shapes"):
        run("allreduce", [{"reduce": "sum"}] * 2, [[torch.ones(2)], [torch.ones(3)]])
