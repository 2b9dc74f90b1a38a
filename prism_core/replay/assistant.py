"""The replay assistant: one process that hosts the virtual ranks of a run (paper §6.1, §7): every
one, or only those the sandbox ranks talk to (`emulation.virtual_ranks`, replay/hosted.py).

Each virtual rank walks its graph from the bare (or calibrated) PrismTrace. Communication with
a sandbox rank is real: for every group that holds a sandbox rank, each virtual member owns a
gloo process group made on the same store keys as c10d makes the sandbox's, and issues the
op there with the tensors of `virtual_ops`. Communication among virtual ranks only is settled
in-process (a collective completes when every member has arrived, a send at once, a recv when
its send has arrived). The loop is event-driven: gloo completions arrive on a queue, so one
process serves thousands of virtual ranks while the sandbox ranks run their real program.

Mode "structure" (slice timing, Stage 2) runs compute nodes in zero time: the sandbox ranks
measure their own durations, and calibration repairs the timeline afterwards. The issue time
of every virtual node is written to `replay/arrivals.npy` (where the whole graph is replayed)
so that a sandbox rank's transfer time can exclude its wait for late peers.
"""

from __future__ import annotations

import argparse
import datetime
import heapq
import json
import os
import queue
import resource
import sys
import threading
import time
import traceback
from array import array
from collections import deque
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from prism_core.replay.steady import NodeMoments

ENV_LAZY_GLOO = "TORCH_GLOO_LAZY_INIT"
MAX_LEAD_S = 2e-3        # timed mode: the most a rank's timer fires ahead of its clock
# ... and the share of the ops issued on a timer that may reach gloo after their due, which the lead
# is moved towards in steps of LEAD_STEP_S (`moved_lead`). Early costs only a hold, late delays the
# op, so the lead aims at a high quantile of the wake-up's lateness, not at its mean: moved a tenth
# of each lateness, half of ep2's ops came late, 0.06 ms on average, its virtual peer issuing 5-6 ms
# a step after its clock (bench/MEASURED.md, item 51)
LATE_SHARE = 0.1
LEAD_STEP_S = 5e-6
# timed mode: the ring parts of the ops a virtual rank reaches within this much calibrated compute
# after the node it computes now are built while it computes (at most AHEAD_OPS ops). Built when the
# op came due, a dp2 emulation's 1 MB and 3 MB gradient all-reduces reached the wire a median 0.9
# and 3.1 ms after their clock (the cache's tensors read, the ring's partials folded), each step,
# and the rank of interest waited that long for its virtual peer (bench/MEASURED.md, item 38). Counted in ops
# instead (the next four), the next step's 3 MB build ran in the 0.8 ms between the two and made the
# rank late there; by calibrated time it runs in the long backward before them.
AHEAD_S = 0.02
AHEAD_OPS = 16
# ... and only the parts that read at least this much of the cache (the op's bytes times its group's
# members, whose partials are folded): tp2's 128-256 KB parts took 0.08-0.15 ms at the op, inside the
# timer's lead, and built ahead on the second thread its emulations came 1.2-2.1 points higher in
# all four pairs of bench/MEASURED.md item 39 (item 40)
AHEAD_MIN_BYTES = 1 << 20
# ... the others (a gloo op's spec and cached inputs, a small ring part's buffers) are prepared on
# the loop's thread while nothing is due for at least PREP_S (`_prep_while_idle`): prepared at the op,
# ep2's all-to-alls took a median 0.11-0.13 ms from the loop to gloo, after their clock where the
# compute before them was shorter (item 51)
PREP_S = 0.5e-3
ASSISTANT = "assistant"
# the graph's columns the replay reads (its steady spans place nodes by label; microbatches, chunks
# and the recorded times it never reads)
REPLAY_COLUMNS = ("kind", "op", "group", "peer", "bytes", "dtype", "seq", "tag", "async_", "ref", "label", "step",
                  "reduce", "splits")


DICT_MEMBERS = 1024       # `_position`: groups up to this size look positions up in a dict

HOLD_SPIN_S = 100e-6     # the end of a hold is spun, as a sleep overshoots by about half that


def _hold_until(when: float) -> None:
    """Wait until `when` (perf_counter): asleep but for the last HOLD_SPIN_S, so
    that an assistant sharing cores with ranks (an unbound launch) takes little from them."""
    left = when - time.perf_counter()
    if left > HOLD_SPIN_S:
        time.sleep(left - HOLD_SPIN_S)
    while time.perf_counter() < when:
        pass


def ops_ahead(before: np.ndarray, done: float, at: int, built: int, ahead_s: float = AHEAD_S,
              most: int = AHEAD_OPS) -> range:
    """Which of a rank's comm ops (counted in its order) to build ahead now: from `at`, its next
    one, those whose calibrated compute before them (`before`, per op) is within `ahead_s` of what
    it has computed by the end of its current node (`done`), at most `most`, less the `built`
    first ones already built."""
    last = min(int(np.searchsorted(before, done + ahead_s, side="right")), at + most, len(before))
    return range(max(built, at), max(last, built, at))


def moved_lead(lead: float, late: float, share: float = LATE_SHARE, step: float = LEAD_STEP_S,
               most: float = MAX_LEAD_S) -> float:
    """The timers' lead after an op issued on a timer was ready `late` s after its due (< 0:
    early): up by `step` * (1 - `share`) if late, down by `step` * `share` if not, within 0 …
    `most`; so that about `share` of them come late, whatever the wake-up's lateness."""
    return min(max(lead + step * ((late > 0) - share), 0.0), most)


def builds_ahead(nbytes: int, members: int, min_bytes: int = AHEAD_MIN_BYTES) -> bool:
    """Whether a ring part of an op of `nbytes` in a group of `members` is built ahead: what
    building it reads from the cache (every member's partial) is at least `min_bytes`."""
    return nbytes * members >= min_bytes


@dataclass
class _Holds:
    """Timed mode: the gloo ops issued, those held until their clock (ready up to `lead` early),
    for how long in all, and the most any went on the wire ahead of its clock (<= 0: none did)."""
    ops: int = 0
    held: int = 0
    held_s: float = 0.0
    most_ahead_s: float = -float("inf")
    cost_s: float = 0.0       # the real ranks' issue cost the ops were held for beyond their clock
    # seconds, one per op (8 bytes each: a timed replay of many virtual ranks issues millions):
    late: array = field(default_factory=lambda: array("d"))      # how long after its clock each went on the wire
    behind: array = field(default_factory=lambda: array("d"))    # how far past its rank's clock the loop came to it
    resumed: array = field(default_factory=lambda: array("d"))   # from a completion's stamp to the loop taking it


class _Handle:
    """One op of one virtual rank: done once its outputs are in; ranks blocked on it wait here."""

    __slots__ = ("done", "waiters", "keep", "when")

    def __init__(self):
        self.done = False
        self.waiters: list[int] | None = None    # made by the first rank to wait (most ops have none)
        self.keep = None
        self.when: float | None = None   # completion time, when known

    def wait_by(self, rank: int) -> None:
        if self.waiters is None:
            self.waiters = [rank]
        else:
            self.waiters.append(rank)


class _Local:
    __slots__ = ("arrived", "handles", "sent", "last")

    def __init__(self):
        self.arrived = 0
        self.handles: list[tuple[_Handle, int]] = []   # (handle, node) of the members so far
        self.sent = False
        self.last = 0.0


class _RingOp:
    """One ring all-reduce of a group holding a sandbox rank: its virtual members' handles, the
    node each is at, and the neighbour parts still running."""
    __slots__ = ("handles", "nodes", "parts", "last")

    def __init__(self):
        self.handles: list[_Handle] = []
        self.nodes: dict[int, int] = {}
        self.parts = 0
        self.last = 0.0           # when the latest finished part's gloo works completed


class _Call:
    """Work for the loop's thread, queued by a pool thread (a barrier token arrived)."""
    __slots__ = ("fn",)

    def __init__(self, fn):
        self.fn = fn


RING_KINDS = ("", "allreduce", "all_gather", "reduce_scatter", "tree_broadcast", "tree_reduce", "tree_allreduce")
FIRST_TREE = RING_KINDS.index("tree_broadcast")


def ring_nodes(trace) -> np.ndarray:
    """Per node: which ring or tree the backend runs it as (an index into RING_KINDS; 0: gloo's
    own algorithm), decided by `pruned.ring_algorithm` and `pruned.tree_algorithm` from the graph
    as the backend decides from the tensors. A coalesced op (splits recorded) keeps gloo's."""
    from prism_core.backend.pruned import RING_OPS, ring_algorithm, tree_algorithm
    from prism_core.trace.schema import COMM, OP_CODE, OPS, REDUCE_OPS

    c = trace.columns
    kinds = np.zeros(len(c["kind"]), dtype=np.int8)
    codes = [OP_CODE[o] for o in (*RING_OPS, "broadcast", "reduce")]
    idx = np.nonzero((c["kind"] == COMM) & np.isin(c["op"], codes) & (c["splits"] == 0))[0]
    if not len(idx):
        return kinds
    keys = np.stack([c["op"][idx].astype(np.int64), c["reduce"][idx].astype(np.int64),
                     c["dtype"][idx].astype(np.int64), c["group"][idx].astype(np.int64),
                     c["bytes"][idx].astype(np.int64)], axis=1)
    unique, inverse = np.unique(keys, axis=0, return_inverse=True)
    found = np.zeros(len(unique), dtype=np.int8)
    for n, (op, reduce, dtype, g, nbytes) in enumerate(unique.tolist()):
        name = trace.dtypes[dtype] or "float32"
        args = (OPS[op], REDUCE_OPS[reduce], nbytes // torch_element_size(name), len(trace.groups[g]), name)
        kind = ring_algorithm(*args) or tree_algorithm(*args)
        found[n] = RING_KINDS.index(kind or "")
    kinds[idx] = found[inverse.reshape(-1)]
    return kinds


def torch_element_size(dtype_name: str) -> int:
    import torch

    return torch.empty((), dtype=getattr(torch, dtype_name)).element_size()


@dataclass
class GroupPruning:
    """Which groups holding a sandbox rank keep only some virtual members on the wire, and why."""
    prunable: set[int]                  # every op a barrier, ring, tree, or point-to-point
    with_barrier: set[int]
    with_ring: set[int]
    tree_roots: dict[int, set[int]]     # group -> tree roots (positions) its tree ops use
    p2p_peers: dict[int, set[int]]      # group -> virtual ranks with point-to-point ops to or from a sandbox rank


def group_pruning(trace, groups: set[int], ring: np.ndarray, sandbox: set[int]) -> GroupPruning:
    from prism_core.trace.matching import node_ranks
    from prism_core.trace.schema import COMM, OP_CODE, P2P_OPS

    c = trace.columns
    comm = c["kind"] == COMM
    barrier = comm & (c["op"] == OP_CODE["barrier"])
    p2p = comm & np.isin(c["op"], list(P2P_OPS))
    tree = ring >= FIRST_TREE
    rings = (ring > 0) & ~tree
    other = np.unique(c["group"][comm & ~barrier & (ring == 0) & ~p2p])
    with_barrier = set(np.unique(c["group"][barrier]).tolist()) & groups
    with_ring = set(np.unique(c["group"][rings]).tolist()) & groups
    tree_roots: dict[int, set[int]] = {}
    idx = np.nonzero(tree & np.isin(c["group"], list(groups)))[0]
    # one row per distinct (group, tree kind, root): a set of Python tuples over every node held
    # megabytes at thousands of ranks
    rows = np.unique(np.stack([c["group"][idx].astype(np.int64), ring[idx].astype(np.int64),
                               c["peer"][idx].astype(np.int64)], axis=1), axis=0)
    for g, kind, peer in rows.tolist():
        root = 0 if RING_KINDS[kind] == "tree_allreduce" else trace.groups[g].index(peer)
        tree_roots.setdefault(g, set()).add(root)
    p2p_peers: dict[int, set[int]] = {}
    idx = np.nonzero(p2p & np.isin(c["group"], list(groups)))[0]
    if len(idx):
        ranks = node_ranks(trace)[idx]
        peers = c["peer"][idx]
        mine = np.isin(ranks, list(sandbox))
        rows = np.unique(np.stack([c["group"][idx][mine].astype(np.int64), peers[mine].astype(np.int64)], axis=1),
                         axis=0)
        for g, peer in rows.tolist():
            if peer not in sandbox:
                p2p_peers.setdefault(g, set()).add(peer)
    return GroupPruning(set(groups) - set(other.tolist()), with_barrier, with_ring, tree_roots, p2p_peers)


DEFAULT_GROUP = "0"   # c10d names the default group "0"; later groups count up from 1


def c10d_store(base, group_name: str):
    """The store c10d hands the prism backend for group `group_name`, with the backend's own prefix.

    As torch 2.x builds it: the default group's store is `default_pg` / `0/`; every later group's
    is `<name>/` on top of the default group's store; each backend then adds `<device>/`.
    """
    import torch.distributed as dist

    store = dist.PrefixStore(f"{DEFAULT_GROUP}/", dist.PrefixStore("default_pg", base))
    if group_name != DEFAULT_GROUP:
        store = dist.PrefixStore(f"{group_name}/", store)
    from prism_core.backend.process_group import gloo_store

    return gloo_store(dist.PrefixStore("cpu/", store))


def _nth_of_rank_set(trace) -> list[int]:
    """Per group: how many groups of the same rank set the program created before it (c10d's order:
    numeric names count up; a DP-expanded group carries its place as `dedup:<n>:`)."""
    def order(g: int) -> int:
        name = trace.group_names[g]
        if name.isdigit():
            return int(name)
        return int(name.split(":")[1]) if name.startswith("dedup:") else 1 << 62
    by_set: dict[tuple[int, ...], list[int]] = {}
    for g in sorted(range(len(trace.groups)), key=lambda g: (order(g), g)):
        by_set.setdefault(tuple(sorted(trace.groups[g])), []).append(g)
    nth = [0] * len(trace.groups)
    for ids in by_set.values():
        for n, g in enumerate(ids):
            nth[g] = n
    return nth


class Assistant:
    def __init__(self, trace, sandbox: set[int], cache_root: Path | None, timeout_s: float, model=None,
                 source: np.ndarray | None = None, pacer=None, late_join=None, spin=None, build_ahead: bool = True,
                 ring_combine: bool = True, group_source: np.ndarray | None = None):
        from prism_core.replay.awake import CoreSpin
        from prism_core.replay.hosted import replayed_ranks
        from prism_core.replay.virtual_ops import Inputs
        from prism_core.trace.matching import match_ops

        self.trace = trace
        self.sandbox = set(sandbox)
        # a graph loaded for the sandbox ranks' neighbours only (replay/hosted.py): the other
        # virtual ranks hold no nodes and are not replayed
        self.neighbours_only = trace.node_index is not None
        self.virtual = replayed_ranks(trace, self.sandbox)
        self._hosted = set(self.virtual) if self.neighbours_only else None     # None: every one
        self._virtual_count: dict[int, int] = {}     # group -> its virtual members replayed
        # neighbours only, a DP-expanded graph: per group, the group its nodes copy (collect/dedup.py),
        # which names a copied rank's cache entry without its source rank's rows
        self.group_source = group_source if self.neighbours_only else None
        if self.neighbours_only and source is not None and group_source is None and cache_root is not None:
            raise ValueError("virtual_ranks=neighbours on a DP-expanded graph with a tensor cache needs the "
                             "collection's group_source.npy (collected by an older PrismLLM): collect again, "
                             "or set emulation.virtual_ranks=all")
        self.timeout_s = timeout_s
        self.match = match_ops(trace)
        self.inputs = Inputs(cache_root, range(trace.world_size) if not self.neighbours_only else
                             self._cache_readers(source))
        self.arrivals = np.full(len(trace.columns["kind"]), np.nan)
        self.real_groups = {g for g, members in enumerate(trace.groups) if not self.sandbox.isdisjoint(members)}
        self.ring = ring_nodes(trace)
        self.pruning = group_pruning(trace, self.real_groups, self.ring, self.sandbox)
        self.rings: dict[int, _RingOp] = {}      # op id -> ring or tree op in progress
        self._positions: dict[int, frozenset[int]] = {}   # group -> its sandbox ranks' positions
        self._index: dict[int, dict | tuple[np.ndarray, np.ndarray]] = {}   # group -> positions (`_position`)
        self._shapes: dict[int, object] = {}
        self.barriers: dict[int, object] = {}    # op id -> PrunedBarrier in progress
        self.moves: list = []                    # barrier tokens in flight (the run ends after them)
        self.pgs: dict[tuple[int, int], object] = {}
        self.gloo_members = 0          # members of its gloo groups' gloo layers, all together
        self.compact_groups = 0        # groups whose gloo layer holds only the members kept (backend/compact.py)
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        # issues (one drain per gloo group at a time) and blocking p2p waits
        self.pool = ThreadPoolExecutor(max_workers=256, thread_name_prefix="gloo-issue-wait")
        self.pending: dict[tuple[int, int], deque] = {}
        self.lock = threading.Lock()
        self.local: dict[int, _Local] = {}
        self.model = model        # timed mode: the calibrated NodeModel (spans, transfers); None: structure
        self.timers: list = []
        self._timer_seq = 0
        self.clock: list[float] = []   # per rank (sandbox ranks' unused): a list, not a dict, at 16,384 ranks
        # timed mode: a rank's timer fires `lead` s before its clock, so that the gloo op it
        # issues next reaches gloo on time; fed back from each such issue (see _issued_on_time)
        self.lead = 0.0
        self._targets: dict[int, float] = {}     # rank -> the clock it was woken for, its gloo op pending
        self._due: dict[int, float] = {}         # node -> the clock its gloo op goes on the wire at (timed)
        # the most a ready op is held: its rank woke at most the lead early, and its due adds the
        # issue cost its real rank took (several ms on a loaded slice), so every due is within this
        self._max_hold = MAX_LEAD_S + (float(model.issue_cost.max()) if model is not None and len(model.issue_cost) else 0.0)
        self.holds = _Holds()
        self._woken: dict[int, float] = {}       # rank -> the clock its timer woke it for
        self._ranks = None        # rank of every node, when first needed
        self.source = source      # DP-expanded graph: per rank, the collected rank it copies
        self.pacer = pacer        # co-run: virtual ranks another member runs for real keep to them (pacing.py)
        self.late_join = late_join    # plain slice: a collective goes on the wire once a sandbox member issued it
        self.stopped = None       # timed mode, launch stopped from outside: its stopped time (stopped.py)
        self.follow = None        # timed mode, `--follow-pace`: the sandbox ranks' pace (follow.py)
        self._slipped = self._stop_base = 0.0    # stopped seconds seen in all, and when the replay began
        self.spin = spin if spin is not None else CoreSpin([])   # timed: its cores awake while virtual ranks compute
        # timed mode: what virtual ranks send, built ahead on a thread of its own (`_build_ahead`)
        self.ahead_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="build-ahead") \
            if model is not None and build_ahead else None
        self.built_ahead = 0      # ops whose sends were built ahead
        self.ring_combine = ring_combine   # a virtual rank between two sandbox ranks combines as a real one
        self._comm_nodes: dict[int, tuple] = {}        # rank -> its comm nodes and compute so far (timed)
        self._ahead_next: dict[int, int] = {}          # rank -> its next comm node (by count) not yet built ahead
        self._ahead_rings: dict[int, list] = {}        # op id -> its ring parts, being built
        self._to_prep: deque = deque()                 # (rank, gloo node) or (None, ring op id) to prepare when idle
        self._prepped: dict[int, tuple] = {}           # gloo node -> its spec and inputs, prepared ahead
        self.prepped_ahead = 0

    # -- set-up -----------------------------------------------------------------------------
    def connect(self, base_store) -> None:
        """A gloo group per virtual member of every group holding a sandbox rank (lazily connected):
        the graph's c10d names, or those the sandbox ranks publish for DP-expanded groups."""
        import torch.distributed as dist

        from prism_core.backend import compact
        from prism_core.backend.install import group_name_key
        from prism_core.backend.transport_threads import make_gloo_group

        nth = _nth_of_rank_set(self.trace)
        timeout = datetime.timedelta(seconds=self.timeout_s)
        members = {g: self._virtual_members(g) for g in self.real_groups}
        kept = {g: self._kept_positions(g, members[g]) for g in self.real_groups}
        # first: a sandbox rank making its group waits to know which members exist
        self.compact_groups = compact.publish(base_store, [
            (self.trace.group_names[g] if self._named(g) else None, self.trace.groups[g], nth[g], kept[g])
            for g in sorted(self.real_groups)])
        self._preload_inputs()
        # the graph's names first: they need no wait; a DP-expanded group's c10d name comes from a
        # sandbox member, published when the program creates the group
        for g in sorted(self.real_groups, key=lambda g: not self._named(g)):
            ranks = self.trace.groups[g]
            name = self.trace.group_names[g] if self._named(g) else \
                base_store.get(group_name_key(ranks, nth[g])).decode()
            store = c10d_store(base_store, name)
            whole = len(kept[g]) == len(ranks)
            for rank in members[g]:
                # made before the replay starts: made later, beside live gloo traffic, a lazily
                # initialised ProcessGroupGloo was seen to block in its constructor
                at = self._position(g, rank)
                self.pgs[(rank, g)] = compact.layer(store, at, kept[g], timeout) if not whole else \
                    make_gloo_group(lambda: dist.ProcessGroupGloo(store, at, len(ranks), timeout))
                self.gloo_members += len(kept[g])

    def _preload_inputs(self) -> None:
        """Read ahead from the tensor cache what the virtual members of groups holding a sandbox
        rank send, and every member's input a sandbox rank's ring neighbours fold."""
        from prism_core.trace.schema import OPS

        c = self.trace.columns
        wanted: list[tuple[int, str, int]] = []     # (whose cache entry, key, step)
        for r in self.virtual:
            s = self.trace.rank_slice(r)
            nodes = s.start + np.nonzero(np.isin(c["group"][s], list(self.real_groups)))[0]
            for i in nodes:
                if OPS[c["op"][i]] != "recv":
                    wanted.append((*self._cached_as(r, int(i)), int(c["step"][i])))
        for r in self.sandbox:          # ring neighbours fold every member's input, theirs too
            s = self.trace.rank_slice(r)
            for i in s.start + np.nonzero((self.ring[s] > 0) & (self.ring[s] < FIRST_TREE))[0]:
                wanted.append((*self._cached_as(r, int(i)), int(c["step"][i])))
        if self.neighbours_only:        # what the members not hosted put in, folded too
            done: set[int] = set()
            for r in sorted(self.sandbox):
                s = self.trace.rank_slice(r)
                for i in map(int, s.start + np.nonzero(self.ring[s] > 0)[0]):
                    op = int(self.match.op_id[i])
                    if op in done:
                        continue
                    done.add(op)
                    for m in self.trace.groups[c["group"][i]]:
                        if m in self.sandbox or m in self._hosted:
                            continue
                        holder = m if self.source is None or self.inputs.has(m) else int(self.source[m])
                        if self.inputs.has(holder):
                            wanted.append((*self._cached_as(m, i), int(c["step"][i])))
        self.inputs.preload(wanted)

    def _cache_readers(self, source: np.ndarray | None) -> list[int]:
        """Neighbours only: the ranks whose cache entries the replay may read, the members of groups
        holding a sandbox rank (an absent member's input is folded into a compensated chunk), and
        whose entries a DP-expanded one of them replays (not every rank's reader: memory)."""
        ranks = set(self.sandbox) | set(self.virtual)
        for members in self.trace.groups:
            if not self.sandbox.isdisjoint(members):
                ranks.update(members)
        if source is not None:
            ranks |= {int(source[r]) for r in ranks}
        return sorted(ranks)

    def _kept_positions(self, g: int, virtual_members: list[int]) -> list[int]:
        """The positions of group `g` on the wire: its sandbox ranks and the virtual members kept."""
        return sorted({self._position(g, r) for r in virtual_members} | self._sandbox_positions(g))

    def _named(self, g: int) -> bool:
        """The graph records the group's c10d name (it was collected, not made by DP expansion)."""
        return not self.trace.group_names[g].startswith("dedup:")

    def _virtual_members(self, g: int) -> list[int]:
        """The virtual members of group `g` (holding a sandbox rank) that exist on the wire."""
        from prism_core.replay.hosted import needed_positions

        members = self.trace.groups[g]
        pruning = self.pruning
        needed = needed_positions(len(members), self._sandbox_positions(g), g in pruning.prunable,
                                  g in pruning.with_barrier, g in pruning.with_ring, pruning.tree_roots.get(g, ()),
                                  [self._position(g, r) for r in pruning.p2p_peers.get(g, ())])
        return [members[p] for p in sorted(needed) if members[p] not in self.sandbox]

    def _virtual_members_replayed(self, g: int) -> int:
        """How many virtual members of group `g` this replay runs (every one, or those hosted)."""
        n = self._virtual_count.get(g)
        if n is None:
            if not self.neighbours_only:
                n = len(self.trace.groups[g]) - len(self._sandbox_positions(g))
            else:
                n = sum(1 for m in self.trace.groups[g] if m in self._hosted)
            self._virtual_count[g] = n
        return n

    def _position(self, g: int, rank: int) -> int:
        """`rank`'s position in group `g`; KeyError if it is not a member. `tuple.index` is O(W) per
        call: a dict for a group of up to DICT_MEMBERS (a lookup per gloo op), bisection in the
        group's sorted ranks for a larger one (a dict of 16,384 ranks held a MiB)."""
        found = self._index.get(g)
        if found is None:
            members = self.trace.groups[g]
            if len(members) <= DICT_MEMBERS:
                found = {r: p for p, r in enumerate(members)}
            else:
                ranks = np.asarray(members, dtype=np.int64)
                order = np.argsort(ranks, kind="stable")
                found = (ranks[order], order)
            self._index[g] = found
        if isinstance(found, dict):
            return found[rank]
        ranks, order = found
        j = int(np.searchsorted(ranks, rank))
        if j == len(ranks) or ranks[j] != rank:
            raise KeyError(rank)
        return int(order[j])

    def _sandbox_positions(self, g: int) -> frozenset[int]:
        found = self._positions.get(g)
        if found is None:
            found = self._positions[g] = frozenset(p for p, r in enumerate(self.trace.groups[g]) if r in self.sandbox)
        return found

    def _ring_neighbours(self, g: int) -> set[int]:
        from prism_core.replay.ring import ring_neighbours

        return ring_neighbours(len(self.trace.groups[g]), set(self._sandbox_positions(g)))

    # -- the loop ---------------------------------------------------------------------------
    def run(self) -> None:
        from prism_core.trace.schema import COMM, COMPUTE

        c = self.trace.columns
        kind, async_, ref = c["kind"], c["async_"], c["ref"]
        span = self.model.span if self.model is not None else None
        # per rank (lists, not dicts: at W=16,384 each dict held a MiB)
        pos = self.trace.offsets[:-1].tolist()
        end = self.trace.offsets[1:].tolist()
        handles: dict[int, dict[int, _Handle]] = {}      # rank -> its async ops not yet waited for
        blocked: dict[int, int] = {}     # rank -> the node it is blocked at (`_report` says how)
        ready = deque(self.virtual)
        remaining = len(self.virtual)
        deadline = time.monotonic() + self.timeout_s
        for pacer in (self.pacer, self.late_join):
            if pacer is not None:
                pacer.start(deadline)
        # timed mode: each rank's own clock, the ideal end of its previous node, so that late
        # wake-ups do not add up over thousands of nodes
        start = time.perf_counter()
        self.clock = [start] * self.trace.world_size
        if self.stopped is not None:           # stops before the replay began move nothing
            self._slipped = self._stop_base = self.stopped.total()
        while remaining:
            while ready:
                r = ready.popleft()
                blocked.pop(r, None)
                base = int(self.trace.offsets[r])
                i = pos[r]
                while i < end[r]:
                    k = kind[i]
                    if k == COMPUTE:
                        i += 1
                        if span is not None:                          # timed: the node takes its time
                            self._woken.pop(r, None)                  # not followed by an op at once
                            self.clock[r] += span[i - 1] if self.follow is None else span[i - 1] * self.follow.factor()
                            self._slip()
                            wake = self.clock[r] - self.lead + (self._wire_cost(i) if i < end[r] else 0.0)
                            if wake > time.perf_counter():
                                self._at(wake, r)
                                blocked[r] = i - 1
                                self._build_ahead(r, i)
                                break
                        continue
                    if k == COMM:
                        h = self._issue(r, i)
                        if async_[i]:
                            handles.setdefault(r, {})[i - base] = h
                        elif not h.done:
                            h.wait_by(r)
                            blocked[r] = i
                            i += 1
                            break
                        i += 1
                        continue
                    h = handles[r].pop(int(ref[i]))   # a wait node
                    self._woken.pop(r, None)
                    i += 1
                    if not h.done:
                        h.wait_by(r)
                        blocked[r] = base + int(ref[i - 1])
                        break
                pos[r] = i
                if i >= end[r] and r not in blocked:
                    remaining -= 1
            if not remaining:
                break
            self._slip()
            now = time.perf_counter()
            while self.timers and self.timers[0][0] <= now:
                _, _, what = heapq.heappop(self.timers)
                if isinstance(what, _Handle):
                    self._finish(what, ready)
                else:
                    self._woken[what] = self.clock[what]
                    ready.append(what)
            if ready:
                continue
            if self._to_prep:
                self._prep_while_idle(self.timers[0][0] if self.timers else now + 1.0)
                now = time.perf_counter()
            wait = 1.0 if not self.timers else self.timers[0][0] - now
            self.spin.set_computing(bool(self.timers))
            try:
                h = self.events.get(timeout=max(0.0, min(wait, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() >= deadline:
                    raise TimeoutError(self._report(blocked)) from None
                continue
            self._take_events(h, ready)
        # every token move ends before we leave: the last releases must reach the sandbox ranks, and
        # a sandbox rank's last token to a virtual child must find its receiver still there
        for future in self.moves:
            future.result(timeout=max(1.0, deadline - time.monotonic()))
        while not self.events.empty():
            if isinstance(event := self.events.get_nowait(), BaseException):
                raise event

    def _take_events(self, h, ready: deque) -> None:
        """Handle event `h` and every other one queued: completed handles, calls, errors."""
        while True:
            # A stop may have ended while the loop waited. Move the times set before it first: an
            # event's time, taken after it on a gloo thread, must not be moved by it. (Moved, a
            # virtual rank lost the whole stop again: tp2 emulations taking turns of 0.3 s ran
            # steps of 0.55-0.61 s against 0.23-0.30.)
            self._slip()
            if isinstance(h, BaseException):
                raise h
            if isinstance(h, _Call):
                h.fn()
            else:
                self._finish(h, ready)
            try:
                h = self.events.get_nowait()
            except queue.Empty:
                return

    def _slip(self) -> None:
        """Timed mode, the launch stopped from outside (stopped.py): move every time not yet reached
        (clocks, timers, ops due) later by the stopped time since the last look, so that a stop
        does not eat into what a virtual rank waits for. Within one node of the stop's end."""
        if self.stopped is None:
            return
        total = self.stopped.total()
        d = total - self._slipped
        if d <= 0:
            return
        self._slipped = total
        clock = self.clock
        for r in range(len(clock)):
            clock[r] += d
        self.timers = [(when + d, seq, what) for when, seq, what in self.timers]    # a uniform shift keeps the heap
        for _, _, what in self.timers:
            if isinstance(what, _Handle) and what.when is not None:
                what.when += d
        for times in (self._due, self._targets, self._woken):    # _due is popped on pool threads
            for key in list(times):
                try:
                    times[key] += d
                except KeyError:
                    pass

    def _at(self, when: float, what) -> None:
        """Timed mode: at `when`, resume a rank (an int) or complete a handle."""
        self._timer_seq += 1
        heapq.heappush(self.timers, (when, self._timer_seq, what))

    def _complete_local(self, h: _Handle, i: int, arrived: float) -> None:
        """An in-process op's member completes: at once (structure), or after its transfer (timed)."""
        if self.model is None or self.model.transfer[i] <= 0:
            h.done = True
            h.when = arrived
            self.events.put(h)
        else:
            h.when = arrived + self.model.transfer[i]
            self._at(h.when, h)

    def _wire_cost(self, i: int) -> float:
        """Timed mode: how long after its clock node `i` goes on the wire (its issue cost, where it
        is a gloo op of a group holding a sandbox rank), so that the timer before it fires that
        much later and a costly op is not held longer than a cheap one."""
        from prism_core.trace.schema import COMM

        if self.trace.columns["kind"][i] != COMM or int(self.trace.columns["group"][i]) not in self.real_groups:
            return 0.0
        return float(self.model.issue_cost[i])

    def _issued_on_time(self, rank: int) -> None:
        """Timed mode, `rank`'s gloo op ready for gloo: move `lead` (`moved_lead`) so that about
        LATE_SHARE of such ops are ready after their due; the rest are held to it. Only an op
        issued right after a timer wake-up, not queued behind others, says how late the wake-up
        and the hand-over to a gloo thread are; a stale target (another member's part issued for
        a rank) shows as a lateness beyond any lead and is ignored."""
        target = self._targets.pop(rank, None)
        if target is not None:
            late = time.perf_counter() - target
            if abs(late) < MAX_LEAD_S:
                with self.lock:        # gloo issues run on pool threads
                    self.lead = moved_lead(self.lead, late)

    def _finish(self, h: _Handle, ready: deque) -> None:
        h.done = True
        h.keep = None
        if not h.waiters:
            return
        when = h.when if h.when is not None else time.perf_counter()
        if h.when is not None:
            self.holds.resumed.append(time.perf_counter() - h.when)
        for r in h.waiters:
            self.clock[r] = max(self.clock[r], when)
        ready.extend(h.waiters)
        h.waiters = None

    def _report(self, blocked: dict[int, int]) -> str:
        from prism_core.trace.schema import COMPUTE, OPS

        c = self.trace.columns

        def how(i: int) -> str:          # a wait names its async op's node; a blocking op, its own
            return "computing at" if c["kind"][i] == COMPUTE else "waiting for" if c["async_"][i] else "in"
        lines = [f"virtual rank {r} blocked {how(i)} {OPS[c['op'][i]]} #{c['seq'][i]} of group "
                 f"{list(self.trace.groups[c['group'][i]])} (name {self.trace.group_names[c['group'][i]]!r}, "
                 f"{c['bytes'][i]} B)" for r, i in sorted(blocked.items())[:20]]
        return (f"replay did not finish within {self.timeout_s:g} s; " + ("; ".join(lines) or
                "no virtual rank is blocked"))

    # -- ops --------------------------------------------------------------------------------
    def _issue(self, rank: int, i: int) -> _Handle:
        from prism_core.trace.schema import OPS

        c = self.trace.columns
        now = time.perf_counter()
        woken_for = self._woken.pop(rank, None)
        if self.model is not None:   # woken up to `lead` early: in-process ops arrive on the clock
            now = max(now, self.clock[rank])
        self.arrivals[i] = now
        h = _Handle()
        g = int(c["group"][i])
        op = int(c["op"][i])
        if g in self.real_groups and OPS[op] == "barrier":
            if self._paced(rank):                # joins once its counterpart has (on the loop's thread)
                self.pool.submit(self._barrier_when_paced, rank, i, g, h)
            else:
                self._issue_barrier(rank, i, g, h)
            return h
        timed_wake = woken_for is not None and self.model is not None
        # timed: the op goes on the wire as long after its issue as the real rank's went (its own
        # call, the hand-over to its ring's thread), so that the sandbox member's transfer holds
        # that time as it does in the job when this member is the last to arrive
        cost = float(self.model.issue_cost[i]) if self.model is not None else 0.0
        if self.model is not None and g in self.real_groups:
            self._due[i] = self.clock[rank] + cost
            self.holds.behind.append(time.perf_counter() - self.clock[rank])
        if g in self.real_groups and self.ring[i]:
            if timed_wake:
                self._targets[rank] = woken_for + cost   # on the wire once every member is in: _issued_on_time
            if self.ring[i] >= FIRST_TREE:
                self._issue_tree(rank, i, g, h)
            else:
                self._issue_ring(rank, i, g, h)
            return h
        if g in self.real_groups and self._on_gloo(i):
            if timed_wake:
                self._targets[rank] = woken_for + cost
            self._issue_gloo(rank, i, h)
            return h
        entry = self.local.get(int(self.match.op_id[i]))
        if entry is None:
            entry = self.local[int(self.match.op_id[i])] = _Local()
        op_id = int(self.match.op_id[i])
        now = self.arrivals[i]
        alone = self.neighbours_only and self.match.members[op_id] == 1
        if OPS[op] == "send":              # in-process sends are buffered: done at once
            h.done = True
            if alone:                      # to a rank not hosted (neighbours only)
                del self.local[op_id]
                return h
            if entry.handles:              # the recv came first
                recv_h, recv_i = entry.handles[0]
                self._complete_local(recv_h, recv_i, now)
                del self.local[op_id]
            else:
                entry.sent = True
                entry.last = now
            return h
        if OPS[op] == "recv":
            if entry.sent or alone:        # alone: from a rank not hosted, which sent in time
                self._complete_local(h, i, now)
                del self.local[op_id]
            else:
                entry.handles.append((h, i))
            return h
        entry.arrived += 1
        entry.handles.append((h, i))
        if entry.arrived == self.match.members[op_id]:
            for member, node in entry.handles:
                self._complete_local(member, node, now)
            del self.local[op_id]
        return h

    def _gloo_op(self, rank: int, i: int) -> tuple:
        """`rank`'s op at node `i` as its gloo group issues it: its spec and its inputs read."""
        import torch

        from prism_core.replay.virtual_ops import OpSpec, prepare
        from prism_core.trace.schema import OPS, REDUCE_OPS, ROOTED_OPS

        c = self.trace.columns
        g = int(c["group"][i])
        members = self.trace.groups[g]
        kind = OPS[c["op"][i]]
        peer = int(c["peer"][i])
        holder, key = self._cached_as(rank, i)
        spec = OpSpec(kind=kind, key=key, group=tuple(members), me=self._position(g, rank), nbytes=int(c["bytes"][i]),
                      dtype=getattr(torch, self.trace.dtypes[c["dtype"][i]] or "float32"),
                      reduce=REDUCE_OPS[c["reduce"][i]],
                      root=self._position(g, peer) if c["op"][i] in ROOTED_OPS and peer >= 0 else None,
                      peer=self._position(g, peer) if kind in ("send", "recv") else None, tag=int(c["tag"][i]))
        if kind == "all_to_all_single" and c["splits"][i]:
            spec.member_splits, spec.row_bytes = self._member_splits(i, members)
        return spec, prepare(spec, holder, self.inputs)

    def _issue_gloo(self, rank: int, i: int, h: _Handle) -> None:
        g = int(self.trace.columns["group"][i])
        got = self._prepped.pop(i, None)
        spec, tensors = got if got is not None else self._gloo_op(rank, i)
        kind = spec.kind
        # Issuing a send or recv can block: a lazily connected gloo pair connects on its first op
        # in the calling thread, which needs the peer to reach that pair too. So p2p ops issue on a
        # pool thread, and whatever follows them on the same gloo group queues behind them (program
        # order per group; one drain at a time); collectives of an idle group issue here at once.
        pg_key = (rank, g)
        pending = self.pending.setdefault(pg_key, deque())
        # a paced op may wait for its counterpart, a collective joining late for its sandbox member
        off_loop = kind in ("send", "recv") or self._paced(rank) or self.late_join is not None
        with self.lock:
            busy = bool(pending)
            if busy or off_loop:
                pending.append((i, spec, tensors, h))
        if busy:
            self._targets.pop(rank, None)            # it waits its turn: not a hand-over delay
            return                                   # the group's drain issues it in turn
        if off_loop:
            self.pool.submit(self._drain, pg_key)
        else:
            self._issue_now(pg_key, i, spec, tensors, h)

    def _issue_now(self, pg_key: tuple, i: int, spec, tensors, h) -> None:
        from prism_core.replay.ring import RingPart
        from prism_core.replay.tree import TreePart
        from prism_core.replay.virtual_ops import issue

        if isinstance(spec, RingPart):
            spec.prepare()                        # its sends built from the cache: tensors in hand
        if self._paced(pg_key[0]):                # co-run: on the wire once its real counterpart issued it
            self.pacer.wait_for(pg_key[0], i - int(self.trace.offsets[pg_key[0]]))
        elif self.late_join is not None and getattr(spec, "kind", "") not in ("send", "recv"):
            self._join_late(i)
        self._issued_on_time(pg_key[0])           # how late the hand-over came: feeds `lead`
        due = self._due.pop(i, None)
        if due is not None:                       # timed: never on the wire before its clock
            ready = time.perf_counter()
            with self.spin.hold():
                _hold_until(min(due, ready + self._max_hold))
        handed = time.perf_counter()               # the moment gloo gets the op, tensors in hand
        cost = float(self.model.issue_cost[i]) if due is not None else 0.0
        self.arrivals[i] = handed - cost          # a timed member arrived its issue cost before (its due holds it)
        if due is not None:
            with self.lock:
                holds = self.holds
                holds.ops += 1
                holds.cost_s += cost
                if due > ready:
                    holds.held += 1
                    holds.held_s += due - ready
                holds.most_ahead_s = max(holds.most_ahead_s, due - handed)
                holds.late.append(max(handed - due, 0.0))
        pg = self.pgs[pg_key[:2]]                 # a tree part's queue key names its queue too
        if isinstance(spec, TreePart):            # completes its members through its futures
            spec.run(pg)
            return
        if isinstance(spec, RingPart):            # h: the _RingOp
            works, keep = spec.run(pg)
            if works:
                self.pool.submit(self._wait_then, works, keep, h)
            else:                                 # the part ran its steps in run()
                self._part_finished(h, time.perf_counter())
            return
        works, keep = issue(pg, spec, tensors)
        h.keep = (works, keep)
        if spec.kind in ("send", "recv") or len(works) != 1 or not self._on_future(works[0], h):
            self.pool.submit(self._wait, works, h)

    def _join_late(self, i: int) -> None:
        """Wait until a sandbox member of node `i`'s op has issued it (`late_join`, a pool thread)."""
        for r, node in self._member_nodes(i, self.trace.groups[int(self.trace.columns["group"][i])]):
            if r in self.sandbox:
                self.late_join.wait_for(r, node - int(self.trace.offsets[r]))
                return

    def _paced(self, rank: int) -> bool:
        return self.pacer is not None and rank in self.pacer.counterparts

    def _barrier_when_paced(self, rank: int, i: int, g: int, h: _Handle) -> None:
        try:
            self.pacer.wait_for(rank, i - int(self.trace.offsets[rank]))
        except BaseException as err:  # noqa: BLE001 - reported on the loop's thread
            self.events.put(err)
            return
        arrived = time.perf_counter()

        def join() -> None:
            self.arrivals[i] = arrived
            self._issue_barrier(rank, i, g, h)
        self.events.put(_Call(join))

    def _drain(self, pg_key: tuple) -> None:
        pending = self.pending[pg_key]
        try:
            while True:
                i, spec, tensors, h = pending[0]
                self._issue_now(pg_key, i, spec, tensors, h)
                with self.lock:
                    pending.popleft()
                    if not pending:
                        return
        except BaseException as err:  # noqa: BLE001 - reported on the loop's thread
            self.events.put(err)

    def _on_future(self, work, h: _Handle) -> bool:
        try:
            work.get_future().then(lambda _f, h=h: self._done_at(h))
            return True
        except RuntimeError:   # some gloo works have no future
            return False

    # -- the pruned ring all-reduce (groups holding a sandbox rank) ----------------------------
    def _issue_ring(self, rank: int, i: int, g: int, h: _Handle) -> None:
        """Count this virtual member in; once all are, the sandbox ranks' ring neighbours play their
        part (`replay.ring`); every virtual member completes when those parts are done.
        (All-reduce, all-gather or reduce-scatter: `self.ring[i]` says which.)"""
        ring = self._all_arrived(rank, i, g, h)
        if ring is None:
            self._targets.pop(rank, None)             # it waits for the other virtual members
            return
        parts = self._ahead_rings.pop(int(self.match.op_id[i]), None)
        if parts is None:
            parts = self._ring_parts(i, g, ring.nodes)
        self._share_due(ring.nodes.values(), [node for _, node, _ in parts])
        ring.parts = len(parts)
        if not parts:
            self._ring_done(ring)
            return
        for rank_p, node, part in parts:
            self._enqueue((rank_p, g), (node, part, None, ring))

    def _ring_parts(self, i: int, g: int, nodes: dict[int, int]) -> list[tuple[int, int, object]]:
        """(virtual member, its node, its `RingPart`) of each sandbox rank's ring neighbour in the op
        at node `i` of group `g`; `nodes`: each virtual member's node in it."""
        import torch

        from prism_core.replay.ring import RingPart
        from prism_core.trace.schema import REDUCE_OPS

        members = self.trace.groups[g]
        sandbox = self._sandbox_positions(g)
        c = self.trace.columns
        dtype = self.trace.dtypes[c["dtype"][i]] or "float32"
        numel = int(c["bytes"][i]) // torch_element_size(dtype)
        op = REDUCE_OPS[c["reduce"][i]]
        out = []
        for p in sorted(self._ring_neighbours(g)):
            rank_p = members[p]
            part = RingPart(kind=RING_KINDS[self.ring[i]], me=p, k=len(members), sandbox=sandbox, op=op,
                            numel=numel, dtype=getattr(torch, dtype), combine_work=self.ring_combine,
                            load=lambda n=nodes[rank_p]: self._ring_inputs(n, members, numel, dtype))
            out.append((rank_p, nodes[rank_p], part))
        return out

    def _build_ahead(self, rank: int, i: int) -> None:
        """Timed mode, virtual `rank` computing up to node `i`: build the ring parts (the partials
        folded from the cache) of the ops it reaches within `AHEAD_S` of calibrated compute after
        that on the build-ahead thread, in order, so that each is in hand when its clock comes, as
        a real rank's data is; only parts that read `AHEAD_MIN_BYTES` of the cache (`builds_ahead`).
        The others, smaller ring parts and the ops `_issue_gloo` issues (their specs and cached
        inputs), are queued to be prepared on the loop's thread while it idles
        (`_prep_while_idle`): on the second thread tp2's small parts slowed its emulations
        (item 40)."""
        from prism_core.trace.schema import COMM, COMPUTE

        if self.ahead_pool is None:
            return
        c = self.trace.columns
        found = self._comm_nodes.get(rank)
        if found is None:
            s = self.trace.rank_slice(rank)
            before = np.concatenate([[0.0], np.cumsum(np.where(c["kind"][s] == COMPUTE, self.model.span[s], 0.0))])
            nodes = s.start + np.flatnonzero(c["kind"][s] == COMM)
            found = self._comm_nodes[rank] = (nodes, before[nodes - s.start], before, s.start)
        nodes, at_node, before, start = found
        todo = ops_ahead(at_node, float(before[i - start]), int(np.searchsorted(nodes, i)),
                         self._ahead_next.get(rank, 0))
        if not todo:
            return
        self._ahead_next[rank] = todo.stop
        for j in map(int, nodes[todo]):
            g = int(c["group"][j])
            if g not in self.real_groups or self.ring[j] >= FIRST_TREE:   # a tree part reads its inputs as it goes
                continue
            if not self.ring[j]:
                if self._on_gloo(j):
                    self._to_prep.append((rank, j))
                continue
            o = int(self.match.op_id[j])
            if o in self._ahead_rings:
                continue
            parts = self._ahead_rings[o] = self._ring_parts(j, g, dict(self._member_nodes(j, self.trace.groups[g])))
            if builds_ahead(int(c["bytes"][j]), len(self.trace.groups[g])):
                for _, _, part in parts:
                    part.prepare_on(self.ahead_pool)
                self.built_ahead += 1
            else:
                self._to_prep.append((None, o))

    def _on_gloo(self, i: int) -> bool:
        """Node `i`, of a group holding a sandbox rank and not a ring or tree op: `_issue_gloo` issues it."""
        from prism_core.trace.schema import OPS, P2P_OPS

        c = self.trace.columns
        op = int(c["op"][i])
        return OPS[op] != "barrier" and (op not in P2P_OPS or int(c["peer"][i]) in self.sandbox)

    def _prep_while_idle(self, until: float) -> None:
        """Timed mode: prepare the ops queued by `_build_ahead` on the loop's thread (a gloo op's
        spec and inputs, a small ring part's buffers) while nothing is due before `until` less
        PREP_S and no event waits, so that the work is done before the op's clock, as a real rank
        has its data in hand; what is not prepared by then is prepared at the op, as before."""
        while self._to_prep and time.perf_counter() + PREP_S < until and self.events.empty():
            rank, what = self._to_prep.popleft()
            if rank is None:                      # a ring op's parts: unless it ran already
                for _, _, part in self._ahead_rings.get(what, ()):
                    part.prepare()
            elif np.isnan(self.arrivals[what]) and what not in self._prepped:    # not issued yet
                self._prepped[what] = self._gloo_op(rank, what)
            else:
                continue
            self.prepped_ahead += 1

    def _issue_tree(self, rank: int, i: int, g: int, h: _Handle) -> None:
        """Count this virtual member in; once all are, the sandbox ranks' tree neighbours play their
        part (`replay.tree`); each virtual member completes once what it depends on has happened.
        The parts queue apart from the rank's point-to-point ops on the group (a part blocks
        until its sandbox neighbours reach the op, and they may first wait for such an op)."""
        import torch

        from prism_core.replay.tree import TreeOp, tree_neighbours
        from prism_core.trace.schema import REDUCE_OPS

        tree = self._all_arrived(rank, i, g, h)
        if tree is None:
            self._targets.pop(rank, None)             # it waits for the other virtual members
            return
        members = self.trace.groups[g]
        sandbox = self._sandbox_positions(g)
        c = self.trace.columns
        kind = RING_KINDS[self.ring[i]]
        root = 0 if kind == "tree_allreduce" else self._position(g, int(c["peer"][i]))
        parts = sorted(tree_neighbours(len(members), root, set(sandbox)))
        nodes = tree.nodes          # every virtual member's node: the parts' and every input loaded are theirs
        self._share_due(nodes.values(), [nodes[members[p]] for p in parts])
        if not parts:
            self._ring_done(tree)
            return
        dtype = self.trace.dtypes[c["dtype"][i]] or "float32"
        numel = int(c["bytes"][i]) // torch_element_size(dtype)
        shared = TreeOp(kind, len(members), root, sandbox, REDUCE_OPS[c["reduce"][i]], numel, getattr(torch, dtype),
                        load=lambda p: self._member_input(members[p], nodes.get(members[p], i), numel, dtype))
        queued = [(p, shared.part(p)) for p in parts]
        # members waiting for the same parts complete together: one callback per distinct wait,
        # not a closure per member (thousands at W=16,384)
        by_wait: dict[tuple, list[_Handle]] = {}
        for member, handle in zip(tree.nodes, tree.handles):
            by_wait.setdefault(tuple(shared.depends(self._position(g, member))), []).append(handle)
        for futures, handles in by_wait.items():
            self._complete_after(handles, futures)
        for p, part in queued:
            self._enqueue((members[p], g, "tree"), (nodes[members[p]], part, None, None))

    def _share_due(self, arrived, parts: list[int]) -> None:
        """Timed mode: a ring or tree op goes on the wire once its last virtual member is due; each
        part (by its node) gets that moment."""
        if self.model is None:
            return
        dues = [self._due.pop(n) for n in arrived if n in self._due]
        if dues:
            due = max(dues)
            for n in parts:
                self._due[n] = due

    def _all_arrived(self, rank: int, i: int, g: int, h: _Handle) -> _RingOp | None:
        """Count virtual `rank` (at node `i`, handle `h`) into the ring or tree op of group `g`;
        the op, once every virtual member has arrived, else None."""
        op_id = int(self.match.op_id[i])
        op = self.rings.get(op_id)
        if op is None:
            op = self.rings[op_id] = _RingOp()
        op.handles.append(h)
        op.nodes[rank] = i
        if len(op.handles) < self._virtual_members_replayed(g):
            return None
        del self.rings[op_id]
        return op

    def _enqueue(self, key: tuple, item: tuple) -> None:
        """Queue `item` (node, spec, tensors, handle) behind what `key`'s queue holds, in order."""
        pending = self.pending.setdefault(key, deque())
        with self.lock:
            busy = bool(pending)
            pending.append(item)
        if busy:
            self._targets.pop(key[0], None)          # it waits its turn: not a hand-over delay
        else:
            self.pool.submit(self._drain, key)

    def _complete_after(self, handles: list[_Handle], futures: tuple) -> None:
        """Complete `handles` when every future is done (at once, with none)."""
        if not futures:
            self._done_at(*handles)
            return
        left = [len(futures)]
        lock = threading.Lock()

        def one_more(_future) -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                self._done_at(*handles)
        for f in futures:
            f.add_done_callback(one_more)

    def _member_input(self, member: int, node: int, numel: int, dtype: str):
        """What `member` put into the collective at its `node`, flat: from the tensor cache, or zeros."""
        import torch

        holder, key = self._cached_as(member, node)
        cached = self.inputs.get(holder, key)    # a list form's blocks: one after the other
        if cached and sum(t.numel() for t in cached) == numel:
            return torch.cat([t.reshape(-1) for t in cached]) if len(cached) > 1 else cached[0].reshape(-1)
        return torch.zeros(numel, dtype=getattr(torch, dtype))

    def _ring_inputs(self, i: int, members: tuple[int, ...], numel: int, dtype: str) -> list:
        """Every member's input of the all-reduce at node `i`, flat: from the tensor cache, or zeros."""
        return [self._member_input(m, node, numel, dtype) for m, node in self._member_nodes(i, members)]

    def _wait_then(self, works, keep, ring: _RingOp) -> None:
        try:
            for w in works:
                w.wait()
            done = time.perf_counter()
            del keep
            self._part_finished(ring, done)
        except BaseException as err:  # noqa: BLE001 - reported on the loop's thread
            self.events.put(err)

    def _part_finished(self, ring: _RingOp, at: float) -> None:
        """(Any thread.) A part's gloo works completed at `at`: count it on the loop's thread."""
        self.events.put(_Call(lambda: self._part_done(ring, at)))

    def _part_done(self, ring: _RingOp, at: float) -> None:
        ring.parts -= 1
        ring.last = max(ring.last, at)
        if ring.parts == 0:
            self._ring_done(ring, ring.last)

    def _ring_done(self, ring: _RingOp, at: float | None = None) -> None:
        """Complete the op's virtual members: when its last part's works completed (not when
        this loop got round to it), or now when it had no part on the wire."""
        now = time.perf_counter() if at is None else at
        for h in ring.handles:
            h.when = now
            self.events.put(h)
        ring.handles = []

    # -- the pruned tree barrier (groups holding a sandbox rank) ------------------------------
    def _shape(self, g: int):
        from prism_core.replay.tree_barrier import barrier_shape

        if g not in self._shapes:
            members = self.trace.groups[g]
            hosted = self._hosted
            self._shapes[g] = barrier_shape(len(members), {p for p, r in enumerate(members) if r in self.sandbox},
                                            None if hosted is None else lambda p: members[p] in hosted)
        return self._shapes[g]

    def _issue_barrier(self, rank: int, i: int, g: int, h: _Handle) -> None:
        """Count this virtual member in; only the sandbox ranks' tree neighbours send or receive."""
        from prism_core.replay.tree_barrier import PrunedBarrier

        members = self.trace.groups[g]
        op_id = int(self.match.op_id[i])
        b = self.barriers.get(op_id)
        if b is None:
            shape = self._shape(g)
            def release() -> None:
                now = time.perf_counter()
                for p, qs in shape.from_sandbox.items():
                    for q in qs:
                        self._token(members[p], g, q, send=True)
                for member in b.handles:
                    member.when = now
                    self.events.put(member)
                del self.barriers[op_id]

            b = self.barriers[op_id] = PrunedBarrier(
                shape, send_up=lambda c, q: self._token(members[c], g, q, send=True), release=release)
            for p, qs in shape.from_sandbox.items():      # the sandbox children's tokens up
                for q in qs:
                    self._token(members[p], g, q, send=False, then=lambda q=q, b=b: b.ready(q))
            for c, q in shape.up_to_sandbox.items():      # the release from a sandbox parent
                self._token(members[c], g, q, send=False, then=b.settle)
        b.handles.append(h)
        b.ready(self._position(g, rank))

    def _token(self, rank: int, g: int, peer: int, send: bool, then=None) -> None:
        """Send or receive a barrier token on virtual `rank`'s gloo group (on a pool thread: the first
        use of a lazily connected pair blocks); `then` runs on the loop once a receive completed."""
        import torch

        from prism_core.backend.pruned import BARRIER_TAG

        def move() -> None:
            try:
                pg = self.pgs[(rank, g)]
                token = torch.zeros(1, dtype=torch.uint8)
                (pg.send([token], peer, BARRIER_TAG) if send else pg.recv([token], peer, BARRIER_TAG)).wait()
                if then is not None:
                    self.events.put(_Call(then))
            except BaseException as err:  # noqa: BLE001 - reported on the loop's thread
                self.events.put(err)

        self.moves.append(self.pool.submit(move))

    def _member_nodes(self, i: int, members: tuple[int, ...]) -> list[tuple[int, int]]:
        """(member, its node) of the collective node `i` takes part in, in group order; a member this
        replay does not host (neighbours only) answers with node `i`, which names the op's cache
        entry as well (`_cached_as`)."""
        from prism_core.trace.matching import node_ranks

        o = int(self.match.op_id[i])
        nodes = self.match.order[self.match.bounds[o]:self.match.bounds[o + 1]]
        if self._ranks is None:
            self._ranks = node_ranks(self.trace)
        by_rank = {int(self._ranks[n]): int(n) for n in nodes}
        if not self.neighbours_only:
            return [(m, by_rank[m]) for m in members]
        return [(m, by_rank.get(m, i)) for m in members]

    def _member_splits(self, i: int, members: tuple[int, ...]) -> tuple[list[list[int]], int]:
        """Every member's splits of the uneven all-to-all node `i` takes part in, and the bytes of a row."""
        c = self.trace.columns
        by_rank = dict(self._member_nodes(i, members))
        splits, row_bytes = [], 0
        for m in members:
            text = self.trace.splits[c["splits"][by_rank[m]]]
            if not text:
                raise ValueError(f"all_to_all_single node {i}: rank {m} of group {list(members)} has no splits "
                                 "recorded where its peers split unevenly")
            s = [int(x) for x in text.split(",")]
            if sum(s):
                row_bytes = int(c["bytes"][by_rank[m]]) // sum(s)
            splits.append(s)
        return splits, row_bytes

    def _done_at(self, *handles: _Handle) -> None:
        now = time.perf_counter()
        for h in handles:
            h.when = now
            self.events.put(h)

    def _cached_as(self, rank: int, i: int) -> tuple[int, str]:
        """Whose cache entry holds what `rank` sends at node `i`: its own, or, for a rank that a DP
        expansion copied from a collected replica, that replica rank's at the same node. (`i` may be
        another member's node of the same collective where `rank` is not hosted: a collective's key
        names its group and seq only.)"""
        if self.source is None or self.inputs.has(rank):
            return rank, self._key(rank, i)
        s = int(self.source[rank])
        if not self.neighbours_only:             # every rank hosted: the source rank's node is here
            return s, self._key(s, int(self.trace.offsets[s]) + i - int(self.trace.offsets[rank]))
        if self.group_source is None:            # no cache (else refused at the start): nothing to name
            return s, ""
        return s, self._copied_key(s, i)

    def _copied_key(self, s: int, i: int) -> str:
        """The cache key of source rank `s`'s node that node `i` (of a rank copied from `s`, or of
        another member of the same collective) copies: on the group its group copies, at the same
        seq; a point-to-point peer is the peer's own source."""
        from prism_core.trace.schema import OPS

        c = self.trace.columns
        copied = int(self.group_source[c["group"][i]])
        if copied < 0:
            raise ValueError(f"node {i}: its group {list(self.trace.groups[c['group'][i]])} copies no collected group")
        name = self.trace.group_names[copied]
        kind = OPS[c["op"][i]]
        if kind in ("send", "recv"):
            peer = int(self.source[int(c["peer"][i])])
            src, dst = (s, peer) if kind == "send" else (peer, s)
            return f"p/{name}/{src}/{dst}/{int(c['tag'][i])}/{int(c['seq'][i])}"
        return f"c/{name}/{int(c['seq'][i])}"

    def _key(self, rank: int, i: int) -> str:
        """The op's key in the tensor cache, as context-switching collection wrote it."""
        from prism_core.trace.schema import OPS

        c = self.trace.columns
        name = self.trace.group_names[c["group"][i]]
        kind = OPS[c["op"][i]]
        if kind in ("send", "recv"):
            peer = int(c["peer"][i])
            src, dst = (rank, peer) if kind == "send" else (peer, rank)
            return f"p/{name}/{src}/{dst}/{int(c['tag'][i])}/{int(c['seq'][i])}"
        return f"c/{name}/{int(c['seq'][i])}"

    def _wait(self, works, h: _Handle) -> None:
        try:
            for w in works:
                w.wait()
            self._done_at(h)
        except BaseException as err:  # noqa: BLE001 - reported on the loop's thread
            self.events.put(err)

    def close(self) -> None:
        self.spin.close()
        for pacer in (self.pacer, self.late_join):
            if pacer is not None:
                pacer.close()
        self.pool.shutdown(wait=False, cancel_futures=True)
        if self.ahead_pool is not None:
            self.ahead_pool.shutdown(wait=True, cancel_futures=True)   # before the cache it reads closes
        self.inputs.close()


def _quantiles(values) -> dict | None:
    """Median, mean, 90th percentile and most of `values` (a stop of the launch lands in the tail)."""
    if not values:
        return None
    v = np.asarray(values)
    return {"median": float(np.median(v)), "mean": float(v.mean()), "p90": float(np.percentile(v, 90)),
            "max": float(v.max())}


@dataclass
class ReplayTiming:
    span: np.ndarray        # per node: seconds it takes (compute) on the calibrated timeline
    transfer: np.ndarray    # per node: seconds from the last arrival to completion (communication)
    issue_cost: np.ndarray  # per node: seconds a real rank took from issuing the op to the wire
    alone_span: np.ndarray | None = None   # per node: compute as its rank took it alone (calibrate/predict.py)
    moments: NodeMoments | None = None     # when each node ran, in the timeline and where measured (replay/steady.py)
    timed_pass: bool = False               # the alone spans are a timed pass's slices' (as an emulation times)


# what `_timing` reads of a timeline, per node
TIMING_PER_NODE = ("span", "transfer", "issue_cost", "alone_span", "start", "end", "measured_start", "measured_end",
                   "measured_queued")


def load_timing(path: Path, nodes: np.ndarray | None = None, nodes_in_graph: int | None = None) -> ReplayTiming:
    """A calibrated timeline's timing, of every node, or of `nodes` only (sorted indices into a
    graph of `nodes_in_graph` nodes; a graph loaded for some ranks), read without the others'
    (calibrate/timeline_rows.py). ValueError where the timeline is not of such a graph."""
    if nodes is not None:
        from prism_core.calibrate.timeline_rows import read_rows

        data = read_rows(path, nodes, int(nodes_in_graph), TIMING_PER_NODE, whole=("timed_pass",))
        missing = [name for name in ("span", "transfer") if name not in data]
        if missing:
            raise ValueError(f"{path}: holds no {' or '.join(missing)}")
        return _timing(data)
    with np.load(path) as data:      # a mapping whose members are read as they are asked for
        return _timing(data)


def _timing(data: Mapping[str, np.ndarray]) -> ReplayTiming:
    from prism_core.replay.steady import node_moments

    cost = data["issue_cost"] if "issue_cost" in data else np.zeros_like(data["transfer"])
    timed = bool(data["timed_pass"]) if "timed_pass" in data else False
    return ReplayTiming(span=data["span"], transfer=data["transfer"], issue_cost=cost,
                        alone_span=data.get("alone_span"), moments=node_moments(data), timed_pass=timed)


def resident_bytes() -> int | None:
    """This process's resident memory now (Linux `/proc/self/statm`), None where it cannot be read."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def peak_resident_bytes() -> int:
    """The most resident memory this process has held since it started its program: `VmHWM` of
    /proc/self/status. (`getrusage`'s ru_maxrss also counts what the process held between its fork
    and its exec, its launcher's pages: in bench/scale.py at W=16,384 it read 290 MiB before the
    assistant had loaded anything, its own resident memory then 262 MiB.) Where /proc cannot be
    read, ru_maxrss. The kernel moves VmHWM up lazily: never below the resident memory now."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return max(int(line.split()[1]) * 1024, resident_bytes() or 0)
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_assistant(graph: Path, sandbox: list[int], result_dir: Path, cache: Path | None, timeout_s: float,
                  timing: Path | None = None, pace: dict[int, Path] | None = None, pace_socket: str = "",
                  join_late: bool = False, awake_fds: list[int] | None = None, follow_pace: int | None = None,
                  pace_reference: str = "loaded", pace_steps: int = 1, build_ahead: bool = True,
                  virtual_spans: str = "timed", steady_from: int = 0, ring_combine: bool = True,
                  virtual_ranks: str = "all") -> None:
    """Connect to the job's store (torchrun environment), replay every virtual rank, write arrivals.

    `timing`: a calibrated timeline (`timeline.npz`): virtual ranks then take their calibrated
    time for each node; without it they replay the structure as fast as it allows. `pace`: in a
    co-run, virtual rank -> the flight record of the member running it for real, which it keeps
    to (nudged on the abstract socket `pace_socket`; replay/pacing.py). `join_late`: a plain
    slice whose virtual members of collectives go on the wire once a sandbox member has issued the
    op (the sandbox ranks nudge `pace_socket`). `awake_fds`: timed, the pipes to the spins on this
    assistant's cores, which run while its virtual ranks compute (replay/awake.py). `follow_pace`:
    timed, the virtual ranks' compute follows the sandbox ranks' pace after that many warm-up
    steps (replay/follow.py); None: it does not. `pace_reference`: "loaded", the pace is read against
    the sandbox ranks' calibrated spans, "alone", against their compute as timed in their slices (the
    timeline's `alone_span`, where it has one), or "timed", that where those slices were timed as an
    emulation is (a second timing pass) and the calibrated spans otherwise (`follow.reference_spans`);
    over up to `pace_steps` steps. `build_ahead`: timed,
    what the virtual ranks send is built while they compute up to it (`Assistant._build_ahead`).
    `virtual_ranks`: "all", every virtual rank is replayed; "neighbours", only those the sandbox
    ranks talk to (replay/hosted.py), of which alone the graph's and the timeline's rows are read;
    unless they are every virtual rank, no arrivals are written then (calibration reads them from a
    slice, which replays all).
    `virtual_spans`: timed, "steady": each virtual rank's steady steps from `steady_from` take their
    positions' trimmed mean spans; "paired": only those of virtual ranks whose every peer is a
    sandbox rank (replay/steady.py); "matched": those, each keeping the share of its timed noise
    that its sandbox peers do not share with it (`steady.kept_noise`); "timed": the timeline's
    spans as they are.
    """
    import torch
    import torch.distributed as dist

    from prism_core.backend.transport_threads import loop_policies
    from prism_core.collect.context_switch import GROUP_SOURCE, REPLICA_SOURCE
    from prism_core.replay.hosted import load_for_replay, replayed_ranks
    from prism_core.runtime import write_json_atomic

    torch.set_num_threads(1)
    # resident memory after each phase: what grows with W, the graph, its replay state or gloo's
    rss: dict[str, int | None] = {}
    peak: dict[str, int] = {}       # the most held up to each phase's end

    def phase_ends(name: str) -> None:
        rss[name] = resident_bytes()
        # VmHWM is moved up lazily (not when the allocator hands pages back): never below a sample
        peak[name] = max(peak_resident_bytes(), rss[name] or 0, *peak.values())
    phase_ends("started")
    trace = load_for_replay(graph, REPLAY_COLUMNS, set(sandbox), virtual_ranks)
    phase_ends("graph")
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    model = None
    if timing is not None:      # neighbours only: the hosted nodes' timing alone is read
        try:
            model = load_timing(timing, trace.node_index, trace.nodes_in_graph)
        except ValueError as err:
            raise ValueError(f"the timeline does not fit the graph {graph}: {err}") from None
    if model is not None and model.span.shape != trace.columns["kind"].shape:
        raise ValueError(f"{timing} does not belong to the graph {graph}")
    steady: list[int] = []
    matched: dict[int, tuple[float | None, float]] = {}
    if model is not None and virtual_spans != "timed":
        from prism_core.replay.steady import matched_noise, paired_ranks, steady_spans

        virtual = replayed_ranks(trace, set(sandbox))
        steady = virtual if virtual_spans == "steady" else paired_ranks(trace, virtual, sandbox)
        if virtual_spans == "matched":
            matched = matched_noise(trace, model.span, steady, sandbox, steady_from, model.moments)
        model = replace(model, span=steady_spans(trace, model.span, steady, steady_from,
                                                 kept={r: w for r, (_, w) in matched.items()}))
    source_path = Path(graph).parent / REPLICA_SOURCE
    source = np.load(source_path) if source_path.is_file() else None
    group_source_path = Path(graph).parent / GROUP_SOURCE
    group_source = np.load(group_source_path) if group_source_path.is_file() else None
    pacer = late_join = None
    if pace or join_late:
        from prism_core.replay.pacing import Pacer

        if pace:
            pacer = Pacer(pace, pace_socket)
        else:       # the same wait, on the sandbox ranks' own flight records
            late_join = Pacer({r: Path(result_dir) / "flight" / f"{r}.bin" for r in sandbox}, pace_socket)
    from prism_core.replay.awake import CoreSpin

    spin = CoreSpin((awake_fds or []) if model is not None else [])
    assistant = Assistant(trace, set(sandbox), cache, timeout_s, model, source, pacer, late_join, spin, build_ahead,
                          ring_combine, group_source)
    phase_ends("assistant")
    if model is not None:
        from prism_core.replay.stopped import StoppedTime

        assistant.stopped = StoppedTime.from_env()
        if follow_pace is not None:
            from prism_core.replay.follow import (PaceFollower, pace_ranks, reference_compute, reference_spans,
                                                  shared_cores)

            placement = Path(result_dir) / "placement.json"     # the launcher writes it before starting us
            off = shared_cores(json.loads(placement.read_text()) if placement.is_file() else {})
            reference = {}
            columns = trace.columns
            read = [] if off else pace_ranks(columns["kind"], columns["step"], trace.offsets, model.span,
                                             list(sandbox), follow_pace)
            against, against_name = reference_spans(model.span, model.alone_span, model.timed_pass, pace_reference)
            for r in read:
                cols = trace.rank(r)
                reference[r] = reference_compute(cols["kind"], cols["step"], against[trace.rank_slice(r)], follow_pace)
            assistant.follow = PaceFollower({r: Path(result_dir) / "flight" / f"{r}.bin" for r in reference},
                                            reference, off, pace_steps, against_name)
    started, cpu0 = time.perf_counter(), time.process_time()
    try:
        assistant.connect(store)
        phase_ends("connected")
        assistant.run()
        phase_ends("replayed")
    finally:
        assistant.close()
    out = result_dir / "replay"
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "stats.json", {
        "virtual_ranks": len(assistant.virtual), "virtual_ranks_in_job": trace.world_size - len(set(sandbox)),
        # "all" where every virtual rank was a neighbour: the whole graph was replayed
        "hosted": "all" if trace.node_index is None else virtual_ranks, "gloo_groups": len(assistant.pgs),
        "gloo_members": assistant.gloo_members, "compact_groups": assistant.compact_groups,
        "gloo_loop_policies": sorted(loop_policies().values()),
        "timer_lead_s": assistant.lead,
        "timed_gloo_ops": assistant.holds.ops, "held_ops": assistant.holds.held, "held_s": assistant.holds.held_s,
        "timed_issue_cost_s": assistant.holds.cost_s,
        "spun_cores": spin.cores, "spin_switches": spin.switches,
        "max_ahead_of_clock_s": assistant.holds.most_ahead_s if assistant.holds.ops else None,
        "late_on_wire_s": _quantiles(assistant.holds.late), "built_ahead": assistant.built_ahead,
        "issue_behind_clock_s": _quantiles(assistant.holds.behind), "prepped_ahead": assistant.prepped_ahead,
        "resume_delay_s": _quantiles(assistant.holds.resumed),
        "groups_in_job": len(trace.groups), "groups_instantiated": len(assistant.real_groups),
        "nodes": int(sum(trace.num_nodes(r) for r in assistant.virtual)), "wall_s": time.perf_counter() - started,
        "cpu_s": time.process_time() - cpu0, "timed": model is not None,
        "idle_class": hasattr(os, "SCHED_IDLE") and os.sched_getscheduler(0) == os.SCHED_IDLE,
        "paced_ranks": sorted(pacer.counterparts) if pacer else [], "pace_nudges": pacer.nudges if pacer else 0,
        "paced_waits": pacer.waits if pacer else 0, "paced_wait_s": pacer.waited_s if pacer else 0.0,
        "late_join": late_join is not None, "late_join_waits": late_join.waits if late_join else 0,
        "late_join_wait_s": late_join.waited_s if late_join else 0.0,
        "follow_pace": assistant.follow.stats() if assistant.follow is not None else None,
        "virtual_spans": None if model is None else virtual_spans, "steady_ranks": len(steady),
        "shared_noise": {str(r): rho for r, (rho, _) in sorted(matched.items())},
        "kept_noise": {str(r): w for r, (_, w) in sorted(matched.items())},
        "stopped_s": assistant._slipped - assistant._stop_base,     # the schedule moved by it
        "inputs_streamed": assistant.inputs.streamed, "inputs_read_on_demand": assistant.inputs.on_demand,
        "max_rss_bytes": max(peak_resident_bytes(), *peak.values()), "rss_bytes": rss,
        "peak_rss_bytes": peak})
    if trace.node_index is None:
        tmp = out / f".arrivals.{os.getpid()}.npy"
        np.save(tmp, assistant.arrivals)
        os.replace(tmp, out / "arrivals.npy")


def main(argv: list[str] | None = None) -> None:
    from prism_core.launch.cores import bind_from_env
    from prism_core.launch.rank_main import _die_with_launcher
    from prism_core.runtime import write_json_atomic

    parser = argparse.ArgumentParser(prog="prism_core.replay.assistant")
    parser.add_argument("--graph", required=True, type=Path, help="trace.zarr to replay")
    parser.add_argument("--sandbox", required=True, help="comma-separated sandbox ranks")
    parser.add_argument("--result-dir", required=True, type=Path)
    parser.add_argument("--cache", type=Path, default=None, help="tensors.zarr of the collection, if any")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--timing", type=Path, default=None, help="timeline.npz: replay in calibrated time")
    parser.add_argument("--pace", action="append", default=[], metavar="RANK=FLIGHT",
                        help="co-run: virtual RANK keeps to the real rank whose flight record is FLIGHT")
    parser.add_argument("--pace-socket", default="", help="abstract socket name the paced-on ranks nudge")
    parser.add_argument("--join-late", action="store_true",
                        help="plain slice: a virtual member of a collective with a sandbox rank goes on the wire "
                             "once a sandbox member has issued it (the sandbox ranks nudge --pace-socket)")
    parser.add_argument("--idle", action="store_true",
                        help="co-run member: the whole assistant in the idle scheduling class, so that it runs "
                             "only while the sandbox ranks on its cores wait")
    parser.add_argument("--awake-fds", default="", metavar="FD[,FD]",
                        help="timed: pipes to the spins on this assistant's cores (launch/neighbour_load.py "
                             "--control); they run while its virtual ranks compute")
    parser.add_argument("--follow-pace", type=int, default=None, metavar="WARMUP",
                        help="timed: the virtual ranks' compute follows the sandbox ranks' pace after WARMUP steps "
                             "(replay/follow.py)")
    parser.add_argument("--pace-reference", choices=("alone", "loaded", "timed"), default="loaded",
                        help="with --follow-pace: read the pace against the sandbox ranks' compute timed in their "
                             "slices (alone: the timeline's alone_span; timed: that where the slices were timed, "
                             "a second pass, else loaded) or against their calibrated spans (loaded)")
    parser.add_argument("--pace-steps", type=int, default=1, metavar="N",
                        help="with --follow-pace: read the pace over up to N steps")
    parser.add_argument("--virtual-spans", choices=("timed", "steady", "paired", "matched"), default="timed",
                        help="timed: the virtual ranks' compute spans as calibrated (timed), their steady steps' "
                             "positions' trimmed means (steady), those only for virtual ranks whose every peer "
                             "is a sandbox rank (paired; replay/steady.py), or those keeping the share of their "
                             "noise their sandbox peers do not share (matched)")
    parser.add_argument("--steady-from", type=int, default=0, metavar="STEP",
                        help="with --virtual-spans steady, paired or matched: the first step that may be steady")
    parser.add_argument("--virtual-ranks", choices=("all", "neighbours"), default="all",
                        help="replay every virtual rank (all) or only those the sandbox ranks talk to, reading only "
                             "their rows of the graph (neighbours; replay/hosted.py)")
    parser.add_argument("--no-build-ahead", action="store_true",
                        help="timed: build what a virtual rank sends when its op comes due, not while it computes "
                             "up to it (an ablation)")
    parser.add_argument("--no-ring-combine", action="store_true",
                        help="a virtual rank between two sandbox ranks on a ring sends on as soon as it has "
                             "received, without the combine a real member does first (an ablation; replay/ring.py)")
    ns = parser.parse_args(argv)
    if (ns.pace or ns.join_late) and not ns.pace_socket:
        parser.error("--pace and --join-late need --pace-socket")
    if ns.pace and ns.join_late:
        parser.error("--join-late is for a plain slice, --pace for a co-run member")
    pace = {int(r): Path(f) for r, f in (item.split("=", 1) for item in ns.pace)}
    _die_with_launcher()
    bind_from_env()
    if ns.idle and hasattr(os, "SCHED_IDLE"):    # before any thread starts: they all inherit it
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    os.environ[ENV_LAZY_GLOO] = "1"
    try:
        run_assistant(ns.graph, [int(r) for r in ns.sandbox.split(",") if r], ns.result_dir, ns.cache, ns.timeout,
                      ns.timing, pace, ns.pace_socket, ns.join_late,
                      [int(fd) for fd in ns.awake_fds.split(",") if fd], ns.follow_pace, ns.pace_reference,
                      ns.pace_steps, not ns.no_build_ahead, ns.virtual_spans, ns.steady_from, not ns.no_ring_combine,
                      ns.virtual_ranks)
    except BaseException:  # noqa: BLE001 - every failure is reported to the launcher the same way
        text = traceback.format_exc()
        sys.stderr.write(text)
        sys.stderr.flush()
        write_json_atomic(ns.result_dir / "errors" / f"{ASSISTANT}.json",
                          {"rank": ASSISTANT, "time": time.time(), "traceback": text})
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
