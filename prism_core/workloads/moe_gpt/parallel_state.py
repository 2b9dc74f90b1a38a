"""Process groups of one rank, built from the topology the way Megatron-core's parallel_state does.

Every rank creates every group of size > 1 in the same order (torch requires it); a group of
size 1 is left as None and the code that would use it does the local equivalent.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from prism_core.topology import RankCoord, Topology


@dataclass
class ParallelState:
    topo: Topology
    coord: RankCoord
    vpp: int
    groups: dict[str, dist.ProcessGroup | None]
    members: dict[str, tuple[int, ...] | None]

    @property
    def rank(self) -> int:
        return self.coord.rank

    def group(self, kind: str) -> dist.ProcessGroup | None:
        return self.groups.get(kind)

    def size(self, kind: str) -> int:
        m = self.members.get(kind)
        return len(m) if m else 1

    def is_first_chunk(self, chunk: int) -> bool:
        return self.coord.pp == 0 and chunk == 0

    def is_last_chunk(self, chunk: int) -> bool:
        return self.coord.pp == self.topo.pp - 1 and chunk == self.vpp - 1

    def pp_peer(self, offset: int) -> int:
        """Global rank of the pipeline stage `offset` away (wrapping, as interleaving needs)."""
        pp = (self.coord.pp + offset) % self.topo.pp
        return self.topo.rank_of(self.coord.tp, self.coord.dp, pp)


def build(topo: Topology, rank: int, vpp: int, timeout=None) -> ParallelState:
    groups: dict[str, dist.ProcessGroup | None] = {}
    members: dict[str, tuple[int, ...] | None] = {}
    for kind in ("tp", "dp", "pp", "ep", "expert_dp", "embedding"):
        mine = topo.group_of(kind, rank)
        members[kind] = mine
        groups[kind] = None
        for ranks in topo.groups(kind):
            if len(ranks) < 2:
                continue
            pg = dist.new_group(list(ranks), timeout=timeout)
            if ranks == mine:
                groups[kind] = pg
    return ParallelState(topo=topo, coord=topo.coord(rank), vpp=vpp, groups=groups, members=members)
