"""The virtual side of the backend's ring all-reduce, pruned to the sandbox ranks' ring neighbours.

A sandbox rank at ring position p talks to p - 1 and p + 1 only. When one of them is virtual,
the assistant plays it: a left neighbour (p - 1) sends, step by step, what `pruned.boundary_sends`
builds from the tensor cache (the full ring's partials, so the sandbox rank ends with the full
ring's bits); a right neighbour (p + 1) takes what the sandbox rank sends. A virtual rank that
is both (a sandbox rank on each side) paces its sends on its receives, as the real ring does.
Nobody else in the group exists on the wire. The part starts once every virtual member of the
group has arrived at the op, as no member of the real ring could finish before that.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from prism_core.backend.pruned import RING_TAG, boundary_sends, chunk_bounds


def ring_neighbours(k: int, sandbox: set[int]) -> set[int]:
    """Virtual positions next to a sandbox position on the ring."""
    return {(p + d) % k for p in sandbox for d in (-1, 1)} - set(sandbox)


@dataclass
class RingPart:
    """What virtual position `me` of a k-ring does in one all-reduce."""
    me: int
    k: int
    sandbox: frozenset[int]
    op: str
    numel: int
    dtype: torch.dtype
    load: Callable[[], list[torch.Tensor]]    # every position's input (cached, or zeros), flat

    def run(self, pg) -> tuple[list, list]:
        """Issue the part on this member's gloo group; returns (works, tensors to keep alive).
        A member between two sandbox ranks runs its steps here, in order, and returns no work."""
        k, me = self.k, self.me
        left, right = (me - 1) % k, (me + 1) % k
        sends = boundary_sends(self.load(), me, set(self.sandbox), self.op) if right in self.sandbox else None
        bounds = chunk_bounds(self.numel, k)
        dtype = self.dtype
        recvs = None
        if left in self.sandbox:   # the chunks the sandbox rank sends: reduce-scatter, then all-gather
            order = [(me - 1 - s) % k for s in range(k - 1)] + [(me - s) % k for s in range(k - 1)]
            recvs = [torch.empty(bounds[c][1] - bounds[c][0], dtype=dtype) for c in order]
        if sends is not None and recvs is not None:
            for out, into in zip(sends[0] + sends[1], recvs):
                work = pg.send([out], right, RING_TAG)
                pg.recv([into], left, RING_TAG).wait()
                work.wait()
            return [], []
        if sends is not None:
            outs = sends[0] + sends[1]
            return [pg.send([t], right, RING_TAG) for t in outs], outs
        return [pg.recv([t], left, RING_TAG) for t in recvs], recvs
