"""The prism backend under unmodified scripts: every op served and traced, clear errors, mismatches caught."""

from __future__ import annotations

import time

import pytest

from prism_core.config import load_config
from prism_core.launch import LaunchError
from prism_core.record import record
from prism_core.trace import load_trace, problems
from prism_core.trace.schema import OPS

from tests.jobs import assert_nothing_left, make_job

ALL_OPS = """
    import torch.distributed._functional_collectives as funcol
    dist.init_process_group({backend})
    r, w = dist.get_rank(), dist.get_world_size()
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sub = dist.new_group([0, 1])
    for step in range(2):
        x = torch.ones(4) * (r + 1)
        dist.all_reduce(x)
        dist.all_reduce(x, group=sub)
        dist.broadcast(x, src=1)
        dist.all_gather([torch.empty(4) for _ in range(w)], x)
        dist.all_gather_into_tensor(torch.empty(4 * w), x)
        dist.reduce_scatter(torch.empty(4), [torch.ones(4) for _ in range(w)])
        dist.reduce_scatter_tensor(torch.empty(2), x)
        splits = [1, 2] if r == 0 else [2, 1]
        dist.all_to_all_single(torch.empty(3), torch.ones(3), splits, splits)
        dist.all_to_all([torch.empty(2) for _ in range(w)], [torch.ones(2) for _ in range(w)])
        dist.scatter(torch.empty(4), [torch.ones(4)] * w if r == 0 else None, src=0)
        dist.gather(x, [torch.empty(4) for _ in range(w)] if r == 0 else None, dst=0)
        dist.reduce(x, dst=0)
        if r == 0:
            dist.send(x, 1)
        else:
            dist.recv(x, 0)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, 1 - r), dist.P2POp(dist.irecv, torch.empty(4), 1 - r)])
        handle = dist.all_reduce(torch.ones(8), async_op=True)
        y = funcol.all_gather_tensor(x, 0, dist.group.WORLD) + 1
        for wk in works:
            wk.wait()
        handle.wait()
        dist.barrier()
        loss = model(x).sum()
        loss.backward()
        opt.step()
    dist.destroy_process_group()
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", ['"gloo"', '"nccl"', ""])
def test_every_op_of_an_unmodified_script_is_served_and_traced(tmp_path, backend):
    config, script = make_job(tmp_path, ALL_OPS.format(backend=backend))
    record(load_config(config), tmp_path / "out", echo=False)
    trace = load_trace(tmp_path / "out" / "trace.zarr")
    assert problems(trace) == []
    seen = {OPS[int(op)] for op in trace.columns["op"][trace.columns["kind"] == 1]}
    assert seen >= {"allreduce", "broadcast", "allgather", "all_gather_single", "reduce_scatter",
                    "reduce_scatter_single", "all_to_all_single", "alltoall", "scatter", "gather", "reduce",
                    "send", "recv", "barrier"}
    assert trace.columns["async_"].sum() > 0, "the async all_reduce should have its own wait node"
    assert_nothing_left(tmp_path, script)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("call,named", [
    ("dist.all_reduce(torch.ones(2), op=dist._make_nccl_premul_sum(2.0))", "PREMUL_SUM"),
    ("dist.recv(torch.ones(2)) if dist.get_rank() == 0 else dist.send(torch.ones(2), 0)", "recv from any source"),
])
def test_unsupported_op_fails_naming_it(tmp_path, call, named):
    config, script = make_job(tmp_path, f"""
        dist.init_process_group("gloo")
        {call}
    """)
    with pytest.raises(LaunchError, match=named):
        record(load_config(config), tmp_path / "out", echo=False)
    assert_nothing_left(tmp_path, script)


@pytest.mark.timeout(120)
def test_mismatched_collectives_fail_early_naming_ranks_and_ops(tmp_path):
    config, script = make_job(tmp_path, """
        dist.init_process_group("gloo")
        x = torch.ones(1000)
        dist.all_reduce(x)
        if dist.get_rank() == 0:
            dist.all_reduce(x)
        else:
            dist.broadcast(x, 0)
        dist.barrier()
    """, timeout_s=90)
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        record(load_config(config), tmp_path / "out", echo=False)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert "mismatched collectives" in message
    assert "rank 0 calls allreduce" in message and "rank 1 calls broadcast" in message
    assert elapsed < 60, f"took {elapsed:.0f} s; the job timeout is 90 s"
    assert_nothing_left(tmp_path, script)
