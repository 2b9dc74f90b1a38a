"""Rank topology: Megatron-core's rank order, each rank's coordinates and every process group.

Order (fastest first), as Megatron-core's RankGenerator with context parallelism 1:
    dense ranks:  tp, dp, pp          rank = tp_i + tp·(dp_i + dp·pp_i)
    expert ranks: tp, ep, edp, pp     dp_i = ep_i + ep·edp_i   (expert TP = dense TP)
Groups:
    tp         same (dp, pp)                      pp   same (tp, dp)
    dp         same (tp, pp)                      ep   same (tp, edp, pp)
    expert_dp  same (tp, ep, pp)
    embedding  first and last pp stage of each pp group (only when pp > 1)
DP equivalence classes: ranks with the same (tp, pp) coordinates run the same program up to
renaming of their peers (the bytes of MoE all-to-alls depend on data and are the exception);
each class has one member per DP replica.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

GROUP_KINDS = ("tp", "pp", "dp", "ep", "expert_dp", "embedding")


@dataclass(frozen=True)
class RankCoord:
    rank: int
    tp: int
    dp: int
    pp: int
    ep: int
    edp: int


@dataclass(frozen=True)
class Topology:
    tp: int
    pp: int
    dp: int
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "ep"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.dp % self.ep:
            raise ValueError(f"ep={self.ep} must divide dp={self.dp}")

    @classmethod
    def from_config(cls, cfg) -> Topology:
        p = cfg.parallel
        return cls(tp=p.tp, pp=p.pp, dp=p.dp, ep=p.ep)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def edp(self) -> int:
        return self.dp // self.ep

    def rank_of(self, tp: int, dp: int, pp: int) -> int:
        return tp + self.tp * (dp + self.dp * pp)

    def coord(self, rank: int) -> RankCoord:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of {self.world_size}")
        tp_i = rank % self.tp
        dp_i = (rank // self.tp) % self.dp
        pp_i = rank // (self.tp * self.dp)
        return RankCoord(rank=rank, tp=tp_i, dp=dp_i, pp=pp_i, ep=dp_i % self.ep, edp=dp_i // self.ep)

    @cached_property
    def _groups(self) -> dict[str, tuple[tuple[int, ...], ...]]:
        tp, dp, pp, ep, edp = self.tp, self.dp, self.pp, self.ep, self.edp
        r = self.rank_of
        groups = {
            "tp": [tuple(r(t, d, p) for t in range(tp)) for p in range(pp) for d in range(dp)],
            "dp": [tuple(r(t, d, p) for d in range(dp)) for p in range(pp) for t in range(tp)],
            "pp": [tuple(r(t, d, p) for p in range(pp)) for d in range(dp) for t in range(tp)],
            "ep": [tuple(r(t, e + ep * x, p) for e in range(ep)) for p in range(pp) for x in range(edp)
                   for t in range(tp)],
            "expert_dp": [tuple(r(t, e + ep * x, p) for x in range(edp)) for p in range(pp) for e in range(ep)
                          for t in range(tp)],
        }
        groups["embedding"] = [(g[0], g[-1]) for g in groups["pp"]] if pp > 1 else []
        return {k: tuple(v) for k, v in groups.items()}

    def groups(self, kind: str) -> tuple[tuple[int, ...], ...]:
        """Every group of one kind, each as a tuple of global ranks in group-rank order."""
        if kind not in GROUP_KINDS:
            raise ValueError(f"unknown group kind {kind!r}; known: {', '.join(GROUP_KINDS)}")
        return self._groups[kind]

    def group_of(self, kind: str, rank: int) -> tuple[int, ...] | None:
        """The group of `kind` that holds `rank` (None for ranks in no embedding group)."""
        return self._index[kind].get(rank)

    @cached_property
    def _index(self) -> dict[str, dict[int, tuple[int, ...]]]:
        return {kind: {r: g for g in groups for r in g} for kind, groups in self._groups.items()}

    def dp_equivalence_classes(self) -> tuple[tuple[int, ...], ...]:
        """Ranks whose programs are equal up to renaming: one class per (tp, pp), one member per DP replica."""
        return self.groups("dp")

    def replica_ranks(self, dp_index: int = 0) -> tuple[int, ...]:
        """The ranks of one DP replica: one representative of every equivalence class."""
        return tuple(self.rank_of(t, dp_index, p) for p in range(self.pp) for t in range(self.tp))
