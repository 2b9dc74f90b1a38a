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
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from prism_core.calibrate.durations import (RankTiming, load_ran, merge_model, pool_member_noise, replica_noise,
                                            slice_timings, step_ends, with_loaded_compute)
from prism_core.calibrate.timeline import NodeModel, solve
from prism_core.config import PrismConfig
from prism_core.metrics import metrics_document, rank_metrics
from prism_core.trace import Trace
from prism_core.trace.schema import COMPUTE
from prism_core.trace.matching import OpMatch, match_ops


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


def predict(bare: Trace, slices: list[tuple[Path, list[int]]], source: np.ndarray,
            loaded: list[Path | None] | None = None, warmup: int = 0, orders: int = 1,
            replicas: list[tuple[Path, list[int]]] | None = None) -> Prediction:
    """`loaded[i]`: slice i run beside the neighbour load (None, or a run the load did not run in: its
    compute spans are the plain run's). DP replicas renamed from one timed rank take its steps
    from `warmup` on in up to `orders` orders (`durations.replica_noise`, `replica_orders`), or
    their own compute where `replicas` (co-run members that ran replicas for real) has it."""
    match = match_ops(bare)
    timings, load = timed_ranks(bare, match, slices, loaded)
    measured = replica_spans(bare, match, replicas or [])
    if load is not None:
        load["replicas_measured"] = sorted(measured)
    return predict_from(bare, match, timings, source, warmup, orders, load, measured)


def replica_spans(bare: Trace, match: OpMatch, runs: list[tuple[Path, list[int]]],
                  waits_out: str = "assistant") -> dict[int, np.ndarray]:
    """The spans of DP replicas that ran for real in a co-run (`runs`: directory, ranks), those
    whose co-run had every member bound to its core (`load_ran`); `waits_out` as in `slice_timings`."""
    out: dict[int, np.ndarray] = {}
    for directory, ranks in runs:
        if load_ran(directory):
            out.update({r: t.span for r, t in slice_timings(bare, match, directory, ranks, waits_out).items()})
    return out


def timed_ranks(bare: Trace, match: OpMatch, slices: list[tuple[Path, list[int]]],
                loaded: list[Path | None] | None = None, waits_out: str = "assistant") -> tuple[dict[int, RankTiming], dict | None]:
    """What every timed rank measured in its slice, compute from the slice's loaded run where it
    has one; and how many slices had one and how much longer their compute was. `waits_out`: as in
    `slice_timings`."""
    timings: dict[int, RankTiming] = {}
    used, plain_compute, loaded_compute = 0, 0.0, 0.0
    for (directory, sandbox), load_dir in zip(slices, loaded or [None] * len(slices)):
        plain = slice_timings(bare, match, directory, sandbox, waits_out)
        if load_dir is not None and load_ran(load_dir):
            beside = slice_timings(bare, match, load_dir, sandbox, waits_out)
            plain_compute += _compute_total(bare, plain)
            plain = with_loaded_compute(bare, plain, beside)
            loaded_compute += _compute_total(bare, plain)
            used += 1
        timings.update(plain)
    load = None
    if loaded is not None:
        load = {"slices": used, "of": len(slices),
                "compute_ratio": loaded_compute / plain_compute if plain_compute > 0 else None}
    return timings, load


def predict_from(bare: Trace, match: OpMatch, timings: dict[int, RankTiming], source: np.ndarray,
                 warmup: int = 0, orders: int = 1, load: dict | None = None,
                 measured: dict[int, np.ndarray] | None = None) -> Prediction:
    """The calibrated prediction from the timed ranks' measurements (`timed_ranks`) and the spans
    of replicas measured in co-runs (`replica_spans`)."""
    model = merge_model(bare, timings, source)
    model = pool_member_noise(bare, match, model, timings, source)
    model, shares = replica_noise(bare, model, source, warmup, orders, measured)
    end, start, rounds = solve(model, match, bare.offsets, source=shares)
    step_times, uncalibrated, peaks = {}, {}, {}
    for r in range(bare.world_size):
        t = timings[int(source[r])]
        ends = step_ends(bare, end, r)[:len(t.step_times)]
        times = [ends[0] - t.gaps[0]] + [ends[k] - ends[k - 1] - t.gaps[k] for k in range(1, len(ends))]
        step_times[r] = times
        uncalibrated[r] = list(t.step_times)
        peaks[r] = list(t.peaks)
    return Prediction(step_times, uncalibrated, peaks, end, start, rounds, model, load)


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
