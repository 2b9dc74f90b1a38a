"""Ring and tree collectives, full and pruned to the sandbox ranks' neighbours (paper §6.3, Appendix D).

These are the schedules the prism backend's collectives follow, written as plain functions over
tensors so that their numerics and their traffic can be checked step by step. Each returns the
outputs of the ranks that exist and the traffic: (phase, step, src, dst) -> bytes.

Ring all-reduce on K ranks = reduce-scatter then all-gather, K-1 steps each. In reduce-scatter
step s, rank i sends its partial of chunk (i - s) mod K to rank i+1, which adds its own share;
chunk c ends complete on its owner (c - 1) mod K. In all-gather step s, rank i sends chunk
(i + 1 - s) mod K on to rank i+1.

Pruned: only the sandbox ranks and their ring neighbours exist. A virtual left neighbour v of
a sandbox rank sends, for a chunk whose remaining path v+1 .. owner is all sandbox, the partial
the full ring would carry there, folded in ring order from the tensor cache's values of the
pruned ranks; any other chunk may carry any value (it reaches no sandbox output). In all-gather
it sends the complete chunk. Appendix D compensates (full-scale result less the contributions
still to come), which is exact for integer-valued data; folding in the ring's order is exact for
any floats, because every sandbox rank then adds the same numbers in the same order as in the
full ring. Every sandbox rank holds the full ring's result to the bit and sends and receives
the same bytes at every step.

Trees (broadcast, reduce, and an all-reduce too small for the ring: a reduce to position 0
then a broadcast from it) use a binary tree over group positions rooted at the root: a pruned
tree keeps the sandbox ranks, their parents and their children; a virtual parent sends the
root's data, a virtual child sends its whole subtree's reduction, folded in the tree's order
(a node's input, then each child's subtree in turn), so sums are the full tree's to the bit.
"""

from __future__ import annotations

import torch

Traffic = dict[tuple[str, int, int, int], int]
REDUCE_OPS = ("sum", "max", "min")


def _combine(a: torch.Tensor, b: torch.Tensor, op: str) -> torch.Tensor:
    if op == "sum":
        return a + b
    if op == "max":
        return torch.maximum(a, b)
    if op == "min":
        return torch.minimum(a, b)
    raise ValueError(f"reduce op {op!r}: pruned rings serve sum, max and min")


def _reduce_all(tensors: list[torch.Tensor], op: str) -> torch.Tensor:
    out = tensors[0].clone()
    for t in tensors[1:]:
        out = _combine(out, t, op)
    return out


def chunk_bounds(numel: int, k: int) -> list[tuple[int, int]]:
    """K contiguous chunks, the first numel % k one element longer (sizes differ by at most one)."""
    base, extra = divmod(numel, k)
    bounds, start = [], 0
    for c in range(k):
        size = base + (1 if c < extra else 0)
        bounds.append((start, start + size))
        start += size
    return bounds


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# -- full rings ----------------------------------------------------------------------------------

def ring_allreduce(inputs: list[torch.Tensor], op: str) -> tuple[list[torch.Tensor], Traffic]:
    """The unpruned ring: every rank's output and the traffic of every step."""
    k = len(inputs)
    bounds = chunk_bounds(inputs[0].numel(), k)
    flat = [t.reshape(-1) for t in inputs]
    partial = [[f[a:b].clone() for a, b in bounds] for f in flat]   # partial[i][c]
    traffic: Traffic = {}
    for s in range(k - 1):
        sent = [(i, (i - s) % k, partial[i][(i - s) % k].clone()) for i in range(k)]
        for i, c, value in sent:
            dst = (i + 1) % k
            traffic[("reduce_scatter", s, i, dst)] = _nbytes(value)
            partial[dst][c] = _combine(value, flat[dst][bounds[c][0]:bounds[c][1]], op)
    done = [[None] * k for _ in range(k)]
    for i in range(k):
        done[i][(i + 1) % k] = partial[i][(i + 1) % k]
    for s in range(k - 1):
        sent = [(i, (i + 1 - s) % k, done[i][(i + 1 - s) % k]) for i in range(k)]
        for i, c, value in sent:
            dst = (i + 1) % k
            traffic[("all_gather", s, i, dst)] = _nbytes(value)
            done[dst][c] = value.clone()
    return [torch.cat(d).reshape(inputs[0].shape) for d in done], traffic


# -- pruned rings --------------------------------------------------------------------------------

def ring_members(k: int, sandbox: set[int]) -> set[int]:
    """The ranks a pruned ring keeps: the sandbox ranks and their left and right neighbours."""
    return set(sandbox) | {(i - 1) % k for i in sandbox} | {(i + 1) % k for i in sandbox}


RING_OPS = {"allreduce": "allreduce", "all_gather_single": "all_gather", "allgather": "all_gather",
            "reduce_scatter_single": "reduce_scatter", "reduce_scatter": "reduce_scatter"}


def ring_algorithm(op: str, reduce: str, numel: int, k: int, dtype: str) -> str | None:
    """Which ring the backend runs an op as ("allreduce", "all_gather", "reduce_scatter"), or None
    for gloo's own algorithm. The backend and the assistant decide from the same facts, all in the
    graph: the op, the reduce op, the input's element count (every chunk holds at least one
    element; a reduce-scatter's input splits evenly), the group size and the dtype's name."""
    kind = RING_OPS.get(op)
    if kind is None or k < 2 or numel < 1 or dtype == "bool" or dtype.startswith("complex"):
        return None
    if kind == "all_gather":
        return kind
    if reduce not in REDUCE_OPS or numel < k:
        return None
    return kind if kind == "allreduce" or numel % k == 0 else None


TREE_KINDS = ("tree_broadcast", "tree_reduce", "tree_allreduce")


def tree_algorithm(op: str, reduce: str, numel: int, k: int, dtype: str) -> str | None:
    """Which tree the backend runs an op as (one of TREE_KINDS), or None: a broadcast of any
    dtype, a reduce, and an all-reduce the ring does not take (fewer elements than ranks), for
    sum, max and min. Decided, like `ring_algorithm`, from facts the graph records."""
    if k < 2 or numel < 1:
        return None
    if op == "broadcast":
        return "tree_broadcast"
    if op not in ("reduce", "allreduce") or reduce not in REDUCE_OPS or dtype == "bool" or dtype.startswith("complex"):
        return None
    if op == "reduce":
        return "tree_reduce"
    return "tree_allreduce" if ring_algorithm(op, reduce, numel, k, dtype) is None else None


def fold(inputs: list[torch.Tensor | None], first: int, last: int, a: int, b: int, op: str) -> torch.Tensor:
    """Elements a:b of positions first, first+1, ..., last (mod k) combined in the ring's order: the
    partial the full ring holds there, bit for bit (each step adds the receiver's own share)."""
    k = len(inputs)
    value = _slice(inputs[first], a, b).clone()
    r = first
    while r != last:
        r = (r + 1) % k
        value = _combine(value, _slice(inputs[r], a, b), op)
    return value


def _slice(t: torch.Tensor, a: int, b: int) -> torch.Tensor:
    return t.reshape(-1)[a:b]


def boundary_sends(inputs: list[torch.Tensor], v: int, sandbox: set[int], op: str
                   ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """What virtual position `v`, the left neighbour of a sandbox rank, sends at each reduce-scatter
    and all-gather step of the pruned ring, from every position's cached input.

    Reduce-scatter step s carries chunk (v - s): when every rank after v up to the chunk's owner
    is a sandbox rank, the partial the full ring would carry (so the sandbox ranks end with the
    full ring's bits, not only its value); otherwise zeros, as the chunk reaches no sandbox
    output. All-gather step s carries the complete chunk (v + 1 - s).
    """
    k = len(inputs)
    bounds = chunk_bounds(inputs[0].numel(), k)
    rs, ag = [], []
    for s in range(k - 1):
        c = (v - s) % k
        a, b = bounds[c]
        owner = (c - 1) % k
        path, r = [], v
        while r != owner:
            r = (r + 1) % k
            path.append(r)
        rs.append(fold(inputs, c, v, a, b, op) if all(p in sandbox for p in path)
                  else torch.zeros(b - a, dtype=inputs[0].dtype))
    for s in range(k - 1):
        c = (v + 1 - s) % k
        a, b = bounds[c]
        ag.append(fold(inputs, c, (c - 1) % k, a, b, op))
    return rs, ag


def ring_allreduce_pruned(k: int, sandbox: set[int], inputs: list[torch.Tensor], op: str
                          ) -> tuple[dict[int, torch.Tensor], Traffic]:
    """The pruned ring: the sandbox ranks' outputs and the traffic among the ranks that exist.

    `inputs[i]`: every position's input; the sandbox ranks use their own, their virtual left
    neighbours what `boundary_sends` builds from the others (the tensor cache, in a replay).
    """
    if not sandbox:
        return {}, {}
    bounds = chunk_bounds(inputs[0].numel(), k)
    own = {i: inputs[i].reshape(-1) for i in sandbox}
    members = ring_members(k, sandbox)
    virtual_sends = {i: boundary_sends(inputs, i, sandbox, op) for i in members
                     if i not in sandbox and (i + 1) % k in sandbox}
    partial = {i: {c: own[i][a:b].clone() for c, (a, b) in enumerate(bounds)} for i in sandbox}
    traffic: Traffic = {}
    for s in range(k - 1):
        sends = []
        for i in members:
            dst = (i + 1) % k
            if dst not in members or (i not in sandbox and dst not in sandbox):
                continue          # only links that touch a sandbox rank carry data
            c = (i - s) % k
            sends.append((i, dst, c, partial[i][c].clone() if i in sandbox else virtual_sends[i][0][s]))
        for i, dst, c, value in sends:
            traffic[("reduce_scatter", s, i, dst)] = _nbytes(value)
            if dst in sandbox:
                a, b = bounds[c]
                partial[dst][c] = _combine(value, own[dst][a:b], op)
    done = {i: {(i + 1) % k: partial[i][(i + 1) % k]} for i in sandbox}
    for s in range(k - 1):
        sends = []
        for i in members:
            dst = (i + 1) % k
            if dst not in members or (i not in sandbox and dst not in sandbox):
                continue
            c = (i + 1 - s) % k
            sends.append((i, dst, c, done[i][c] if i in sandbox else virtual_sends[i][1][s]))
        for i, dst, c, value in sends:
            traffic[("all_gather", s, i, dst)] = _nbytes(value)
            if dst in sandbox:
                done[dst][c] = value.clone()
    outputs = {i: torch.cat([done[i][c] for c in range(k)]).reshape(inputs[0].shape) for i in sandbox}
    return outputs, traffic


# -- all-gather and reduce-scatter rings ----------------------------------------------------------
#
# All-gather on k ranks: in step s rank i sends block (i - s) to i + 1 (its own input at s = 0);
# after k - 1 steps every rank holds every block. Pruned, a virtual left neighbour v sends block
# (v - s): member (v - s)'s input, from the tensor cache, exactly what v would have forwarded.
#
# Reduce-scatter: block c ends on rank c. In step s rank i sends its partial of block (i - 1 - s)
# to i + 1, which adds its own share: block c starts at rank c + 1 and its owner adds last.
# Pruned, v sends the full ring's partial of block (v - 1 - s), folded in ring order from the
# cache, when every rank after v up to the owner is a sandbox rank; zeros otherwise.

def _block(t: torch.Tensor, b: int, n: int) -> torch.Tensor:
    return t.reshape(-1)[b * n:(b + 1) * n]


def allgather_sends(inputs: list[torch.Tensor], v: int) -> list[torch.Tensor]:
    k = len(inputs)
    return [inputs[(v - s) % k].reshape(-1) for s in range(k - 1)]


def reduce_scatter_sends(inputs: list[torch.Tensor], v: int, sandbox: set[int], op: str) -> list[torch.Tensor]:
    k = len(inputs)
    n = inputs[0].numel() // k
    out = []
    for s in range(k - 1):
        b = (v - 1 - s) % k
        path, r = [], v
        while r != b:
            r = (r + 1) % k
            path.append(r)
        out.append(fold(inputs, (b + 1) % k, v, b * n, (b + 1) * n, op) if all(p in sandbox for p in path)
                   else torch.zeros(n, dtype=inputs[0].dtype))
    return out


def _links(k: int, members: set[int], sandbox: set[int] | None):
    """(src, dst) of the ring links that carry data: all, or those touching a sandbox rank."""
    for i in sorted(members):
        dst = (i + 1) % k
        if dst in members and (sandbox is None or i in sandbox or dst in sandbox):
            yield i, dst


def ring_allgather(inputs: list[torch.Tensor], sandbox: set[int] | None = None
                   ) -> tuple[dict[int, torch.Tensor], Traffic]:
    """Every rank's output (the sandbox ranks', when pruned to `sandbox`) and the traffic."""
    k = len(inputs)
    real = set(range(k)) if sandbox is None else set(sandbox)
    members = set(range(k)) if sandbox is None else ring_members(k, sandbox)
    virtual = {v: allgather_sends(inputs, v) for v in members - real if (v + 1) % k in real}
    have = {i: {i: inputs[i].reshape(-1).clone()} for i in real}
    traffic: Traffic = {}
    for s in range(k - 1):
        sends = [(i, dst, (i - s) % k, have[i][(i - s) % k] if i in real else virtual[i][s])
                 for i, dst in _links(k, members, sandbox)]
        for i, dst, b, value in sends:
            traffic[("all_gather", s, i, dst)] = _nbytes(value)
            if dst in real:
                have[dst][b] = value.clone()
    return {i: torch.cat([have[i][b] for b in range(k)]) for i in real}, traffic


def ring_reduce_scatter(inputs: list[torch.Tensor], op: str, sandbox: set[int] | None = None
                        ) -> tuple[dict[int, torch.Tensor], Traffic]:
    """Every rank's block of the reduction (the sandbox ranks', when pruned) and the traffic."""
    k = len(inputs)
    n = inputs[0].numel() // k
    real = set(range(k)) if sandbox is None else set(sandbox)
    members = set(range(k)) if sandbox is None else ring_members(k, sandbox)
    virtual = {v: reduce_scatter_sends(inputs, v, real, op) for v in members - real if (v + 1) % k in real}
    partial: dict[tuple[int, int], torch.Tensor] = {}
    traffic: Traffic = {}
    for s in range(k - 1):
        sends = []
        for i, dst in _links(k, members, sandbox):
            b = (i - 1 - s) % k
            if i in real:
                value = _block(inputs[i], b, n).clone() if s == 0 else partial.pop((i, b))
            else:
                value = virtual[i][s]
            sends.append((i, dst, b, value))
        for i, dst, b, value in sends:
            traffic[("reduce_scatter", s, i, dst)] = _nbytes(value)
            if dst in real:
                partial[(dst, b)] = _combine(value, _block(inputs[dst], b, n), op)
    return {i: partial[(i, i)] for i in real}, traffic


def traffic_of(traffic: Traffic, rank: int) -> dict[tuple[str, int, str], int]:
    """What one rank sends and receives at each step: (phase, step, "send"|"recv") -> bytes."""
    out = {}
    for (phase, step, src, dst), nbytes in traffic.items():
        if src == rank:
            out[(phase, step, "send")] = nbytes
        if dst == rank:
            out[(phase, step, "recv")] = nbytes
    return out


# -- trees ---------------------------------------------------------------------------------------

def _tree(k: int, root: int) -> tuple[dict[int, int], dict[int, list[int]]]:
    """Binary tree over positions 0..k-1 rooted at `root` (positions renumbered from the root)."""
    parent, children = {}, {i: [] for i in range(k)}
    for j in range(1, k):
        node, up = (root + j) % k, (root + (j - 1) // 2) % k
        parent[node] = up
        children[up].append(node)
    return parent, children


def tree_members(k: int, root: int, sandbox: set[int]) -> set[int]:
    parent, children = _tree(k, root)
    keep = set(sandbox)
    for i in sandbox:
        if i in parent:
            keep.add(parent[i])
        keep.update(children[i])
    return keep


def tree_broadcast(inputs: list[torch.Tensor], root: int, sandbox: set[int] | None = None
                   ) -> tuple[dict[int, torch.Tensor], Traffic]:
    """Broadcast down the tree; pruned to `sandbox` (a virtual parent sends the root's data)."""
    k = len(inputs)
    parent, _ = _tree(k, root)
    ranks = set(range(k)) if sandbox is None else tree_members(k, root, sandbox)
    traffic: Traffic = {}
    out = {root: inputs[root].clone()} if root in ranks else {}
    order = [(root + j) % k for j in range(1, k)]            # parents come before their children
    for node in order:
        up = parent[node]
        if node not in ranks or up not in ranks:
            continue
        if sandbox is not None and node not in sandbox and up not in sandbox:
            continue
        value = out[up] if up in out else inputs[root].clone()   # a virtual parent: the root's data
        traffic[("broadcast", 0, up, node)] = _nbytes(value)
        out[node] = value.clone()
    keep = ranks if sandbox is None else sandbox
    return {i: out[i] for i in keep if i in out}, traffic


def tree_reduce(inputs: list[torch.Tensor], root: int, op: str, sandbox: set[int] | None = None
                ) -> tuple[torch.Tensor | None, Traffic]:
    """Reduce up the tree to the root; pruned, a virtual child sends its subtree's whole reduction."""
    k = len(inputs)
    parent, children = _tree(k, root)
    ranks = set(range(k)) if sandbox is None else tree_members(k, root, sandbox)

    def subtree(node: int) -> torch.Tensor:
        return _reduce_all([inputs[node]] + [subtree(c) for c in children[node]], op)

    traffic: Traffic = {}
    acc: dict[int, torch.Tensor] = {}
    for node in reversed([(root + j) % k for j in range(k)]):   # children before parents
        if node not in ranks:
            continue
        real = sandbox is None or node in sandbox
        if real:
            value = inputs[node].clone()
            for c in children[node]:
                if c in acc:
                    value = _combine(value, acc.pop(c), op)
        else:
            value = subtree(node)            # from the tensor cache: exact for whatever is above
        up = parent.get(node)
        if up is None:
            acc[node] = value
            continue
        if up in ranks and (sandbox is None or real or up in sandbox):
            traffic[("reduce", 0, node, up)] = _nbytes(value)
            acc[node] = value
    return acc.get(root), traffic


BARRIER_TAG = 0x7FFF_FF00   # the point-to-point tag of the tree barrier's tokens (kept apart from programs' tags)
RING_TAG = 0x7FFF_FF01      # and of the ring all-reduce's chunks
TREE_TAG = 0x7FFF_FF02      # and of the tree broadcast's and reduce's


def tree_parent(position: int, k: int, root: int = 0) -> int | None:
    """The parent of `position` in `_tree(k, root)`, in O(1) (None for the root)."""
    j = (position - root) % k
    return None if j == 0 else (root + (j - 1) // 2) % k


def tree_children(position: int, k: int, root: int = 0) -> list[int]:
    j = (position - root) % k
    return [(root + c) % k for c in (2 * j + 1, 2 * j + 2) if c < k]


def subtree_of(position: int, k: int, root: int = 0):
    """Positions of the subtree under `position` (itself included), level by level: ranges of j."""
    lo = hi = (position - root) % k
    while lo < k:
        yield from ((root + j) % k for j in range(lo, min(hi, k - 1) + 1))
        lo, hi = 2 * lo + 1, 2 * hi + 2
