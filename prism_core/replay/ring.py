"""The virtual side of the backend's rings (all-reduce, all-gather, reduce-scatter), pruned to the
sandbox ranks' ring neighbours.

A sandbox rank at ring position p talks to p - 1 and p + 1 only. When one of them is virtual,
the assistant plays it: a left neighbour (p - 1) sends, step by step, what `pruned` builds from
the tensor cache (the full ring's partials and blocks, so the sandbox rank ends with the full
ring's bits); a right neighbour (p + 1) takes what the sandbox rank sends. A virtual rank that
is both (a sandbox rank on each side) paces its sends on its receives, as the real ring does, and
after each receive of a reduce step combines it with its own input's chunk, as a real member
does before it sends on (`combine_work`): what it sends comes from the cache, so the combine
changes no bit, only its time, which the sandbox rank waits for. Nobody else in the group exists
on the wire. The part starts once every virtual member of the group has arrived at the op, as no
member of the real ring could finish before that.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field

import torch

from prism_core.backend.pruned import (
    RING_TAG, allgather_sends, boundary_sends, chunk_bounds, reduce_scatter_sends,
)
from prism_core.backend.ring import combine_into


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
    combine_work: bool = True      # between two sandbox ranks: combine each reduce step's receive
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
            inputs = self.load() if (me + 1) % k in self.sandbox else None
            sends = self._sends(inputs) if inputs is not None else None
            recvs = combine = None
            if (me - 1) % k in self.sandbox:   # what the sandbox rank sends, step by step
                recvs = [torch.empty(n, dtype=self.dtype) for n in self._received_sizes()]
                if inputs is not None and self.combine_work:
                    combine = self._own_chunks(inputs[me])
            self._ready = (sends, recvs, combine)

    def run(self, pg) -> tuple[list, list]:
        """Issue the part on this member's gloo group; returns (works, tensors to keep alive).
        A member between two sandbox ranks runs its steps here, in order, and returns no work."""
        k, me = self.k, self.me
        left, right = (me - 1) % k, (me + 1) % k
        self.prepare()
        sends, recvs, combine = self._ready
        self._ready = None
        if sends is not None and recvs is not None:
            for s, (out, into) in enumerate(zip(sends, recvs)):
                work = pg.send([out], right, RING_TAG)
                pg.recv([into], left, RING_TAG).wait()
                work.wait()
                if combine is not None and s < len(combine):
                    combine_into(into, combine[s], self.op)     # its time only: the receive is not kept
            return [], []
        if sends is not None:
            return [pg.send([t], right, RING_TAG) for t in sends], sends
        return [pg.recv([t], left, RING_TAG) for t in recvs], recvs

    def _own_chunks(self, mine: torch.Tensor) -> list[torch.Tensor]:
        """The chunks of this member's own input a real member combines its receives with, one per
        reduce step (backend/ring.py): all-reduce's reduce-scatter steps, every reduce-scatter step;
        none for an all-gather."""
        k, me = self.k, self.me
        if self.kind == "allreduce":
            bounds = chunk_bounds(self.numel, k)
            return [mine[bounds[(me - 1 - s) % k][0]:bounds[(me - 1 - s) % k][1]] for s in range(k - 1)]
        if self.kind == "reduce_scatter":
            n = self.numel // k
            return [mine[((me - 2 - s) % k) * n:((me - 2 - s) % k + 1) * n] for s in range(k - 1)]
        return []

    def _sends(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        sandbox = set(self.sandbox)
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
