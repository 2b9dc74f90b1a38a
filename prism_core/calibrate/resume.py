"""What a compute node costs more after its rank waited: fitted from a slice's two runs, applied to the timeline.

A compute node that follows a longer wait (the time since its rank's previous compute node ended)
takes longer: on this machine, whose idle cores halt, each microsecond a rank waited more before a
node than it did in `prism record` added 0.05-0.24 us to the node, up to some 150-500 us after waits
of milliseconds (bench/MEASURED.md item 35). A co-run's members wait longer than the real job's ranks
(their virtual peers go on the wire a few hundred microseconds after their counterparts issue), so
their compute came out 2-6% over the record's on tp2 and ep2, though each node ran the same code.

The cost of node i is modelled as `C * (h_i + m h_(i-1) + m^2 h_(i-2) + ...)` with
`h_i = 1 - exp(-gap_i / tau)`: a core grows colder the longer it waits, and a node after several
long waits in a row pays for the earlier ones too (memory `m`). It is fitted from what the slices
already have: the same ranks' compute nodes timed twice, in the plain slice and in the loaded run,
after different waits. Their difference, node by node, is a share of the node (what the loaded
run's neighbours cost, and the machine's speed moving between the runs: it stays) plus `C` times
the difference of the two runs' terms; `tau` and `m` are the pair of a grid that fits best. Calibration then moves every compute span from the waits
it was measured after to the waits its own timeline puts before it, and solves again until the
timeline stops moving (`predict.predict_from`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from prism_core.trace.schema import COMPUTE

TAUS_S = (0.25e-3, 0.5e-3, 1e-3, 2e-3, 4e-3, 8e-3)
# how much of the waits before the previous compute nodes still costs (a core left cold by
# several waits in a row), and how many nodes back that reaches
MEMORIES = (0.0, 0.25, 0.5, 0.75)
HISTORY = 8
# node pairs whose two spans differ by more than this are another kind of noise (a preemption, a
# page fault storm): left out of the fit
OUTLIER_S = 1e-3
MIN_NODES = 200
FIT_NODES = 200_000     # the fit reads the first ranks' nodes up to this many
# a span moves by at most this share of itself: a node of a few microseconds cannot give back a
# cost fitted on nodes of milliseconds (the cost grows with the node: bench/MEASURED.md item 35)
MAX_SHARE = 0.5


@dataclass(frozen=True)
class ResumeCost:
    """What a compute node costs more after waits: `cost_s * (1 - exp(-gap / tau_s))` for the wait
    of `gap` seconds before it, plus `memory` times the same for the node before, and so on.
    `share`: the loaded run's nodes over the plain run's at equal waits, less 1 (kept in its spans:
    its neighbours' cost, and the machine's speed moving between the runs); `nodes`: the node pairs
    it was fitted on."""
    tau_s: float
    cost_s: float
    share: float
    nodes: int
    memory: float = 0.0

    def __call__(self, gap: np.ndarray, rank: np.ndarray | None = None) -> np.ndarray:
        """The cost of each node of a sequence of compute nodes with the waits `gap` before them."""
        return self.cost_s * history(_cold(gap, self.tau_s), self.memory, rank)

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, doc: dict | None) -> ResumeCost | None:
        return None if not doc else cls(**{k: doc[k] for k in ("tau_s", "cost_s", "share", "nodes", "memory")
                                           if k in doc})


def compute_gaps(kind: np.ndarray, t_start: np.ndarray, t_end: np.ndarray) -> np.ndarray:
    """Per node of one rank: for a compute node, the time since the rank's previous compute node
    ended (what it waited, communication included); NaN for the first compute node and for every
    other node."""
    gap = np.full(len(kind), np.nan)
    nodes = np.nonzero(kind == COMPUTE)[0]
    gap[nodes[1:]] = np.maximum(t_start[nodes[1:]] - t_end[nodes[:-1]], 0.0)
    return gap


def timeline_gaps(kind: np.ndarray, start: np.ndarray, end: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """`compute_gaps` of every rank of a solved timeline at once (all ranks concatenated)."""
    gap = np.full(len(kind), np.nan)
    nodes = np.nonzero(kind == COMPUTE)[0]
    if len(nodes) < 2:
        return gap
    rank = np.searchsorted(offsets, nodes, side="right") - 1
    same = rank[1:] == rank[:-1]
    after, before = nodes[1:][same], nodes[:-1][same]
    gap[after] = np.maximum(start[after] - end[before], 0.0)
    return gap


def fit_resume_cost(samples: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]) -> ResumeCost | None:
    """The cost fitted over `samples`, each (spans, gaps) of one rank's compute nodes in one run and
    (spans, gaps) of the same nodes in another, in node order; None where too few nodes have both,
    where the waits hardly differ between the runs, or where longer waits did not cost more."""
    kept, total = [], 0
    for sample in samples:                 # enough ranks for the fit; a large job's many are alike
        if total >= FIT_NODES:
            break
        kept.append(sample)
        total += len(sample[0])
    samples = kept
    diffs = [np.asarray(a, dtype=float) - np.asarray(b, dtype=float) for a, _, b, _ in samples]
    n = sum(int(np.sum(np.isfinite(d) & (np.abs(d) < OUTLIER_S))) for d in diffs)
    if n < MIN_NODES:
        return None
    best = None
    for tau in TAUS_S:
        for memory in MEMORIES:
            xs, ys, ss = [], [], []
            for d, (_, gap_a, span_b, gap_b) in zip(diffs, samples):
                x = history(_cold(np.asarray(gap_a, dtype=float), tau), memory) - \
                    history(_cold(np.asarray(gap_b, dtype=float), tau), memory)
                ok = np.isfinite(x) & np.isfinite(d) & (np.abs(d) < OUTLIER_S)
                xs.append(x[ok])
                ys.append(d[ok])
                ss.append(np.asarray(span_b, dtype=float)[ok])
            x, y, span = np.concatenate(xs), np.concatenate(ys), np.concatenate(ss)
            if len(x) < MIN_NODES or np.std(x) < 1e-3:
                continue
            # the runs' other differences scale with the node (the neighbours' share of the
            # machine, its speed moving between the runs): a share of the span, not a cost per node
            design = np.column_stack([span, x])
            coef, *_ = np.linalg.lstsq(design, y, rcond=None)
            sse = float(np.sum((design @ coef - y) ** 2))
            if best is None or sse < best[0]:
                best = (sse, tau, memory, coef, len(x))
    if best is None or best[3][1] <= 0:
        return None
    _, tau, memory, (share, cost), nodes = best
    return ResumeCost(tau_s=float(tau), cost_s=float(cost), share=float(share), nodes=nodes, memory=float(memory))


def _cold(gap: np.ndarray, tau: float) -> np.ndarray:
    return -np.expm1(-np.maximum(gap, 0.0) / tau)


def history(cold: np.ndarray, memory: float, rank: np.ndarray | None = None) -> np.ndarray:
    """`cold[i] + memory * cold[i-1] + memory^2 * cold[i-2] + ...` over a sequence of compute nodes
    (NaN where any term is; `HISTORY` terms); `rank`: the rank of each, terms not crossing ranks."""
    out = np.array(cold, dtype=float, copy=True)
    if memory <= 0:
        return out
    weight = 1.0
    for k in range(1, HISTORY):
        weight *= memory
        term = np.full(len(out), np.nan)
        term[k:] = cold[:-k]
        if rank is not None:
            term[k:][rank[k:] != rank[:-k]] = 0.0
        out += weight * np.where(np.isfinite(term), term, 0.0)
    return out


def resumed_spans(span: np.ndarray, kind: np.ndarray, offsets: np.ndarray, measured_gap: np.ndarray,
                  gap: np.ndarray, cost: ResumeCost, ranks: np.ndarray | None = None) -> np.ndarray:
    """`span` (all ranks' nodes) with every compute node whose waits are known moved from the waits
    it was measured after (`measured_gap`) to `gap`, by at most `MAX_SHARE` of itself; `ranks`:
    only theirs (all by default)."""
    out = np.array(span, dtype=float, copy=True)
    if ranks is None:
        nodes = np.nonzero(kind == COMPUTE)[0]
    else:
        nodes = np.concatenate([np.arange(offsets[r], offsets[r + 1]) for r in np.asarray(ranks, dtype=np.int64)]
                               or [np.zeros(0, dtype=np.int64)])
        nodes = nodes[kind[nodes] == COMPUTE]
    rank = np.searchsorted(offsets, nodes, side="right") - 1
    move = cost(gap[nodes], rank) - cost(measured_gap[nodes], rank)
    ok = np.isfinite(move)
    nodes, move = nodes[ok], move[ok]
    limit = MAX_SHARE * out[nodes]
    out[nodes] += np.clip(move, -limit, limit)
    return out
