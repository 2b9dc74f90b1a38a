"""Single-rank numerics of the workload's building blocks against plain reference formulas."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from prism_core.config import config_from_dict
from prism_core.topology import Topology
from prism_core.workloads.moe_gpt.comm import vocab_parallel_cross_entropy
from prism_core.workloads.moe_gpt.data import sample
from prism_core.workloads.moe_gpt.moe import MoE
from prism_core.workloads.moe_gpt.parallel_state import ParallelState


def _single_rank_state() -> ParallelState:
    topo = Topology(1, 1, 1, 1)
    members = {k: topo.group_of(k, 0) for k in ("tp", "dp", "pp", "ep", "expert_dp", "embedding")}
    return ParallelState(topo=topo, coord=topo.coord(0), vpp=1, groups={}, members=members)


def _cfg(**model):
    return config_from_dict({"name": "t", "job": {"world_size": 1}, "model": model})


def test_vocab_parallel_cross_entropy_matches_torch_on_one_rank():
    torch.manual_seed(0)
    logits = torch.randn(12, 50, requires_grad=True)
    target = torch.randint(50, (12,))
    ours = vocab_parallel_cross_entropy(logits, target, 0, None)
    ref_logits = logits.detach().clone().requires_grad_()
    ref = F.cross_entropy(ref_logits, target, reduction="none")
    torch.testing.assert_close(ours, ref)
    ours.mean().backward()
    ref.mean().backward()
    torch.testing.assert_close(logits.grad, ref_logits.grad)


def test_moe_matches_per_token_reference():
    cfg = _cfg(hidden_size=16, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=8)
    moe = MoE(cfg, layer=0, state=_single_rank_state(), aux_scale=0.0)
    x = torch.randn(2, 5, 16)
    out = moe(x)
    tokens = x.reshape(-1, 16)
    expected = torch.zeros_like(tokens)
    for i, tok in enumerate(tokens):
        probs = (tok @ moe.router.t()).softmax(-1)
        top_p, top_i = probs.topk(2)
        top_p = top_p / top_p.sum()
        for p, e in zip(top_p, top_i):
            hidden = F.silu(tok @ moe.w_gate[e].t()) * (tok @ moe.w_up[e].t())
            expected[i] += p * (hidden @ moe.w_down[e].t())
    torch.testing.assert_close(out.reshape(-1, 16), expected, rtol=1e-5, atol=1e-6)


def test_aux_loss_gradient_reaches_the_router():
    cfg = _cfg(hidden_size=16, num_experts=4, moe_router_topk=1, moe_ffn_hidden_size=8)
    with_aux = MoE(cfg, layer=0, state=_single_rank_state(), aux_scale=0.5)
    without = MoE(cfg, layer=0, state=_single_rank_state(), aux_scale=0.0)
    x = torch.randn(3, 4, 16)
    with_aux(x).sum().backward()
    without(x).sum().backward()
    assert not torch.allclose(with_aux.router.grad, without.router.grad)


def test_samples_are_deterministic_and_in_vocabulary():
    a, b = sample(7, 42, 32, 100), sample(7, 42, 32, 100)
    assert torch.equal(a, b) and a.shape == (33,)
    assert int(a.min()) >= 0 and int(a.max()) < 100
    assert not torch.equal(a, sample(7, 43, 32, 100))
