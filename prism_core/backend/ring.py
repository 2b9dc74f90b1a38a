"""The prism backend's rings over a group's point-to-point links (paper §6.3, Appendix D).

Every real run (record, slices, emulation) runs all-reduce, all-gather and reduce-scatter as
these rings, so a real run and an emulated one move the same bytes, and a sandbox rank's
virtual ring neighbours can prune the rest of the ring away (`pruned`, `replay.ring`). The
schedules are `pruned.ring_allreduce`'s, `ring_allgather`'s and `ring_reduce_scatter`'s, done in
place: all-reduce's reduce-scatter step s sends the partial of chunk (me - s) and adds the left
neighbour's partial of chunk (me - 1 - s) into the tensor, its all-gather step s sends chunk
(me + 1 - s) and receives chunk (me - s) straight into the tensor; an all-gather receives each
block straight into the output; a reduce-scatter passes partials through two buffers and
receives the last one into the output.

The receive buffer comes from numpy, not torch's allocator: like gloo's own buffers it stays out
of the peak-memory count, which would otherwise depend on when this thread ran. Rings of one
group run one at a time, in issue order, on the group's worker thread, so successive rings on
the same tag cannot interleave.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import numpy as np
import torch

from prism_core.backend.pruned import RING_TAG, chunk_bounds


def combine_into(dst: torch.Tensor, src: torch.Tensor, op: str) -> None:
    if op == "sum":
        dst.add_(src)
    elif op == "max":
        torch.maximum(dst, src, out=dst)
    else:
        torch.minimum(dst, src, out=dst)


def scratch(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A buffer of `numel` elements outside torch's allocator (see the module docstring)."""
    size = torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.empty(numel * size, dtype=np.uint8)).view(dtype)


def ring_allreduce_inplace(pg, flat: torch.Tensor, me: int, k: int, op: str) -> None:
    """Run the ring on `pg` (a gloo group of k ranks, this one at position `me`) over the 1-D `flat`."""
    bounds = chunk_bounds(flat.numel(), k)
    right, left = (me + 1) % k, (me - 1) % k
    buf = scratch(max(b - a for a, b in bounds), flat.dtype)
    for s in range(k - 1):
        a, b = bounds[(me - s) % k]
        send = pg.send([flat[a:b]], right, RING_TAG)
        a, b = bounds[(me - 1 - s) % k]
        into = buf[:b - a]
        pg.recv([into], left, RING_TAG).wait()
        send.wait()
        combine_into(flat[a:b], into, op)
    for s in range(k - 1):
        a, b = bounds[(me + 1 - s) % k]
        send = pg.send([flat[a:b]], right, RING_TAG)
        a, b = bounds[(me - s) % k]
        pg.recv([flat[a:b]], left, RING_TAG).wait()
        send.wait()


def ring_allgather_inplace(pg, blocks: list[torch.Tensor], me: int, k: int) -> None:
    """`blocks[me]` holds this rank's input; the others are filled from the left neighbour."""
    right, left = (me + 1) % k, (me - 1) % k
    for s in range(k - 1):
        send = pg.send([blocks[(me - s) % k]], right, RING_TAG)
        pg.recv([blocks[(me - 1 - s) % k]], left, RING_TAG).wait()
        send.wait()


def ring_reduce_scatter_inplace(pg, blocks: list[torch.Tensor], out: torch.Tensor, me: int, k: int,
                                op: str) -> None:
    """`blocks`: this rank's input, block b going to rank b; `out` receives block `me` reduced."""
    right, left = (me + 1) % k, (me - 1) % k
    bufs = [scratch(out.numel(), out.dtype) for _ in range(2)]
    outgoing = blocks[(me - 1) % k]
    for s in range(k - 1):
        into = out if s == k - 2 else bufs[s % 2]
        send = pg.send([outgoing], right, RING_TAG)
        pg.recv([into], left, RING_TAG).wait()
        send.wait()
        combine_into(into, blocks[(me - 2 - s) % k], op)
        outgoing = into


class RingWork:
    """The work of one ring: its future completes (with the op's tensors) when the ring is done."""

    def __init__(self):
        self.future = torch.futures.Future()
        self.finished = threading.Event()     # set once the ring's thread holds nothing of the op

    def wait(self, timeout=None) -> bool:
        self.future.wait()       # raises the ring's error, if it failed
        self.finished.wait()
        return True

    def is_completed(self) -> bool:
        return self.future.done()

    def get_future(self):
        return self.future


class RingRunner:
    """One daemon thread per group that runs its rings in issue order."""

    def __init__(self, name: str):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=f"prism-ring-{name}", daemon=True)
        self._thread.start()

    def submit(self, run: Callable[[], None], result: list[torch.Tensor]) -> RingWork:
        """Queue `run` (one ring); the work's future gets `result` (the op's output tensors)."""
        work = RingWork()
        self._queue.put([run, result, work])
        return work

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            _run_one(item)
            del item

    def close(self) -> None:
        self._queue.put(None)


def _run_one(item: list) -> None:
    """Run one ring; complete the future; drop every reference this thread holds; then let the
    program's wait return. A tensor the program lets go of right after its wait must be freed on
    the program's thread, at the same point of every run, or the peak-memory count would depend
    on this thread's timing."""
    run, result, work = item
    item.clear()
    error = None
    try:
        run()
    except BaseException as err:  # noqa: BLE001 - handed to whoever waits on the work
        error = err
    del run
    if error is None:
        work.future.set_result(result)
    else:
        work.future.set_exception(error)
    del result, error
    work.finished.set()
