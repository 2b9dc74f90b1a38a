"""The virtual side of the prism backend's tree barrier, pruned to the sandbox ranks' neighbours.

The backend's barrier passes a token up a binary tree to position 0 and back down (see
`PrismProcessGroup._tree_barrier`). In a replay only the virtual ranks next to a sandbox rank
talk to it: a virtual child sends its token up once every rank of its subtree has arrived, a
virtual parent takes the sandbox rank's token and sends the release down once the whole group
has arrived. Every other virtual member only counts as arrived; nobody else exists on the wire.
Readiness is counted, not walked: each arrival decrements the counters of its few relevant
ancestors, so one barrier costs O(k log k) at most for a group of k ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prism_core.backend.pruned import subtree_of, tree_children, tree_parent


@dataclass
class BarrierShape:
    """Who talks to whom in a group's pruned barrier (positions in the group)."""
    k: int
    sandbox: frozenset[int]
    up_to_sandbox: dict[int, int]            # virtual child -> its sandbox parent
    from_sandbox: dict[int, list[int]]       # virtual parent -> its sandbox children
    counts: dict[int, int]                   # relevant virtual node -> items in its subtree

    @property
    def neighbours(self) -> set[int]:
        return set(self.up_to_sandbox) | set(self.from_sandbox)


def barrier_shape(k: int, sandbox: set[int], present=None) -> BarrierShape:
    """The barrier's shape; `present(position)`: whether a virtual member is replayed at all (a
    replay hosting the sandbox ranks' neighbours only does not wait for the others); None: all are."""
    up, down = {}, {}
    for q in sandbox:
        p = tree_parent(q, k)
        if p is not None and p not in sandbox:
            down.setdefault(p, []).append(q)
        for c in tree_children(q, k):
            if c not in sandbox:
                up[c] = q
    relevant = set(up) | ({0} if 0 not in sandbox else set())
    counts = {}
    for v in relevant:   # items: virtual ranks, and sandbox ranks whose token comes to a virtual parent
        counts[v] = sum(1 for m in subtree_of(v, k) if (m not in sandbox and (present is None or present(m)))
                        or (m in sandbox and tree_parent(m, k) not in sandbox))
    return BarrierShape(k, frozenset(sandbox), up, {p: sorted(qs) for p, qs in down.items()}, counts)


@dataclass
class PrunedBarrier:
    """One barrier op in progress. `send(position, to_position)` and the caller's posted receives
    move the tokens; `release()` is called once, when the whole group has arrived."""
    shape: BarrierShape
    send_up: object      # callable(virtual child, sandbox parent)
    release: object      # callable()
    pending: dict[int, int] = field(default_factory=dict)
    released: bool = False
    handles: list = field(default_factory=list)   # the virtual members' op handles, completed at release

    def __post_init__(self):
        self.pending = dict(self.shape.counts)

    def ready(self, position: int) -> None:
        """A virtual member arrived, or a sandbox member's token reached its virtual parent."""
        a = position
        while a is not None:
            if a in self.pending:
                self.pending[a] -= 1
                if self.pending[a] == 0:
                    if a in self.shape.up_to_sandbox:
                        self.send_up(a, self.shape.up_to_sandbox[a])
                    elif a == 0:
                        self.settle()
            a = tree_parent(a, self.shape.k)

    def settle(self) -> None:
        """The group has arrived (the virtual root counted everyone, or a sandbox parent sent the release)."""
        if not self.released:
            self.released = True
            self.release()
