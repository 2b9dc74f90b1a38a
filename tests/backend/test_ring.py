"""The backend's rings, run for real over gloo point-to-point links: every rank ends with `pruned`'s
ring all-reduce, all-gather and reduce-scatter results to the bit, asynchronous rings keep their
order, and what the rings do not serve goes to gloo's algorithm."""

from __future__ import annotations

import pytest
import torch

from prism_core.backend.ring import scratch
from prism_core.config import load_config
from prism_core.record import record

from tests.jobs import assert_nothing_left, make_job, rank_result

RINGS = """
    import json
    from prism_core.backend.pruned import ring_allgather, ring_allreduce, ring_reduce_scatter
    dist.init_process_group("gloo")
    r, w = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(100 + r)
    results = {}
    def check(name, x, op, reference_op):
        ins = [torch.empty_like(x) for _ in range(w)]
        dist.all_gather(ins, x)
        expected = ring_allreduce(ins, reference_op)[0][r]
        dist.all_reduce(x, op=op)
        results[name] = bool(torch.equal(x, expected))
    for op, ref in ((dist.ReduceOp.SUM, "sum"), (dist.ReduceOp.MAX, "max"), (dist.ReduceOp.MIN, "min")):
        check(ref, torch.randn(1003, generator=g) * 1e4, op, ref)
    check("bf16", torch.randn(37, generator=g).to(torch.bfloat16), dist.ReduceOp.SUM, "sum")
    check("int", torch.randint(-99, 99, (10,), generator=g), dist.ReduceOp.SUM, "sum")
    # all-gather and reduce-scatter, tensor and list forms
    x = torch.randn(7, generator=g) * 1e3
    ins = [torch.empty_like(x) for _ in range(w)]
    dist.all_gather(ins, x)
    out = torch.empty(7 * w)
    dist.all_gather_into_tensor(out, x)
    results["all_gather"] = bool(torch.equal(out, ring_allgather(ins)[0][r])
                                 and torch.equal(torch.cat(ins), out))
    y = torch.randn(5 * w, generator=g) * 1e3
    ys = [torch.empty_like(y) for _ in range(w)]
    dist.all_gather(ys, y)
    expected = ring_reduce_scatter(ys, "sum")[0][r]
    mine, listed = torch.empty(5), torch.empty(5)
    dist.reduce_scatter_tensor(mine, y)
    dist.reduce_scatter(listed, list(y.chunk(w)))
    maxed = torch.empty(5)
    dist.reduce_scatter_tensor(maxed, y, op=dist.ReduceOp.MAX)
    results["reduce_scatter"] = bool(torch.equal(mine, expected) and torch.equal(listed, expected)
                                     and torch.equal(maxed, ring_reduce_scatter(ys, "max")[0][r]))
    # asynchronous rings, waited in reverse, through their futures as DDP's hooks do
    xs = [torch.full((50 + i,), float(r + i)) for i in range(4)]
    futs = [dist.all_reduce(x, async_op=True).get_future().then(lambda f: f.value()[0] * 1) for x in xs]
    results["async"] = all(torch.equal(f.wait(), torch.full((50 + i,), float(sum(range(w)) + w * i)))
                           for i, f in reversed(list(enumerate(futs))))
    # not the ring: fewer elements than ranks, a product, a non-contiguous tensor (ring on a copy)
    small = torch.full((2,), float(r + 1)); dist.all_reduce(small)
    prod = torch.full((8,), 2.0); dist.all_reduce(prod, op=dist.ReduceOp.PRODUCT)
    strided = torch.arange(24.0).reshape(4, 6).t() * (r + 1); dist.all_reduce(strided)
    results["fallbacks"] = (torch.equal(small, torch.full((2,), float(w * (w + 1) // 2)))
                            and torch.equal(prod, torch.full((8,), 2.0 ** w))
                            and torch.equal(strided, torch.arange(24.0).reshape(4, 6).t() * (w * (w + 1) // 2)))
    print("RESULT " + json.dumps(results), flush=True)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):          # steps for the record's metrics
        model(torch.ones(2)).sum().backward()
        opt.step()
    dist.destroy_process_group()
"""


def test_scratch_buffers_are_not_torch_allocations():
    buf = scratch(10, torch.bfloat16)
    assert buf.dtype == torch.bfloat16 and buf.numel() == 10
    assert buf.untyped_storage().nbytes() == 20


@pytest.mark.timeout(180)
def test_every_rank_ends_with_the_rings_result_to_the_bit(tmp_path):
    config, script = make_job(tmp_path, RINGS, world_size=4)
    record(load_config(config), tmp_path / "out", echo=False)
    for rank in range(4):
        results = rank_result(tmp_path / "out", rank)
        assert results == {"sum": True, "max": True, "min": True, "bf16": True, "int": True, "async": True,
                           "all_gather": True, "reduce_scatter": True, "fallbacks": True}, f"rank {rank}"
    assert_nothing_left(tmp_path, script)
