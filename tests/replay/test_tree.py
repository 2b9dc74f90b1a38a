"""The pruned trees in a replay (broadcast, reduce, small all-reduce) beside point-to-point
traffic on the same group: sandbox ranks end with the real run's results to the bit while only
their tree neighbours and point-to-point peers exist on the wire."""

from __future__ import annotations

import json
import queue
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prism_core.backend.pruned import _combine, tree_broadcast, tree_members, tree_reduce
from prism_core.collect.stage import collect
from prism_core.config import config_from_dict
from prism_core.record import record
from prism_core.replay.slices import run_with_assistant
from prism_core.replay.tree import TreeOp, tree_neighbours

from tests.jobs import DoneWork, assert_no_rank_processes, rank_result

SCRIPT = """
import json
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
r, w = dist.get_rank(), dist.get_world_size()
g = torch.Generator().manual_seed(11 + r)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
out = {}
for step in range(2):
    for root in (0, 4):
        x = torch.randn(33, generator=g) * 1e3
        dist.broadcast(x, src=root)
        out[f"b{root}.{step}"] = x.tolist()
    for name, op in (("sum", dist.ReduceOp.SUM), ("max", dist.ReduceOp.MAX)):
        x = torch.randn(w - 2, generator=g) * 1e3
        dist.all_reduce(x, op=op)
        out[f"{name}{step}"] = x.tolist()
    x = torch.randn(17, generator=g) * 1e3
    dist.reduce(x, dst=2)
    out[f"reduce{step}"] = x.tolist()
    a = torch.randn(5, generator=g)
    b = torch.empty(5)
    req = dist.isend(a, (r + 1) % w)
    dist.recv(b, (r - 1) % w)
    req.wait()
    out[f"p2p{step}"] = b.tolist()
    model(torch.ones(4)).sum().backward()
    opt.step()
print("RESULT " + json.dumps(out), flush=True)
dist.destroy_process_group()
"""


def test_neighbours_in_trees_of_any_root():
    assert tree_neighbours(7, 0, {1}) == {0, 3, 4}
    assert tree_neighbours(7, 4, {1}) == {5}            # position 1 is the root's 4th: parent 5
    assert tree_neighbours(7, 0, {0, 1, 2}) == {3, 4, 5, 6}
    for k, root, sandbox in ((9, 3, {0, 5}), (16, 0, {15}), (2, 1, {0})):
        assert tree_neighbours(k, root, sandbox) == tree_members(k, root, sandbox) - sandbox


class _Wire:
    """A gloo group stand-in: records what a part sends, answers its receives with `incoming`."""
    def __init__(self, incoming=None):
        self.sent, self.incoming = [], incoming or {}

    def send(self, tensors, dst, tag):
        self.sent.append((dst, tensors[0].clone()))
        return DoneWork()

    def recv(self, tensors, src, tag):
        tensors[0].copy_(self.incoming[src])
        return DoneWork()


def _op(kind, k, root, sandbox, inputs, op="sum"):
    return TreeOp(kind, k, root, frozenset(sandbox), op, inputs[0].numel(), inputs[0].dtype, load=lambda p: inputs[p])


@pytest.mark.parametrize("op", ["sum", "max", "min"])
def test_virtual_children_send_their_subtrees_reduction_folded_as_the_full_tree(op):
    k, root, inputs = 11, 2, [torch.randn(7) * 10 ** (i % 5) for i in range(11)]
    tree = _op("tree_reduce", k, root, {2}, inputs, op)     # the root alone is real
    sent = {}
    for child in (3, 4):                                    # its children: subtrees of 7 and 2 positions
        wire = _Wire()
        tree.part(child).run(wire)
        (dst, value), = wire.sent
        assert dst == 2
        sent[child] = value
    # the root folds as the backend does: its input, then each child's subtree in turn
    acc = inputs[2].clone()
    for child in (3, 4):
        acc = _combine(acc, sent[child], op)
    full, _ = tree_reduce(inputs, root, op)
    assert torch.equal(acc, full)


def test_a_sandbox_rank_below_a_virtual_one_gets_the_full_allreduce():
    k, inputs = 7, [torch.randn(3) * 10 ** i for i in range(7)]
    sandbox = {4}                       # under position 1, under the root 0
    tree = _op("tree_allreduce", k, 0, sandbox, inputs)
    wire = _Wire({4: inputs[4]})        # position 4 has no children: it sends its input up
    tree.part(1).run(wire)
    full, _ = tree_reduce(inputs, 0, "sum")
    (dst, value), = wire.sent
    assert dst == 4 and torch.equal(value, full)
    out, _ = tree_broadcast([full] * k, 0)
    assert torch.equal(out[4], value)


# slow: the assistant's part is the ring's test (tests/replay/test_ring.py), the trees' results
# tests/backend/test_tree.py and tests/replay/test_tree_barrier.py
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_sandbox_ranks_get_the_real_runs_bits_with_only_tree_neighbours_and_peers(tmp_path):
    script = tmp_path / "trees.py"
    script.write_text(SCRIPT)
    cfg = config_from_dict({"name": "trees", "job": {"program": str(script), "world_size": 7, "iterations": 2,
                                                     "warmup": 1, "timeout_s": 120},
                            "emulation": {"collect_mode": "context_switch", "sandbox": 2}})
    record(cfg, tmp_path / "record", echo=False)
    real = {r: rank_result(tmp_path / "record", r) for r in range(7)}
    graph = collect(cfg, tmp_path / "collect")
    # {1}: roots 0 (broadcast, all-reduce) -> 0, 3, 4; root 4 -> 5; root 2 (reduce) -> 4; peers 0, 2.
    # {2, 5}: the reduce's root itself, and 5 under 2 in the tree rooted at 0.
    # {6, 0}: 6 a leaf below 2 (root 0), the point-to-point ring wrapping from 6 to 0.
    for sandbox in ([1], [2, 5], [6, 0]):
        out = tmp_path / "-".join(map(str, sandbox))
        run_with_assistant(cfg, graph.directory, sandbox, out)
        wire = set()
        for root in (0, 4, 2):
            wire |= tree_neighbours(7, root, set(sandbox))
        wire |= {(r + d) % 7 for r in sandbox for d in (-1, 1)} - set(sandbox)
        stats = json.loads((out / "replay" / "stats.json").read_text())
        assert stats["gloo_groups"] == len(wire), sandbox
        assert sandbox != [1] or len(wire) == 5          # rank 6 is pruned
        for r in sandbox:
            assert rank_result(out, r) == real[r], f"sandbox {sandbox}, rank {r}"
    assert_no_rank_processes()


class _Mailboxes:
    """In-memory point-to-point links between tree positions: per (src, dst) a queue of tensors."""
    def __init__(self):
        self.boxes: dict = {}
        self.links = set()
        self.lock = threading.Lock()

    def box(self, src, dst) -> queue.Queue:
        with self.lock:     # made under the lock: two threads must not each make their own
            return self.boxes.setdefault((src, dst), queue.Queue())

    def pg(self, me):
        wire = self

        class _Pg:
            def send(self, tensors, dst, tag):
                with wire.lock:
                    wire.links.add((me, dst))
                wire.box(me, dst).put(tensors[0].clone())
                return DoneWork()

            def recv(self, tensors, src, tag):
                tensors[0].copy_(wire.box(src, me).get(timeout=20))
                return DoneWork()
        return _Pg()


def test_a_virtual_member_completes_once_what_it_needs_in_the_full_tree_happened():
    inputs = [torch.randn(2) for _ in range(7)]
    bcast = _op("tree_broadcast", 7, 0, {2}, inputs)      # parts: 0 (2's parent), 5 and 6 (its children)
    parts = {p: bcast.part(p) for p in tree_neighbours(7, 0, {2})}
    assert sorted(parts) == [0, 5, 6]
    assert bcast.depends(1) == [] and bcast.depends(3) == []             # nothing of rank 2 on their path
    assert bcast.depends(0) == [bcast.done[0]]
    assert bcast.depends(5) == [bcast.done[5], bcast.down[5]]
    reduce = _op("tree_reduce", 7, 0, {5}, inputs)        # 5's partial goes up through 2 to the root
    for p in tree_neighbours(7, 0, {5}):
        reduce.part(p)
    assert reduce.depends(2) == [reduce.done[2], reduce.up[5]]
    assert reduce.depends(0) == [reduce.up[5]] and reduce.depends(1) == []
    small = _op("tree_allreduce", 7, 0, {5}, inputs)
    small.part(2)
    assert small.depends(4) == [small.done[2]]                           # everyone waits for everything


@settings(max_examples=120, deadline=None)
@given(st.integers(2, 64).flatmap(lambda k: st.tuples(
    st.just(k), st.integers(0, k - 1), st.sets(st.integers(0, k - 1), min_size=1, max_size=min(k, 6)))),
    st.sampled_from(["tree_broadcast", "tree_reduce", "tree_allreduce"]), st.sampled_from(["sum", "max", "min"]))
def test_pruned_trees_give_every_sandbox_rank_the_full_trees_bits(case, kind, op):
    """Sandbox ranks run the backend's tree functions, their virtual neighbours `TreePart`s, over
    in-memory links: every sandbox rank ends with the full tree's result, and nobody else talks."""
    from prism_core.backend.tree import tree_allreduce_inplace, tree_broadcast_inplace, tree_reduce_inplace

    k, root, sandbox = case
    if kind == "tree_allreduce":
        root = 0
    g = torch.Generator().manual_seed(k * 1000 + root)
    inputs = [torch.randn(5, generator=g) * 10 ** (i % 6) for i in range(k)]
    if kind == "tree_broadcast":
        expected = {p: inputs[root] for p in range(k)}
    else:
        full, _ = tree_reduce(inputs, root, op)
        expected = {p: full if (p == root or kind == "tree_allreduce") else inputs[p] for p in range(k)}
    wire = _Mailboxes()
    tree = _op(kind, k, root, sandbox, inputs, op)
    outputs, errors = {}, []

    def sandbox_rank(p):
        flat = inputs[p].clone()
        pg = wire.pg(p)
        if kind == "tree_broadcast":
            tree_broadcast_inplace(pg, flat, p, k, root)
        elif kind == "tree_reduce":
            tree_reduce_inplace(pg, flat, p, k, root, op)
        else:
            tree_allreduce_inplace(pg, flat, p, k, op)
        outputs[p] = flat

    def guard(fn, *args):
        try:
            fn(*args)
        except BaseException as err:  # noqa: BLE001
            errors.append(err)

    threads = [threading.Thread(target=guard, args=(sandbox_rank, p)) for p in sandbox]
    threads += [threading.Thread(target=guard, args=(lambda v: tree.part(v).run(wire.pg(v)), v))
                for v in tree_neighbours(k, root, sandbox)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    for p in sandbox:
        assert torch.equal(outputs[p], expected[p]), (p, kind)
    on_wire = tree_members(k, root, sandbox)
    assert all(a in on_wire and b in on_wire and (a in sandbox or b in sandbox) for a, b in wire.links)
