"""The CPU collective executor: computes every member's outputs once all inputs of an op are in.

`run(kind, metas, inputs)` takes, per group rank (in group order), the op's metadata and input
tensors as the rank sent them, and returns per group rank the tensors to copy into its outputs.
Reductions add in group-rank order; gloo's ring adds in another order, so floating-point results
can differ from a real run in the last bits (a program whose control flow hinges on such bits
could then take another path in collection).
"""

from __future__ import annotations

import torch


class ExecutorError(RuntimeError):
    pass


def _reduce(tensors: list[torch.Tensor], op: str) -> torch.Tensor:
    out = tensors[0].clone()
    for t in tensors[1:]:
        if op in ("sum", "avg"):
            out += t
        elif op == "product":
            out *= t
        elif op == "max":
            torch.maximum(out, t, out=out)
        elif op == "min":
            torch.minimum(out, t, out=out)
        elif op == "band":
            out &= t
        elif op == "bor":
            out |= t
        elif op == "bxor":
            out ^= t
        else:
            raise ExecutorError(f"reduce op {op!r} is not supported")
    if op == "avg":
        out = out / len(tensors) if out.is_floating_point() else torch.div(out, len(tensors), rounding_mode="trunc")
    return out


def _check_same(kind: str, inputs: list[list[torch.Tensor]]) -> None:
    shapes = {tuple((tuple(t.shape), t.dtype) for t in ins) for ins in inputs}
    if len(shapes) > 1:
        raise ExecutorError(f"{kind}: members passed tensors of different shapes or dtypes: {sorted(map(str, shapes))}")


def run(kind: str, metas: list[dict], inputs: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
    n = len(inputs)
    meta = metas[0]
    if kind in ("allreduce", "allreduce_coalesced"):
        _check_same(kind, inputs)
        out = [_reduce([ins[i] for ins in inputs], meta["reduce"]) for i in range(len(inputs[0]))]
        return [out] * n
    if kind == "reduce":
        _check_same(kind, inputs)
        root = meta["root"]
        out = [_reduce([ins[i] for ins in inputs], meta["reduce"]) for i in range(len(inputs[0]))]
        return [out if g == root else [] for g in range(n)]
    if kind == "broadcast":
        return [inputs[meta["root"]]] * n
    if kind == "allgather":  # each rank sends k tensors; output [k][n] flattened index-major
        _check_same(kind, inputs)
        k = len(inputs[0])
        return [[inputs[r][i] for i in range(k) for r in range(n)]] * n
    if kind == "all_gather_single":
        _check_same(kind, inputs)
        return [[torch.cat([ins[0].reshape(-1) for ins in inputs])]] * n
    if kind == "reduce_scatter":  # each rank sends n tensors (one per destination)
        return [[_reduce([inputs[r][g] for r in range(n)], meta["reduce"])] for g in range(n)]
    if kind == "reduce_scatter_single":
        _check_same(kind, inputs)
        total = _reduce([ins[0].reshape(-1) for ins in inputs], meta["reduce"])
        return [[c] for c in total.chunk(n)]
    if kind == "all_to_all_single":
        chunks = []
        for g, ins in enumerate(inputs):
            flat = ins[0]
            splits = metas[g]["in_splits"] or [flat.shape[0] // n] * n
            if sum(splits) != flat.shape[0]:
                raise ExecutorError(f"all_to_all_single: rank {g} of the group splits {flat.shape[0]} rows as {splits}")
            chunks.append(flat.split(splits))
        return [[torch.cat([chunks[src][dst] for src in range(n)])] for dst in range(n)]
    if kind == "alltoall":
        return [[inputs[src][dst] for src in range(n)] for dst in range(n)]
    if kind == "scatter":
        return [[inputs[meta["root"]][g]] for g in range(n)]
    if kind == "gather":
        root = meta["root"]
        return [[ins[0] for ins in inputs] if g == root else [] for g in range(n)]
    if kind == "barrier":
        return [[] for _ in range(n)]
    raise ExecutorError(f"collective {kind!r} is not supported by the collection executor")
