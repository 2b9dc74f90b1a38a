"""DP dedup: the graph of one data-parallel replica, expanded to all W ranks by renaming.

Replica d is obtained from replica 0 by a relabelling of data-parallel indices that every
group kind respects: the dp index is split into (ep, edp) coordinates and each is shifted
cyclically (ep by d mod ep, edp by d div ep), so TP, PP, DP, EP, expert-DP and embedding
groups map onto groups of the same kind. Each node of a replica-0 rank is copied to its image
rank with its group and p2p peer renamed (a collective's root keeps its position in the group);
sequence numbers, sizes and labels stay. Where a
program's communication sizes depend on its data (MoE all-to-all splits), replicas differ in
reality and the expansion gives every replica replica 0's sizes.
"""

from __future__ import annotations

import numpy as np

from prism_core.topology import Topology
from prism_core.trace.schema import ROOTED_OPS
from prism_core.trace.store import Trace


def rank_map(topo: Topology, replica: int) -> np.ndarray:
    """image[r] for every global rank r under the relabelling that sends replica 0 to `replica`."""
    de, dx = replica % topo.ep, replica // topo.ep
    image = np.empty(topo.world_size, dtype=np.int64)
    for r in range(topo.world_size):
        c = topo.coord(r)
        dp = (c.ep + de) % topo.ep + topo.ep * ((c.edp + dx) % topo.edp)
        image[r] = topo.rank_of(c.tp, dp, c.pp)
    return image


def replica_source(topo: Topology) -> np.ndarray:
    """Per global rank: the replica-0 rank whose nodes it takes in the expanded graph."""
    source = np.empty(topo.world_size, dtype=np.int64)
    for d in range(topo.dp):
        image = rank_map(topo, d)
        for r in topo.replica_ranks(0):
            source[int(image[r])] = r
    return source


def expand_replica(trace: Trace, topo: Topology) -> Trace:
    """A full W-rank trace built from the replica-0 ranks of `trace` (other ranks' rows are ignored)."""
    return expand_replica_with_groups(trace, topo)[0]


def expand_replica_with_groups(trace: Trace, topo: Topology) -> tuple[Trace, np.ndarray]:
    """`expand_replica`, and per group of the expanded trace the group of `trace` it copies: a
    copied rank's node on group g stands for its source rank's node on that group, at the same seq
    (a replay that does not hold the copied rank's rows finds its cached input by it)."""
    if trace.world_size != topo.world_size:
        raise ValueError(f"trace has {trace.world_size} ranks, topology {topo.world_size}")
    groups = list(trace.groups)
    names = list(trace.group_names)
    # Several groups may share a rank set (a DP group and an expert-DP group when ep = 1): they are
    # told apart by creation order, which c10d makes the same on every rank (numeric group names).
    by_set: dict[tuple[int, ...], list[int]] = {}
    for i in sorted(range(len(groups)), key=lambda i: (int(names[i]) if names[i].isdigit() else 1 << 62, i)):
        by_set.setdefault(tuple(sorted(groups[i])), []).append(i)
    nth = {i: ids.index(i) for ids in by_set.values() for i in ids}

    def group_id(source: int, ranks: tuple[int, ...]) -> int:
        key = tuple(sorted(ranks))
        ids = by_set.setdefault(key, [])
        while len(ids) <= nth[source]:
            ids.append(len(groups))
            groups.append(tuple(sorted(ranks)))   # c10d's order: a member's place is its group rank
            names.append(f"dedup:{len(ids) - 1}:" + ",".join(map(str, ranks)))
        return ids[nth[source]]

    source = {}   # target rank -> (replica-0 rank, image map)
    for d in range(topo.dp):
        image = rank_map(topo, d)
        for r in topo.replica_ranks(0):
            source[int(image[r])] = (r, image)
    per_rank = []
    copied: dict[int, int] = {}      # group of the expanded trace -> the group of `trace` its nodes copy
    for target in range(topo.world_size):
        r, image = source[target]
        cols = {k: v.copy() for k, v in trace.rank(r).items()}
        gmap = np.array([group_id(i, tuple(int(image[m]) for m in g)) for i, g in enumerate(trace.groups)] or [0],
                        dtype=np.int32)
        has_group = cols["group"] >= 0
        for old in np.unique(cols["group"][has_group]).tolist():
            if copied.setdefault(int(gmap[old]), old) != old:
                raise ValueError(f"DP expansion: group {list(groups[gmap[old]])} copies both group "
                                 f"{list(trace.groups[copied[int(gmap[old])]])} and group {list(trace.groups[old])}")
        cols["group"] = np.where(has_group, gmap[np.maximum(cols["group"], 0)], -1).astype(np.int32)
        has_peer = cols["peer"] >= 0
        old_group = trace.columns["group"][trace.rank_slice(r)]
        old_peer = trace.columns["peer"][trace.rank_slice(r)]
        cols["peer"] = np.where(has_peer, image[np.maximum(cols["peer"], 0)], -1).astype(np.int32)
        # A root keeps its place in the group (programs name roots as "rank 0" or "the group's
        # first rank"), so a world-group broadcast from rank 0 stays rooted at rank 0.
        for i in np.nonzero(np.isin(cols["op"], list(ROOTED_OPS)) & has_peer)[0]:
            position = trace.groups[old_group[i]].index(int(old_peer[i]))
            cols["peer"][i] = groups[cols["group"][i]][position]
        per_rank.append(cols)
    offsets = np.zeros(topo.world_size + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(c["kind"]) for c in per_rank])
    columns = {k: np.concatenate([c[k] for c in per_rank]) for k in trace.columns}
    peaks = [trace.step_peaks[source[t][0]] if trace.step_peaks else [] for t in range(topo.world_size)]
    expanded = Trace(world_size=topo.world_size, columns=columns, offsets=offsets, groups=groups, group_names=names,
                     labels=list(trace.labels), dtypes=list(trace.dtypes), step_peaks=peaks, splits=list(trace.splits))
    group_source = np.full(len(groups), -1, dtype=np.int32)     # -1: no node is on it
    for g, old in copied.items():
        group_source[g] = old
    return expanded, group_source
