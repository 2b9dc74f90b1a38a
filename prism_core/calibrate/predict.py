"""Stage 2b: merge the slices into one timed graph and predict each rank's iteration time.

`predict` solves the global timeline (`timeline.solve`) over the model merged from every slice
(`durations`), reads each rank's step ends off it, and takes away the per-step gaps the program
keeps outside its iterations (time between an optimizer step and the next `iteration_start`).
Next to it, `uncalibrated` is what each rank measured in its own slice, where virtual peers
answered as fast as the graph allowed: the paper's ablation without inter-slice calibration.
Where a slice has a loaded run, its compute spans come from that run; collectives whose
members were timed in different slices have their members' noise pooled, loaded runs or not;
DP replicas that take a timed rank's durations take its steps' compute in other orders, so that
their collectives wait for the slowest as real replicas do, or the compute of the same replica
run for real beside its timed rank in a co-run (`replica_spans`, `durations.replica_noise`).
Last, each compute span moves from the wait it was measured after to the wait the timeline puts
before it, at the cost of a wait fitted from the slices' plain and loaded runs (`resume.py`), and
the timeline is solved again. Beside the model, `alone_span`: each compute span times how much of
it its rank took alone (its plain run over its loaded run, at equal waits: `durations.alone_factor`),
what a timed replay's rank of interest, alone beside its assistant, reads its pace against
(replay/follow.py).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from prism_core.calibrate.durations import (RankTiming, load_ran, merge_model, pool_member_noise, replica_noise,
                                            slice_timings, step_ends, with_loaded_compute)
from prism_core.calibrate.resume import ResumeCost, fit_resume_cost, resumed_spans, timeline_gaps
from prism_core.calibrate.timeline import NodeModel, solve
from prism_core.config import PrismConfig
from prism_core.metrics import metrics_document, rank_metrics
from prism_core.trace import Trace
from prism_core.trace.schema import COMPUTE
from prism_core.trace.matching import OpMatch, match_ops


# the timeline solved again with the spans moved to its waits at most this many times, or until no
# node's end moves by more than the tolerance
RESUME_ROUNDS = 6
RESUME_TOL_S = 1e-6


@dataclass
class Prediction:
    step_times: dict[int, list[float]]       # per rank, every step, calibrated
    uncalibrated: dict[int, list[float]]     # per rank, as measured in its slice
    peaks: dict[int, list[int | None]]
    end: np.ndarray                          # end time of every node of the calibrated graph
    start: np.ndarray
    rounds: int
    model: NodeModel
    loaded: dict | None = None               # slices whose compute came from a loaded run, and how much longer
    measured_span: np.ndarray | None = None  # the model's spans before they moved to the timeline's waits (resume.py)
    alone_span: np.ndarray | None = None     # compute spans as their ranks would take them alone (no neighbour)


def predict(bare: Trace, slices: list[tuple[Path, list[int]]], source: np.ndarray,
            loaded: list[Path | None] | None = None, warmup: int = 0, orders: int = 1,
            replicas: list[tuple[Path, list[int]]] | None = None, resume: bool = True) -> Prediction:
    """`loaded[i]`: slice i run beside the neighbour load (None, or a run the load did not run in: its
    compute spans are the plain run's). DP replicas renamed from one timed rank take its steps
    from `warmup` on in up to `orders` orders (`durations.replica_noise`, `replica_orders`), or
    their own compute where `replicas` (co-run members that ran replicas for real) has it.
    `resume`: compute spans move to the waits the timeline puts before them, at the cost fitted
    from the slices' plain and loaded runs (`resume.py`; none where no loaded run ran)."""
    match = match_ops(bare)
    timings, load = timed_ranks(bare, match, slices, loaded, warmup=warmup)
    measured = replica_timings(bare, match, replicas or [])
    if load is not None:
        load["replicas_measured"] = sorted(measured)
    cost = ResumeCost.from_dict(load.get("resume")) if resume and load is not None else None
    return predict_from(bare, match, timings, source, warmup, orders, load, {r: t.span for r, t in measured.items()},
                        resume=cost, measured_gaps={r: t.resume_gap for r, t in measured.items()},
                        measured_times={r: (t.began, t.ended) for r, t in measured.items()
                                        if t.began is not None and t.ended is not None},
                        measured_queued={r: t.queued for r, t in measured.items() if t.queued is not None})


def replica_timings(bare: Trace, match: OpMatch, runs: list[tuple[Path, list[int]]],
                    waits_out: str = "assistant") -> dict[int, RankTiming]:
    """What the DP replicas that ran for real in a co-run (`runs`: directory, ranks) measured there,
    those whose co-run had every member bound to its core (`load_ran`); `waits_out` as in `slice_timings`."""
    out: dict[int, RankTiming] = {}
    for directory, ranks in runs:
        if load_ran(directory):
            out.update(slice_timings(bare, match, directory, ranks, waits_out))
    return out


def replica_spans(bare: Trace, match: OpMatch, runs: list[tuple[Path, list[int]]],
                  waits_out: str = "assistant") -> dict[int, np.ndarray]:
    """The spans of `replica_timings`."""
    return {r: t.span for r, t in replica_timings(bare, match, runs, waits_out).items()}


def timed_ranks(bare: Trace, match: OpMatch, slices: list[tuple[Path, list[int]]],
                loaded: list[Path | None] | None = None, waits_out: str = "assistant",
                warmup: int = 0) -> tuple[dict[int, RankTiming], dict | None]:
    """What every timed rank measured in its slice, compute from the slice's loaded run where it
    has one; and how many slices had one, how much longer their compute was, and what a wait cost
    the compute after it, fitted over the steps from `warmup` on of the ranks timed in both runs
    (`resume.py`; "resume": None where it could not be fitted). `waits_out`: as in `slice_timings`."""
    timings: dict[int, RankTiming] = {}
    used, plain_compute, loaded_compute = 0, 0.0, 0.0
    samples = []
    for (directory, sandbox), load_dir in zip(slices, loaded or [None] * len(slices)):
        plain = slice_timings(bare, match, directory, sandbox, waits_out)
        if load_dir is not None and load_ran(load_dir):
            beside = slice_timings(bare, match, load_dir, sandbox, waits_out)
            samples += _resume_samples(bare, plain, beside, warmup)
            plain_compute += _compute_total(bare, plain)
            plain = with_loaded_compute(bare, plain, beside, warmup)
            loaded_compute += _compute_total(bare, plain)
            used += 1
        timings.update(plain)
    load = None
    if loaded is not None:
        cost = fit_resume_cost(samples)
        load = {"slices": used, "of": len(slices),
                "compute_ratio": loaded_compute / plain_compute if plain_compute > 0 else None,
                "resume": cost.as_dict() if cost is not None else None}
    return timings, load


def _resume_samples(bare: Trace, plain: dict[int, RankTiming], loaded: dict[int, RankTiming], warmup: int) -> list:
    """Each rank's compute nodes from `warmup` on as (spans, waits before them) in its loaded run and in its plain one."""
    out = []
    for r, t in plain.items():
        other = loaded[r]
        if t.resume_gap is None or other.resume_gap is None:
            continue
        cols = bare.rank(r)
        nodes = (cols["kind"] == COMPUTE) & (cols["step"] >= warmup)
        out.append((other.span[nodes], other.resume_gap[nodes], t.span[nodes], t.resume_gap[nodes]))
    return out


def predict_from(bare: Trace, match: OpMatch, timings: dict[int, RankTiming], source: np.ndarray,
                 warmup: int = 0, orders: int = 1, load: dict | None = None,
                 measured: dict[int, np.ndarray] | None = None, resume: ResumeCost | None = None,
                 measured_gaps: dict[int, np.ndarray] | None = None,
                 measured_times: dict[int, tuple[np.ndarray, np.ndarray]] | None = None,
                 measured_queued: dict[int, np.ndarray] | None = None) -> Prediction:
    """The calibrated prediction from the timed ranks' measurements (`timed_ranks`) and the spans
    of replicas measured in co-runs (`replica_spans`; `measured_gaps`: the waits before them;
    `measured_times`: when they began and ended there; `measured_queued`: the waits for a core
    their spans hold).
    `resume`: each compute span moves from the wait it was measured after to the one the timeline
    puts before it, and the timeline is solved again until its step ends stop moving (`resume.py`)."""
    model = merge_model(bare, timings, source)
    model = pool_member_noise(bare, match, model, timings, source)
    model, shares = replica_noise(bare, model, source, warmup, orders, measured, measured_gaps, measured_times,
                                  measured_queued)
    end, start, rounds = solve(model, match, bare.offsets, source=shares)
    measured_span = model.span
    if resume is not None:
        model, end, start, more = move_to_timeline(bare, match, model, shares, end, start, resume)
        rounds += more
    alone = alone_spans(bare, timings, source, model.span)
    step_times, uncalibrated, peaks = {}, {}, {}
    for r in range(bare.world_size):
        t = timings[int(source[r])]
        ends = step_ends(bare, end, r)[:len(t.step_times)]
        times = [ends[0] - t.gaps[0]] + [ends[k] - ends[k - 1] - t.gaps[k] for k in range(1, len(ends))]
        step_times[r] = times
        uncalibrated[r] = list(t.step_times)
        peaks[r] = list(t.peaks)
    return Prediction(step_times, uncalibrated, peaks, end, start, rounds, model, load, measured_span, alone)


def move_to_timeline(bare: Trace, match: OpMatch, model: NodeModel, shares: np.ndarray, end: np.ndarray,
                     start: np.ndarray, resume: ResumeCost) -> tuple[NodeModel, np.ndarray, np.ndarray, int]:
    """`model` (solved: `end`, `start`) with each compute span moved from the wait it was measured
    after (`model.resume_gap`) to the one the timeline puts before it at `resume`'s cost, solved
    again until no node's end moves by `RESUME_TOL_S` (at most `RESUME_ROUNDS` times). Spans move
    on the ranks the quotient solver solves (`shares`, `durations.replica_noise`); the rest copy
    them. Returns the model, the ends and starts, and the solver's rounds."""
    if model.resume_gap is None or not np.isfinite(model.resume_gap).any():
        return model, end, start, 0
    kind, measured = bare.columns["kind"], model.span
    own = np.unique(shares)
    copies = [(bare.rank_slice(int(r)), bare.rank_slice(int(shares[r])))
              for r in np.nonzero(shares != np.arange(len(shares)))[0]]
    rounds = 0
    for _ in range(RESUME_ROUNDS):
        gap = timeline_gaps(kind, start, end, bare.offsets)
        span = resumed_spans(measured, kind, bare.offsets, model.resume_gap, gap, resume, own)
        for to, of in copies:
            span[to] = span[of]
        model = replace(model, span=span)
        before = end
        end, start, more = solve(model, match, bare.offsets, source=shares)
        rounds += more
        if np.max(np.abs(end - before), initial=0.0) < RESUME_TOL_S:
            break
    return model, end, start, rounds


def alone_spans(bare: Trace, timings: dict[int, RankTiming], source: np.ndarray,
                span: np.ndarray) -> np.ndarray | None:
    """`span` (the calibrated model's) with every compute node of a rank whose timing came from a
    loaded run times its `alone_factor` (replicas take their source rank's). None where no timed
    rank has one."""
    if not any(t.alone_factor is not None for t in timings.values()):
        return None
    kind = bare.columns["kind"]
    factor = np.ones(len(span))
    for r in range(bare.world_size):
        f = timings[int(source[r])].alone_factor
        if f is not None:
            factor[bare.rank_slice(r)] = f
    return np.where(kind == COMPUTE, span * factor, span)


def _compute_total(bare: Trace, timings: dict[int, RankTiming]) -> float:
    return float(sum(t.span[bare.rank(r)["kind"] == COMPUTE].sum() for r, t in timings.items()))


def _peak(peaks: list[int | None], warmup: int) -> int | None:
    measured = [p for p in peaks[warmup:] if p is not None]
    return max(measured) if measured else None


def prediction_metrics(cfg: PrismConfig, prediction: Prediction) -> dict:
    """metrics.json, mode "predicted", for every rank (DESIGN.md §9); the ablation rides along."""
    warmup = cfg.job.warmup
    capacity = cfg.job.device_memory_bytes
    ranks = {}
    for r, times in prediction.step_times.items():
        entry = rank_metrics(r, times, warmup, _peak(prediction.peaks[r], warmup))
        over = [k for k, p in enumerate(prediction.peaks[r]) if capacity is not None and p is not None and p > capacity]
        if over:   # the slice ran unbounded; with the capacity this rank runs out at that step
            entry["oom"], entry["oom_step"] = True, over[0]
        measured = prediction.uncalibrated[r][warmup:]
        entry["uncalibrated_iteration_time_s"] = statistics.median(measured) if measured else None
        ranks[r] = entry
    doc = metrics_document("predicted", cfg.job.world_size, ranks)
    doc["calibration_rounds"] = prediction.rounds
    if prediction.loaded is not None:
        doc["loaded_compute"] = {**prediction.loaded, "neighbours": cfg.emulation.neighbours}
    oom = sorted(r for r, e in ranks.items() if e["oom"])
    if oom:
        step = min(ranks[r]["oom_step"] for r in oom)
        doc["oom"] = {"ranks": [r for r in oom if ranks[r]["oom_step"] == step], "step": step,
                      "message": f"peak live memory would exceed job.device_memory_bytes={capacity}"}
    return doc
