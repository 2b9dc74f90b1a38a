"""The virtual side of the backend's trees (broadcast, reduce, small all-reduce), pruned to the
sandbox ranks' tree neighbours.

A sandbox rank at tree position p talks to its parent and its children only; the assistant
plays those that are virtual, one `TreePart` each, all sharing the op's `TreeOp`. Nobody else
in the group exists on the wire; what the pruned ranks would have computed is computed here:

- reduce (and the all-reduce's first half, to position 0): a virtual parent receives each
  sandbox child's partial; a virtual child of a sandbox rank sends its subtree's reduction,
  folded in the tree's order — its own input, then each child's subtree in turn — from the
  tensor cache for virtual ranks and from what the wire brought for sandbox ones, so every
  sandbox rank ends with the full tree's bits;
- broadcast (and the all-reduce's second half): a virtual child of a sandbox rank receives from
  it; a virtual parent sends what reaches it: what the nearest sandbox ancestor sent down (the
  part below that ancestor received it), or, with no sandbox ancestor, the root's cached input
  (the whole reduction, for the all-reduce).

A part waits in-process for what it needs (another part's receive), so a sandbox rank below
another is paced by it, as in the full tree. The parts start once every virtual member of the
group has arrived at the op, as for the rings. A virtual member's op completes when what it
depends on in the full tree has happened (`TreeOp.depends`): in a broadcast, the data reaching
it; in a reduce, its subtree's sandbox ranks having sent; in the all-reduce, everything; and
its own part, if it has one. So a member that needs no sandbox rank finishes at once, and may
go on to talk to a sandbox rank that has not yet reached the op, as in the real run.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future

import torch

from prism_core.backend.pruned import TREE_TAG, _combine, tree_children, tree_parent


def tree_neighbours(k: int, root: int, sandbox: set[int]) -> set[int]:
    """Virtual positions next to a sandbox position in the tree rooted at `root`."""
    out = set()
    for p in sandbox:
        parent = tree_parent(p, k, root)
        if parent is not None:
            out.add(parent)
        out.update(tree_children(p, k, root))
    return out - set(sandbox)


class TreeOp:
    """What the parts of one tree op share: inputs, what the wire brought, the root's reduction."""

    def __init__(self, kind: str, k: int, root: int, sandbox: frozenset[int], op: str, numel: int,
                 dtype: torch.dtype, load: Callable[[int], torch.Tensor]):
        self.kind, self.k, self.root, self.sandbox = kind, k, root, sandbox
        self.op, self.numel, self.dtype, self.load = op, numel, dtype, load
        self.up: dict[int, Future] = {p: Future() for p in sandbox}      # sandbox p's partial, received by its parent
        self.down: dict[int, Future] = {}                                # what virtual v received from its parent
        self.done: dict[int, Future] = {}                                # each part: finished
        self._root_value: Future | None = None
        self._lock = threading.Lock()
        # the sandbox ranks and their ancestors (whose subtrees hold a sandbox rank), and per virtual
        # node the sandbox ranks whose partials pass through it on the way up (a walk stops at the
        # first sandbox ancestor, whose own partial carries them on)
        self._paths: set[int] = set()
        self._below: dict[int, list[int]] = {}
        for q in sandbox:
            node = q
            while node is not None and node not in self._paths:
                self._paths.add(node)
                node = tree_parent(node, k, root)
            up = tree_parent(q, k, root)
            while up is not None and up not in sandbox:
                self._below.setdefault(up, []).append(q)
                up = tree_parent(up, k, root)

    def value(self, node: int) -> torch.Tensor:
        """`node`'s subtree reduction as the full tree folds it. Each node's is asked for once (by
        its parent's, or by its own part), except the root's, which several parts may need."""
        if node in self.sandbox:
            return self.up[node].result()
        if node != self.root:
            return self._fold(node)
        with self._lock:
            mine = self._root_value is None
            if mine:
                self._root_value = Future()
            found = self._root_value
        if not mine:
            return found.result()
        try:
            found.set_result(self._fold(node))
        except BaseException as err:
            found.set_exception(err)
            raise
        return found.result()

    def _fold(self, node: int) -> torch.Tensor:
        if node not in self._paths:
            return self._fold_virtual(node)
        acc = self.load(node)          # `_combine` makes new tensors: the loaded one stays as it is
        for c in tree_children(node, self.k, self.root):
            acc = _combine(acc, self.value(c), self.op)
        return acc

    def _fold_virtual(self, top: int) -> torch.Tensor:
        """The reduction of a subtree of virtual ranks only, a level at a time from the bottom up:
        each node's input, then its first child's value, then its second's — per element the
        same operations in the same order as node by node, so the same bits."""
        k, root = self.k, self.root
        levels = []                                  # (first j, last j) of each level, j = position - root
        lo = hi = (top - root) % k
        while lo < k:
            levels.append((lo, min(hi, k - 1)))
            lo, hi = 2 * lo + 1, 2 * hi + 2
        below = None                                 # values of the level under the current one
        for lo, hi in reversed(levels):
            # row by row into one tensor: a list of every position's loaded tensor, stacked, held
            # thousands of tensor objects at once at W=16,384
            acc = torch.empty((hi - lo + 1, self.numel), dtype=self.dtype)
            for j in range(lo, hi + 1):
                acc[j - lo] = self.load((root + j) % k)
            if below is not None:
                child_lo = 2 * lo + 1
                j = torch.arange(lo, hi + 1)
                for first in (1, 2):
                    c = 2 * j + first
                    has = c < k
                    if bool(has.any()):
                        acc[has] = _combine(acc[has], below[c[has] - child_lo], self.op)
            below = acc
        return below[0]

    def _from_sandbox(self, node: int) -> int | None:
        """The virtual child of `node`'s nearest sandbox ancestor on its path (the part that receives
        what that ancestor sends down), or None when no ancestor is a sandbox rank."""
        below, up = node, tree_parent(node, self.k, self.root)
        while up is not None and up not in self.sandbox:
            below, up = up, tree_parent(up, self.k, self.root)
        return None if up is None else below

    def data_at(self, node: int) -> torch.Tensor:
        """What virtual `node` holds once the broadcast passed it."""
        below = self._from_sandbox(node)
        if below is not None:
            return self.down_future(below).result()
        if self.kind == "tree_broadcast":
            return self.load(self.root)
        return self.value(self.root)

    def down_future(self, node: int) -> Future:
        with self._lock:
            return self.down.setdefault(node, Future())

    def part(self, me: int) -> TreePart:
        self.done[me] = Future()
        return TreePart(self, me)

    def depends(self, node: int) -> list[Future]:
        """What virtual `node`'s op waits for before it completes (call once every part exists)."""
        if self.kind == "tree_allreduce":
            return list(self.done.values())
        out = [self.done[node]] if node in self.done else []
        if self.kind == "tree_broadcast":
            below = self._from_sandbox(node)
            return out if below is None else out + [self.down_future(below)]
        return out + [self.up[q] for q in self._below.get(node, ())]


class TreePart:
    """Virtual position `me`'s sends and receives in one tree op, run in order on its gloo group."""

    def __init__(self, tree: TreeOp, me: int):
        self.tree, self.me = tree, me

    def run(self, pg) -> tuple[list, list]:
        t, me = self.tree, self.me
        parent = tree_parent(me, t.k, t.root)
        kids = [c for c in tree_children(me, t.k, t.root) if c in t.sandbox]
        done = t.done[me]
        try:
            if t.kind in ("tree_reduce", "tree_allreduce"):
                for q in kids:
                    buf = torch.empty(t.numel, dtype=t.dtype)
                    pg.recv([buf], q, TREE_TAG).wait()
                    t.up[q].set_result(buf)
                if parent is not None and parent in t.sandbox:
                    pg.send([t.value(me)], parent, TREE_TAG).wait()
            if t.kind in ("tree_broadcast", "tree_allreduce"):
                if parent is not None and parent in t.sandbox:
                    buf = torch.empty(t.numel, dtype=t.dtype)
                    pg.recv([buf], parent, TREE_TAG).wait()
                    t.down_future(me).set_result(buf)
                if kids:
                    data = t.data_at(me)
                    for work in [pg.send([data], q, TREE_TAG) for q in kids]:
                        work.wait()
        except BaseException as err:
            # whoever waits on this part's receives must not wait for ever
            for q in kids:
                if not t.up[q].done():
                    t.up[q].set_exception(err)
            future = t.down_future(me)
            if not future.done():
                future.set_exception(err)
            done.set_exception(err)
            raise
        done.set_result(None)
        return [], []
