"""The backend's trees, run for real over gloo point-to-point links: broadcast from any root,
reduce to any root, and an all-reduce too small for the ring, each ending with `pruned`'s tree
results to the bit on every rank."""

from __future__ import annotations

import pytest

from prism_core.backend.pruned import tree_algorithm
from prism_core.config import load_config
from prism_core.record import record

from tests.jobs import assert_nothing_left, make_job, rank_result

TREES = """
    import json
    from prism_core.backend.pruned import tree_broadcast, tree_reduce
    dist.init_process_group("gloo")
    r, w = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(300 + r)
    results = {}
    def everyone(x):
        ins = [torch.empty_like(x) for _ in range(w)]
        dist.all_gather(ins, x.contiguous())
        return ins
    for root in range(w):
        x = torch.randn(13, generator=g) * 1e4
        expected = everyone(x)[root].clone()
        dist.broadcast(x, src=root)
        results[f"broadcast{root}"] = bool(torch.equal(x, expected))
    b = torch.randint(0, 2, (6,), generator=g).bool()
    expected = everyone(b)[3].clone()
    dist.broadcast(b, src=3)
    results["broadcast_bool"] = bool(torch.equal(b, expected))
    for root, (op, name) in enumerate(((dist.ReduceOp.SUM, "sum"), (dist.ReduceOp.MAX, "max"),
                                       (dist.ReduceOp.MIN, "min"), (dist.ReduceOp.SUM, "sum"))):
        x = torch.randn(11, generator=g) * 1e4
        ins = everyone(x)
        mine = x.clone()
        dist.reduce(x, dst=root, op=op)
        expected = tree_reduce(ins, root, name)[0] if r == root else mine
        results[f"reduce{root}"] = bool(torch.equal(x, expected))
    for op, name in ((dist.ReduceOp.SUM, "sum"), (dist.ReduceOp.MAX, "max")):
        x = torch.randn(w - 1, generator=g) * 1e4          # fewer elements than ranks: not the ring
        ins = everyone(x)
        dist.all_reduce(x, op=op)
        results[f"small_{name}"] = bool(torch.equal(x, tree_reduce(ins, 0, name)[0]))
    strided = (torch.arange(12.0).reshape(3, 4) * (r + 1)).t()
    dist.broadcast(strided, src=1)
    results["strided"] = bool(torch.equal(strided, (torch.arange(12.0).reshape(3, 4) * 2).t()))
    print("RESULT " + json.dumps(results), flush=True)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):          # steps for the record's metrics
        model(torch.ones(2)).sum().backward()
        opt.step()
    dist.destroy_process_group()
"""


def test_which_ops_run_as_trees():
    assert tree_algorithm("broadcast", "", 1, 2, "bool") == "tree_broadcast"
    assert tree_algorithm("broadcast", "", 0, 4, "float32") is None
    assert tree_algorithm("broadcast", "", 10, 1, "float32") is None
    assert tree_algorithm("reduce", "max", 100, 4, "float32") == "tree_reduce"
    assert tree_algorithm("reduce", "product", 100, 4, "float32") is None
    assert tree_algorithm("allreduce", "sum", 3, 4, "float32") == "tree_allreduce"
    assert tree_algorithm("allreduce", "sum", 4, 4, "float32") is None      # the ring's
    assert tree_algorithm("allreduce", "sum", 1, 2, "bool") is None
    assert tree_algorithm("all_gather_single", "", 1, 4, "float32") is None


@pytest.mark.timeout(180)
def test_every_rank_ends_with_the_trees_result_to_the_bit(tmp_path):
    config, script = make_job(tmp_path, TREES, world_size=5)
    record(load_config(config), tmp_path / "out", echo=False)
    expected = {**{f"broadcast{root}": True for root in range(5)}, "broadcast_bool": True,
                **{f"reduce{root}": True for root in range(4)}, "small_sum": True, "small_max": True, "strided": True}
    for rank in range(5):
        results = rank_result(tmp_path / "out", rank)
        assert results == expected, f"rank {rank}"
    assert_nothing_left(tmp_path, script)
