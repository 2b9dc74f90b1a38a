"""The pruned rings in a replay (all-reduce, all-gather, reduce-scatter): sandbox ranks end with the
real run's results to the bit while only their ring neighbours exist, whether a virtual rank sits
on one side or between two sandbox ranks."""

from __future__ import annotations

import json
import os

import pytest
import torch

from prism_core.backend.pruned import ring_allreduce
from prism_core.collect.stage import collect
from prism_core.config import config_from_dict
from prism_core.launch.cores import machine_cores
from prism_core.record import record
from prism_core.replay.ring import RingPart, ring_neighbours
from prism_core.replay.slices import run_with_assistant

from tests.jobs import DoneWork, assert_no_rank_processes, rank_result

SCRIPT = """
import json
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
r, w = dist.get_rank(), dist.get_world_size()
g = torch.Generator().manual_seed(7 + r)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
out = {}
for step in range(2):
    for name, op in (("sum", dist.ReduceOp.SUM), ("max", dist.ReduceOp.MAX), ("min", dist.ReduceOp.MIN)):
        x = torch.randn(301, generator=g) * 1e3
        dist.all_reduce(x, op=op)
        out[f"{name}{step}"] = x.tolist()
    xs = [torch.randn(40 + i, generator=g) for i in range(3)]
    works = [dist.all_reduce(x, async_op=True) for x in xs]
    for i, wk in enumerate(works):
        wk.wait()
        out[f"async{step}.{i}"] = xs[i].tolist()
    x = torch.randn(9, generator=g)
    gathered = torch.empty(9 * w)
    dist.all_gather_into_tensor(gathered, x)
    out[f"ag{step}"] = gathered.tolist()
    blocks = [torch.empty(9) for _ in range(w)]
    dist.all_gather(blocks, x * 2)
    out[f"agl{step}"] = torch.cat(blocks).tolist()
    y = torch.randn(4 * w, generator=g) * 1e3
    mine = torch.empty(4)
    dist.reduce_scatter_tensor(mine, y)
    out[f"rs{step}"] = mine.tolist()
    dist.reduce_scatter(mine, list((y * 3).chunk(w)), op=dist.ReduceOp.MIN)
    out[f"rsl{step}"] = mine.tolist()
    model(torch.ones(4)).sum().backward()
    opt.step()
print("RESULT " + json.dumps(out), flush=True)
dist.destroy_process_group()
"""


def test_neighbours_of_sandbox_positions():
    assert ring_neighbours(6, {1}) == {0, 2}
    assert ring_neighbours(6, {1, 3}) == {0, 2, 4}
    assert ring_neighbours(2, {0}) == {1}
    assert ring_neighbours(4, {0, 1, 2, 3}) == set()


class _Recorder:
    """A gloo group stand-in that records what a ring part sends and answers its receives."""
    def __init__(self):
        self.sent, self.received = [], []

    def send(self, tensors, dst, tag):
        self.sent.append((dst, tensors[0].clone()))
        return DoneWork()

    def recv(self, tensors, src, tag):
        self.received.append((src, tensors[0].numel()))
        return DoneWork()


def test_a_left_neighbour_sends_the_full_rings_partials():
    k, sandbox = 5, frozenset({3, 4})
    inputs = [torch.randn(23) * 10 ** i for i in range(k)]
    pg = _Recorder()
    RingPart(kind="allreduce", me=2, k=k, sandbox=sandbox, op="sum", numel=23, dtype=torch.float32, load=lambda: inputs).run(pg)
    assert [dst for dst, _ in pg.sent] == [3] * 2 * (k - 1) and not pg.received
    # what rank 2 sends in the full ring at every step, for the chunks that reach a sandbox output
    full, _ = ring_allreduce(inputs, "sum")
    ag = [t for _, t in pg.sent[k - 1:]]
    from prism_core.backend.pruned import chunk_bounds
    bounds = chunk_bounds(23, k)
    for s, t in enumerate(ag):
        a, b = bounds[(2 + 1 - s) % k]
        assert torch.equal(t, full[2][a:b])


class _Zeros(_Recorder):
    """As `_Recorder`, and every receive arrives as zeros and is kept, to see what was done with it."""
    def __init__(self):
        super().__init__()
        self.into = []

    def recv(self, tensors, src, tag):
        tensors[0].zero_()
        self.into.append(tensors[0])
        return super().recv(tensors, src, tag)


@pytest.mark.parametrize("kind, numel", [("allreduce", 23), ("reduce_scatter", 24), ("all_gather", 6)])
@pytest.mark.parametrize("k", [2, 3])
def test_a_member_between_two_sandbox_ranks_combines_each_reduce_steps_receive_as_a_real_one(kind, numel, k):
    from prism_core.backend.pruned import chunk_bounds

    me, sandbox = k - 1, frozenset(range(k - 1))
    inputs = [torch.randn(numel) for _ in range(k)]
    runs = {}
    for combine in (True, False):
        pg = _Zeros()
        RingPart(kind=kind, me=me, k=k, sandbox=sandbox, op="sum", numel=numel, dtype=torch.float32,
                 load=lambda: inputs, combine_work=combine).run(pg)
        runs[combine] = pg
    on, off = runs[True], runs[False]
    # the same bits sent, step by step, each step's send after the previous step's receive
    assert len(on.sent) == len(off.sent) == len(on.into) and on.sent
    assert all(d1 == d2 and torch.equal(a, b) for (d1, a), (d2, b) in zip(on.sent, off.sent))
    assert all(not t.any() for t in off.into)
    # the reduce steps' receives combined with the chunk of its own input a real member adds there
    if kind == "allreduce":
        bounds = chunk_bounds(numel, k)
        own = [inputs[me][slice(*bounds[(me - 1 - s) % k])] for s in range(k - 1)]
    elif kind == "reduce_scatter":
        n = numel // k
        own = [inputs[me][((me - 2 - s) % k) * n:((me - 2 - s) % k + 1) * n] for s in range(k - 1)]
    else:
        own = []
    assert len(own) <= len(on.into)
    for s, t in enumerate(on.into):
        assert torch.equal(t, own[s]) if s < len(own) else not t.any()


def _counted_parts(op: str, k: int = 4):
    """Two identical parts of virtual position k-1 (sandbox 0..k-2) that count their cache reads,
    and what the first sent when run as built at its op."""
    inputs = [torch.randn(19) for _ in range(k)]
    loads = []

    def load():
        loads.append(1)
        return inputs

    def part():
        return RingPart(kind="allreduce", me=k - 1, k=k, sandbox=frozenset(range(k - 1)), op=op, numel=19,
                        dtype=torch.float32, load=load)
    plain = _Recorder()
    part().run(plain)
    return part(), plain, loads


def test_a_prepared_part_reads_the_cache_once_and_sends_the_same_bytes():
    part, plain, loads = _counted_parts("max")
    prepared = _Recorder()
    part.prepare()
    part.prepare()
    assert len(loads) == 2            # once per part: run() uses what prepare() built
    part.run(prepared)
    assert len(loads) == 2 and len(prepared.sent) == len(plain.sent) == 2 * (4 - 1)
    assert all(d1 == d2 and torch.equal(a, b) for (d1, a), (d2, b) in zip(plain.sent, prepared.sent))
    assert part._ready is None        # nothing kept after the run


def test_a_part_built_ahead_on_another_thread_sends_what_one_built_at_its_op_does():
    from concurrent.futures import ThreadPoolExecutor

    part, plain, loads = _counted_parts("sum")
    ahead = _Recorder()
    with ThreadPoolExecutor(max_workers=1) as pool:
        part.prepare_on(pool)
        part.prepare_on(pool)         # once only
        part.prepare()                # waits for the build, builds nothing more
    assert len(loads) == 2
    part.run(ahead)
    assert len(loads) == 2 and len(ahead.sent) == len(plain.sent)
    assert all(d1 == d2 and torch.equal(a, b) for (d1, a), (d2, b) in zip(plain.sent, ahead.sent))


def test_an_error_building_ahead_is_raised_where_the_part_is_prepared():
    from concurrent.futures import ThreadPoolExecutor

    def load():
        raise OSError("the cache could not be read")

    part = RingPart(kind="allreduce", me=1, k=2, sandbox=frozenset({0}), op="sum", numel=4, dtype=torch.float32,
                    load=load)
    with ThreadPoolExecutor(max_workers=1) as pool:
        part.prepare_on(pool)
        with pytest.raises(OSError, match="could not be read"):
            part.prepare()


@pytest.mark.timeout(400)
def test_sandbox_ranks_get_the_real_runs_bits_with_only_their_ring_neighbours(tmp_path):
    script = tmp_path / "rings.py"
    script.write_text(SCRIPT)
    cfg = config_from_dict({"name": "rings", "job": {"program": str(script), "world_size": 6, "iterations": 2,
                                                     "warmup": 1, "timeout_s": 120},
                            "emulation": {"collect_mode": "context_switch", "sandbox": 2}})
    record(cfg, tmp_path / "record", echo=False)
    real = {r: rank_result(tmp_path / "record", r) for r in range(6)}
    graph = collect(cfg, tmp_path / "collect")
    # {1, 3}: virtual 0 sends to 1, virtual 2 sits between two sandbox ranks, virtual 4 receives
    # from 3; {0, 5}: neighbours 1 and 4, the ring wraps from 5 to 0
    for sandbox, neighbours in (([1, 3], {0, 2, 4}), ([0, 5], {1, 4})):
        out = tmp_path / "-".join(map(str, sandbox))
        run_with_assistant(cfg, graph.directory, sandbox, out)
        stats = json.loads((out / "replay" / "stats.json").read_text())
        assert stats["gloo_groups"] == len(neighbours), sandbox
        # the world group, pruned: its gloo layer holds the sandbox ranks and the neighbours only
        assert stats["compact_groups"] == 1 and stats["gloo_members"] == len(neighbours) * (len(neighbours) + len(sandbox))
        assert stats["gloo_loop_policies"] and set(stats["gloo_loop_policies"]) == {os.SCHED_IDLE}, \
            "every gloo device loop of the assistant in the idle class"
        placement = json.loads((out / "placement.json").read_text())
        if len(sandbox) + 1 <= len(machine_cores()):   # a core per sandbox rank and one for the assistant
            assert placement["bound"] and sorted(placement["ranks"]) == sorted(map(str, sandbox))
            assert placement["assistant"] and not set(placement["assistant"]) & set(placement["ranks"].values())
        else:
            assert not placement["bound"] and "cores" in placement["reason"]
        for r in sandbox:
            assert rank_result(out, r) == real[r], f"sandbox {sandbox}, rank {r}"
    # hosting the neighbours only (emulation.virtual_ranks): ranks 2 and 3 do not exist, their inputs
    # (read ahead from their own cache entries) are folded into what 1 and 4 send, to the bit
    out = tmp_path / "0-5-near"
    run_with_assistant(cfg, graph.directory, [0, 5], out, virtual_ranks="neighbours")
    stats = json.loads((out / "replay" / "stats.json").read_text())
    assert stats["virtual_ranks"] == 2 and stats["inputs_read_on_demand"] == 0
    for r in (0, 5):
        assert rank_result(out, r) == real[r], f"neighbours only, rank {r}"
    assert_no_rank_processes()
