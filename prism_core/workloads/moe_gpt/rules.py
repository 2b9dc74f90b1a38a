"""Tensor rules of the `moe_gpt` workload for rules-mode collection.

Only one collective needs a rule: rank 0's broadcast of the dataloader status (train / valid /
test), which must say "there is training data". Token ids fall back to zeros (in vocabulary)
and per-expert token counts to this rank's own counts for every EP peer (plausible, consistent
with the all-to-all sizes this rank then uses).
"""

from __future__ import annotations

import torch


def dataloader_status(op):
    if op.kind == "broadcast" and len(op.group) == op.world_size and op.outputs and \
            op.outputs[0].dtype == torch.long and op.outputs[0].numel() == 3:
        return [torch.tensor([1, 0, 0], dtype=torch.long)]
    return None


RULES = ["prism_core.workloads.moe_gpt.rules:dataloader_status"]
