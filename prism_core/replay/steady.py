"""Steady spans for the virtual ranks of a timed replay: each compute node of a steady step takes its
position's trimmed mean over those steps, not the span one step of the timing run happened to take.

A virtual rank's calibrated span for one node of one step is one draw of this machine's noise, from
the slices minutes earlier. Node by node it says next to nothing about the same node in another run:
its deviation from its position's median correlated -0.01 / +0.10 / +0.01 / +0.00 (dp2 / ep2 / pp2 /
tp2, medians of 8) with the same rank's in `prism record` (README item 45, `bench/node_noise.py`).
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

Steps whose sequence of compute nodes is not the rank's most common one, and warm-up steps, keep
their spans. A trimmed mean, not the median: a node's noise is skewed (slow draws are longer than
fast ones), and a virtual rank is to compute what its real rank does on average; trimmed, so that one
stalled draw (a preemption) is not spread over every step.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from prism_core.calibrate.durations import steady_compute
from prism_core.trace import Trace
from prism_core.trace.schema import COMPUTE

TRIM = 0.1     # the share of a position's steps left out at each end


def trimmed_mean(values: np.ndarray, trim: float = TRIM) -> np.ndarray:
    """Per column: the mean of its values without the lowest and highest `trim` share of them."""
    v = np.sort(values, axis=0)
    k = int(trim * len(v))
    return v[k:len(v) - k].mean(axis=0) if len(v) > 2 * k else v.mean(axis=0)


def paired_ranks(trace: Trace, virtual: Iterable[int], sandbox: Iterable[int]) -> list[int]:
    """The virtual ranks whose every peer -- every other member of each group they communicate in --
    is a sandbox rank."""
    real = set(sandbox)
    kind, group = trace.columns["kind"], trace.columns["group"]
    # per group, its members that are not sandbox ranks, once (a world group of W members would
    # otherwise be walked for each of its W - S virtual ranks)
    others: dict[int, set[int]] = {}
    out = []
    for r in virtual:
        s = trace.rank_slice(int(r))
        used = np.unique(group[s][(kind[s] != COMPUTE) & (group[s] >= 0)])
        for g in used.tolist():
            if g not in others:
                others[g] = {m for m in trace.groups[g] if m not in real}
        if all(others[g] <= {int(r)} for g in used.tolist()):
            out.append(int(r))
    return out


def steady_spans(trace: Trace, span: np.ndarray, ranks: Iterable[int], first_step: int,
                 trim: float = TRIM) -> np.ndarray:
    """`span` (per node of the graph) with each compute node of `ranks`' steady steps from
    `first_step` replaced by its position's trimmed mean over those steps. Other nodes and ranks
    are left as they are; a rank with fewer than two steady steps too."""
    out = np.array(span, dtype=np.float64, copy=True)
    for r in ranks:
        grid = steady_compute(trace, int(r), first_step)      # [step, position], nodes of the rank
        if grid is None:
            continue
        nodes = grid + int(trace.offsets[r])
        out[nodes] = trimmed_mean(out[nodes], trim)[None, :]
    return out
