"""Which virtual ranks a replay hosts, and the graph it loads for them.

`emulation.virtual_ranks: all` hosts every virtual rank of the job: a late sandbox rank's delay
travels through virtual ranks that never talk to it and back. `neighbours` hosts only the virtual
ranks the sandbox ranks talk to (paper §6.1, the "active" virtual ranks): the members of groups
holding a sandbox rank that neighbour pruning keeps on the wire (ring and tree neighbours, the
barrier's, point-to-point peers, every member of a group whose ops are not pruned). The others
hold no nodes: a hosted rank's op among virtual ranks completes once its hosted members are in
(a receive from an absent rank at once), and a pruned member's input to a compensated chunk is
read from the tensor cache by the op's group and seq. What the assistant holds then grows with
the sandbox's neighbourhood, not with the job: it reads those ranks' rows of the graph only.

The set is found from the sandbox ranks' own nodes: every collective of a group holding a sandbox
rank is one of theirs too, and their point-to-point ops name their peers.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from prism_core.trace.store import Trace, TraceStore, load_trace

MODES = ("all", "neighbours")
# what finding the neighbours reads of the sandbox ranks' nodes (`ring_nodes`, `group_pruning`)
NEIGHBOUR_COLUMNS = ("op", "group", "peer", "bytes", "dtype", "reduce", "splits")


def needed_positions(k: int, sandbox: frozenset[int], prunable: bool, barrier: bool, ring: bool,
                     tree_roots: Iterable[int], p2p: Iterable[int]) -> set[int]:
    """Virtual positions of a k-member group holding the sandbox positions `sandbox` that must exist
    on the wire: every one where the group has an op neighbour pruning does not cover (`prunable`
    False), else the barrier's and ring's neighbours, each tree's (by root), and the point-to-point
    peers."""
    from prism_core.replay.ring import ring_neighbours
    from prism_core.replay.tree import tree_neighbours
    from prism_core.replay.tree_barrier import barrier_shape

    if not prunable:
        return set(range(k)) - set(sandbox)
    needed = set(p2p)
    if barrier:
        needed |= barrier_shape(k, set(sandbox)).neighbours
    if ring:
        needed |= ring_neighbours(k, set(sandbox))
    for root in tree_roots:
        needed |= tree_neighbours(k, root, set(sandbox))
    return needed - set(sandbox)


def neighbour_ranks(trace: Trace, sandbox: set[int]) -> set[int]:
    """The virtual ranks the sandbox ranks talk to, from `trace`, which needs to hold the sandbox
    ranks' nodes only."""
    from prism_core.replay.assistant import group_pruning, ring_nodes

    real = {g for g, members in enumerate(trace.groups) if not sandbox.isdisjoint(members)}
    pruning = group_pruning(trace, real, ring_nodes(trace), sandbox)
    out: set[int] = set()
    for g in real:
        members = trace.groups[g]     # looked up by index: a dict of a 16,384-rank group held a MiB
        positions = needed_positions(
            len(members), frozenset(members.index(r) for r in sandbox if r in members), g in pruning.prunable,
            g in pruning.with_barrier, g in pruning.with_ring, pruning.tree_roots.get(g, ()),
            [members.index(r) for r in pruning.p2p_peers.get(g, ())])
        out.update(members[p] for p in positions)
    return out - sandbox


def replayed_ranks(trace: Trace, sandbox: set[int]) -> list[int]:
    """The virtual ranks a replay of `trace` runs: every rank but the sandbox's, or, where the graph
    was loaded for the sandbox's neighbours only, those of them that hold nodes."""
    return [r for r in range(trace.world_size) if r not in sandbox
            and (trace.node_index is None or trace.num_nodes(r) > 0)]


def load_for_replay(path: Path, columns: Iterable[str], sandbox: set[int], mode: str) -> Trace:
    """The graph as a replay hosting `mode`'s virtual ranks reads it: whole ("all"), or only the
    sandbox ranks' and their neighbours' nodes ("neighbours"; `Trace.node_index` set). Where every
    virtual rank is a neighbour (every W=2 job, a ring of three), "neighbours" reads it whole, and
    the replay is "all"'s."""
    if mode not in MODES:
        raise ValueError(f"virtual ranks {mode!r}: one of {', '.join(MODES)}")
    if mode == "all":
        return load_trace(path, columns)
    store = TraceStore(path)
    hosted = sandbox | neighbour_ranks(store.load(NEIGHBOUR_COLUMNS, ranks=sandbox), sandbox)
    return store.load(columns, ranks=None if len(hosted) == store.world_size else hosted)
