"""Tensor rules: what a collective returns when a rank runs alone against a fake world (paper Appendix C).

A rank collected in rules mode has no peers. For each op its outputs come from the first rule
that answers (the config's `emulation.rules`, then the workload's own), otherwise from a
deterministic filler of the right shape and dtype: the rank's own contribution where the op
has one (all-reduce keeps the input, all-gather repeats it, reduce-scatter keeps this rank's
chunk), zeros elsewhere — never uninitialised memory. A rule is a callable `rule(op) -> list
of tensors | None` taking an `OpView`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

import torch

Rule = Callable[["OpView"], "list[torch.Tensor] | None"]


class RuleError(RuntimeError):
    pass


@dataclass
class OpView:
    rank: int                       # global rank running the program
    world_size: int
    kind: str                       # allreduce, broadcast, all_gather_single, all_to_all_single, recv, ...
    group: tuple[int, ...]          # global ranks of the group
    group_rank: int
    seq: int                        # call number on this group
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]     # the buffers to fill (shapes and dtypes to match)
    root: int | None = None         # group rank of the root, for rooted ops


def load_rules(names: list[str]) -> list[Rule]:
    rules = []
    for name in names:
        module, _, attr = name.partition(":")
        try:
            rules.append(getattr(importlib.import_module(module), attr))
        except (ImportError, AttributeError, ValueError) as err:
            raise RuleError(f"emulation.rules: cannot load {name!r} ({err}); write module:function") from None
    return rules


def filler(op: OpView) -> list[torch.Tensor]:
    n = len(op.group)
    if op.kind in ("allreduce", "allreduce_coalesced", "reduce"):
        return [t.clone() for t in op.inputs]
    if op.kind == "reduce_scatter":
        return [op.inputs[op.group_rank].clone()]
    if op.kind == "all_gather_single":
        return [op.inputs[0].reshape(-1).repeat(n)]
    if op.kind == "allgather":
        return [t.clone() for t in op.inputs for _ in range(n)]
    if op.kind == "reduce_scatter_single":
        return [op.inputs[0].reshape(-1).chunk(n)[op.group_rank].clone()]
    if op.kind == "broadcast" and op.root == op.group_rank:
        return [t.clone() for t in op.inputs]
    if op.kind == "scatter" and op.root == op.group_rank:
        return [op.inputs[op.group_rank].clone()]
    out = [torch.zeros_like(t) for t in op.outputs]
    if op.kind in ("alltoall", "gather") and len(out) == n and op.inputs:
        mine = op.inputs[op.group_rank] if op.kind == "alltoall" else op.inputs[0]
        out[op.group_rank] = mine.clone().reshape(out[op.group_rank].shape)   # this rank's own slot
    return out


_FILLER = object()


def answer(op: OpView, rules: list[Rule], fallback=_FILLER) -> list[torch.Tensor] | None:
    """The first rule's answer; else the filler (or `fallback`, when given)."""
    for rule in rules:
        out = rule(op)
        if out is not None:
            check_answer(op, out, f"rule {getattr(rule, '__qualname__', repr(rule))}")
            return out
    return filler(op) if fallback is _FILLER else fallback


def check_answer(op: OpView, out: list[torch.Tensor], who: str) -> None:
    if len(out) != len(op.outputs) or any(o.numel() != b.numel() or o.dtype != b.dtype
                                          for o, b in zip(out, op.outputs)):
        want = [(tuple(b.shape), str(b.dtype)) for b in op.outputs]
        got = [(tuple(o.shape), str(o.dtype)) for o in out]
        raise RuleError(f"{who} answered {op.kind} #{op.seq} of group {list(op.group)} on rank {op.rank} "
                        f"with {got}, but the program expects {want}")
