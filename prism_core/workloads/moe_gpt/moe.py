"""The MoE block: top-k router with a load-balancing aux loss, SwiGLU experts, all-to-all token dispatch.

Dispatch follows Megatron-core's all-to-all token dispatcher: tokens are permuted by expert,
per-expert counts are all-gathered over the EP group, tokens move with an uneven
`all_to_all_single`, are regrouped by local expert, run through the (tensor-parallel) experts,
reduced over TP, and travel back the same way to be combined with their routing weights.
With `model.moe_router: balanced` tokens are spread over the experts round-robin (Megatron's
forced load balancing), which makes every all-to-all size independent of the data.
The aux loss reaches the router through Megatron's trick: an autograd function that passes
activations through unchanged and injects the aux loss gradient in the backward pass.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from prism_core.workloads.moe_gpt.comm import all_gather_flat, all_to_all, copy_to_group, reduce_from_group
from prism_core.workloads.moe_gpt.init import full_param, shard


class _AuxLossScaler(torch.autograd.Function):
    @staticmethod
    def forward(ctx, output, aux_loss, scale):
        ctx.scale = scale
        ctx.save_for_backward(aux_loss)
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad):
        (aux_loss,) = ctx.saved_tensors
        return grad, torch.full_like(aux_loss, ctx.scale), None


class MoE(nn.Module):
    def __init__(self, cfg, layer: int, state, aux_scale: float):
        super().__init__()
        m, seed = cfg.model, cfg.job.seed
        self.state = state
        self.num_experts, self.topk = m.num_experts, m.moe_router_topk
        ep, tp = state.topo.ep, state.topo.tp
        self.local_experts = m.num_experts // ep
        self.first_expert = state.coord.ep * self.local_experts
        self.aux_scale = aux_scale
        self.balanced = m.moe_router == "balanced"
        p = f"layers.{layer}.mlp"
        self.router = nn.Parameter(full_param(seed, f"{p}.router", (m.num_experts, m.hidden_size), m.init_std))
        f, h, t = m.moe_ffn_hidden_size, m.hidden_size, state.coord.tp
        experts = range(self.first_expert, self.first_expert + self.local_experts)
        self.w_gate = nn.Parameter(torch.stack(
            [shard(full_param(seed, f"{p}.experts.{e}.w_gate", (f, h), m.init_std), 0, t, tp) for e in experts]))
        self.w_up = nn.Parameter(torch.stack(
            [shard(full_param(seed, f"{p}.experts.{e}.w_up", (f, h), m.init_std), 0, t, tp) for e in experts]))
        self.w_down = nn.Parameter(torch.stack(
            [shard(full_param(seed, f"{p}.experts.{e}.w_down", (h, f), m.init_std), 1, t, tp) for e in experts]))
        for w in (self.w_gate, self.w_up, self.w_down):
            w.expert_param = True

    def _route(self, tokens: torch.Tensor):
        logits = tokens @ self.router.t()
        probs = logits.softmax(dim=-1)
        if self.balanced:
            # Megatron's forced load balancing: token i goes to experts (i·k + j) mod E whatever
            # the logits say, so every count is independent of the data; the weights still come
            # from the router, so it keeps learning.
            n = tokens.shape[0]
            top_idx = (torch.arange(n).unsqueeze(1) * self.topk + torch.arange(self.topk)) % self.num_experts
            top_p = probs.gather(1, top_idx)
        else:
            top_p, top_idx = probs.topk(self.topk, dim=-1)
        top_p = top_p / top_p.sum(dim=-1, keepdim=True)
        counts = torch.bincount(top_idx.reshape(-1), minlength=self.num_experts)
        fraction = counts.to(probs.dtype) / top_idx.numel()
        aux_loss = self.num_experts * (fraction * probs.mean(dim=0)).sum()
        return top_p, top_idx, counts, aux_loss

    def _experts(self, grouped: torch.Tensor, per_expert: list[int]) -> torch.Tensor:
        grouped = copy_to_group(grouped, self.state.group("tp"))
        outs = []
        for e, chunk in enumerate(grouped.split(per_expert)):
            hidden = F.silu(chunk @ self.w_gate[e].t()) * (chunk @ self.w_up[e].t())
            outs.append(hidden @ self.w_down[e].t())
        out = torch.cat(outs) if outs else grouped
        return reduce_from_group(out, self.state.group("tp"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        top_p, top_idx, counts, aux_loss = self._route(tokens)

        flat_expert = top_idx.reshape(-1)
        order = torch.argsort(flat_expert, stable=True)
        token_of = torch.arange(tokens.shape[0]).repeat_interleave(self.topk)[order]
        permuted = tokens.index_select(0, token_of)

        ep, me, n_local = self.state.topo.ep, self.state.coord.ep, self.local_experts
        ep_group = self.state.group("ep")
        if ep_group is not None:
            gathered = counts.new_empty(ep * self.num_experts)
            all_gather_flat(gathered, counts, group=ep_group)
            gathered = gathered.view(ep, self.num_experts)
        else:
            gathered = counts.view(1, -1)
        local_counts = gathered[:, me * n_local:(me + 1) * n_local]  # [ep sources, local experts]
        in_splits = counts.view(ep, n_local).sum(dim=1).tolist()
        out_splits = local_counts.sum(dim=1).tolist()

        received = all_to_all(permuted, out_splits, in_splits, ep_group)
        expert_of = torch.arange(n_local).repeat(ep).repeat_interleave(local_counts.reshape(-1))
        regroup = torch.argsort(expert_of, stable=True)
        y = self._experts(received.index_select(0, regroup), local_counts.sum(dim=0).tolist())
        y = y.index_select(0, torch.argsort(regroup))
        returned = all_to_all(y, in_splits, out_splits, ep_group)

        weights = top_p.reshape(-1)[order].unsqueeze(-1).to(returned.dtype)
        out = torch.zeros_like(tokens).index_add(0, token_of, returned * weights)
        out = _AuxLossScaler.apply(out, aux_loss, self.aux_scale)
        return out.view(shape)
