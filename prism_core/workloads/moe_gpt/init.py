"""Layout-independent parameter initialisation.

Each parameter is drawn in full from a generator seeded by (seed, global parameter name), then
sliced to this rank's shard, so every parallel layout starts from exactly the single-rank weights.
"""

from __future__ import annotations

import zlib

import torch


def full_param(seed: int, name: str, shape: tuple[int, ...], std: float) -> torch.Tensor:
    gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
    return torch.randn(shape, generator=gen) * std


def shard(t: torch.Tensor, dim: int, index: int, parts: int) -> torch.Tensor:
    return t.chunk(parts, dim=dim)[index].contiguous()
