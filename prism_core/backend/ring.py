"""The prism backend's ring all-reduce over a group's point-to-point links (paper §6.3, Appendix D).

Every real run (record, slices, emulation) reduces with this ring, so a real run and an emulated
one move the same bytes, and a sandbox rank's virtual ring neighbours can prune the rest of the
ring away (`pruned.boundary_sends`). The schedule is `pruned.ring_allreduce`'s, done in place:
reduce-scatter step s sends the partial of chunk (me - s) and adds the left neighbour's partial
of chunk (me - 1 - s) into the tensor; all-gather step s sends chunk (me + 1 - s) and receives
chunk (me - s) straight into the tensor.

The receive buffer comes from numpy, not torch's allocator: like gloo's own buffers it stays out
of the peak-memory count, which would otherwise depend on when this thread ran. Rings of one
group run one at a time, in issue order, on the group's worker thread, so successive rings on
the same tag cannot interleave.
"""

from __future__ import annotations

import queue
import threading

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


class RingWork:
    """The work of one ring: its future completes (with the op's tensors) when the ring is done."""

    def __init__(self):
        self.future = torch.futures.Future()

    def wait(self, timeout=None) -> bool:
        self.future.wait()       # raises the ring's error, if it failed
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

    def submit(self, pg, tensors: list[torch.Tensor], me: int, k: int, op: str) -> RingWork:
        work = RingWork()
        self._queue.put((pg, tensors, me, k, op, work))
        return work

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            _run_one(*item)
            del item         # the tensors go with the work, not with this thread

    def close(self) -> None:
        self._queue.put(None)


def _run_one(pg, tensors: list[torch.Tensor], me: int, k: int, op: str, work: RingWork) -> None:
    t = tensors[0]
    try:
        flat = t.view(-1) if t.is_contiguous() else t.contiguous().view(-1)
        ring_allreduce_inplace(pg, flat, me, k, op)
        if not t.is_contiguous():
            t.copy_(flat.view(t.shape))
    except BaseException as err:  # noqa: BLE001 - handed to whoever waits on the work
        work.future.set_exception(err)
        return
    work.future.set_result(tensors)
