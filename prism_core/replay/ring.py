"""The virtual side of the backend's rings (all-reduce, all-gather, reduce-scatter), pruned to the
sandbox ranks' ring neighbours.

A sandbox rank at ring position p talks to p - 1 and p + 1 only. When one of them is virtual,
the assistant plays it: a left neighbour (p - 1) sends, step by step, what `pruned` builds from
the tensor cache (the full ring's partials and blocks, so the sandbox rank ends with the full
ring's bits); a right neighbour (p + 1) takes what the sandbox rank sends. A virtual rank that
is both (a sandbox rank on each side) paces its sends on its receives, as the real ring does.
Nobody else in the group exists on the wire. The part starts once every virtual member of the
group has arrived at the op, as no member of the real ring could finish before that.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field

import torch

from prism_core.backend.pruned import (
    RING_TAG, allgather_sends, boundary_sends, chunk_bounds, reduce_scatter_sends,
)


def ring_neighbours(k: int, sandbox: set[int]) -> set[int]:
    """Virtual positions next to a sandbox position on the ring."""
    return {(p + d) % k for p in sandbox for d in (-1, 1)} - set(sandbox)


@dataclass
class RingPart:
    """What virtual position `me` of a k-ring does in one all-reduce, all-gather or reduce-scatter."""
    kind: str                      # "allreduce" | "all_gather" | "reduce_scatter"
    me: int
    k: int
    sandbox: frozenset[int]
    op: str
    numel: int                     # elements of each member's input
    dtype: torch.dtype
    load: Callable[[], list[torch.Tensor]]    # every position's input (cached, or zeros), flat
    _ready: tuple | None = field(default=None, init=False, repr=False, compare=False)   # prepare()'s
    _building: Future | None = field(default=None, init=False, repr=False, compare=False)

    def prepare_on(self, executor: Executor) -> None:
        """Start building the part on `executor`, ahead of its op (timed mode: while its virtual
        member still computes); `prepare` then waits for it."""
        if self._ready is None and self._building is None:
            self._building = executor.submit(self._build)

    def prepare(self) -> None:
        """Build what this member sends (from the cache) and the buffers it receives into. A real
        ring member has its data at hand when it arrives: the assistant prepares a part before it
        stamps the member's arrival, so that the building is not taken for transfer time, and in
        timed mode starts it while the member computes (`prepare_on`), so that it does not make
        the member late either."""
        building, self._building = self._building, None
        if building is not None:
            building.result()                 # an error building it is raised here
        self._build()

    def _build(self) -> None:
        if self._ready is None:
            k, me = self.k, self.me
            sends = self._sends() if (me + 1) % k in self.sandbox else None
            recvs = None
            if (me - 1) % k in self.sandbox:   # what the sandbox rank sends, step by step
                recvs = [torch.empty(n, dtype=self.dtype) for n in self._received_sizes()]
            self._ready = (sends, recvs)

    def run(self, pg) -> tuple[list, list]:
        """Issue the part on this member's gloo group; returns (works, tensors to keep alive).
        A member between two sandbox ranks runs its steps here, in order, and returns no work."""
        k, me = self.k, self.me
        left, right = (me - 1) % k, (me + 1) % k
        self.prepare()
        sends, recvs = self._ready
        self._ready = None
        if sends is not None and recvs is not None:
            for out, into in zip(sends, recvs):
                work = pg.send([out], right, RING_TAG)
                pg.recv([into], left, RING_TAG).wait()
                work.wait()
            return [], []
        if sends is not None:
            return [pg.send([t], right, RING_TAG) for t in sends], sends
        return [pg.recv([t], left, RING_TAG) for t in recvs], recvs

    def _sends(self) -> list[torch.Tensor]:
        inputs, sandbox = self.load(), set(self.sandbox)
        if self.kind == "allreduce":
            rs, ag = boundary_sends(inputs, self.me, sandbox, self.op)
            return rs + ag
        if self.kind == "all_gather":
            return allgather_sends(inputs, self.me)
        return reduce_scatter_sends(inputs, self.me, sandbox, self.op)

    def _received_sizes(self) -> list[int]:
        k, me = self.k, self.me
        if self.kind == "allreduce":
            bounds = chunk_bounds(self.numel, k)
            order = [(me - 1 - s) % k for s in range(k - 1)] + [(me - s) % k for s in range(k - 1)]
            return [bounds[c][1] - bounds[c][0] for c in order]
        if self.kind == "all_gather":
            return [self.numel] * (k - 1)
        return [self.numel // k] * (k - 1)
