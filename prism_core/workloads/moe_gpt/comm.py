"""Autograd-aware communication primitives of Megatron-style tensor and expert parallelism.

`copy_to_group`: identity forward, all-reduce of the gradient backward (input of a column-parallel
linear). `reduce_from_group`: all-reduce forward, identity backward (output of a row-parallel
linear, vocab-parallel embedding). `all_to_all`: uneven all_to_all_single whose backward is the
reverse exchange. `vocab_parallel_cross_entropy`: Megatron's loss over vocab-sharded logits.
A `None` group means a group of one rank: every primitive is then the local identity.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# torch 2.13 renamed the flat collectives; older releases (what GPU clusters run) have the old names.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_group(x: torch.Tensor, group) -> torch.Tensor:
    return x if group is None else _CopyToGroup.apply(x, group)


def reduce_from_group(x: torch.Tensor, group) -> torch.Tensor:
    return x if group is None else _ReduceFromGroup.apply(x, group)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        back = grad.new_empty((sum(ctx.in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), ctx.in_splits, ctx.out_splits, group=ctx.group)
        return back, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    return x if group is None else _AllToAll.apply(x, out_splits, in_splits, group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, group):
        # logits: [N, V/tp] of this rank's vocab slice [vocab_start, vocab_start + V/tp)
        logits = logits.float()
        local_max = logits.max(dim=-1).values
        if group is not None:
            dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - local_max.unsqueeze(-1)
        n_local = logits.shape[-1]
        outside = (target < vocab_start) | (target >= vocab_start + n_local)
        local_target = (target - vocab_start).masked_fill(outside, 0)
        rows = torch.arange(logits.shape[0])
        predicted = shifted[rows, local_target].masked_fill(outside, 0.0)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        if group is not None:
            both = torch.stack([predicted, sum_exp])
            dist.all_reduce(both, group=group)
            predicted, sum_exp = both[0], both[1]
        loss = sum_exp.log() - predicted
        softmax = exp / sum_exp.unsqueeze(-1)
        ctx.save_for_backward(softmax, local_target, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, outside = ctx.saved_tensors
        grad = softmax.clone()
        rows = torch.arange(grad.shape[0])
        grad[rows, local_target] -= (~outside).to(grad.dtype)
        return grad * grad_loss.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, vocab_start: int, group):
    """Per-token loss for logits sharded over the vocabulary across `group`."""
    return _VocabParallelCrossEntropy.apply(logits, target, vocab_start, group)
