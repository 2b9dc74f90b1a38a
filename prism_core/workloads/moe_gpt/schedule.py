"""Pipeline schedules: Megatron's 1F1B and interleaved orders, and an executor over explicit p2p.

`pipeline_order` gives one pp rank's sequence of forward/backward steps exactly as Megatron's
`forward_backward_pipelining_without_interleaving` / `..._with_interleaving` order them
(warm-up forwards, steady one-forward-one-backward, cool-down backwards). The executor moves
activations forward and gradients backward with `isend`/`irecv` (tag 0 activations, tag 1
gradients): sends are asynchronous and completed at the end of the step, receives are waited
right before the step that consumes them. With `overlap_p2p` the receive for the next step is
posted before the current step computes, so the transfer overlaps compute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from prism_core.annotations import annotate

ACTIVATION_TAG, GRADIENT_TAG = 0, 1


@dataclass(frozen=True)
class Step:
    kind: str  # "F" or "B"
    chunk: int  # virtual stage index on this pp rank
    mb: int


def pipeline_order(pp: int, vpp: int, microbatches: int, pp_rank: int) -> list[Step]:
    m = microbatches
    if pp == 1:
        return [s for i in range(m) for s in (Step("F", 0, i), Step("B", 0, i))]
    if vpp == 1:
        warmup = min(pp - pp_rank - 1, m)
        order = [Step("F", 0, i) for i in range(warmup)]
        for i in range(m - warmup):
            order += [Step("F", 0, warmup + i), Step("B", 0, i)]
        return order + [Step("B", 0, i) for i in range(m - warmup, m)]
    total = m * vpp
    group = pp * vpp
    warmup = total if m == pp else min((pp - pp_rank - 1) * 2 + (vpp - 1) * pp, total)

    def mb(k):
        return (k // group) * pp + k % pp

    def fwd(k):
        return Step("F", (k % group) // pp, mb(k))

    def bwd(k):
        return Step("B", vpp - 1 - (k % group) // pp, mb(k))

    order = [fwd(k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [fwd(k + warmup), bwd(k)]
    return order + [bwd(k) for k in range(total - warmup, total)]


class PipelineExecutor:
    """Runs one training step's forward/backward over this rank's model chunks."""

    def __init__(self, state, chunks, act_shape: tuple[int, ...], microbatches: int, overlap: bool):
        self.state, self.chunks = state, chunks
        self.act_shape, self.m, self.overlap = act_shape, microbatches, overlap
        self.order = pipeline_order(state.topo.pp, state.vpp, microbatches, state.coord.pp)
        pp, me = state.topo.pp, state.coord.pp
        self.prev, self.next = state.pp_peer(-1), state.pp_peer(+1)
        self.first_pp, self.last_pp = me == 0, me == pp - 1

    def _needs_recv(self, step: Step) -> bool:
        if step.kind == "F":
            return not self.state.is_first_chunk(step.chunk)
        return not self.state.is_last_chunk(step.chunk)

    def _post_recv(self, step: Step):
        if not self._needs_recv(step):
            return None
        buf = torch.empty(self.act_shape)
        if step.kind == "F":
            return buf, dist.irecv(buf, src=self.prev, tag=ACTIVATION_TAG)
        return buf, dist.irecv(buf, src=self.next, tag=GRADIENT_TAG)

    def run(self, batch: Callable[[int], tuple[torch.Tensor | None, torch.Tensor | None]]) -> list[float]:
        inputs, outputs, sends, losses = {}, {}, [], []
        posted = None
        for i, step in enumerate(self.order):
            recv = posted if posted is not None else self._post_recv(step)
            posted = None
            if self.overlap and i + 1 < len(self.order):
                posted = self._post_recv(self.order[i + 1])
            if recv is not None:
                recv[1].wait()
            key = (step.chunk, step.mb)
            chunk = self.chunks[step.chunk]
            if step.kind == "F":
                tokens, labels = batch(step.mb) if (chunk.first or chunk.last) else (None, None)
                x = tokens if chunk.first else recv[0].requires_grad_()
                with annotate("fwd", mb=step.mb, chunk=step.chunk):
                    out = chunk(x, labels)
                inputs[key], outputs[key] = x, out
                if chunk.last:
                    losses.append(out.item())
                else:
                    sends.append((dist.isend(out.detach(), dst=self.next, tag=ACTIVATION_TAG), out))
            else:
                out, x = outputs.pop(key), inputs.pop(key)
                with annotate("bwd", mb=step.mb, chunk=step.chunk):
                    if chunk.last:
                        torch.autograd.backward(out / self.m)
                    else:
                        torch.autograd.backward(out, grad_tensors=recv[0])
                if not chunk.first:
                    sends.append((dist.isend(x.grad, dst=self.prev, tag=GRADIENT_TAG), x.grad))
        for work, _tensor in sends:  # the tensor is held until its send completes
            work.wait()
        return losses
