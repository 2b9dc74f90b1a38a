"""Names of c10d reduce ops, as the trace and the collection protocol spell them."""

from __future__ import annotations

import torch.distributed as dist

REDUCE_OPS = (("sum", dist.ReduceOp.SUM), ("avg", dist.ReduceOp.AVG), ("product", dist.ReduceOp.PRODUCT),
              ("max", dist.ReduceOp.MAX), ("min", dist.ReduceOp.MIN), ("band", dist.ReduceOp.BAND),
              ("bor", dist.ReduceOp.BOR), ("bxor", dist.ReduceOp.BXOR))
BY_NAME = dict(REDUCE_OPS)


def reduce_name(op) -> str:
    # options carry a ReduceOp wrapper that compares equal to the enum value but hashes apart
    for name, value in REDUCE_OPS:
        if op == value:
            return name
    raise NotImplementedError(f"prism: reduce op {op} is not supported")
