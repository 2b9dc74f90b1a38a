"""The prism backend's trees over a group's point-to-point links (paper §6.3, Appendix D).

Every real run broadcasts, reduces, and all-reduces a tensor smaller than the group (too small
for the ring) along `pruned`'s binary tree, so that an emulated rank of interest can talk to its
tree parent and children alone (`replay.tree`). Broadcast: receive from the parent, then send
to each child. Reduce: fold each child's subtree into this rank's value in turn (the order
`pruned.tree_reduce` uses), then send it to the parent; only the root's tensor changes. The
small all-reduce is a reduce to position 0 followed by a broadcast from it. They run on the
group's ring thread (`ring.RingRunner`), in issue order with the rings; receive buffers live
outside torch's allocator, as the rings' do.
"""

from __future__ import annotations

import torch

from prism_core.backend.pruned import TREE_TAG, tree_children, tree_parent
from prism_core.backend.ring import combine_into, scratch


def tree_broadcast_inplace(pg, flat: torch.Tensor, me: int, k: int, root: int) -> None:
    """`flat` (1-D, contiguous) ends holding the root's data on every position."""
    parent = tree_parent(me, k, root)
    if parent is not None:
        pg.recv([flat], parent, TREE_TAG).wait()
    for work in [pg.send([flat], c, TREE_TAG) for c in tree_children(me, k, root)]:
        work.wait()


def tree_reduce_into(pg, flat: torch.Tensor, acc: torch.Tensor, me: int, k: int, root: int, op: str) -> None:
    """`acc` (a copy of this rank's input) ends holding its subtree's reduction, which went to the
    parent; on the root, the whole group's."""
    children = tree_children(me, k, root)
    if children:
        buf = scratch(flat.numel(), flat.dtype)
        for c in children:
            pg.recv([buf], c, TREE_TAG).wait()
            combine_into(acc, buf, op)
    parent = tree_parent(me, k, root)
    if parent is not None:
        pg.send([acc], parent, TREE_TAG).wait()


def tree_reduce_inplace(pg, flat: torch.Tensor, me: int, k: int, root: int, op: str) -> None:
    """The root's `flat` ends holding the reduction; the others' keep their input."""
    acc = scratch(flat.numel(), flat.dtype)
    acc.copy_(flat)
    tree_reduce_into(pg, flat, acc, me, k, root, op)
    if me == root:
        flat.copy_(acc)


def tree_allreduce_inplace(pg, flat: torch.Tensor, me: int, k: int, op: str) -> None:
    """Reduce to position 0, then broadcast from it."""
    tree_reduce_into(pg, flat, flat, me, k, 0, op)
    tree_broadcast_inplace(pg, flat, me, k, 0)
