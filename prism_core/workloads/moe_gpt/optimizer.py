"""Gradient reduction and the update (Adam or SGD), Megatron-style, inside one `optimizer.step()`.

Before the update: QK-norm gradients are summed over TP, tied embedding gradients over the
embedding group (first and last pipeline stage). Then either
  - DDP mode: dense gradients are all-reduced over DP, expert gradients over expert-DP, and
    every rank updates every parameter; or
  - distributed-optimizer mode (ZeRO-1): gradients are reduce-scattered over the same groups,
    each rank updates its shard of the flat parameter buffer (optimizer state sharded too) and
    the updated shards are all-gathered back into the model.
Both divide by the full DP size (expert gradients gather the tokens of dp/edp ranks through the
all-to-all). The update is written out elementwise so both modes compute the same values; SGD
(no state, update proportional to the gradient) makes any gradient-scale error visible in the
losses, which Adam's scale invariance would hide.
Putting all of this inside `step()` makes the iteration boundary (the global optimizer
post-step hook) fall after the parameter all-gather, where Megatron's step ends too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from prism_core.workloads.moe_gpt.comm import all_gather_flat, reduce_scatter_flat


def _flat_grads(params: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in params])


def _scatter_back(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset:offset + n].view_as(t))
        offset += n


def _all_reduce_grads(params: list[torch.Tensor], group) -> None:
    if group is None or not params:
        return
    flat = _flat_grads(params)
    dist.all_reduce(flat, group=group)
    _scatter_back(flat, [p.grad for p in params])


@dataclass
class _Bucket:
    params: list[torch.nn.Parameter]
    group: object
    group_size: int
    group_rank: int
    shard: torch.Tensor | None = None  # distributed mode: this rank's slice of the flat parameters

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)

    @property
    def shard_size(self) -> int:
        return -(-self.numel // self.group_size)


class MegatronOptimizer(torch.optim.Optimizer):
    def __init__(self, params, state, lr: float, distributed: bool, kind: str = "adam", betas=(0.9, 0.95),
                 eps: float = 1e-8):
        params = [p for p in params if p.requires_grad]
        self.model_params = params
        self.distributed = distributed
        self.kind = kind
        self.dp = state.topo.dp
        self.tp_group, self.emb_group = state.group("tp"), state.group("embedding")
        dense = [p for p in params if not getattr(p, "expert_param", False)]
        expert = [p for p in params if getattr(p, "expert_param", False)]
        self.buckets = [
            _Bucket(dense, state.group("dp"), state.size("dp"), state.members["dp"].index(state.rank)),
            _Bucket(expert, state.group("expert_dp"), state.size("expert_dp"),
                    state.members["expert_dp"].index(state.rank)),
        ]
        self.buckets = [b for b in self.buckets if b.params]
        if distributed:
            for b in self.buckets:
                flat = torch.cat([p.detach().reshape(-1) for p in b.params])
                flat = torch.nn.functional.pad(flat, (0, b.shard_size * b.group_size - flat.numel()))
                start = b.group_rank * b.shard_size
                b.shard = flat[start:start + b.shard_size].clone().requires_grad_()
            opt_params = [b.shard for b in self.buckets]
        else:
            opt_params = params
        super().__init__(opt_params, dict(lr=lr, betas=betas, eps=eps))

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.model_params:
            p.grad = None
        super().zero_grad(set_to_none)

    def _reduce_model_parallel_grads(self) -> None:
        _all_reduce_grads([p for p in self.model_params if getattr(p, "tp_partial_grad", False)], self.tp_group)
        _all_reduce_grads([p for p in self.model_params if getattr(p, "embedding_tied", False)], self.emb_group)

    def _reduce_data_parallel_grads(self) -> None:
        for b in self.buckets:
            if not self.distributed:
                _all_reduce_grads(b.params, b.group)
                for p in b.params:
                    p.grad.div_(self.dp)
                continue
            flat = _flat_grads(b.params)
            flat = torch.nn.functional.pad(flat, (0, b.shard_size * b.group_size - flat.numel()))
            if b.group is None:
                grad = flat.clone()
            else:
                grad = flat.new_empty(b.shard_size)
                reduce_scatter_flat(grad, flat, group=b.group)
            b.shard.grad = grad.div_(self.dp)

    def _gather_params(self) -> None:
        for b in self.buckets:
            if b.group is None:
                flat = b.shard.detach()
            else:
                flat = b.shard.new_empty(b.shard_size * b.group_size)
                all_gather_flat(flat, b.shard.detach(), group=b.group)
            _scatter_back(flat[:b.numel], [p.data for p in b.params])

    @torch.no_grad()
    def step(self, closure=None):
        for p in self.model_params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self._reduce_model_parallel_grads()
        self._reduce_data_parallel_grads()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if self.kind == "sgd":
                    p.add_(p.grad, alpha=-group["lr"])
                    continue
                st = self.state[p]
                if not st:
                    st["step"], st["exp_avg"], st["exp_avg_sq"] = 0, torch.zeros_like(p), torch.zeros_like(p)
                st["step"] += 1
                st["exp_avg"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
                st["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                denom = (st["exp_avg_sq"].sqrt() / math.sqrt(1 - beta2 ** st["step"])).add_(group["eps"])
                p.addcdiv_(st["exp_avg"], denom, value=-group["lr"] / (1 - beta1 ** st["step"]))
        if self.distributed:
            self._gather_params()
        return None
