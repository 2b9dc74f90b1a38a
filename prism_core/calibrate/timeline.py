"""The global timeline of a timed graph, computed in dependency order with array operations.

Every node i of a rank ends at  e_i = max(e_{i-1}, R_i) + a_i : it starts when the rank's
previous node has ended and, for a synchronising node, not before its release R_i; then it
takes a_i. Releases come from other ranks:

- a blocking communication node that synchronised is released when the last member of its op
  arrives (a member arrives when its previous node ends);
- an asynchronous op completes at (last arrival + transfer) if it synchronised, else at
  (own issue + its local time); a wait node is released at that completion;
- compute and non-synchronising nodes have no release.

For fixed releases the recurrence is a segmented max-plus scan, done with cumulative sums
and a running maximum. Releases depend on the other ranks' ends, so the scan is repeated
until nothing moves; each round pushes the timeline one synchronisation hop further, and the
result is the earliest timeline consistent with every dependency (a longest-path solution).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from prism_core.trace.matching import OpMatch

NO_RELEASE, OP_RELEASE, WAIT_RELEASE = 0, 1, 2


class CalibrationError(RuntimeError):
    pass


@dataclass
class NodeModel:
    """Per node of the graph (all ranks concatenated, in trace order)."""
    span: np.ndarray          # a_i, seconds
    release: np.ndarray       # NO_RELEASE / OP_RELEASE / WAIT_RELEASE
    ref: np.ndarray           # wait nodes: global index of the async op they wait for; -1 otherwise
    completes_synced: np.ndarray   # comm nodes: completion follows the last arrival (else own issue)
    transfer: np.ndarray      # comm nodes: seconds from the last arrival (or own issue) to completion
    issue_cost: np.ndarray | None = None   # comm nodes: seconds from issue to the wire (a replay's hand-over)
    resume_gap: np.ndarray | None = None   # compute nodes: the wait before each in the run its span is from (NaN unknown)
    measured_start: np.ndarray | None = None   # when each node began in the run its span is from (NaN unknown)
    measured_end: np.ndarray | None = None
    measured_queued: np.ndarray | None = None  # the wait for a core each span holds there (NaN unknown)


def solve(model: NodeModel, match: OpMatch, offsets: np.ndarray, source: np.ndarray | None = None,
          max_rounds: int = 100_000, tol: float = 1e-9) -> tuple[np.ndarray, np.ndarray, int]:
    """End and start time of every node; also the number of rounds it took.

    `source[r]`: the rank whose model rank r carries (DP replicas renamed from one replica).
    When given, the model is symmetric under that renaming, so is its earliest timeline: it is
    solved on the source ranks alone (an op's member on another replica arrives when the
    corresponding node of its source does) and copied out — exact, and W/|sources| times smaller.
    """
    offsets = np.asarray(offsets, dtype=np.int64)
    world = len(offsets) - 1
    if source is None or np.array_equal(source, np.arange(world)):
        return _solve(model.span, model.release, model.ref, model.completes_synced, model.transfer, offsets,
                      match.op_id, match.order, match.bounds, max_rounds, tol)
    source = np.asarray(source, dtype=np.int64)
    kept = np.unique(source)
    sizes = np.diff(offsets)
    q_offsets = np.zeros(len(kept) + 1, dtype=np.int64)
    q_offsets[1:] = np.cumsum(sizes[kept])
    slot = np.full(world, -1, dtype=np.int64)
    slot[kept] = np.arange(len(kept))
    rank_of = np.repeat(np.arange(world), sizes)
    local = np.arange(len(rank_of)) - offsets[rank_of]
    to_q = q_offsets[slot[source[rank_of]]] + local          # every node -> its source's node
    own = slot[rank_of] >= 0                                  # nodes of the kept ranks themselves
    q_nodes = np.nonzero(own)[0]                               # in rank order, as q_offsets
    # ops with a member on a kept rank, members mapped to their sources' nodes
    op_has_kept = np.zeros(match.n_ops, dtype=bool)
    member_ops = np.repeat(np.arange(match.n_ops), match.members)
    op_has_kept[member_ops[own[match.order]]] = True
    keep_members = op_has_kept[member_ops]
    compact = np.cumsum(op_has_kept) - 1
    q_order = to_q[match.order[keep_members]]
    q_bounds = np.append(np.nonzero(np.diff(np.concatenate(([-1], member_ops[keep_members]))))[0],
                         int(keep_members.sum()))
    q_op = np.where(match.op_id[q_nodes] >= 0, compact[np.maximum(match.op_id[q_nodes], 0)], -1)
    q_ref = np.where(model.ref[q_nodes] >= 0, to_q[np.maximum(model.ref[q_nodes], 0)], -1)
    end_q, start_q, rounds = _solve(model.span[q_nodes], model.release[q_nodes], q_ref,
                                    model.completes_synced[q_nodes], model.transfer[q_nodes], q_offsets, q_op,
                                    q_order, q_bounds, max_rounds, tol)
    return end_q[to_q], start_q[to_q], rounds


def _solve(span, release_kind, ref, synced_all, transfer, offsets, op_id, order, bounds, max_rounds, tol):
    n = len(span)
    world = len(offsets) - 1
    seg_id = np.repeat(np.arange(world), np.diff(offsets))
    seg_start = offsets[:-1]
    first = np.zeros(n, dtype=bool)
    first[seg_start[np.diff(offsets) > 0]] = True
    op_nodes = np.nonzero(op_id >= 0)[0]
    op_of = op_id[op_nodes]
    sync_nodes = op_nodes[release_kind[op_nodes] == OP_RELEASE]
    sync_of = op_id[sync_nodes]
    waits = np.nonzero(release_kind == WAIT_RELEASE)[0]
    refs = ref[waits]
    synced = synced_all[op_nodes]
    xfer = transfer[op_nodes]
    op_starts = bounds[:-1]
    # the scan's constant parts: cumulative spans within each rank
    total = np.cumsum(span)
    base = np.where(seg_start[seg_id] > 0, total[np.maximum(seg_start[seg_id] - 1, 0)], 0.0)
    cum = total - base
    before = cum - span

    def scan(release):
        term = np.maximum(release - before, 0.0)
        big = float(term.max(initial=0.0)) * 2.0 + 1.0
        lift = seg_id * big
        term += lift
        np.maximum.accumulate(term, out=term)
        term -= lift
        return term + cum

    release = np.full(n, -np.inf)
    end = scan(release)
    completion = np.full(n, -np.inf)
    start = np.empty(n)
    for rounds in range(1, max_rounds + 1):
        start[1:] = end[:-1]
        start[first] = 0.0
        if len(order):
            last = np.maximum.reduceat(start[order], op_starts)
            release[sync_nodes] = last[sync_of]
            completion[op_nodes] = np.where(synced, last[op_of], start[op_nodes]) + xfer
        if len(waits):
            release[waits] = completion[refs]
        new_end = scan(release)
        if np.all(np.abs(new_end - end) <= tol):
            start[1:] = new_end[:-1]
            start[first] = 0.0
            return new_end, start, rounds
        end = new_end
    raise CalibrationError(f"the timeline did not settle after {max_rounds} rounds: the graph's dependencies "
                           "form a cycle (ranks waiting on each other)")
