"""Steady spans for the virtual ranks of a timed replay: each compute node of a steady step takes its
position's trimmed mean over those steps, not the span one step of the timing run happened to take.

A virtual rank's calibrated span for one node of one step is one draw of this machine's noise, from
the slices minutes earlier. Node by node it says next to nothing about the same node in another run:
its deviation from its position's median correlated -0.01 / +0.10 / +0.01 / +0.00 (dp2 / ep2 / pp2 /
tp2, medians of 8) with the same rank's in `prism record` (bench/MEASURED.md item 45, `bench/node_noise.py`).
Yet the real ranks of one run share much of theirs: 0.69 / 0.51 / 0.10 / 0.62 (the machine's slow
spells slow both cores at once; pp2's stages compute other nodes at the same moment). Replayed as
timed, a virtual rank's noise is drawn apart from its sandbox peer's, the two leave a collective
about twice as far apart as the real ranks do (ep2: 10th-90th percentile of the node-by-node
difference -0.31 ... +0.31 ms against -0.17 ... +0.17), and the sandbox rank waits for its peer at
each of ep2's ~90 ops a step: 0.095 ms a node against the record's 0.055 (steady: 0.045), some 4 ms
of a 190 ms step; its core idles and computes the next node slower after it (calibrate/resume.py).
In item 45's same turns the emulations came +1.37 / +0.20 / +2.57 / +3.98% (pp2 / dp2 / tp2 / ep2,
four pairs) with timed spans and -0.52 / +0.10 / +0.48 / -0.24% with steady ones; in item 46's
(three pairs) -0.36 / +0.42 / +1.75 / +0.92% and -2.81 / -1.95 / -0.67 / +0.12%. Where the real
ranks share little noise (pp2) a steady virtual rank waits less than a real peer would (0.045 ms a
node against 0.101), which leans such emulations low. The machine's drift, which the noise
also carries, is what `follow.py` follows.

Only where the sandbox ranks' live noise stands for it, though: a virtual rank whose every peer (a
member of any group it communicates in) is a sandbox rank (`paired_ranks`, `emulation.virtual_spans:
paired`, the default). Virtual ranks that wait for each other need their noise: a collective over
many members ends with the slowest, which the calibration models with each replica's steps in
another order (calibrate/durations.py `replica_noise`). Solving the demo's W=64 timeline (ten
steps; `bench/steady_timeline.py`, bench/logs/steady_timeline_demo10.txt) again with its 62 virtual ranks steady shortened the step 4.0-4.4%; with the two ranks of
interest's steps in another order (their live noise another draw than the timeline's) and the
virtual ranks as timed it moved -0.12 ... +0.10%: at W=64 a timed virtual rank's draw beside the
sandbox ranks' costs next to nothing, at W=2 it costs the waits above.

A steady rank beside a peer that shares little of a real peer's noise (pp2: 0.10, its stages
compute other nodes at the same moment) is closer to it than a real one; `emulation.virtual_spans:
matched` gives each such rank back part of its own draw, w of its deviation from the trimmed mean,
with w read from the calibrated timeline (`shared_noise`, `kept_noise`): sqrt(1 - 2 rho), so
that the live and the virtual rank leave each node as far apart as two real ranks sharing rho.
The timeline's spans come from the loaded co-run, both ranks at once, each keeping to the other
through its assistant (replay/pacing.py), and read as they are they share less than the record's
ranks: on items 47-48's kept runs (16 pairs) 0.08-0.14 / 0.28-0.42 / 0.33-0.51 / 0.46-0.75 for pp2 /
ep2 / tp2 / dp2, against the records' 0.08-0.16 / 0.42-0.57 / 0.50-0.69 / 0.52-0.83. Part of it is
where the nodes ran: the machine's noise lands on the same node of two ranks as far as they compute
it at the same moment, and the co-run's same nodes overlapped 0.63-0.67 / 0.52-0.58 / 0.34-0.40 of
their length (ep2 / tp2 / dp2; 0.3 ms apart, the relay through the assistants) where the timeline's,
like the record's, overlap 0.84-0.86 / 0.86-0.89 / 0.42-0.47 (pp2's stages: 0.02-0.04 both). So
`shared_noise` takes the co-run's rho times the timeline's overlap over the co-run's: 0.10-0.19 /
0.36-0.55 / 0.52-0.80 / 0.57-0.92 on those pairs (`bench/shared_noise.py`, its slices calibrated
again; bench/MEASURED.md item 49). It is not all of it: ep2's and tp2's co-runs share less even at the nodes
that did overlap (the shared product grew 0.1-0.7 per unit of a node's overlap, dp2's 0.8-2.0 and
pp2's 1.4-3.9, items 47-49), so ep2's rho stayed under the record's, and its w (0-0.56 over 15
pairs, 13 of them 0.29 or more) over what the record's rho gives (0-0.39).

Since item 52 the correlation is of the spans less the wait for a core each still holds
(calibrate/durations.py `RankTiming.queued`, `timeline.npz` -> `measured_queued`): what ran on a
rank's core while it waited is that core's, not the machine's, so no peer shares it. On item
51's kept pairs, calibrated again (`bench/shared_noise.py`),
ep2 reads 0.44-0.67 (the spans as they were: 0.35-0.56) against its records' 0.43-0.58 and keeps
w 0-0.34, where the w that would have left each emulated rank as far from its peer node by node
as in its second record (`w needed`) was 0-0.34: over the 8 pairs a mean +0.03 from it, where the
spans as they were gave +0.22. pp2 reads as before (0.12-0.18); tp2 (0.82-0.91 against
0.59-0.73) and dp2 (0.94-1.00 against 0.69-0.80) read over their records', where w is 0 either
way. Why ep2's co-run shares less of the rest than its records is not found.

Steps whose sequence of compute nodes is not the rank's most common one, and warm-up steps, keep
their spans. Each position takes its trimmed mean, so that one stalled draw (a preemption) is not
spread over every step, scaled so that the step computes what the rank's median step did (the
sum of its nodes' spans over the steady steps): a node's noise is skewed, slow draws longer than
fast ones, and the trimmed means alone summed to 0.5-3.7% less than the median step (item 47's
32 calibrated virtual ranks; dp2 0.5-1.6%, ep2 1.0-2.1%, pp2 0.7-3.7%, tp2 0.8-2.2%), which
leaned the emulations low. The fidelity bench reads each run's median step too.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from prism_core.calibrate.durations import steady_compute, steady_steps
from prism_core.trace import Trace
from prism_core.trace.schema import COMPUTE

TRIM = 0.1     # the share of a position's steps left out at each end
CLIP_S = 1e-3  # a node's deviation counts at most this far from its position's median: one stall
               # (a preemption) is not noise the two cores share
AT_ONCE = 0.9  # two measured runs ran at once where they share this much of the shorter one's time


def trimmed_mean(values: np.ndarray, trim: float = TRIM) -> np.ndarray:
    """Per column: the mean of its values without the lowest and highest `trim` share of them."""
    v = np.sort(values, axis=0)
    k = int(trim * len(v))
    return v[k:len(v) - k].mean(axis=0) if len(v) > 2 * k else v.mean(axis=0)


def groups_used(trace: Trace, rank: int) -> list[int]:
    """The groups `rank` communicates in (its communication nodes' groups)."""
    kind, group = trace.columns["kind"], trace.columns["group"]
    s = trace.rank_slice(rank)
    return np.unique(group[s][(kind[s] != COMPUTE) & (group[s] >= 0)]).tolist()


def paired_ranks(trace: Trace, virtual: Iterable[int], sandbox: Iterable[int]) -> list[int]:
    """The virtual ranks whose every peer -- every other member of each group they communicate in --
    is a sandbox rank."""
    real = set(sandbox)
    # per group, its members that are not sandbox ranks, once (a world group of W members would
    # otherwise be walked for each of its W - S virtual ranks)
    others: dict[int, set[int]] = {}
    out = []
    for r in virtual:
        used = groups_used(trace, int(r))
        for g in used:
            if g not in others:
                others[g] = {m for m in trace.groups[g] if m not in real}
        if all(others[g] <= {int(r)} for g in used):
            out.append(int(r))
    return out


def deviations(spans: np.ndarray) -> np.ndarray:
    """[step, position] spans less their position's median over the steps, clipped to +-CLIP_S."""
    return np.clip(spans - np.median(spans, axis=0), -CLIP_S, CLIP_S)


@dataclass(frozen=True)
class NodeMoments:
    """When each node of the graph ran (per node, all ranks concatenated): in the calibrated
    timeline (`start`, `end`) and in the run its span was measured in (`measured_start`,
    `measured_end`, this machine's monotonic clock; NaN unknown); and the wait for a core its span
    holds from there (`measured_queued`, calibrate/durations.py `RankTiming.queued`; None where the
    calibration did not keep it)."""
    start: np.ndarray
    end: np.ndarray
    measured_start: np.ndarray
    measured_end: np.ndarray
    measured_queued: np.ndarray | None = None


def node_moments(timeline: Mapping[str, np.ndarray]) -> NodeMoments | None:
    """The `NodeMoments` of a calibrated `timeline.npz` (opened); None where it has no measured times
    (calibrated before they were kept)."""
    names = ("start", "end", "measured_start", "measured_end")
    files = getattr(timeline, "files", timeline)
    if not all(n in files for n in names):
        return None
    queued = np.asarray(timeline["measured_queued"], dtype=np.float64) if "measured_queued" in files else None
    return NodeMoments(*(np.asarray(timeline[n], dtype=np.float64) for n in names), measured_queued=queued)


def less_waits(span: np.ndarray, moments: NodeMoments) -> np.ndarray:
    """`span` less the wait for a core each holds (`moments.measured_queued`; none where unknown)."""
    return span if moments.measured_queued is None else span - np.nan_to_num(moments.measured_queued)


def overlaps(a0: np.ndarray, a1: np.ndarray, b0: np.ndarray, b1: np.ndarray) -> np.ndarray | None:
    """Per pair of nodes ([a0, a1] beside [b0, b1]): the time they ran at once over the geometric
    mean of their lengths (1: the same interval, 0 for a node of no length). None where a time is
    unknown."""
    a0, a1, b0, b1 = (np.asarray(x, dtype=np.float64).ravel() for x in (a0, a1, b0, b1))
    if not (np.isfinite(a0).all() and np.isfinite(a1).all() and np.isfinite(b0).all() and np.isfinite(b1).all()):
        return None
    shared = np.clip(np.minimum(a1, b1) - np.maximum(a0, b0), 0.0, None)
    length = np.sqrt(np.clip(a1 - a0, 0.0, None) * np.clip(b1 - b0, 0.0, None))
    return np.divide(shared, length, out=np.zeros_like(shared), where=length > 0)


def overlap(a0: np.ndarray, a1: np.ndarray, b0: np.ndarray, b1: np.ndarray) -> float | None:
    """How much pairs of nodes ran at once: the mean of their `overlaps`; None where a time is unknown."""
    each = overlaps(a0, a1, b0, b1)
    return None if each is None else float(np.mean(each))


def at_once(a0: np.ndarray, a1: np.ndarray, b0: np.ndarray, b1: np.ndarray) -> bool:
    """Whether two runs' nodes ran at once: each one's first start to last end shares at least
    `AT_ONCE` of the shorter one's (not two runs one after the other, or barely touching)."""
    first, last = max(np.min(a0), np.min(b0)), min(np.max(a1), np.max(b1))
    shorter = min(np.max(a1) - np.min(a0), np.max(b1) - np.min(b0))
    return bool(shorter > 0 and (last - first) >= AT_ONCE * shorter)


def shared_noise(trace: Trace, span: np.ndarray, rank: int, peer: int, first_step: int,
                 moments: NodeMoments | None = None) -> float | None:
    """How much of its noise `rank` shares with `peer` in `span` (a calibrated timeline): the
    correlation, node by node over the steady steps both ranks have from `first_step`, of their
    spans' deviations from their positions' medians. None where the two ranks' steady steps compute
    different numbers of nodes, where fewer than two steps are common, or where one does not vary.

    With `moments`, where the two ranks' spans were measured at once (a co-run): that correlation
    times how much more their nodes overlap in the timeline than where they were measured
    (`overlap`; at most 1). The machine's noise lands on two ranks' same node as far as they
    compute it at the same moment, and the co-run's members keep to each other through their
    assistants, some 0.3 ms apart, where the record's and the timeline's are 0.04 ms apart.
    Where `moments` holds each span's wait for a core (`measured_queued`), the correlation is of
    the spans less those waits, which no peer shares (see the module's docstring)."""
    found = [steady_steps(trace, int(r), first_step) for r in (rank, peer)]
    if found[0] is None or found[1] is None or found[0][1].shape[1] != found[1][1].shape[1]:
        return None
    common = sorted(set(found[0][0]) & set(found[1][0]))
    if len(common) < 2:
        return None
    if moments is not None:
        span = less_waits(span, moments)
    dev, nodes = [], []
    for r, (steps, grid) in zip((rank, peer), found):
        rows = grid[[steps.index(k) for k in common]] + int(trace.offsets[r])
        nodes.append(rows.ravel())
        dev.append(deviations(span[rows]).ravel())
    if dev[0].std() == 0 or dev[1].std() == 0:
        return None
    rho = float(np.corrcoef(dev[0], dev[1])[0, 1])
    if moments is None:
        return rho
    a, b = nodes
    measured = [moments.measured_start[a], moments.measured_end[a], moments.measured_start[b], moments.measured_end[b]]
    there = overlap(*measured)
    if there is None or there <= 0 or not at_once(*measured):
        return rho
    here = overlap(moments.start[a], moments.end[a], moments.start[b], moments.end[b])
    return float(np.clip(rho * here / there, -1.0, 1.0)) if here is not None else rho


def kept_noise(rho: float | None) -> float:
    """The share of its timed noise a virtual rank keeps beside a sandbox peer it shares `rho` of
    its noise with, so that the two leave each node as far apart as two real ranks do.

    Two real ranks of noise s each, sharing rho of it, are apart by a variance of 2 s^2 (1 - rho)
    at each node; the sandbox rank's live noise and a virtual rank's w of its calibrated draw, which
    is unrelated to it, by s^2 (1 + w^2). So w = sqrt(1 - 2 rho), and 0 (steady) where rho is 0.5 or
    more: such real ranks are closer than a live rank and a steady one can be. None (not read): 0."""
    if rho is None or not np.isfinite(rho):
        return 0.0
    return float(np.sqrt(max(0.0, 1.0 - 2.0 * rho)))


def sandbox_peers(trace: Trace, rank: int, sandbox: Iterable[int]) -> list[int]:
    """The sandbox ranks that share a group `rank` communicates in."""
    real = set(sandbox)
    return sorted({m for g in groups_used(trace, int(rank)) for m in trace.groups[g] if m in real and m != rank})


def matched_noise(trace: Trace, span: np.ndarray, ranks: Iterable[int], sandbox: Iterable[int],
                  first_step: int, moments: NodeMoments | None = None) -> dict[int, tuple[float | None, float]]:
    """Per virtual rank of `ranks`: (rho, w), the noise it shares with its sandbox peers in the
    calibrated `span` (their mean, where read; `moments` as in `shared_noise`) and the share of
    its own noise it keeps for it."""
    sandbox = list(sandbox)
    out = {}
    for r in ranks:
        read = [x for p in sandbox_peers(trace, int(r), sandbox)
                if (x := shared_noise(trace, span, int(r), p, first_step, moments)) is not None]
        rho = float(np.mean(read)) if read else None
        out[int(r)] = (rho, kept_noise(rho))
    return out


def steady_spans(trace: Trace, span: np.ndarray, ranks: Iterable[int], first_step: int,
                 trim: float = TRIM, kept: Mapping[int, float] | None = None) -> np.ndarray:
    """`span` (per node of the graph) with each compute node of `ranks`' steady steps from
    `first_step` replaced by its position's trimmed mean over those steps, scaled so that a steady
    step computes what the rank's median step did, plus `kept[rank]` (0 where not given) of the
    node's own deviation from that. Other nodes and ranks are left as they are; a rank with fewer
    than two steady steps too."""
    out = np.array(span, dtype=np.float64, copy=True)
    for r in ranks:
        grid = steady_compute(trace, int(r), first_step)      # [step, position], nodes of the rank
        if grid is None:
            continue
        nodes = grid + int(trace.offsets[r])
        drawn = out[nodes]
        mean = trimmed_mean(drawn, trim)
        if mean.sum() > 0:
            mean = mean * (float(np.median(drawn.sum(axis=1))) / float(mean.sum()))
        w = (kept or {}).get(int(r), 0.0)
        out[nodes] = mean[None, :] + w * (drawn - mean[None, :]) if w else mean[None, :]
    return out
