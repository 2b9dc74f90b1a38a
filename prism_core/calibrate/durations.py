"""Node durations measured in the slices, merged into one model of the whole graph.

From a slice: each sandbox rank's trace (every node's start and end on this machine's
monotonic clock) and the assistant's issue time of every virtual node. For each sandbox node:

- compute, and ops that did not wait for peers: the span until the rank's next node began;
- a blocking op that synchronised: its transfer time — end minus the moment its last member
  arrived — plus what the rank spent after completion before its next node (not the wait for
  late peers, which calibration recomputes);
- an asynchronous op: the issue cost as its span, and its transfer time for the completion;
- a wait: what it took after the op had completed; for a point-to-point op seen complete only
  at its wait, whose peer was there before the wait began, all the wait took (see below).

With a loaded run of the slice (the same ranks run again beside the job's other ranks — a
co-run of several slices at once — or beside a stand-in compute load on the assistant's cores:
the neighbours that compute beside a rank in the full job), compute nodes take their spans from
it and everything else from the plain run, whose assistant had its core alone.
A compute span of a run that had an assistant leaves out the part of the rank's waits for its
core within it (`trace/run_delay.py`) that the assistant ran: an assistant sharing the rank's
core (each member's, in a co-run on 2 cores) takes that time, which the full job never spends.
The rest of the wait stays, as it does in a `prism record` run: the rank's own other threads
(its ring transports) and the launcher take their time in the full job too.
Collectives whose members were timed in different runs give every member the members' mean
transfer (`pool_member_noise`).

Ranks not timed themselves (other DP replicas) take the model of the rank they are renamed from,
their steps' compute in another order (`replica_noise`), or, for a replica that ran for real in
a co-run beside its timed rank (`stage.co_runs`), the compute it measured there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from prism_core.calibrate.resume import compute_gaps
from prism_core.calibrate.timeline import NO_RELEASE, OP_RELEASE, WAIT_RELEASE, CalibrationError, NodeModel
from prism_core.trace import Trace, merge_parts
from prism_core.trace.store import read_queued, read_wire
from prism_core.trace.matching import OpMatch
from prism_core.trace.schema import COMM, COMPUTE, OP_CODE, OPS, P2P_OPS, WAIT

# ops in which every member sends to and receives from every other
ALL_TO_ALL_OPS = frozenset({OP_CODE["all_to_all_single"], OP_CODE["alltoall"]})
# an op that ended this much before its last member arrived did not wait for it (a buffered send)
SYNC_SLACK_S = 1e-6
# a wait that took longer than this blocked (a wait on a finished op costs a few microseconds)
WAIT_BLOCKED_S = 50e-6
# which of a compute span's waits for a core a run with an assistant takes out (`slice_timings`)
WAITS_OUT = ("assistant", "foreign", "all", "none")


@dataclass
class RankTiming:
    """What one timed rank measured in its slice."""
    span: np.ndarray
    release: np.ndarray
    completes_synced: np.ndarray
    transfer: np.ndarray
    step_times: list[float]      # as measured in the slice (the ablation without calibration)
    gaps: list[float]            # per step: time between the previous step's end and this step's start
    peaks: list[int | None]
    run: str = ""                # the slice run it was measured in
    issue_cost: np.ndarray | None = None   # comm nodes: seconds from the rank's issue to the wire (0 unknown)
    resume_gap: np.ndarray | None = None   # compute nodes: what the rank waited before each in its run (resume.py)
    # compute spans from a loaded run: how much of them the rank took alone (its plain run, as an
    # emulation's rank of interest computes), `alone_factor`; replay/follow.py reads its pace against it
    alone_factor: float | None = None
    # per node: when it began and ended in the run its span is from (this machine's monotonic
    # clock), which replay/steady.py `shared_noise` reads against the timeline's
    began: np.ndarray | None = None
    ended: np.ndarray | None = None
    # per node: the wait for a core its span still holds (what `waits_out` left in; 0 where none was
    # noted), which replay/steady.py `shared_noise` takes out: no peer shares it
    queued: np.ndarray | None = None


def _check_same_structure(bare: Trace, rank: int, measured: dict[str, np.ndarray], where: Path) -> None:
    ref = bare.rank(rank)
    if len(ref["kind"]) != len(measured["kind"]):
        raise CalibrationError(f"rank {rank} ran {len(measured['kind'])} nodes in slice {where}, the bare graph has "
                               f"{len(ref['kind'])}: the program's structure changed since collection; re-collect")
    for col in ("kind", "op", "bytes", "seq", "async_"):
        diff = np.nonzero(ref[col] != measured[col])[0]
        if len(diff):
            i = int(diff[0])
            raise CalibrationError(f"rank {rank} in slice {where} differs from the bare graph at node {i} ({col}: "
                                   f"{OPS[measured['op'][i]] if col == 'op' else measured[col][i]} vs "
                                   f"{OPS[ref['op'][i]] if col == 'op' else ref[col][i]}); re-collect")


def slice_timings(bare: Trace, match: OpMatch, slice_dir: Path, sandbox: list[int],
                  waits_out: str = "assistant") -> dict[int, RankTiming]:
    """The timing model of each sandbox rank of one slice. `waits_out`: which waits for its core a
    compute span of a run with an assistant leaves out: "assistant", the part the assistant ran;
    "foreign", all but what the rank's own other threads ran; "all" of them; "none" (the last
    three are ablations)."""
    if waits_out not in WAITS_OUT:
        raise ValueError(f"waits_out {waits_out!r}: one of {', '.join(WAITS_OUT)}")
    slice_dir = Path(slice_dir)
    measured = merge_parts(slice_dir / "trace_parts", bare.world_size, sandbox)
    arrivals = slice_dir / "replay" / "arrivals.npy"
    if arrivals.is_file():
        issue = np.load(arrivals)
    elif sorted(sandbox) == list(range(bare.world_size)):   # every rank real (a `prism record` run)
        issue = np.full(bare.columns["kind"].shape, np.nan)
    else:
        raise CalibrationError(f"{slice_dir}: no replay/arrivals.npy from the assistant; rerun the slice")
    if issue.shape != bare.columns["kind"].shape:
        raise CalibrationError(f"{slice_dir}: the assistant's arrivals do not match the bare graph; rerun the slice")
    for r in sandbox:
        cols = measured.rank(r)
        _check_same_structure(bare, r, cols, slice_dir)
        issue[bare.rank_slice(r)] = cols["t_start"]
    valid = match.order[np.isfinite(issue[match.order])]
    last = np.full(match.n_ops, -np.inf)
    np.maximum.at(last, match.op_id[valid], issue[valid])
    out = {}
    for r in sandbox:
        out[r] = _unqueued(bare, r, _rank_timing(bare, match, r, measured.rank(r), last, slice_dir), slice_dir,
                           waits_out if arrivals.is_file() else "none")
    return out


def _unqueued(bare: Trace, rank: int, timing: RankTiming, slice_dir: Path, waits_out: str) -> RankTiming:
    """`timing` with its compute spans less the waits for its core `waits_out` names (`slice_timings`),
    and the rest of each wait (`RankTiming.queued`).

    A rank is bound to one core, so what its other threads ran there was a wait of its program's
    thread; the assistant ran there only where the launcher named it (it shares the rank's core).
    """
    nodes, queued, own, helper = read_queued(Path(slice_dir) / "trace_parts" / f"{rank}.npz")
    if not len(nodes):
        return replace(timing, queued=np.zeros(len(timing.span)))
    if nodes.max() >= len(timing.span) or np.any(bare.rank(rank)["kind"][nodes] != COMPUTE):
        raise CalibrationError(f"rank {rank} in slice {slice_dir}: its waits for a core name nodes that are not "
                               "compute; rerun the slice")
    span = timing.span.copy()
    if waits_out == "none":
        out = np.zeros(len(nodes))
    else:
        out = queued if waits_out == "all" else np.maximum(queued - own, 0.0)
        if waits_out == "assistant":
            out = np.minimum(out, helper)
        span[nodes] = np.maximum(span[nodes] - out, 0.0)
    rest = np.zeros(len(span))
    rest[nodes] = np.minimum(queued - out, span[nodes])
    return replace(timing, span=span, queued=rest)


def load_ran(slice_dir: Path) -> bool:
    """Whether a loaded run had its neighbours: a co-run whose members all ran bound to their
    cores, or a launch that ran the stand-in load to its end (it starts one only when bound to
    cores, alone on the machine)."""
    from prism_core.replay.slices import CO_RUN

    if (Path(slice_dir) / CO_RUN).is_file():
        return True
    placement = Path(slice_dir) / "placement.json"
    if not placement.is_file():
        return False
    doc = json.loads(placement.read_text())
    cores = doc.get("neighbour_load") or []
    return bool(cores) and sorted(doc.get("neighbour_load_ran") or []) == sorted(cores)


# a compute node counts towards `alone_factor` where its rank waited before it within this of the
# same in both runs: a longer wait costs the node after it (calibrate/resume.py), and the factor is
# what the neighbour, not the wait, made of it
SAME_WAIT_S = 50e-6


def alone_factor(plain: RankTiming, loaded: RankTiming, nodes: np.ndarray) -> float | None:
    """The plain run's compute over the loaded run's, over the compute `nodes` its rank waited
    about as long before in both (`SAME_WAIT_S`); None where there are none or the waits are unknown."""
    if plain.resume_gap is None or loaded.resume_gap is None:
        return None
    same = nodes & (np.abs(plain.resume_gap - loaded.resume_gap) < SAME_WAIT_S)
    total = float(loaded.span[same].sum())
    return float(plain.span[same].sum()) / total if total > 0 else None


def with_loaded_compute(bare: Trace, plain: dict[int, RankTiming], loaded: dict[int, RankTiming],
                        warmup: int = 0) -> dict[int, RankTiming]:
    """`plain`'s timings with the compute spans of `loaded` (the same ranks' loaded run), and the
    waits before them there; `alone_factor` over the steps from `warmup` on."""
    out = {}
    for r, t in plain.items():
        cols = bare.rank(r)
        compute = cols["kind"] == COMPUTE
        span = t.span.copy()
        span[compute] = loaded[r].span[compute]
        gap = None
        if loaded[r].resume_gap is not None:
            gap = np.full(len(span), np.nan) if t.resume_gap is None else t.resume_gap.copy()
            gap[compute] = loaded[r].resume_gap[compute]
        began, ended = (_with_compute(t.began, loaded[r].began, compute), _with_compute(t.ended, loaded[r].ended, compute))
        out[r] = replace(t, span=span, resume_gap=gap, began=began, ended=ended,
                         queued=_with_compute(t.queued, loaded[r].queued, compute),
                         alone_factor=alone_factor(t, loaded[r], compute & (cols["step"] >= warmup)))
    return out


def _with_compute(plain: np.ndarray | None, loaded: np.ndarray | None, compute: np.ndarray) -> np.ndarray | None:
    """`plain` (per node) with the compute nodes' values from `loaded`; NaN where one is unknown."""
    if plain is None and loaded is None:
        return None
    out = np.full(len(compute), np.nan) if plain is None else np.array(plain, dtype=np.float64)
    out[compute] = np.nan if loaded is None else np.asarray(loaded)[compute]
    return out


def _rank_timing(bare: Trace, match: OpMatch, rank: int, cols: dict, last: np.ndarray, slice_dir: Path) -> RankTiming:
    kind, async_ = cols["kind"], cols["async_"]
    t0, t1 = cols["t_start"], cols["t_end"]
    n = len(kind)
    nxt = np.empty(n)
    nxt[:-1] = t0[1:]
    if n:
        nxt[-1] = t1[-1]
    span = nxt - t0
    release = np.full(n, NO_RELEASE, dtype=np.int8)
    synced = np.zeros(n, dtype=bool)
    transfer = np.zeros(n)
    comm = np.nonzero(kind == COMM)[0]
    arrive = last[match.op_id[bare.rank_slice(rank)][comm]]
    lastest = np.maximum(arrive, t0[comm])
    did_sync = t1[comm] >= lastest - SYNC_SLACK_S
    synced[comm] = did_sync
    transfer[comm] = np.where(did_sync, np.maximum(t1[comm] - lastest, 0.0), t1[comm] - t0[comm])
    # An async op whose completion was only seen at its wait (gloo p2p works, and the few gloo
    # collectives, have no completion callback) completed when the wait ended. If its last peer
    # came after the wait began, the transfer ran from that arrival. A point-to-point op whose
    # peer was there before: its bytes moved once this rank blocked (a rank bound to its own
    # core gives its gloo loop, idle class, backend/transport_threads.py, no time while it
    # computes), so it is done when its peer is there and the wait takes what it took. A
    # collective that blocked at its wait ran from the last arrival; one that did not, ended
    # before the wait and only what the wait saw of it is known. Fed a real run's own times,
    # the timeline gives back that run under every rule.
    waits = np.nonzero(kind == WAIT)[0]
    refs = cols["ref"][waits]
    done = t1[refs].copy()
    late = t1[refs] >= t1[waits] - SYNC_SLACK_S
    seen_at_wait = refs[late]
    if len(seen_at_wait):
        pos = np.searchsorted(comm, seen_at_wait)
        w0, w1 = t0[waits[late]], t1[waits[late]]
        peer_first = (lastest[pos] <= w0) & np.isin(cols["op"][seen_at_wait], list(P2P_OPS))
        blocked = w1 - w0 > WAIT_BLOCKED_S
        transfer[seen_at_wait] = np.where(
            peer_first, 0.0, np.maximum(np.where(blocked, w1 - lastest[pos], w1 - np.maximum(lastest[pos], w0)), 0.0))
        done[late] = np.where(peer_first, w0, w1)
        synced[seen_at_wait] = True
    blocking = comm[(async_[comm] == 0) & did_sync]
    release[blocking] = OP_RELEASE
    span[blocking] = transfer[blocking] + np.maximum(nxt[blocking] - t1[blocking], 0.0)
    release[waits] = WAIT_RELEASE
    span[waits] = np.maximum(nxt[waits] - np.maximum(t0[waits], done), 0.0)
    if np.any(~np.isfinite(span)):
        raise CalibrationError(f"rank {rank} in slice {slice_dir}: some nodes have no times (was it recorded?)")
    result = json.loads((slice_dir / "results" / f"{rank}.json").read_text())
    steps = result["step_times_s"]
    step_col = cols["step"]
    ends = [float(t1[np.nonzero(step_col == k)[0][-1]]) for k in range(len(steps)) if np.any(step_col == k)]
    gaps = [0.0] + [max((ends[k] - ends[k - 1]) - steps[k], 0.0) for k in range(1, len(ends))]
    return RankTiming(span=span, release=release, completes_synced=synced, transfer=transfer, step_times=steps,
                      gaps=gaps, peaks=result.get("step_peaks") or [], run=str(slice_dir),
                      issue_cost=_issue_cost(slice_dir / "trace_parts" / f"{rank}.npz", t0, t1, kind),
                      resume_gap=compute_gaps(kind, t0, t1), began=np.array(t0, dtype=np.float64),
                      ended=np.array(t1, dtype=np.float64))


def _issue_cost(part: Path, t0: np.ndarray, t1: np.ndarray, kind: np.ndarray) -> np.ndarray:
    """Per node: how long after its issue the rank's backend handed a communication op over to the
    wire (`trace/recorder.py`), at most the op's own time (a stamp off the nodes' clock cannot hold
    a virtual op for longer than the op took); 0 where not noted (compute, older traces)."""
    cost = np.zeros(len(kind))
    if not part.is_file():
        return cost
    nodes, when = read_wire(part)
    ok = (nodes >= 0) & (nodes < len(kind))
    ok[ok] = kind[nodes[ok]] == COMM
    nodes, when = nodes[ok], when[ok]
    cost[nodes] = np.clip(when - t0[nodes], 0.0, np.maximum(t1[nodes] - t0[nodes], 0.0))
    return cost


def merge_model(bare: Trace, timings: dict[int, RankTiming], source: np.ndarray) -> NodeModel:
    """The whole graph's model: each rank's own timing, or that of the rank it is renamed from."""
    n = len(bare.columns["kind"])
    span, transfer, cost = np.zeros(n), np.zeros(n), np.zeros(n)
    gap, began, ended, queued = np.full(n, np.nan), np.full(n, np.nan), np.full(n, np.nan), np.full(n, np.nan)
    release = np.zeros(n, dtype=np.int8)
    synced = np.zeros(n, dtype=bool)
    for r in range(bare.world_size):
        t = timings.get(int(source[r]))
        if t is None:
            raise CalibrationError(f"no slice timed rank {int(source[r])} (needed for rank {r})")
        s = bare.rank_slice(r)
        if len(t.span) != s.stop - s.start:
            raise CalibrationError(f"rank {r} has {s.stop - s.start} nodes but rank {int(source[r])}, whose timing it "
                                   f"takes, has {len(t.span)}")
        span[s], transfer[s], release[s], synced[s] = t.span, t.transfer, t.release, t.completes_synced
        if t.issue_cost is not None:
            cost[s] = t.issue_cost
        if t.resume_gap is not None:
            gap[s] = t.resume_gap
        if t.began is not None and t.ended is not None:
            began[s], ended[s] = t.began, t.ended
        if t.queued is not None:
            queued[s] = t.queued
    ref = np.full(n, -1, dtype=np.int64)
    waits = np.nonzero(bare.columns["kind"] == WAIT)[0]
    rank_of = np.repeat(np.arange(bare.world_size), np.diff(bare.offsets))
    ref[waits] = bare.offsets[rank_of[waits]] + bare.columns["ref"][waits]
    return NodeModel(span=span, release=release, ref=ref, completes_synced=synced, transfer=transfer, issue_cost=cost,
                     resume_gap=gap, measured_start=began, measured_end=ended, measured_queued=queued)


def pool_member_noise(bare: Trace, match: OpMatch, model: NodeModel, timings: dict[int, RankTiming],
                      source: np.ndarray) -> NodeModel:
    """Collectives whose members were timed in different runs: every member takes the op's mean
    transfer over its members.

    Members of a real collective leave it together, give or take what their order of arrival
    makes (the real tp2 run: ends 31 us apart on average; each rank's mean transfer within
    6-14 us of the other's, which is the higher changing from run to run). Timed in different
    slices, each member's transfer carries its own run's noise (tens to a hundred microseconds
    an op) and a lasting part that belongs to the run, not the rank (tp2: rank 1's slices
    measured 405-408 us an all-reduce, rank 0's 370-372, in two pairs of slices), so that in
    the timeline they leave apart and the next op's earlier arrival waits for the later: time
    no run spends. Ops of one run (a `prism record` fed back, a slice of S ranks) keep their
    members' own times. A blocking op's span (its transfer plus what followed it) moves with
    its transfer.

    Pooled: collectives whose members move the same bytes, and all-to-alls whatever their parts
    (every member sends to and receives from every other and returns once all its parts are in,
    so members leave together however the exchange is split; moe_gpt's expert all-to-alls move
    144-380 KB a member, the members' parts differing in half the ops). Point-to-point ops, and
    other collectives of unequal parts, keep their members' own times. ep2, fed the real run's
    compute (two pairs): +1.34 and +3.35% with the all-to-alls unpooled, +0.64 and +2.17% pooled.
    """
    index = {name: k for k, name in enumerate(sorted({t.run for t in timings.values()}))}
    if len(index) < 2 or match.n_ops == 0:
        return model
    rank_of = np.repeat(np.arange(bare.world_size), np.diff(bare.offsets))
    run_of_timed = {r: index[t.run] for r, t in timings.items()}
    run_of_rank = np.array([run_of_timed[int(source[r])] for r in range(bare.world_size)])
    order, starts = match.order, match.bounds[:-1]
    op_of = np.repeat(np.arange(match.n_ops), match.members)
    run = run_of_rank[rank_of[order]]
    size = bare.columns["bytes"][order].astype(np.float64)
    op = bare.columns["op"][order]
    p2p = np.isin(op, list(P2P_OPS)).astype(np.int8)
    exchange = np.isin(op[starts], list(ALL_TO_ALL_OPS))
    # an op qualifies when its members span runs, all completed from the last arrival, and all
    # move the same bytes or exchange all with all (not a send and a recv)
    pooled = ((np.maximum.reduceat(run, starts) != np.minimum.reduceat(run, starts))
              & (np.minimum.reduceat(model.completes_synced[order].astype(np.int8), starts) == 1)
              & ((np.maximum.reduceat(size, starts) == np.minimum.reduceat(size, starts)) | exchange)
              & (np.maximum.reduceat(p2p, starts) == 0) & (match.members > 1))
    pick = pooled[op_of]
    if not pick.any():
        return model
    nodes, ops = order[pick], op_of[pick]
    old = model.transfer[nodes]
    new = (np.bincount(ops, weights=old, minlength=match.n_ops) / np.maximum(match.members, 1))[ops]
    transfer, span = model.transfer.copy(), model.span.copy()
    transfer[nodes] = new
    blocking = model.release[nodes] == OP_RELEASE      # its span is the transfer plus what followed it
    span[nodes[blocking]] = np.maximum(span[nodes[blocking]] + (new - old)[blocking], 0.0)
    return replace(model, transfer=transfer, span=span)


# replicas of a timed rank get at most this many different orders of its steps (the quotient
# solver then solves this many copies of the timed ranks, not one)
REPLICA_ORDERS = 4


def replica_orders(dp: int, ep: int = 1) -> int:
    """How many orders replicas can take with the quotient solver staying exact: replica d takes
    order d mod n and shares the timeline of replica d mod n, so every group among replicas must
    hold the same orders as the corresponding group of the replica it shares: its expert-parallel
    group (ep consecutive replicas) and its expert-data-parallel group (every ep-th). The largest
    such n <= REPLICA_ORDERS (ep=1: 4; ep=3, dp=6: 3; ep=8, dp=32: 4)."""
    for n in range(min(REPLICA_ORDERS, max(dp, 1)), 1, -1):
        ep_orders = [frozenset(d % n for d in range(g, g + ep)) for g in range(0, dp, ep)]
        edp_orders = [frozenset(d % n for d in range(i, dp, ep)) for i in range(ep)]
        if all(ep_orders[d // ep] == ep_orders[(d % n) // ep] and edp_orders[d % ep] == edp_orders[(d % n) % ep]
               for d in range(dp)):
            return n
    return 1


def replica_copies(source: np.ndarray) -> dict[int, list[int]]:
    """Per timed rank, the ranks that take its durations in replica order: the rank itself, then
    its replicas by rank; the j-th takes order j mod the orders in use (`replica_noise`)."""
    copies: dict[int, list[int]] = {}
    for r, s in enumerate(np.asarray(source).tolist()):
        copies.setdefault(int(s), []).append(r)
    return {s: sorted(rs, key=lambda r: (r != s, r)) for s, rs in copies.items()}


def replica_noise(bare: Trace, model: NodeModel, source: np.ndarray, first_step: int,
                  orders: int = REPLICA_ORDERS, measured: dict[int, np.ndarray] | None = None,
                  measured_gaps: dict[int, np.ndarray] | None = None,
                  measured_times: dict[int, tuple[np.ndarray, np.ndarray]] | None = None,
                  measured_queued: dict[int, np.ndarray] | None = None) -> tuple[NodeModel, np.ndarray]:
    """DP replicas that take a timed rank's durations, each with its steps' compute in another order.

    Replicas of one rank run the same nodes, but each computes with noise of its own (the
    machine's, and in the full job each its own data), and every collective among them waits
    for the slowest: copies of one timed rank never wait for each other, while real replicas do
    (dp2: 0.8-1.2 ms a step, 1% of it, in `prism record`). Replica j of a rank takes the compute
    spans of the timed rank's step k - j*n/m mod n over its n measured steps (from `first_step`,
    the steps with the most common sequence of compute nodes; m orders in use): the same spans,
    the same mean, drawn at steps spread evenly over the run. Not the step before: this machine's
    speed holds for seconds, so neighbouring steps are alike and a replica one step behind waits
    for little (dp2, fed the real run's own rank-0 compute, over 6 pairs: -6.7 ... +0.3% one
    step behind, -1.7 ... +1.2% half the run behind; both ranks' own compute: -0.5 ... +0.4%).
    Replicas j and j + `orders` take the same order (`replica_orders`).

    `measured`: spans (over the rank's nodes) of replicas that ran for real beside their timed
    rank, in step with it (a co-run's spare place, `stage.co_runs`). The first replica of an
    order that has them takes their compute instead of a reordering: this machine's slow spells
    last seconds and slow both cores at once (the two ranks' compute a step correlated 0.78-0.97
    in `prism record` of the W=2 configs), which a reordering of one rank's steps turns into
    waits the real replicas did not have; a replica measured beside the rank has the same spells.

    The waits each compute span was measured after (`model.resume_gap`, calibrate/resume.py) and
    when it was measured (`model.measured_start`, `measured_end`) and the wait for a core it holds
    (`model.measured_queued`) move with the spans; `measured_gaps`, `measured_times` (began,
    ended), `measured_queued`: those of the `measured` replicas (unknown where left out).

    Returns the model and, per rank, the rank whose timeline it shares (the first replica with its
    order), for the quotient solver (`timeline.solve`).
    """
    world = bare.world_size
    source = np.asarray(source, dtype=np.int64)
    shares = np.arange(world)
    order = np.zeros(world, dtype=np.int64)
    for copies in replica_copies(source).values():
        for j, r in enumerate(copies):
            order[r] = j % max(orders, 1)
            shares[r] = copies[order[r]]
    in_use = np.minimum(np.bincount(source, minlength=world), max(orders, 1))   # orders a rank's replicas take
    span = model.span.copy()
    # per-node values measured with each span, which move with it: name -> (values, a measured replica's)
    beside = {name: (np.array(values, dtype=np.float64), own) for name, values, own in (
        ("resume_gap", model.resume_gap, measured_gaps or {}),
        ("measured_start", model.measured_start, {r: t[0] for r, t in (measured_times or {}).items()}),
        ("measured_end", model.measured_end, {r: t[1] for r, t in (measured_times or {}).items()}),
        ("measured_queued", model.measured_queued, measured_queued or {}))
        if values is not None}
    for r in np.nonzero((order > 0) & (shares == np.arange(world)))[0]:   # one replica per order
        if measured and int(r) in measured:
            compute = bare.rank(int(r))["kind"] == COMPUTE
            span[bare.rank_slice(int(r))][compute] = np.asarray(measured[int(r)])[compute]
            for values, own in beside.values():
                mine = own.get(int(r))
                values[bare.rank_slice(int(r))][compute] = np.nan if mine is None else np.asarray(mine)[compute]
            continue
        steps = steady_compute(bare, int(r), first_step)
        if steps is not None:
            nodes = steps + bare.offsets[r]
            j, k, n = int(order[r]), int(in_use[source[r]]), len(steps)
            shift = j * n // k if n >= k else j
            span[nodes] = np.roll(span[nodes], shift, axis=0)
            for values, _ in beside.values():
                values[nodes] = np.roll(values[nodes], shift, axis=0)
    for r in np.nonzero(shares != np.arange(world))[0]:    # the rest copy the first replica of their order
        to, of = bare.rank_slice(int(r)), bare.rank_slice(int(shares[r]))
        span[to] = span[of]
        for values, _ in beside.values():
            values[to] = values[of]
    return replace(model, span=span, **{name: values for name, (values, _) in beside.items()}), shares


def steady_compute(bare: Trace, rank: int, first_step: int) -> np.ndarray | None:
    """Compute nodes of the rank's steps from `first_step` that run the most common sequence of
    them (same ops and labels), as [step, position] (local node indices); None with fewer than
    two such steps."""
    found = steady_steps(bare, rank, first_step)
    return None if found is None else found[1]


def steady_steps(bare: Trace, rank: int, first_step: int) -> tuple[list[int], np.ndarray] | None:
    """`steady_compute` with the step number of each of its rows."""
    cols = bare.rank(rank)
    step, compute = cols["step"], cols["kind"] == COMPUTE
    numbers = range(first_step, int(step.max(initial=-1)) + 1)
    by_step = [np.nonzero(compute & (step == k))[0] for k in numbers]
    keys = [(cols["op"][v].tobytes(), cols["label"][v].tobytes()) for v in by_step]
    kept = [k for k, v in zip(keys, by_step) if len(v)]
    if not kept:
        return None
    common = max(set(kept), key=kept.count)
    rows = [(k, v) for k, key, v in zip(numbers, keys, by_step) if len(v) and key == common]
    return ([k for k, _ in rows], np.stack([v for _, v in rows])) if len(rows) > 1 else None


def step_ends(bare: Trace, end: np.ndarray, rank: int) -> list[float]:
    """End time of each step of `rank` (its last node carrying that step number)."""
    s = bare.rank_slice(rank)
    steps = bare.columns["step"][s]
    e = end[s]
    out = []
    k = 0
    while np.any(steps == k):
        out.append(float(e[np.nonzero(steps == k)[0][-1]]))
        k += 1
    return out
