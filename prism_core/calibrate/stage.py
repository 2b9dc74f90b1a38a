"""Stage 2 as the pipeline sees it: where slices live, and the calibration step that writes metrics.

Slices live under `<timing root>/<graph key>/s<S>/slice_<i>_<key>/`, keyed by the bare graph
they replay and their sandbox ranks, so a rerun reuses every slice that finished (a failed one is
rerun alone); a further pass's slices and loaded runs under `refined_<timeline digest>/` there.
`calibrate_slices` merges them and writes `metrics.json` (mode "predicted") and the calibrated
node times (`timeline.npz`) to the output directory.
"""

from __future__ import annotations

import hashlib
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from prism_core.calibrate.durations import replica_copies, replica_orders
from prism_core.calibrate.predict import predict, prediction_metrics
from prism_core.config import PrismConfig
from prism_core.launch.cores import machine_cores
from prism_core.metrics import write_metrics
from prism_core.replay.slices import TimingPlan, awake_setting, plan_slices, run_slice, run_together, slice_key
from prism_core.topology import Topology
from prism_core.trace import Trace


@dataclass
class SliceJob:
    index: int
    sandbox: list[int]
    directory: Path
    loaded: Path | None = None    # the same slice run beside its neighbours (a co-run) or the stand-in load
    # DP replicas of the sandbox, replicas[j - 1] taking order j (`durations.replica_noise`): a
    # co-run short of members runs them for real beside the slice (`co_runs`)
    replicas: list[list[int]] = field(default_factory=list)


def slice_jobs(cfg: PrismConfig, trace: Trace, graph_dir: Path, timing_root: Path,
               timing: Path | None = None) -> tuple[TimingPlan, list[SliceJob]]:
    """The slices of a timing pass; `timing`: the calibrated timeline the virtual ranks replay (refinement).

    With `loaded_runs` each slice also has a loaded run, each pass its own: a pass's compute spans
    and its slices' compute over them (`alone_span`, what a timed pace is read against:
    replay/follow.py) then come from one stretch of the machine, which moves by several percent
    from minute to minute.
    """
    plan = plan_slices(cfg, trace)
    graph_key = Path(graph_dir).name
    base = Path(timing_root) / graph_key / f"s{cfg.emulation.sandbox}"
    if timing is not None:
        base = base / f"refined_{_digest(timing)}"
    load = loaded_runs(cfg)
    copies, orders = replica_copies(plan.source), plan_orders(cfg, plan)
    jobs = []
    for i, s in enumerate(plan.slices):
        key = slice_key(graph_key, cfg, s)
        loaded = base / f"loaded_{i}_{key}_{_load_kind(cfg)}" if load else None
        replicas = [[copies[r][j] for r in s] for j in range(1, orders) if all(len(copies[r]) > j for r in s)]
        jobs.append(SliceJob(i, s, base / f"slice_{i}_{key}{_timed_kind(cfg, timing is not None)}", loaded, replicas))
    return plan, jobs


def _timed_kind(cfg: PrismConfig, timed: bool) -> str:
    """The settings a slice's spans depend on beyond its key, in its directory's name, so that a
    changed setting runs it afresh: its assistant's cores kept awake, its ring neighbours not
    combining (`ring_combine` off) and, in a timed slice (a second pass), its virtual ranks
    following the pace and taking steady spans."""
    kind = "_awake" if awake_setting(cfg, timed) else ""
    if timed and cfg.emulation.follow_pace:
        kind += "_pace"
    if timed and cfg.emulation.virtual_spans != "timed":
        kind += "_" + cfg.emulation.virtual_spans
    if not cfg.emulation.ring_combine:
        kind += "_nocombine"
    return kind


def replica_dir(loaded: Path, order: int) -> Path:
    """Where a slice's DP replicas of `order` run for real in its co-run."""
    return loaded.with_name(f"{loaded.name}_replica{order}")


def replica_runs(jobs: list[SliceJob]) -> list[tuple[Path, list[int]]]:
    """Every (directory, ranks) where a co-run may have run a slice's DP replicas for real."""
    return [(replica_dir(j.loaded, n + 1), ranks) for j in jobs if j.loaded is not None
            for n, ranks in enumerate(j.replicas)]


def _load_kind(cfg: PrismConfig) -> str:
    """What a loaded run's spans depend on beyond its slice: what computes beside it and, in a
    co-run, its assistant's scheduling class, and its ring neighbours not combining (a changed
    setting runs the loaded runs afresh)."""
    e = cfg.emulation
    kind = f"co_run_{e.co_run_assistant}" if e.neighbours == "co_run" else e.neighbours
    return kind if e.ring_combine else kind + "_nocombine"


def loaded_runs(cfg: PrismConfig) -> bool:
    """Whether slices also run beside neighbours: asked for, bound to cores, and the machine has
    cores for two slices' ranks (a co-run) or for a slice's ranks and the assistant (the stand-in
    load runs on the assistant's core)."""
    cores, s = len(machine_cores()), cfg.emulation.sandbox
    return (cfg.emulation.loaded_compute and cfg.job.cpu_binding == "core"
            and (cores >= 2 * s if cfg.emulation.neighbours == "co_run" else cores > s))


def co_runs(jobs: list[SliceJob], cores: int, sandbox: int) -> list[list[tuple[list[int], Path]]]:
    """The loaded runs of `jobs` in co-runs of `cores // sandbox` slices each, in order; the last
    one filled up, so that every member has neighbours, from the first slices: with their DP
    replicas where they have them (`replica_dir`: the replica's own ranks, run for real and in
    step with the slice, whose compute the calibration gives that replica), else with twins
    (`<loaded dir>_twin<k>`, the same ranks run again, whose spans are not used)."""
    loaded = [j for j in jobs if j.loaded is not None]
    size = max(cores // sandbox, 1)
    groups = [[(j.sandbox, j.loaded) for j in loaded[i:i + size]] for i in range(0, len(loaded), size)]
    if groups and len(groups[-1]) < size:
        fill = size - len(groups[-1])
        for k, j in enumerate((loaded * size)[:fill]):
            n = k // len(loaded)       # the how-many-th time this slice fills a place
            groups[-1].append((j.replicas[n], replica_dir(j.loaded, n + 1)) if n < len(j.replicas)
                              else (j.sandbox, j.loaded.with_name(f"{j.loaded.name}_twin{k}")))
    return groups


def run_loaded(cfg: PrismConfig, graph_dir: Path, jobs: list[SliceJob]) -> None:
    """The slices' loaded runs on this machine: co-runs, or each slice beside the stand-in load."""
    if cfg.emulation.neighbours == "stand_in":
        for job in jobs:
            if job.loaded is not None:
                run_slice(cfg, graph_dir, job.sandbox, job.loaded, neighbour_load=True)
        return
    cores = machine_cores()
    for group in co_runs(jobs, len(cores), cfg.emulation.sandbox):
        run_together(cfg, graph_dir, group, cores)


def _digest(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:12]


def time_and_calibrate(cfg: PrismConfig, trace: Trace, graph_dir: Path, timing_root: Path, out_dir: Path,
                       passes: int | None = None, on_slice=None) -> dict:
    """Every slice in turn on this machine (reusing finished ones), then calibration: Stage 2 without Prefect.

    `passes` (default `emulation.timing_passes`) > 1 refines: the slices run again with the
    virtual ranks replaying the previous pass's calibrated timeline in real time, and are
    calibrated again.
    """
    timing, documents = None, []
    for n in range(passes or cfg.emulation.timing_passes):
        plan, jobs = slice_jobs(cfg, trace, graph_dir, timing_root, timing)
        for job in jobs:
            out = run_slice(cfg, graph_dir, job.sandbox, job.directory, timing)
            if on_slice is not None:
                on_slice(n, job, out)
        run_loaded(cfg, graph_dir, jobs)
        document, timing = calibrate_pass(cfg, trace, plan, jobs, out_dir, n)
        documents.append(document)
    return finish_passes(out_dir, documents)


def calibrate_pass(cfg: PrismConfig, trace: Trace, plan: TimingPlan, jobs: list[SliceJob], out_dir: Path,
                   index: int) -> tuple[dict, Path]:
    """Calibrate one pass's slices; its timeline is kept as `timeline_pass<n>.npz` for the next pass.
    A pass after the first is timed (its slices replayed the previous pass's timeline)."""
    document = calibrate_slices(cfg, trace, plan, jobs, out_dir, timed=index > 0)
    timing = Path(out_dir) / f"timeline_pass{index + 1}.npz"
    (Path(out_dir) / "timeline.npz").replace(timing)
    return document, timing


def finish_passes(out_dir: Path, documents: list[dict]) -> dict:
    """The last pass's prediction as `metrics.json` and `timeline.npz`; the ablation (no inter-slice
    calibration) is the first pass's slice figure, as the paper defines it."""
    out_dir = Path(out_dir)
    shutil.copyfile(out_dir / f"timeline_pass{len(documents)}.npz", out_dir / "timeline.npz")
    document, first = documents[-1], documents[0]
    for r, entry in document["ranks"].items():
        entry["uncalibrated_iteration_time_s"] = first["ranks"][r]["uncalibrated_iteration_time_s"]
        if len(documents) > 1:
            entry["first_pass_iteration_time_s"] = first["ranks"][r]["iteration_time_s"]
    document["timing_passes"] = len(documents)
    write_metrics(out_dir / "metrics.json", document)
    return document


def plan_orders(cfg: PrismConfig, plan: TimingPlan) -> int:
    """How many orders the DP replicas the plan renames take (`durations.replica_orders`; 1 where
    every rank is timed itself)."""
    if np.array_equal(plan.source, np.arange(len(plan.source))):
        return 1
    topo = Topology.from_config(cfg)
    return replica_orders(topo.dp, topo.ep)


def calibrate_slices(cfg: PrismConfig, trace: Trace, plan: TimingPlan, jobs: list[SliceJob], out_dir: Path,
                     timed: bool = False) -> dict:
    """Merge the slices, solve the timeline, write `out_dir/metrics.json` and `out_dir/timeline.npz`
    (`timed_pass`: whether the slices replayed in calibrated time, as an emulation does)."""
    loaded = [j.loaded for j in jobs]
    prediction = predict(trace, [(j.directory, j.sandbox) for j in jobs], plan.source,
                         loaded=loaded if any(loaded) else None, warmup=cfg.job.warmup, orders=plan_orders(cfg, plan),
                         replicas=replica_runs(jobs), resume=cfg.emulation.resume_cost)
    document = prediction_metrics(cfg, prediction)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / ".timeline.tmp.npz"
    m = prediction.model
    # `alone_span` only where loaded runs gave one (replay/assistant.py reads `span` without it)
    optional = {} if prediction.alone_span is None else {"alone_span": prediction.alone_span}
    # when each node's span was measured, beside the timeline's start and end (replay/steady.py `shared_noise`)
    if m.measured_start is not None and m.measured_end is not None:
        optional.update(measured_start=m.measured_start, measured_end=m.measured_end)
    if m.measured_queued is not None:
        optional.update(measured_queued=m.measured_queued)
    np.savez(tmp, start=prediction.start, end=prediction.end, offsets=trace.offsets, span=m.span,
             transfer=m.transfer, release=m.release, completes_synced=m.completes_synced,
             issue_cost=m.issue_cost if m.issue_cost is not None else np.zeros_like(m.transfer),
             measured_span=prediction.measured_span if prediction.measured_span is not None else m.span,
             timed_pass=np.bool_(timed), **optional)
    tmp.replace(out_dir / "timeline.npz")
    write_metrics(out_dir / "metrics.json", document)
    return document
