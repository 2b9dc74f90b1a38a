"""Rules-mode answers from the tensor cache of an earlier context-switching collection.

A rank collected alone has no peers, but if an earlier collection of the same job kept every
rank's communication inputs (`tensors.zarr`), an op's true outputs can be rebuilt: read each
peer's inputs under the op's key, run the CPU executor, take this rank's share. Values the
program cannot know alone — a pipeline peer's shape metadata, a learned router's split counts —
then come out exactly as in a run with all ranks. Anything the cache does not hold falls
through to the other rules and the filler.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from prism_core.cache import CacheError, TensorCacheReader
from prism_core.collect import executor

ENV_TENSOR_CACHE = "PRISM_TENSOR_CACHE"   # a tensors.zarr directory


class CachedPeers:
    """Per-process view of a tensor cache: one reader per peer rank, opened on first use."""

    _instance: CachedPeers | None = None

    def __init__(self, root: Path):
        self.root = Path(root)
        self._readers: dict[int, TensorCacheReader | None] = {}

    @classmethod
    def from_env(cls) -> CachedPeers | None:
        root = os.environ.get(ENV_TENSOR_CACHE)
        if not root:
            return None
        if cls._instance is None or cls._instance.root != Path(root):
            cls._instance = cls(Path(root))
        return cls._instance

    def reader(self, rank: int) -> TensorCacheReader | None:
        if rank not in self._readers:
            try:
                self._readers[rank] = TensorCacheReader(self.root, rank, prefetch_depth=1)
            except CacheError as err:
                if "no cache group" not in str(err):
                    raise          # a damaged cache is an error, a missing rank only a miss
                self._readers[rank] = None
        return self._readers[rank]

    def inputs(self, rank: int, key: str) -> list[torch.Tensor] | None:
        """The tensors `rank` passed to the op `key`; None if the cache does not hold them."""
        reader = self.reader(rank)
        if reader is None:
            return None
        out, i = [], 0
        while f"{key}/{i}" in reader:
            out.append(reader.get(f"{key}/{i}"))
            i += 1
        return out or None

    def collective(self, kind: str, key: str, ranks: tuple[int, ...], me: int, own: list[torch.Tensor],
                   meta: dict) -> list[torch.Tensor] | None:
        """This member's outputs of collective `key` from its peers' cached inputs (its own are live)."""
        if kind == "barrier":
            return []
        rooted = kind in ("broadcast", "scatter")     # only the root passes tensors
        inputs, metas = [], []
        for g, rank in enumerate(ranks):
            if g == me:
                ins = list(own)
            elif rooted and g != meta["root"]:
                ins = []
            else:
                ins = self.inputs(rank, key)
                if ins is None:
                    return None
            peer_meta = dict(meta)
            if kind == "all_to_all_single" and g != me:
                reader = self.reader(rank)   # no splits kept means the rank split evenly
                peer_meta["in_splits"] = ([int(s) for s in reader.get(f"{key}/splits").tolist()]
                                          if f"{key}/splits" in reader else [])
            inputs.append(ins)
            metas.append(peer_meta)
        return executor.run(kind, metas, inputs)[me]
