"""Steady spans for the virtual ranks of a timed replay: each compute node of a steady step takes its
position's trimmed mean over those steps, not the span one step of the timing run happened to take.

A virtual rank's calibrated span for one node of one step is one draw of this machine's noise, from
the slices minutes earlier. Node by node it says next to nothing about the same node in another run:
its deviation from its position's median correlated 0.00-0.08 with `prism record`'s on ep2, dp2 and
tp2 (0.12-0.23 on pp2; item 45, bench/fidelity.py --keep, node by node). Yet the real ranks of one
run share most of theirs (0.50-0.76 on ep2, dp2, tp2: the machine's slow spells slow both cores at
once). Replayed as timed, a virtual rank's noise is drawn apart from its sandbox peer's, the two
leave a collective apart about twice as far as the real ranks do (ep2: 10th-90th percentile of the
node-by-node difference -0.33 ... +0.32 ms against -0.17 ... +0.17), and the sandbox rank waits at
each of ep2's ~90 ops a step: 0.11-0.12 ms a node against the record's 0.06-0.07, some 4 ms of a
190 ms step, and its core idles and computes the next node slower after it (calibrate/resume.py).
The machine's drift, which the noise also carries, is what `follow.py` follows.

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

TRIM = 0.1     # the share of a position's steps left out at each end


def trimmed_mean(values: np.ndarray, trim: float = TRIM) -> np.ndarray:
    """Per column: the mean of its values without the lowest and highest `trim` share of them."""
    v = np.sort(values, axis=0)
    k = int(trim * len(v))
    return v[k:len(v) - k].mean(axis=0) if len(v) > 2 * k else v.mean(axis=0)


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
