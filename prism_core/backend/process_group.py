"""`PrismProcessGroup`: the "prism" c10d backend, a Python ProcessGroup that wraps gloo.

Every op c10d routes to a backend arrives here under its Python name (measured on torch 2.13:
`allreduce`, `broadcast`, `allgather`, `all_gather_single(_coalesced)`, `reduce_scatter`,
`reduce_scatter_single(_coalesced)`, `all_to_all_single`, `alltoall`, `send`, `recv`,
`barrier`, `scatter`, `gather`, `reduce`), is recorded when a trace recorder is active, and
is forwarded to an inner ProcessGroupGloo that does the real transfer: in real runs all-reduce,
all-gather and reduce-scatter run as rings (`ring`), broadcast, reduce and small all-reduces as
trees (`tree`), the barrier as a tree token, over gloo's point-to-point links, so that a replay
can prune them to a rank of interest's neighbours; the rest is gloo's. The returned work wraps
gloo's so that completion (gloo's future callback for collectives, the wait for p2p) and the
program's `wait()` are timed. An op prism cannot serve raises an error naming it.
"""

from __future__ import annotations

import datetime
import os
import sys
import time

import torch
import torch._C._distributed_c10d as c10d
import torch.distributed as dist

from prism_core.backend.compact import CompactGloo
from prism_core.backend.pruned import BARRIER_TAG, ring_algorithm, tree_algorithm, tree_children, tree_parent
from prism_core.backend.tree import tree_allreduce_inplace, tree_broadcast_inplace, tree_reduce_inplace
from prism_core.backend.ring import (
    RingRunner, ring_allgather_inplace, scratch, ring_allreduce_inplace, ring_reduce_scatter_inplace,
)
from prism_core.backend.reduce_ops import reduce_name
from prism_core.backend.transport_threads import make_gloo_group
from prism_core.trace.recorder import Recorder


_C10D_FILE = "distributed_c10d.py"
_SETTLE_S = 0.005


class UnsupportedOpError(RuntimeError):
    pass


def _unsupported(op: str, why: str) -> UnsupportedOpError:
    return UnsupportedOpError(f"prism backend: {op} is not supported ({why})")


class PrismWork(dist.Work):
    """Work of one op: gloo's work(s), plus the trace node whose wait and completion it times.

    `watch` holds the op's tensors with their reference counts from before the issue. gloo's
    worker thread keeps its own reference to a finished op for a moment after `wait()` returns;
    if the program dropped the tensor meanwhile, it would be freed on that thread at a time that
    depends on scheduling, and peak memory would vary between runs. After a blocking wait the
    work therefore lets go of gloo's handles and waits (briefly, bounded) until the references
    are back to where they were, so the free happens at the same point of the program every time.
    """

    def __init__(self, works: list, recorder: Recorder | None, node: int, outputs, collective: bool,
                 watch: list | None = None):
        super().__init__()
        self._works, self._recorder, self._node = works, recorder, node
        self._outputs = outputs
        self._watch = watch
        self._done = False
        if recorder is not None and collective:
            for w in works:
                try:  # the callback holds the recorder and an int, never this work or its tensors
                    w.get_future().then(lambda _fut, rec=recorder, node=node: rec.complete(node))
                except RuntimeError:  # some gloo works (reduce_scatter_single) have no future:
                    pass              # their completion is taken at the wait

    def _settle(self) -> None:
        self._works = []
        deadline = time.perf_counter() + _SETTLE_S
        while any(t._use_count() > n for t, n in self._watch) and time.perf_counter() < deadline:
            os.sched_yield()
        self._watch = None

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        rec = self._recorder
        if rec is None or self._done:
            _wait_all(self._works, timeout)
            return True
        # c10d's own blocking calls (async_op=False) wait right after issuing: one node. A wait
        # from anywhere else (user code, DDP, functional collectives) is its own point.
        blocking = sys._getframe(1).f_code.co_filename.endswith(_C10D_FILE)
        inline, began = rec.wait_begin(self._node, blocking)
        _wait_all(self._works, timeout)
        self._done = True
        if inline and self._watch:
            self._settle()
        rec.wait_end(self._node, inline, began)
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def get_future(self):
        if len(self._works) == 1:
            return self._works[0].get_future()
        outputs = self._outputs
        return torch.futures.collect_all([w.get_future() for w in self._works]).then(lambda _: outputs)


def _wait_all(works: list, timeout) -> None:
    # a function of its own, so no loop variable keeps the last gloo work alive in the caller
    for w in works:
        w.wait() if not timeout else w.wait(timeout)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _coalesced_splits(inputs) -> list[int]:
    """A coalesced gather or scatter's mark in the graph: its inputs' element counts."""
    return [t.numel() for t in inputs]


def _flat(nested) -> list[torch.Tensor]:
    out = []
    for x in nested:
        if isinstance(x, torch.Tensor):
            out.append(x)
        else:
            out.extend(_flat(x))
    return out


def gloo_store(store):
    """The store under which a group's gloo layer meets its peers (the replay assistant's too)."""
    return dist.PrefixStore("prism_gloo/", store)


class PrismProcessGroup(dist.ProcessGroup):
    def __init__(self, store, rank: int, size: int, timeout: datetime.timedelta, global_ranks: list[int],
                 group_id: str, recorder: Recorder | None, inner=None):
        super().__init__(rank, size)
        if inner is None:
            inner = make_gloo_group(lambda: dist.ProcessGroupGloo(gloo_store(store), rank, size, timeout))
        self._inner = inner
        self._gloo = isinstance(inner, (dist.ProcessGroupGloo, CompactGloo))
        self._global_ranks = tuple(global_ranks) if global_ranks else tuple(range(size))
        self._name = group_id
        self._desc = "undefined"
        self._recorder = recorder
        self._ring: RingRunner | None = None
        self._issuing: int | None = None      # the node whose op `_run` is starting (its wire stamp)

    # -- identity (c10d requires these from a Python ProcessGroup) -----------------------------
    def getBackendName(self) -> str:
        return "prism"

    def getGroupName(self) -> str:
        return self._name

    def setGroupName(self, name: str) -> None:
        self._name = name

    def getGroupDesc(self) -> str:
        return self._desc

    def setGroupDesc(self, desc: str) -> None:
        self._desc = desc

    @property
    def inner(self) -> dist.ProcessGroup:
        return self._inner

    # -- recording -------------------------------------------------------------------------------
    def _run(self, op: str, inputs, outputs, start, *, peer: int = -1, tag: int = -1, p2p: bool = False,
             reduce=None, splits=None):
        rec = self._recorder
        if rec is None:
            works = start()
            return PrismWork(works, None, -1, outputs, not p2p and self._gloo)
        ins = _flat(inputs)
        watch = None
        if not p2p and self._gloo:  # gloo runs collectives on worker threads (p2p work is the caller's only)
            tensors = {id(t): t for t in ins + _flat(outputs)}.values()
            watch = [(t, t._use_count()) for t in tensors]
        dtype = str(ins[0].dtype).removeprefix("torch.") if ins else ""
        global_peer = self._global_ranks[peer] if peer >= 0 else -1
        p2p_key = None
        if p2p:
            me = self._global_ranks[self.rank()]
            p2p_key = (me, global_peer, tag) if op == "send" else (global_peer, me, tag)
        node = rec.issue(op, self._name, self._global_ranks, global_peer, _nbytes(ins), dtype, tag, p2p_key,
                         reduce_name(reduce) if reduce is not None else "", list(splits) if splits else None)
        self._issuing = node
        handing = time.perf_counter()
        try:
            works = start()
        finally:
            # gloo's own op: on the wire as the call into gloo begins (a virtual member's stamp in a
            # timed replay is taken there too, its own call into gloo following it); a ring stamps
            # when its thread starts it
            if self._issuing is not None:
                rec.on_wire(node, handing)
                self._issuing = None
        rec.issued(node)
        return PrismWork(works, rec, node, outputs, not p2p and self._gloo, watch)

    # -- collectives -----------------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        opts = opts if opts is not None else c10d.AllreduceOptions()
        if opts.reduceOp == dist.ReduceOp.PREMUL_SUM:
            raise _unsupported("allreduce with ReduceOp.PREMUL_SUM", "gloo cannot run it; scale before a SUM")
        return self._run("allreduce", tensors, tensors, lambda: [self._allreduce(tensors, opts)],
                         reduce=opts.reduceOp, splits=_coalesced_splits(tensors) if len(tensors) > 1 else None)

    # -- rings (real runs: every op `pruned.ring_algorithm` picks; collection transports settle
    # -- the op whole, so they keep the inner group's own) ---------------------------------------
    def _ring_for(self, op: str, t: torch.Tensor, reduce=None, numel: int | None = None) -> str | None:
        """The ring `op` runs as on input `t` (of `numel` elements, when given apart), or None."""
        if not self._gloo or t.is_sparse:
            return None
        name = reduce_name(reduce) if reduce is not None else ""
        return ring_algorithm(op, name, t.numel() if numel is None else numel, self.size(),
                              str(t.dtype).removeprefix("torch."))

    def _submit_ring(self, run, result: list):
        if self._ring is None:
            self._ring = RingRunner(self._name)
        node, rec = self._issuing, self._recorder
        if node is not None and rec is not None:     # the op goes on the wire when its thread starts it
            self._issuing = None
            inner = run

            def run() -> None:
                rec.on_wire(node)
                inner()
        return self._ring.submit(run, result)

    def _tree_for(self, op: str, t: torch.Tensor, reduce=None) -> str | None:
        """The tree `op` runs as on input `t`, or None (`pruned.tree_algorithm`)."""
        if not self._gloo or t.is_sparse:
            return None
        name = reduce_name(reduce) if reduce is not None else ""
        return tree_algorithm(op, name, t.numel(), self.size(), str(t.dtype).removeprefix("torch."))

    def _in_place(self, t: torch.Tensor, algorithm):
        """Run `algorithm(flat)` on the group's thread over `t` as one flat tensor (a contiguous
        copy for a strided `t`, copied back)."""
        def run() -> None:
            if t.is_contiguous():
                algorithm(t.view(-1))
                return
            flat = scratch(t.numel(), t.dtype)     # outside the allocator, as the rings' buffers
            flat.copy_(t.reshape(-1))
            algorithm(flat)
            t.copy_(flat.view(t.shape))
        return self._submit_ring(run, [t])

    def _allreduce(self, tensors, opts):
        t = tensors[0]
        me, k, inner = self.rank(), self.size(), self._inner
        if len(tensors) == 1 and self._ring_for("allreduce", t, opts.reduceOp) is not None:
            op = reduce_name(opts.reduceOp)
            return self._in_place(t, lambda flat: ring_allreduce_inplace(inner, flat, me, k, op))
        if len(tensors) == 1 and self._tree_for("allreduce", t, opts.reduceOp) is not None:
            op = reduce_name(opts.reduceOp)
            return self._in_place(t, lambda flat: tree_allreduce_inplace(inner, flat, me, k, op))
        return self._inner.allreduce(tensors, opts)

    def _allgather_ring(self, op: str, blocks: list[torch.Tensor], input: torch.Tensor, result: list, fallback):
        """All-gather as the ring when the output blocks are contiguous and the input's size."""
        if (self._ring_for(op, input) is None or not input.is_contiguous() or len(blocks) != self.size()
                or any(not b.is_contiguous() or b.numel() != input.numel() or b.dtype != input.dtype
                       for b in blocks)):
            return fallback()
        me, k, inner = self.rank(), self.size(), self._inner

        def run() -> None:
            blocks[me].view(-1).copy_(input.view(-1))
            ring_allgather_inplace(inner, [b.view(-1) for b in blocks], me, k)
        return self._submit_ring(run, result)

    def _reduce_scatter_ring(self, op: str, out: torch.Tensor, blocks: list[torch.Tensor], reduce, result: list,
                             fallback):
        """Reduce-scatter as the ring when the blocks are contiguous and the output's size."""
        if (self._ring_for(op, out, reduce, numel=sum(b.numel() for b in blocks)) is None or not out.is_contiguous() or len(blocks) != self.size()
                or any(not b.is_contiguous() or b.numel() != out.numel() or b.dtype != out.dtype for b in blocks)):
            return fallback()
        me, k, name, inner = self.rank(), self.size(), reduce_name(reduce), self._inner

        def run() -> None:
            ring_reduce_scatter_inplace(inner, [b.view(-1) for b in blocks], out.view(-1), me, k, name)
        return self._submit_ring(run, result)

    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts if opts is not None else c10d.AllreduceCoalescedOptions()
        return self._run("allreduce_coalesced", tensors, tensors,
                         lambda: [self._inner.allreduce_coalesced(tensors, opts)], reduce=opts.reduceOp)

    def broadcast(self, tensors, opts=None):
        opts = opts if opts is not None else c10d.BroadcastOptions()

        def start() -> list:
            if len(tensors) != 1 or self._tree_for("broadcast", tensors[0]) is None:
                return [self._inner.broadcast(tensors, opts)]
            me, k, root, inner = self.rank(), self.size(), opts.rootRank, self._inner
            return [self._in_place(tensors[0], lambda flat: tree_broadcast_inplace(inner, flat, me, k, root))]
        return self._run("broadcast", tensors, tensors, start, peer=opts.rootRank,
                         splits=_coalesced_splits(tensors) if len(tensors) > 1 else None)

    def allgather(self, output_lists, inputs, opts=None):
        opts = opts if opts is not None else c10d.AllgatherOptions()

        def start() -> list:
            gloo = lambda: self._inner.allgather(output_lists, inputs, opts)  # noqa: E731
            if len(inputs) != 1 or len(output_lists) != 1:
                return [gloo()]
            return [self._allgather_ring("allgather", output_lists[0], inputs[0], output_lists, gloo)]
        return self._run("allgather", inputs, output_lists, start)

    def all_gather_single(self, output, input, opts=None):
        opts = opts if opts is not None else c10d.AllgatherOptions()

        def start() -> list:
            gloo = lambda: self._inner._allgather_base(output, input, opts)  # noqa: E731
            if not output.is_contiguous() or output.numel() != input.numel() * self.size():
                return [gloo()]
            return [self._allgather_ring("all_gather_single", list(output.view(self.size(), -1)), input, [output],
                                         gloo)]
        return self._run("all_gather_single", [input], [output], start)

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        # gloo's algorithm, one op per pair; the node's splits (each input's element count) tell
        # the assistant this is not one ring over the whole
        opts = opts if opts is not None else c10d.AllgatherOptions()
        return self._run("all_gather_single", inputs, outputs,
                         lambda: [self._inner._allgather_base(o, i, opts) for o, i in zip(outputs, inputs)],
                         splits=_coalesced_splits(inputs))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter(self, outputs, input_lists, opts=None):
        opts = opts if opts is not None else c10d.ReduceScatterOptions()

        def start() -> list:
            gloo = lambda: self._inner.reduce_scatter(outputs, input_lists, opts)  # noqa: E731
            if len(outputs) != 1 or len(input_lists) != 1 or opts.reduceOp == dist.ReduceOp.PREMUL_SUM:
                return [gloo()]
            return [self._reduce_scatter_ring("reduce_scatter", outputs[0], input_lists[0], opts.reduceOp, outputs,
                                              gloo)]
        return self._run("reduce_scatter", input_lists, outputs, start, reduce=opts.reduceOp)

    def reduce_scatter_single(self, output, input, opts=None):
        opts = opts if opts is not None else c10d.ReduceScatterOptions()

        def start() -> list:
            gloo = lambda: self._inner._reduce_scatter_base(output, input, opts)  # noqa: E731
            k = self.size()
            if (opts.reduceOp == dist.ReduceOp.PREMUL_SUM or not input.is_contiguous()
                    or input.numel() != output.numel() * k):
                return [gloo()]
            return [self._reduce_scatter_ring("reduce_scatter_single", output, list(input.view(k, -1)),
                                              opts.reduceOp, [output], gloo)]
        return self._run("reduce_scatter_single", [input], [output], start, reduce=opts.reduceOp)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        opts = opts if opts is not None else c10d.ReduceScatterOptions()
        return self._run("reduce_scatter_single", inputs, outputs,
                         lambda: [self._inner._reduce_scatter_base(o, i, opts) for o, i in zip(outputs, inputs)],
                         reduce=opts.reduceOp, splits=_coalesced_splits(inputs))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def all_to_all_single(self, output, input, output_splits, input_splits, opts=None):
        opts = opts if opts is not None else c10d.AllToAllOptions()
        return self._run("all_to_all_single", [input], [output],
                         lambda: [self._inner.alltoall_base(output, input, output_splits, input_splits, opts)],
                         splits=input_splits)

    def alltoall(self, outputs, inputs, opts=None):
        opts = opts if opts is not None else c10d.AllToAllOptions()
        return self._run("alltoall", inputs, outputs, lambda: [self._inner.alltoall(outputs, inputs, opts)])

    def barrier(self, opts=None):
        opts = opts if opts is not None else c10d.BarrierOptions()
        if not self._gloo:    # collection transports settle it as one op
            return self._run("barrier", [], [], lambda: [self._inner.barrier(opts)])
        return self._run("barrier", [], [], self._tree_barrier)

    def _tree_barrier(self) -> list:
        """A token up the binary tree to position 0 and back down, over the group's point-to-point
        links. Every rank of a real run does this; in an emulation a rank of interest's parent and
        children are the only virtual ranks it talks to (neighbour pruning, paper Appendix D)."""
        me, k = self.rank(), self.size()
        token = torch.zeros(1, dtype=torch.uint8)
        children = tree_children(me, k)
        for c in children:
            self._inner.recv([token], c, BARRIER_TAG).wait()
        parent = tree_parent(me, k)
        if parent is not None:
            self._inner.send([token], parent, BARRIER_TAG).wait()
            self._inner.recv([token], parent, BARRIER_TAG).wait()
        for c in children:
            self._inner.send([token], c, BARRIER_TAG).wait()
        return []

    def scatter(self, outputs, input_lists, opts=None):
        opts = opts if opts is not None else c10d.ScatterOptions()
        return self._run("scatter", outputs, outputs, lambda: [self._inner.scatter(outputs, input_lists, opts)],
                         peer=opts.rootRank)

    def gather(self, output_lists, inputs, opts=None):
        opts = opts if opts is not None else c10d.GatherOptions()
        return self._run("gather", inputs, output_lists, lambda: [self._inner.gather(output_lists, inputs, opts)],
                         peer=opts.rootRank)

    def reduce(self, tensors, opts=None):
        opts = opts if opts is not None else c10d.ReduceOptions()

        def start() -> list:
            if len(tensors) != 1 or self._tree_for("reduce", tensors[0], opts.reduceOp) is None:
                return [self._inner.reduce(tensors, opts)]
            me, k, root, op, inner = self.rank(), self.size(), opts.rootRank, reduce_name(opts.reduceOp), self._inner
            return [self._in_place(tensors[0], lambda flat: tree_reduce_inplace(inner, flat, me, k, root, op))]
        return self._run("reduce", tensors, tensors, start, peer=opts.rootRank, reduce=opts.reduceOp,
                         splits=_coalesced_splits(tensors) if len(tensors) > 1 else None)

    # -- point to point --------------------------------------------------------------------------
    def send(self, tensors, dst: int, tag: int):
        return self._run("send", tensors, tensors, lambda: [self._inner.send(tensors, dst, tag)], peer=dst, tag=tag,
                         p2p=True)

    def recv(self, tensors, src: int, tag: int):
        return self._run("recv", tensors, tensors, lambda: [self._inner.recv(tensors, src, tag)], peer=src, tag=tag,
                         p2p=True)

    def recv_anysource(self, tensors, tag: int):
        raise _unsupported("recv from any source", "the trace needs a known peer; name the source rank")

    def monitored_barrier(self, *args, **kwargs):
        raise _unsupported("monitored_barrier", "use barrier()")
