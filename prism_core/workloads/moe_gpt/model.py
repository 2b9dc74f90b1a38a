"""Model chunks of the Qwen3-MoE-shaped decoder, sharded Megatron-style over tensor parallelism.

A pipeline of pp × vpp model chunks; chunk c holds layers [c·L/C, (c+1)·L/C). The first chunk
owns the vocab-parallel embedding, the last the final norm, the column-parallel output layer
and the vocab-parallel cross-entropy. Attention is GQA with QK-norm and rotary embeddings;
q/k/v are column-parallel by heads, the output projection row-parallel. QK-norm weights see
only this rank's heads, so their gradients are summed over TP (`tp_partial_grad`).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from prism_core.workloads.moe_gpt.comm import copy_to_group, reduce_from_group, vocab_parallel_cross_entropy
from prism_core.workloads.moe_gpt.init import full_param, shard
from prism_core.workloads.moe_gpt.moe import MoE


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rotary_tables(seq: int, dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    freqs = torch.outer(torch.arange(seq, dtype=torch.float64), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().float(), emb.sin().float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg, layer: int, state):
        super().__init__()
        m, seed = cfg.model, cfg.job.seed
        tp, t = state.topo.tp, state.coord.tp
        self.tp_group = state.group("tp")
        d, h = m.kv_channels, m.hidden_size
        self.head_dim = d
        self.local_heads = m.num_attention_heads // tp
        self.local_groups = m.num_query_groups // tp
        self.attention = m.attention
        p = f"layers.{layer}.attn"
        self.wq = nn.Parameter(shard(full_param(seed, f"{p}.wq", (m.num_attention_heads * d, h), m.init_std), 0, t, tp))
        self.wk = nn.Parameter(shard(full_param(seed, f"{p}.wk", (m.num_query_groups * d, h), m.init_std), 0, t, tp))
        self.wv = nn.Parameter(shard(full_param(seed, f"{p}.wv", (m.num_query_groups * d, h), m.init_std), 0, t, tp))
        self.wo = nn.Parameter(shard(full_param(seed, f"{p}.wo", (h, m.num_attention_heads * d), m.init_std), 1, t, tp))
        self.q_norm = RMSNorm(d, m.norm_eps)
        self.k_norm = RMSNorm(d, m.norm_eps)
        for norm in (self.q_norm, self.k_norm):
            norm.weight.tp_partial_grad = True
        cos, sin = rotary_tables(m.seq_length, d, m.rope_theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _heads(self, x, w, n, norm):
        b, s, _ = x.shape
        y = norm((x @ w.t()).view(b, s, n, self.head_dim)).transpose(1, 2)
        return apply_rotary(y, self.cos[:s], self.sin[:s])

    def forward(self, x):
        b, s, _ = x.shape
        x = copy_to_group(x, self.tp_group)
        q = self._heads(x, self.wq, self.local_heads, self.q_norm)
        k = self._heads(x, self.wk, self.local_groups, self.k_norm)
        v = (x @ self.wv.t()).view(b, s, self.local_groups, self.head_dim).transpose(1, 2)
        repeat = self.local_heads // self.local_groups
        if repeat > 1:
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        if self.attention == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
            mask = torch.ones(s, s, dtype=torch.bool).triu(1)
            out = scores.masked_fill(mask, float("-inf")).softmax(dim=-1) @ v
        out = out.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim)
        return reduce_from_group(out @ self.wo.t(), self.tp_group)


class TransformerLayer(nn.Module):
    def __init__(self, cfg, layer: int, state, aux_scale: float):
        super().__init__()
        eps = cfg.model.norm_eps
        self.input_norm = RMSNorm(cfg.model.hidden_size, eps)
        self.attn = Attention(cfg, layer, state)
        self.post_attn_norm = RMSNorm(cfg.model.hidden_size, eps)
        self.mlp = MoE(cfg, layer, state, aux_scale)

    def forward(self, x):
        x = x + self.attn(self.input_norm(x))
        return x + self.mlp(self.post_attn_norm(x))


class VocabParallelEmbedding(nn.Module):
    def __init__(self, weight: torch.Tensor, vocab_start: int, tp_group):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.vocab_start, self.tp_group = vocab_start, tp_group

    def forward(self, tokens):
        n = self.weight.shape[0]
        outside = (tokens < self.vocab_start) | (tokens >= self.vocab_start + n)
        local = (tokens - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_group(out, self.tp_group)


class ModelChunk(nn.Module):
    """One virtual pipeline stage: chunk `chunk` of this pp rank (global chunk chunk·pp + pp_rank)."""

    def __init__(self, cfg, state, chunk: int, aux_scale: float):
        super().__init__()
        m, seed = cfg.model, cfg.job.seed
        topo, coord = state.topo, state.coord
        n_chunks = topo.pp * state.vpp
        global_chunk = chunk * topo.pp + coord.pp
        per_chunk = m.num_layers // n_chunks
        self.first, self.last = global_chunk == 0, global_chunk == n_chunks - 1
        self.tp_group = state.group("tp")
        self.recompute = m.recompute
        self.vocab_start = coord.tp * (m.vocab_size // topo.tp)
        layers = range(global_chunk * per_chunk, (global_chunk + 1) * per_chunk)
        self.layers = nn.ModuleList(TransformerLayer(cfg, layer, state, aux_scale) for layer in layers)

        def vocab_shard(name):
            return shard(full_param(seed, name, (m.vocab_size, m.hidden_size), m.init_std), 0, coord.tp, topo.tp)

        self.embedding = VocabParallelEmbedding(vocab_shard("embedding"), self.vocab_start, self.tp_group) \
            if self.first else None
        if self.first and not self.last and m.tie_embeddings:
            self.embedding.weight.embedding_tied = True
        self.final_norm = RMSNorm(m.hidden_size, m.norm_eps) if self.last else None
        self.output = None
        if self.last and not (m.tie_embeddings and self.first):
            self.output = nn.Parameter(vocab_shard("embedding" if m.tie_embeddings else "output"))
            # With pp > 1 a tied output layer is a copy kept equal by the embedding-group all-reduce.
            self.output.embedding_tied = m.tie_embeddings

    def forward(self, x, labels=None):
        if self.first:
            x = self.embedding(x)
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False) if self.recompute else layer(x)
        if not self.last:
            return x
        x = self.final_norm(x)
        weight = self.output if self.output is not None else self.embedding.weight
        logits = copy_to_group(x, self.tp_group) @ weight.t()
        loss = vocab_parallel_cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                            self.vocab_start, self.tp_group)
        return loss.mean()
