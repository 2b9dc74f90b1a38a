"""Fidelity of Stages 2 and 3: predicted and emulated iteration time of each rank vs the real run.

For each config it collects the bare graph once, then alternates, pair by pair (the order
alternating too): `prism record` (the job run for real, every rank) and the model (every slice
run afresh, S sandbox ranks real and the rest replayed, then calibration; then one emulation per
rank, that rank real and the others replayed in calibrated time). A rank's iteration time is
the median of its measured steps; a run's figure is the mean over ranks. Printed per config:
the real, predicted and emulated medians over pairs with their errors, a 90% interval of each
error bootstrapped over the pairs (how far this machine's noise between runs moves it), and
beside them the ablation without inter-slice calibration (each rank as timed in its own slice),
the prediction with the ranks' waits for their core left in the slices' compute spans,
the prediction with the real run's compute spans in place of the slices' (what of the error
is communication and calibration, and what is compute measured in another run), the prediction
with the compute spans as measured, not moved to the waits the timeline puts before them
(calibrate/resume.py: "no resume"), and the
prediction from the plain slices alone, their loaded runs left out (what the neighbours moved: the
co-runs, or with `--neighbours stand_in` the MLP load).

With `--turns T` the runs of a pair do not follow one another: they run at once and take turns
of T seconds on the machine (bench/turns.py), so that the real run and the model see the same
machine; two records of one job then differ by ~1% here against ~6% one after the other
(bench/run_to_run.py). The emulations then take turns with a second record of their own
(`_turns_pair`); `--no-emulate` leaves them out.

With `--other-join` (and `--turns`) each plain slice also runs with its virtual members of
collectives joining the other way (late, or with `--join-late` early: replay/slices.py
`run_with_assistant`), taking turns with the rest, and the column "other" is the prediction
with the communication of those slices. With `--other-corun` each co-run runs again with its
assistants in the other scheduling class (`emulation.co_run_assistant`), and "other" is the
prediction with the compute of those co-runs. With `--other-awake` each plain slice runs again
with its assistant's cores kept awake the other way (`emulation.keep_awake`: by default they are,
launch/neighbour_load.py), and "other" is the prediction with the communication of those slices.
With `--other-cost` each emulation runs again on
a copy of the timeline whose issue costs are zero (its virtual ops on the wire at their
calibrated issue, not that plus their rank's issue cost), taking turns with the rest, and a line
after the table gives both against the second record. With `--other-spin` each emulation runs
again with its assistant's cores kept awake while its virtual ranks compute the other way
(`emulation.awake_while_computing`, replay/awake.py), and a line after the table gives both.
With `--other-pace` each emulation runs again with its virtual ranks following its sandbox rank's
pace the other way (`emulation.follow_pace`, replay/follow.py), and a line after the table gives
both. With `--other-reference` each emulation runs again with its pace read the other way
(`emulation.pace_reference` and `pace_steps`: against the loaded runs' spans over one step, or the
plain runs' over ten), and a line after the table gives both; with `--other-steps` with the pace
read as configured but over one step (`emulation.pace_steps`). With `--other-ahead` each emulation
runs again with what its virtual ranks send built the other way (`emulation.build_ahead`: by
default while they compute up to the op, not when it comes due), and a line after the table gives both.
With `--other-combine` each emulation runs again with a virtual rank between two sandbox ranks on a
ring combining each reduce step's receive the other way (`emulation.ring_combine`, replay/ring.py),
and a line after the table gives both.
With `--other-spans` each emulation runs again with its virtual ranks' spans the other way
(`emulation.virtual_spans`: each node's as timed, or its position's trimmed mean over the steady
steps, replay/steady.py), and a line after the table gives both.

With `--passes 2` (and `--turns`) the slices run a second time, their virtual ranks replaying the
first pass's calibrated timeline in real time (calibrate/stage.py `time_and_calibrate`), taking
turns with the second record (and the emulations) and with loaded runs of their own; the columns
"2nd pass" (calibrated from them) and "2nd real compute" (their communication with that record's
compute spans) are against the second record, as the first pass's are against the first.
With `--emulate-second` as well, the second pass's slices and their loaded runs take turns by
themselves, and then the second record and the emulations, which replay the second pass's
timeline: its alone spans (`--pace-reference alone`) are then the compute of ranks timed as an
emulation times its rank of interest, beside a timed assistant, so that a pace read against them
is how far the machine moved since, not also how differently a rank computes beside the
assistant than beside a real peer (bench/MEASURED.md item 61).

    .venv/bin/python bench/fidelity.py [--configs pp2,dp2,tp2,ep2] [--pairs 3] [--passes 1] [--steps 12]
                                       [--turns 0.3 [--no-emulate] [--other-join | --other-corun | --other-awake] [--other-cost] [--other-spin] [--other-pace] [--other-reference] [--other-against] [--other-steps] [--other-ahead] [--other-combine] [--other-spans]
                                       [--passes 2 [--emulate-second]]] [--pace-reference alone|loaded|timed] [--join-late]
                                       [--keep DIR]

Names resolve to configs/tiny_moe_w2_<name>.yaml; a path takes any config (larger W on a
machine with more cores: the real run must fit, W <= cores, for the comparison to mean much).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from prism_core.calibrate import predict
from prism_core.calibrate.durations import load_ran, slice_timings, with_loaded_compute
from prism_core.calibrate.predict import predict_from, replica_timings, timed_ranks
from prism_core.calibrate.resume import ResumeCost
from prism_core.calibrate.stage import (calibrate_pass, co_runs, plan_orders, replica_runs, slice_jobs,
                                       time_and_calibrate)
from prism_core.collect.stage import collect
from prism_core.config import load_config
from prism_core.emulate.stage import emulate
from prism_core.launch.cores import machine_cores
from prism_core.record import RecordOptions, record
from prism_core.replay.slices import run_slice, run_together
from prism_core.trace import load_trace
from prism_core.trace.matching import match_ops
from prism_core.trace.schema import COMPUTE
from prism_core.trace.store import read_queued

sys.path.insert(0, str(Path(__file__).resolve().parent))
from turns import graph_progress, take_turns, unstop_run  # noqa: E402  (a bench script beside this one)

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _config_path(name: str) -> Path:
    path = Path(name)
    return path if path.suffix in (".yaml", ".yml") else CONFIGS / f"tiny_moe_w2_{name}.yaml"


def _mean(doc: dict, key: str) -> float:
    return statistics.mean(r[key] for r in doc["ranks"].values())


def _pct(pred: float, real: float) -> str:
    return f"{100 * (pred - real) / real:+.2f}%"


def _interval(real: list[float], model: list[float], draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A 90% bootstrap interval of the error median(model) / median(real) - 1, resampling whole
    pairs: how far the error itself moves with this machine's noise between runs."""
    rng = np.random.default_rng(seed)
    a, b = np.asarray(real), np.asarray(model)
    picks = rng.integers(0, len(a), size=(draws, len(a)))
    errors = np.median(b[picks], axis=1) / np.median(a[picks], axis=1) - 1
    return float(np.percentile(errors, 5)), float(np.percentile(errors, 95))


def _span(interval: tuple[float, float]) -> str:
    return f"[{100 * interval[0]:+.1f}, {100 * interval[1]:+.1f}]"


def _variant(cfg, graph, root: Path, compute: str, timing: Path | None = None,
             record_dir: str = "record") -> float | None:
    """The pair's prediction rebuilt from its own runs with the compute spans changed.

    "real": every timed rank's compute spans from the pair's real run instead of its slice (ranks
    renamed from a timed rank take them, in other orders, as in the calibration): what is left of
    the error is the model of communication and synchronisation (the slices' transfer times and
    the calibration); the rest was compute measured in another run.
    "plain": the plain slices alone, their loaded runs left out: what the loaded runs' neighbours
    moved (None where no slice's load ran).
    "queued": the slices' compute spans with the ranks' waits for their core left in
    (trace/run_delay.py): what taking out the assistant's part moved. "all-waits": every wait taken
    out, what the ranks' own threads and the rest of the machine ran too (before 2026-12-03 the
    calibration did so).
    "other": communication from the plain slices run the other way (`--other-join`: virtual
    members of collectives joining late, or early; `--other-awake`: the assistant's cores kept
    awake the other way; None where they did not run).
    "other-corun": compute from co-runs whose assistants ran in the other scheduling class
    (`--other-corun`; None where they did not run).
    "reordered": the DP replicas measured in a co-run reordered from their timed rank instead, as
    where none ran (None where none was measured).
    "no-resume": the compute spans as measured, not moved to the waits the timeline puts before them
    (calibrate/resume.py); every other variant moves them at the cost fitted from the pair's slices.
    `timing`: the slices of the pass that replayed this timeline (`--passes 2`); `record_dir`:
    the real run whose compute spans "real" takes. DP replicas measured in a co-run keep their
    spans from it, from the real run in "real", and take reorderings in "plain".
    """
    plan, jobs = slice_jobs(cfg, graph.trace, graph.directory, root / "timing", timing)
    match = match_ops(graph.trace)
    replicas = replica_runs(jobs)
    warmup = cfg.job.warmup
    # every variant moves its compute spans to the timeline's waits at the cost the calibration
    # fitted from these slices (calibrate/resume.py), but "no-resume"
    _, load = timed_ranks(graph.trace, match, [(j.directory, j.sandbox) for j in jobs], [j.loaded for j in jobs],
                          warmup=warmup)
    cost = (ResumeCost.from_dict(load.get("resume")) if cfg.emulation.resume_cost and compute != "no-resume"
            else None)

    def measured_replicas(waits_out: str = "assistant", where=lambda d: d) -> dict:
        return replica_timings(graph.trace, match, [(where(d), ranks) for d, ranks in replicas], waits_out)

    if compute == "other":
        other = [_other(j.directory) for j in jobs]
        if not all((d / "results").is_dir() for d in other):
            return None
        timings, _ = timed_ranks(graph.trace, match, [(d, j.sandbox) for d, j in zip(other, jobs)],
                                 [j.loaded for j in jobs])
        measured = measured_replicas()
    elif compute in ("queued", "all-waits"):
        waits_out = "none" if compute == "queued" else "all"
        timings, _ = timed_ranks(graph.trace, match, [(j.directory, j.sandbox) for j in jobs],
                                 [j.loaded for j in jobs], waits_out=waits_out)
        measured = measured_replicas(waits_out)
    elif compute == "other-corun":
        other = [None if j.loaded is None else _other(j.loaded) for j in jobs]
        if not any(d is not None and load_ran(d) for d in other):
            return None
        timings, _ = timed_ranks(graph.trace, match, [(j.directory, j.sandbox) for j in jobs], other)
        measured = measured_replicas(where=_other)
    elif compute == "plain":
        if not any(j.loaded is not None and load_ran(j.loaded) for j in jobs):
            return None
        timings, _ = timed_ranks(graph.trace, match, [(j.directory, j.sandbox) for j in jobs])
        measured = {}
    elif compute == "reordered":
        if not any(load_ran(d) for d, _ in replicas):
            return None
        timings, _ = timed_ranks(graph.trace, match, [(j.directory, j.sandbox) for j in jobs],
                                 [j.loaded for j in jobs])
        measured = {}
    elif compute == "no-resume":
        timings, _ = timed_ranks(graph.trace, match, [(j.directory, j.sandbox) for j in jobs],
                                 [j.loaded for j in jobs])
        measured = measured_replicas()
    else:
        timings, _ = timed_ranks(graph.trace, match, [(j.directory, j.sandbox) for j in jobs],
                                 [j.loaded for j in jobs])
        real = slice_timings(graph.trace, match, root / record_dir, list(range(cfg.job.world_size)))
        timings = with_loaded_compute(graph.trace, timings, real)     # swaps in the real run's compute spans
        measured = {r: real[r] for r in measured_replicas()}
    prediction = predict_from(graph.trace, match, timings, plan.source, warmup, plan_orders(cfg, plan),
                              measured={r: t.span for r, t in measured.items()}, resume=cost,
                              measured_gaps={r: t.resume_gap for r, t in measured.items()})
    return statistics.mean(statistics.median(t[cfg.job.warmup:]) for t in prediction.step_times.values())


def _compute_against_real(cfg, graph, root: Path) -> tuple[float, float]:
    """The timed ranks' compute over the measured steps (the sum of their compute spans, the part of
    their waits for a core the assistant ran taken out) in the plain slices and in their loaded runs, each as a ratio to the same
    ranks' in the pair's record (nan where no loaded run ran): which of the two computed as the
    real run did."""
    plan, jobs = slice_jobs(cfg, graph.trace, graph.directory, root / "timing")
    match = match_ops(graph.trace)
    real = slice_timings(graph.trace, match, root / "record", list(range(cfg.job.world_size)))

    def compute(timings: dict) -> float:
        total = 0.0
        for r, t in timings.items():
            cols = graph.trace.rank(r)
            total += t.span[(cols["kind"] == COMPUTE) & (cols["step"] >= cfg.job.warmup)].sum()
        return total

    plain = loaded = real_plain = real_loaded = 0.0
    for j in jobs:
        timings = slice_timings(graph.trace, match, j.directory, j.sandbox)
        plain += compute(timings)
        real_plain += compute({r: real[r] for r in j.sandbox})
        if j.loaded is not None and load_ran(j.loaded):
            loaded += compute(slice_timings(graph.trace, match, j.loaded, j.sandbox))
            real_loaded += compute({r: real[r] for r in j.sandbox})
    return plain / real_plain, (loaded / real_loaded if real_loaded else float("nan"))


def _waits(runs: list[tuple[Path, list[int]]], warmup: int) -> tuple[float, float, float]:
    """The ranks' waits for their core within compute over the measured steps, as a share of their
    compute spans (wall); the part of them the ranks' own other threads ran, and the part the
    assistant ran, which the calibration takes out (trace/run_delay.py)."""
    compute = queued = own = assistant = 0.0
    for run_dir, ranks in runs:
        for r in ranks:
            with np.load(run_dir / "trace_parts" / f"{r}.npz") as part:
                measured = (part["kind"] == COMPUTE) & (part["step"] >= warmup)
                compute += float((part["t_end"] - part["t_start"])[measured].sum())
            nodes, q, o, h = read_queued(run_dir / "trace_parts" / f"{r}.npz")
            keep = measured[nodes]
            queued += float(q[keep].sum())
            own += float(np.minimum(q, o)[keep].sum())
            assistant += float(np.minimum(np.maximum(q - o, 0.0), h)[keep].sum())
    return (queued / compute, own / compute, assistant / compute) if compute else (float("nan"),) * 3


def _waits_of(cfg, graph, root: Path) -> str:
    """`_waits` of the pair's record and of its loaded runs, as a line."""
    _, jobs = slice_jobs(cfg, graph.trace, graph.directory, root / "timing")
    loaded = [(j.loaded, j.sandbox) for j in jobs if j.loaded is not None and load_ran(j.loaded)]
    out = []
    for what, runs in (("record", [(root / "record", list(range(cfg.job.world_size)))]), ("loaded runs", loaded)):
        if runs:
            q, o, a = _waits(runs, cfg.job.warmup)
            out.append(f"{what} {100 * q:.2f}% of compute ({100 * o:.2f}% its own threads', {100 * a:.2f}% the "
                       "assistant's)")
    return "waits for a core: " + ", ".join(out)


def _figure(run_dir: Path, world: int, warmup: int) -> float:
    """A run's iteration time from its ranks' step times: the mean over ranks of each one's median."""
    return statistics.mean(statistics.median(json.loads((run_dir / "results" / f"{r}.json").read_text())
                                             ["step_times_s"][warmup:]) for r in range(world))


def _step_noise(run_dir: Path, world: int, warmup: int, draws: int = 1000, seed: int = 0) -> float:
    """How far a run's figure moves with its own steps: the standard deviation of the figure over
    resamples of its measured steps (the same steps for every rank, drawn with replacement), over
    the figure. Two runs' figures differ by about 1.4 times it from their steps alone."""
    times = np.array([json.loads((run_dir / "results" / f"{r}.json").read_text())["step_times_s"][warmup:]
                      for r in range(world)])
    picks = np.random.default_rng(seed).integers(0, times.shape[1], size=(draws, times.shape[1]))
    figures = np.median(times[:, picks], axis=2).mean(axis=0)
    return float(figures.std() / np.median(times, axis=1).mean())


def _selfcheck(cfg, run_dir: Path) -> float:
    """The calibration fed the real run's own node times: must give back its figure."""
    world = cfg.job.world_size
    own = predict(load_trace(run_dir / "trace.zarr"), [(run_dir, list(range(world)))], np.arange(world))
    return statistics.mean(statistics.median(t[cfg.job.warmup:]) for t in own.step_times.values())


def _of_interest(cfg, rank: int):
    return cfg.model_copy(update={"emulation": cfg.emulation.model_copy(update={"ranks_of_interest": [rank]})})


def _model(cfg, graph, root: Path, passes: int) -> dict:
    """The calibrated prediction from the slices under `root/timing` (run here, or reused)."""
    doc = time_and_calibrate(cfg, graph.trace, graph.directory, root / "timing", root / "calibrate", passes=passes)
    return {"pred": _mean(doc, "iteration_time_s"), "uncal": _mean(doc, "uncalibrated_iteration_time_s"),
            "first": _mean(doc, "first_pass_iteration_time_s") if passes > 1 else _mean(doc, "iteration_time_s")}


def _classic_pair(cfg, graph, root: Path, i: int, passes: int) -> dict:
    """One pair run one after the other: `prism record`, then the model (or the other way round)."""
    out: dict = {}
    for what in (("real", "pred") if i % 2 == 0 else ("pred", "real")):
        if what == "real":
            out["real"] = _mean(record(cfg, root / "record", options=RecordOptions(echo=False)), "iteration_time_s")
            out["selfcheck"] = _selfcheck(cfg, root / "record")
            continue
        shutil.rmtree(root / "timing", ignore_errors=True)
        out.update(_model(cfg, graph, root, passes))
        out["emul"] = statistics.mean(
            emulate(_of_interest(cfg, r), graph.directory, root / "calibrate" / "timeline.npz",
                    root / "emulate")["ranks"][str(r)]["iteration_time_s"] for r in range(cfg.job.world_size))
    out["emul_real"] = out["real"]
    return out


def _turns_pair(cfg, graph, root: Path, i: int, args) -> dict:
    """One pair whose runs take turns on the machine (bench/turns.py): `prism record` and every
    slice and co-run (or loaded slice) at once, turns of `--turns` s, their stopped time taken out; the
    prediction is calibrated from those slices. Then, unless `--no-emulate`, `prism record` again
    and one emulation per rank on that calibration, taking turns too: the emulated figure is
    compared with that second record (`emul_real`). The emulations' assistants move their
    schedule by their launch's stopped time as they go (prism_core/replay/stopped.py); before
    that they could not take turns (at 0e18f2d, 2-s turns, only the steps no stop touched:
    −11.9 … +20.1%, no steadier than one run after the other).
    """
    world, warmup = cfg.job.world_size, cfg.job.warmup
    for sub in ("timing", "record", "logs"):
        shutil.rmtree(root / sub, ignore_errors=True)
    (root / "logs").mkdir(parents=True)
    plan, jobs = slice_jobs(cfg, graph.trace, graph.directory, root / "timing")
    # each launch: its command, and the run directories it writes with the ranks each one runs
    runs = [(["record", str(root / "record")], [(root / "record", list(range(world)))])]
    runs += _slice_runs(cfg, graph, jobs, args)
    if i % 2:
        runs = runs[1:] + runs[:1]
    _take_turns(graph, runs, root / "logs", "", args)
    out = {"real": _figure(root / "record", world, warmup), "selfcheck": _selfcheck(cfg, root / "record")}
    out.update(_model(cfg, graph, root, 1))
    out["emul"] = out["emul_real"] = out["pred2"] = out["oracle2"] = float("nan")
    if args.no_emulate and args.passes == 1:
        return out
    timeline = root / "calibrate" / "timeline.npz"
    second = args.passes == 2 and args.emulate_second
    if second:       # the second pass by itself; the emulations replay its timeline
        plan2, jobs2 = _second_pass_jobs(cfg, graph, root)
        runs = _slice_runs(cfg, graph, jobs2, args, _first_timeline(root))
        for _, run_dirs in runs:
            for run_dir, _ in run_dirs:
                shutil.rmtree(run_dir, ignore_errors=True)
        _take_turns(graph, runs, root / "logs", "p", args)
        doc, timeline = calibrate_pass(cfg, graph.trace, plan2, jobs2, root / "calibrate2", 1)
        out["pred2"] = _mean(doc, "iteration_time_s")
    runs = [(["record", str(root / "record_e")], [(root / "record_e", list(range(world)))])]
    if not args.no_emulate:
        for r in range(world):
            runs.append((["emulate", str(root / f"emulate_{r}"), str(graph.directory), str(timeline), str(r)],
                         [(root / f"emulate_{r}", [r])]))
        for v in _variants(args):
            other = _without_issue_cost(timeline) if v.zero_issue_cost else timeline
            for r in range(world):
                runs.append(([v.launch, str(root / f"emulate_{r}_{v.suffix}"), str(graph.directory), str(other),
                              str(r)], [(root / f"emulate_{r}_{v.suffix}", [r])]))
    if args.passes == 2 and not second:
        plan2, jobs2 = _second_pass_jobs(cfg, graph, root)
        runs += _slice_runs(cfg, graph, jobs2, args, _first_timeline(root))
    for _, run_dirs in runs:
        for run_dir, _ in run_dirs:
            shutil.rmtree(run_dir, ignore_errors=True)
    if i % 2:
        runs = runs[1:] + runs[:1]
    _take_turns(graph, runs, root / "logs", "e", args)
    out["emul_real"] = _figure(root / "record_e", world, warmup)
    if not args.no_emulate:
        out["emul"] = statistics.mean(_rank_figure(root / f"emulate_{r}", r, warmup) for r in range(world))
        for v in _variants(args):
            out[f"emul_{v.suffix}"] = statistics.mean(_rank_figure(root / f"emulate_{r}_{v.suffix}", r, warmup)
                                                      for r in range(world))
    if args.passes == 2:
        if not second:
            doc, _ = calibrate_pass(cfg, graph.trace, plan2, jobs2, root / "calibrate2", 1)
            out["pred2"] = _mean(doc, "iteration_time_s")
        out["oracle2"] = _variant(cfg, graph, root, "real", _first_timeline(root), "record_e")
    return out


@dataclass(frozen=True)
class EmulationVariant:
    """A second way each pair's emulations run, in the same turns as the configured one."""
    flag: str                 # the --other-... option that runs it
    suffix: str               # its runs' directories: emulate_<rank>_<suffix>
    launch: str               # the `_launch` kind that runs it
    zero_issue_cost: bool     # it replays a copy of the timeline with the issue costs zeroed
    describe: Callable        # the configured emulation settings -> how it differs, for its line


VARIANTS = (
    EmulationVariant("other_cost", "nocost", "emulate", True,
                     lambda e: "without the virtual ops held for their ranks' issue cost"),
    EmulationVariant("other_spin", "spin", "emulate-awake", False,
                     lambda e: "with the assistant's cores " + ("left to idle" if e.awake_while_computing
                                                                else "kept awake while computing")),
    EmulationVariant("other_pace", "pace", "emulate-pace", False,
                     lambda e: ("without" if e.follow_pace else "with") + " following the sandbox rank's pace"),
    EmulationVariant("other_reference", "ref", "emulate-ref", False,
                     lambda e: "with the pace read against the {} spans over {} step(s)".format(
                         *_other_reference(e))),
    EmulationVariant("other_against", "against", "emulate-against", False,
                     lambda e: f"with the pace read against the {_other_against(e)} spans over {e.pace_steps} "
                               "step(s)"),
    EmulationVariant("other_steps", "steps", "emulate-steps", False,
                     lambda e: f"with the pace read over {_other_steps(e)} step(s)"),
    EmulationVariant("other_ahead", "ahead", "emulate-ahead", False,
                     lambda e: "with what the virtual ranks send built " + ("when the op comes due" if e.build_ahead
                                                                             else "while they compute up to it")),
    EmulationVariant("other_combine", "combine", "emulate-combine", False,
                     lambda e: "with a virtual rank between two sandbox ranks " + (
                         "sending on as soon as it receives" if e.ring_combine
                         else "combining each reduce step's receive first")),
    EmulationVariant("other_spans", "spans", "emulate-spans", False,
                     lambda e: "with the virtual ranks' spans " + ("as timed" if _other_spans(e) == "timed"
                                                                   else "steady beside the sandbox ranks "
                                                                        "(replay/steady.py, paired)")),
)


def _other_steps(emulation) -> int:
    """`--other-steps`: the pace read as configured but over one step, or over ten where configured one."""
    return 1 if emulation.pace_steps > 1 else 10


def _other_reference(emulation) -> tuple[str, int]:
    """`--other-reference`: the pace read the other way: against the loaded runs' spans over one
    step (as before item 36) where it is read against the plain runs' over several, else that."""
    if emulation.pace_reference in ("alone", "timed") or emulation.pace_steps > 1:
        return "loaded", 1
    return "alone", 10


def _other_spans(emulation) -> str:
    """`--other-spans`: the virtual ranks' spans the other way (`emulation.virtual_spans`): paired
    where they are matched (steady beside the sandbox ranks, keeping none of their noise), as timed
    where they are paired or steady, and paired where they are timed."""
    return {"matched": "paired", "timed": "paired"}.get(emulation.virtual_spans, "timed")


def _other_against(emulation) -> str:
    """`--other-against`: the pace read against the other spans (the plain runs' or the loaded
    runs'), over as many steps as configured: the reference alone, apart from the steps."""
    return "loaded" if emulation.pace_reference in ("alone", "timed") else "alone"


def _variants(args) -> list[EmulationVariant]:
    return [v for v in VARIANTS if getattr(args, v.flag)]


# how the emulations ran as configured, in the table's header (bench/pool_fidelity.py reads it)
PACED_HEADER = {True: "emulations as configured following the sandbox rank's pace",
                False: "emulations as configured not following the sandbox rank's pace"}


def _pairs(errors: list[float]) -> str:
    """A pair-wise median and its pairs, as the lines after the table print them."""
    return (f"{100 * statistics.median(errors):+.2f}% (pairs {', '.join(f'{100 * x:+.2f}' for x in errors)})")


def _without_issue_cost(timeline: Path) -> Path:
    """A copy of `timeline` whose virtual ops go on the wire at their calibrated issue time (`--other-cost`)."""
    with np.load(timeline) as data:
        arrays = {k: data[k] for k in data.files}
    arrays["issue_cost"] = np.zeros_like(arrays["transfer"])
    out = timeline.with_name(f"{timeline.stem}_nocost.npz")
    np.savez(out, **arrays)
    return out


def _second_pass_jobs(cfg, graph, root: Path):
    """The second pass's slices, with loaded runs of their own (calibrate/stage.py `slice_jobs`),
    so that the second pass is timed wholly on the machine of its own turns."""
    return slice_jobs(cfg, graph.trace, graph.directory, root / "timing", _first_timeline(root))


def _first_timeline(root: Path) -> Path:
    """The first pass's calibrated timeline (`time_and_calibrate` keeps it beside the last's)."""
    return root / "calibrate" / "timeline_pass1.npz"


def _slice_runs(cfg, graph, jobs, args, timeline: Path | None = None) -> list:
    """The launches of a pass's slices and their loaded runs (co-runs, or each beside the stand-in
    load); with `timeline`, slices whose virtual ranks replay it (a second pass)."""
    runs = []
    for j in jobs:
        if timeline is None:
            runs.append((["slice", str(j.directory), str(graph.directory), _ranks(j.sandbox), "0"],
                         [(j.directory, j.sandbox)]))
        else:
            runs.append((["slice-timed", str(j.directory), str(graph.directory), _ranks(j.sandbox), str(timeline)],
                         [(j.directory, j.sandbox)]))
        if (args.other_join or args.other_awake) and timeline is None:
            runs.append((["slice-other" if args.other_join else "slice-awake", str(_other(j.directory)),
                          str(graph.directory), _ranks(j.sandbox), "0"],
                         [(_other(j.directory), j.sandbox)]))
        if j.loaded is not None and cfg.emulation.neighbours == "stand_in":
            runs.append((["slice", str(j.loaded), str(graph.directory), _ranks(j.sandbox), "1"],
                         [(j.loaded, j.sandbox)]))
    if cfg.emulation.neighbours == "co_run":
        for group in co_runs(jobs, len(machine_cores()), cfg.emulation.sandbox):
            runs.append((["co-run", str(graph.directory), *(x for sb, d in group for x in (str(d), _ranks(sb)))],
                         [(d, sb) for sb, d in group]))
            if args.other_corun and timeline is None:
                group = [(sb, _other(d)) for sb, d in group]
                runs.append((["co-run-other", str(graph.directory),
                              *(x for sb, d in group for x in (str(d), _ranks(sb)))], [(d, sb) for sb, d in group]))
    return runs


def _take_turns(graph, runs: list[tuple[list[str], list[tuple[Path, list[int]]]]], logs: Path, prefix: str,
                args) -> None:
    """The launches of `runs` taking turns (with `--level`, a turn runs on until its launch has
    come as far in the graph as the others; bench/turns.py), their stops noted under `logs` and
    taken out of every run directory."""
    progress = None
    _share_preload([what for what, _ in runs])
    if args.level:
        nodes = {r: len(graph.trace.rank(r)["kind"]) for r in range(graph.trace.world_size)}
        progress = [graph_progress(dirs, nodes) for _, dirs in runs]
    stops = take_turns([launch_cmd(what, args.config_name, args.steps, args.sandbox, args.neighbours, args.join_late,
                                  args.virtual_spans, args.pace_reference)
                        for what, _ in runs],
                       args.turns, 3600, [logs / f"{prefix}{n}.log" for n in range(len(runs))], progress=progress)
    _note_stops(logs / (f"{prefix}_stops.json" if prefix else "stops.json"),
                [[str(d) for d, _ in dirs] for _, dirs in runs], stops)
    for (_, run_dirs), s in zip(runs, stops):
        for run_dir, _ in run_dirs:
            unstop_run(run_dir, s)
    streamed = [d for _, run_dirs in runs for d, _ in run_dirs if _timed_and_streamed(d)]
    if streamed:
        from prism_core.replay.virtual_ops import ENV_PRELOAD

        STREAMED.extend(streamed)
        print(f"warning: {len(streamed)} timed assistant(s) of these turns streamed their cached inputs "
              f"({ENV_PRELOAD}={os.environ.get(ENV_PRELOAD, 'unset')} each): the reads share the "
              "assistant's core and its virtual ranks lag their calibrated time; their figures (emulated, 2nd "
              f"pass) do not hold: {', '.join(d.name for d in streamed)}", flush=True)


STREAMED: list[Path] = []          # timed runs whose assistant streamed its inputs, for the summary


def _timed_and_streamed(run_dir: Path) -> bool:
    stats = Path(run_dir) / "replay" / "stats.json"
    if not stats.is_file():
        return False
    doc = json.loads(stats.read_text())
    return bool(doc.get("timed") and doc.get("inputs_streamed"))


def _share_preload(launches: list[list[str]]) -> None:
    """More assistants at once than cores: each may preload a share of half the memory available
    (replay/virtual_ops.py `PRISM_PRELOAD_BYTES`; past it they stream their inputs), so that the
    turns' launches fit in memory together."""
    from prism_core.replay.virtual_ops import ENV_PRELOAD, memory_available

    assistants = sum((len(w) - 2) // 2 if w[0].startswith("co-run") else 0 if w[0] == "record" else 1
                     for w in launches)
    os.environ.pop(ENV_PRELOAD, None)
    if assistants > (os.cpu_count() or 1):
        os.environ[ENV_PRELOAD] = str(max(memory_available() // (2 * assistants), 1 << 30))


def _note_stops(path: Path, run_dirs: list[list[str]], stops) -> None:
    """Each launch's run directories and stops ([start, end] on the runs' clock), for `--keep`."""
    path.write_text(json.dumps([{"runs": d, "stops": [[float(a), float(b)] for a, b in s]}
                                for d, s in zip(run_dirs, stops)]))


def _other(run_dir: Path) -> Path:
    """Where a plain slice runs again with its virtual members joining the other way (`--other-join`),
    or a co-run member with its assistant in the other scheduling class (`--other-corun`)."""
    return run_dir.with_name(f"{run_dir.name}_other")


def _other_corun(cfg):
    """`cfg` with the co-runs' assistants in the other scheduling class."""
    other = "normal" if cfg.emulation.co_run_assistant == "idle" else "idle"
    return cfg.model_copy(update={"emulation": cfg.emulation.model_copy(update={"co_run_assistant": other})})


def _rank_figure(run_dir: Path, rank: int, warmup: int) -> float:
    return statistics.median(json.loads((run_dir / "results" / f"{rank}.json").read_text())["step_times_s"][warmup:])


def _ranks(sandbox: list[int]) -> str:
    return ",".join(map(str, sandbox))


def launch_cmd(what: list[str], config: str, steps: int, sandbox: int, neighbours: str,
               join_late: bool = False, virtual_spans: str | None = None,
               pace_reference: str | None = None) -> list[str]:
    """The command of one launch (`what`: "record OUT", "slice OUT GRAPH SANDBOX LOADED" (or
    "slice-other ...", its virtual members joining the other way), "emulate OUT GRAPH TIMELINE
    RANK" or "co-run GRAPH OUT SANDBOX [OUT SANDBOX ...]") in a process of its own."""
    return [sys.executable, str(Path(__file__).resolve()), "--launch", *what, "--config", config,
            "--steps", str(steps), "--sandbox", str(sandbox), "--neighbours", neighbours,
            "--join-late" if join_late else "--no-join-late",
            *(["--virtual-spans", virtual_spans] if virtual_spans else []),
            *(["--pace-reference", pace_reference] if pace_reference else [])]


def _load(name: str, steps: int, sandbox: int, neighbours: str = "co_run", virtual_spans: str | None = None,
          pace_reference: str | None = None):
    return load_config(_config_path(name), [f"job.iterations={steps}", "job.warmup=3", f"emulation.sandbox={sandbox}",
                                            f"emulation.neighbours={neighbours}",
                                            *([f"emulation.virtual_spans={virtual_spans}"] if virtual_spans else []),
                                            *([f"emulation.pace_reference={pace_reference}"] if pace_reference
                                              else [])])


def _launch(args) -> None:
    """One launch of a pair that takes turns (run in a process of its own)."""
    cfg = _load(args.config, args.steps, args.sandbox, args.neighbours, args.virtual_spans, args.pace_reference)
    kind, out, *rest = args.launch
    if kind == "record":
        record(cfg, Path(out), options=RecordOptions(echo=False))
    elif kind in ("slice", "slice-other"):
        graph, sandbox, loaded = rest
        late = args.join_late if kind == "slice" else not args.join_late
        run_slice(cfg, Path(graph), [int(r) for r in sandbox.split(",")], Path(out), neighbour_load=loaded == "1",
                  join_late=late and loaded != "1")
    elif kind == "slice-awake":  # "slice-awake OUT GRAPH SANDBOX 0": a plain slice, its assistant's cores the other way
        graph, sandbox, _ = rest
        cfg = cfg.model_copy(update={"emulation": cfg.emulation.model_copy(
            update={"keep_awake": not cfg.emulation.keep_awake})})
        run_slice(cfg, Path(graph), [int(r) for r in sandbox.split(",")], Path(out), join_late=args.join_late)
    elif kind == "slice-timed":  # "slice-timed OUT GRAPH SANDBOX TIMELINE": a second pass's slice
        graph, sandbox, timeline = rest
        run_slice(cfg, Path(graph), [int(r) for r in sandbox.split(",")], Path(out), Path(timeline))
    elif kind in ("emulate", "emulate-awake", "emulate-pace", "emulate-ref", "emulate-steps", "emulate-ahead", "emulate-spans",
                  "emulate-against", "emulate-combine"):
        # "emulate OUT GRAPH TIMELINE RANK"; -awake: cores the other way; -pace: following the pace the other way
        graph, timeline, rank = rest
        if kind == "emulate-awake":
            cfg = cfg.model_copy(update={"emulation": cfg.emulation.model_copy(
                update={"awake_while_computing": not cfg.emulation.awake_while_computing})})
        if kind == "emulate-pace":
            cfg = cfg.model_copy(update={"emulation": cfg.emulation.model_copy(
                update={"follow_pace": not cfg.emulation.follow_pace})})
        if kind == "emulate-spans":
            cfg = cfg.model_copy(update={"emulation": cfg.emulation.model_copy(
                update={"virtual_spans": _other_spans(cfg.emulation)})})
        if kind == "emulate-combine":
            cfg = cfg.model_copy(update={"emulation": cfg.emulation.model_copy(
                update={"ring_combine": not cfg.emulation.ring_combine})})
        if kind == "emulate-ahead":
            cfg = cfg.model_copy(update={"emulation": cfg.emulation.model_copy(
                update={"build_ahead": not cfg.emulation.build_ahead})})
        if kind == "emulate-steps":
            cfg = cfg.model_copy(update={"emulation": cfg.emulation.model_copy(
                update={"pace_steps": _other_steps(cfg.emulation)})})
        if kind == "emulate-ref":
            against, steps = _other_reference(cfg.emulation)
            cfg = cfg.model_copy(update={"emulation": cfg.emulation.model_copy(
                update={"pace_reference": against, "pace_steps": steps})})
        if kind == "emulate-against":
            cfg = cfg.model_copy(update={"emulation": cfg.emulation.model_copy(
                update={"pace_reference": _other_against(cfg.emulation)})})
        emulate(_of_interest(cfg, int(rank)), Path(graph), Path(timeline), Path(out))
    elif kind in ("co-run", "co-run-other"):      # "co-run GRAPH OUT SANDBOX ...": the second word is the graph here
        if kind == "co-run-other":
            cfg = _other_corun(cfg)
        members = [([int(r) for r in sb.split(",")], Path(d)) for d, sb in zip(rest[0::2], rest[1::2])]
        run_together(cfg, Path(out), members, machine_cores())
    else:
        raise SystemExit(f"unknown launch {kind!r}")


def _on_sigterm(signum, frame) -> None:
    # the first SIGTERM unwinds; a second (`timeout` passes its own on, a process manager often
    # sends two) must not cut short the cleanups it started, which left stopped launches behind
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.exit(143)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="pp2,dp2,tp2,ep2")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--passes", type=int, default=1, help="timing passes (2: refined with a timed replay)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--sandbox", type=int, default=1, help="S, sandbox ranks per slice")
    parser.add_argument("--turns", type=float, default=0.0,
                        help="> 0: the runs of a pair take turns of this many seconds (bench/turns.py); "
                             "0: one after the other")
    parser.add_argument("--level", action=argparse.BooleanOptionalAction, default=True,
                        help="with --turns: a turn runs on until its launch has come as far in the graph as the "
                             "others, so that the launches keep level (--no-level: turns of equal length)")
    parser.add_argument("--neighbours", choices=("co_run", "stand_in"), default="co_run",
                        help="what computes beside the slices' loaded runs (emulation.neighbours)")
    parser.add_argument("--virtual-spans", choices=("matched", "paired", "steady", "timed"),
                        help="the emulations' emulation.virtual_spans (default: the config's); --other-spans runs "
                             "them the other way beside")
    parser.add_argument("--pace-reference", choices=("alone", "loaded", "timed"),
                        help="the emulations' emulation.pace_reference (default: the config's); --other-against runs "
                             "them the other way beside")
    parser.add_argument("--emulate-second", action="store_true",
                        help="with --turns and --passes 2: the second pass's slices take turns by themselves, and "
                             "then the second record and the emulations, which replay the second pass's timeline "
                             "(whose alone spans are the timed slices' compute: the pace read against a rank "
                             "computing as it does in an emulation)")
    parser.add_argument("--join-late", action=argparse.BooleanOptionalAction, default=False,
                        help="plain slices: virtual members of collectives join once a sandbox member has issued "
                             "the op (replay/slices.py run_with_assistant)")
    parser.add_argument("--other-join", action="store_true",
                        help="with --turns: each plain slice runs again, taking turns too, with its virtual members "
                             "joining the other way; printed as the column 'other'")
    parser.add_argument("--other-corun", action="store_true",
                        help="with --turns: each co-run runs again, taking turns too, with its assistants in the other "
                             "scheduling class (emulation.co_run_assistant); printed in the column 'other'")
    parser.add_argument("--other-awake", action="store_true",
                        help="with --turns: each plain slice runs again, taking turns too, with its assistant's cores "
                             "kept awake the other way (emulation.keep_awake); printed as the column 'other'")
    parser.add_argument("--other-cost", action="store_true",
                        help="with --turns and the emulations: each emulation also runs, taking turns too, on the "
                             "timeline with its issue costs zeroed (virtual ops on the wire at their calibrated issue "
                             "time); printed after the table")
    parser.add_argument("--other-spin", action="store_true",
                        help="with --turns and the emulations: each emulation also runs, taking turns too, with its "
                             "assistant's cores kept awake while computing the other way "
                             "(emulation.awake_while_computing); printed after the table")
    parser.add_argument("--other-pace", action="store_true",
                        help="with --turns and the emulations: each emulation also runs, taking turns too, with its "
                             "virtual ranks following the sandbox rank's pace the other way (emulation.follow_pace, "
                             "replay/follow.py); printed after the table")
    parser.add_argument("--other-reference", action="store_true",
                        help="with --turns and the emulations: each emulation also runs, taking turns too, with the "
                             "pace read the other way (emulation.pace_reference and pace_steps: against the loaded "
                             "runs' spans over one step, or against the plain runs' over ten); printed after the table")
    parser.add_argument("--other-against", action="store_true",
                        help="with --turns and the emulations: each emulation also runs, taking turns too, with the "
                             "pace read against the other spans (emulation.pace_reference: the loaded runs' where "
                             "the plain runs' are configured, or the other way) over the configured steps; printed "
                             "after the table")
    parser.add_argument("--other-steps", action="store_true",
                        help="with --turns and the emulations: each emulation also runs, taking turns too, with the "
                             "pace read as configured but over one step (or ten where configured one: "
                             "emulation.pace_steps); printed after the table")
    parser.add_argument("--other-ahead", action="store_true",
                        help="with --turns and the emulations: each emulation also runs, taking turns too, with what "
                             "its virtual ranks send built the other way (emulation.build_ahead); printed after the "
                             "table")
    parser.add_argument("--other-combine", action="store_true",
                        help="with --turns and the emulations: each emulation also runs, taking turns too, with a "
                             "virtual rank between two sandbox ranks on a ring combining each reduce step's receive "
                             "the other way (emulation.ring_combine); printed after the table")
    parser.add_argument("--other-spans", action="store_true",
                        help="with --turns and the emulations: each emulation also runs, taking turns too, with its "
                             "virtual ranks' spans the other way (emulation.virtual_spans: paired where matched, as "
                             "timed where paired or steady, paired where timed); "
                             "printed after the table")
    parser.add_argument("--no-emulate", action="store_true",
                        help="with --turns: leave out the second record and the emulations")
    parser.add_argument("--keep", type=Path, help="copy the graph and each pair's runs (and with --turns their "
                        "stops) under KEEP/<config>/ to read afterwards")
    parser.add_argument("--launch", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    args = parser.parse_args()
    # a SIGTERM unwinds like Ctrl-C: the launches' cleanups (take_turns, the launcher) stop their ranks
    signal.signal(signal.SIGTERM, _on_sigterm)
    if args.launch:
        _launch(args)
        return
    if args.emulate_second and (args.passes != 2 or args.turns <= 0 or args.no_emulate):
        parser.error("--emulate-second goes with --turns and --passes 2, and the emulations")
    if args.passes not in (1, 2) or (args.turns > 0 and args.passes == 2 and (args.other_join or args.other_awake)):
        parser.error("--passes takes 1 or 2 (with --turns, 2 not with --other-join or --other-awake)")
    second_ways = ", ".join("--" + v.flag.replace("_", "-") for v in VARIANTS)
    if (args.join_late or args.other_join or args.other_corun or args.other_awake or _variants(args)) \
            and args.turns <= 0:
        parser.error(f"--join-late, --other-join, --other-corun, --other-awake, {second_ways} run with --turns")
    if _variants(args) and args.no_emulate:
        parser.error(f"{second_ways} run the emulations a second way: not with --no-emulate")
    if args.other_join + args.other_corun + args.other_awake > 1:
        parser.error("--other-join, --other-corun and --other-awake fill the same column: one at a time")
    rows, replicas = [], []
    others: dict[str, list] = {v.suffix: [] for v in _variants(args)}
    with tempfile.TemporaryDirectory(prefix="prism-fidelity-") as tmp:
        for name in args.configs.split(","):
            cfg = _load(name, args.steps, args.sandbox, args.neighbours, args.virtual_spans, args.pace_reference)
            args.config_name = name
            if cfg.job.world_size > (os.cpu_count() or 1):
                print(f"note: {cfg.name} has {cfg.job.world_size} ranks on {os.cpu_count()} cores: its real run is "
                      "oversubscribed, so the comparison says little")
            root = Path(tmp) / cfg.name
            graph = collect(cfg, root / "collect")
            if args.keep:
                shutil.copytree(root / "collect", args.keep / cfg.name / "collect", dirs_exist_ok=True)
            pairs = []
            for i in range(args.pairs):
                pair = (_turns_pair(cfg, graph, root, i, args) if args.turns > 0
                        else _classic_pair(cfg, graph, root, i, args.passes))
                first_pass = args.passes == 1 or args.turns > 0    # the first pass's slices are there
                pair["oracle"] = _variant(cfg, graph, root, "real") if first_pass else float("nan")
                pair["noresume"] = _variant(cfg, graph, root, "no-resume") if first_pass else float("nan")
                unloaded = _variant(cfg, graph, root, "plain") if first_pass else None
                pair["plain"] = float("nan") if unloaded is None else unloaded
                pair["queued"] = _variant(cfg, graph, root, "queued") if first_pass else float("nan")
                pair["allwaits"] = _variant(cfg, graph, root, "all-waits") if first_pass else float("nan")
                waits = _waits_of(cfg, graph, root) if first_pass else ""
                reordered = _variant(cfg, graph, root, "reordered") if first_pass else None
                pair["reordered"] = float("nan") if reordered is None else reordered
                pair["plain_c"], pair["loaded_c"] = (_compute_against_real(cfg, graph, root) if first_pass
                                                     else (float("nan"), float("nan")))
                pair.setdefault("pred2", float("nan"))
                for v in VARIANTS:
                    pair.setdefault(f"emul_{v.suffix}", float("nan"))
                pair.setdefault("oracle2", float("nan"))
                other = (_variant(cfg, graph, root, "other") if args.other_join or args.other_awake else
                         _variant(cfg, graph, root, "other-corun") if args.other_corun else None)
                pair["other"] = float("nan") if other is None else other
                pair["noise"] = _step_noise(root / "record", cfg.job.world_size, cfg.job.warmup)
                pairs.append(pair)
                if args.keep:
                    shutil.copytree(root, args.keep / cfg.name / f"pair{i}", ignore=shutil.ignore_patterns("collect"),
                                    dirs_exist_ok=True)
                real = pair["real"]
                print(f"{cfg.name} pair {i + 1}/{args.pairs}: real {real:.4f} s  predicted {pair['pred']:.4f} s "
                      f"({_pct(pair['pred'], real)})  emulated {pair['emul']:.4f} s "
                      f"({_pct(pair['emul'], pair['emul_real'])} against its own record {pair['emul_real']:.4f} s, "
                      f"{_pct(pair['emul_real'], real)} from the first)  "
                      f"with the real compute {pair['oracle']:.4f} s ({_pct(pair['oracle'], real)})  "
                      f"without the resume cost {pair['noresume']:.4f} s ({_pct(pair['noresume'], real)})  "
                      f"without the loaded runs {pair['plain']:.4f} s ({_pct(pair['plain'], real)})  "
                      f"waits for a core kept {pair['queued']:.4f} s ({_pct(pair['queued'], real)})  "
                      f"all waits out {pair['allwaits']:.4f} s ({_pct(pair['allwaits'], real)})  "
                      f"DP replicas reordered {pair['reordered']:.4f} s ({_pct(pair['reordered'], real)})  "
                      f"the other way ({'co-run assistants' if args.other_corun else 'cores awake' if args.other_awake else 'joining'}) {pair['other']:.4f} s "
                      f"({_pct(pair['other'], real)})  "
                      f"emulated without the issue cost {pair['emul_nocost']:.4f} s "
                      f"({_pct(pair['emul_nocost'], pair['emul_real'])})  "
                      f"2nd pass {pair['pred2']:.4f} s ({_pct(pair['pred2'], pair['emul_real'])} against the second "
                      f"record), with its "
                      f"compute {pair['oracle2']:.4f} s ({_pct(pair['oracle2'], pair['emul_real'])})  "
                      f"one pass {pair['first']:.4f} s  uncalibrated {pair['uncal']:.4f} s  compute against the "
                      f"record's: plain slices {_pct(pair['plain_c'], 1)}, loaded runs {_pct(pair['loaded_c'], 1)}",
                      flush=True)
                if waits:
                    print(f"{cfg.name} pair {i + 1}/{args.pairs}: {waits}", flush=True)
            col = {k: [p[k] for p in pairs] for k in pairs[0]}
            real = col["real"]
            r, p, u, f, e, er = (statistics.median(col[k]) for k in ("real", "pred", "uncal", "first", "emul",
                                                                      "emul_real"))
            if not any(np.isnan(col["reordered"])):
                replicas.append((cfg.name, statistics.median([b / a - 1 for a, b in zip(real, col["pred"])]),
                                 statistics.median([b / a - 1 for a, b in zip(real, col["reordered"])]),
                                 [b / a - 1 for a, b in zip(real, col["reordered"])]))
            for v in _variants(args):    # each pair's emulation both ways against its second record
                others[v.suffix].append((cfg.name, [b / a - 1 for a, b in zip(col["emul_real"], col["emul"])],
                                         [b / a - 1 for a, b in zip(col["emul_real"], col[f"emul_{v.suffix}"])]))
            rows.append((cfg.name, r, p, e, er, f, u, statistics.median([b / a - 1 for a, b in zip(real, col["pred"])]),
                         statistics.median([b / a - 1 for a, b in zip(real, col["selfcheck"])]), (max(real) - min(real)) / r,
                         _interval(real, col["pred"]), _interval(col["emul_real"], col["emul"]),
                         statistics.median([b / a - 1 for a, b in zip(col["emul_real"], col["emul"])]),
                         statistics.median([b / a - 1 for a, b in zip(real, col["oracle"])]),
                         statistics.median([b / a - 1 for a, b in zip(real, col["noresume"])]),
                         statistics.median([b / a - 1 for a, b in zip(real, col["plain"])]),
                         statistics.median([b / a - 1 for a, b in zip(real, col["queued"])]),
                         statistics.median([b / a - 1 for a, b in zip(real, col["allwaits"])]),
                         statistics.median([abs(b / a - 1) for a, b in zip(real, col["emul_real"])]),
                         statistics.median([b / a - 1 for a, b in zip(real, col["other"])]),
                         statistics.median([b / a - 1 for a, b in zip(col["emul_real"], col["pred2"])]),
                         statistics.median([b / a - 1 for a, b in zip(col["emul_real"], col["oracle2"])]),
                         statistics.median(col["plain_c"]) - 1, statistics.median(col["loaded_c"]) - 1,
                         statistics.median(col["noise"])))
    how = ((f"record and slices taking turns of {args.turns:g} s" +
            (" (no emulation)" if args.no_emulate else "; then a second record and the emulations, taking turns"))
           if args.turns > 0 else "runs one after the other")
    emulation = _load(args.config_name, args.steps, args.sandbox, virtual_spans=args.virtual_spans,
                      pace_reference=args.pace_reference).emulation
    if not (args.turns > 0 and args.no_emulate):     # pool_fidelity.py reads how the emulations ran
        how += f"; {PACED_HEADER[emulation.follow_pace]}"
    print(f"\n{args.steps} steps per run ({args.steps - 3} measured), S={args.sandbox}, {args.passes} timing "
          f"pass(es), medians over {args.pairs} pairs, {how}; error = predicted (or emulated) vs real")
    print(f"{'config':<18} {'real (s)':>9} {'predicted (s)':>13} {'error':>8} {'pair-wise':>9} "
          f"{'90% interval':>15} {'real (s)':>9} {'emulated (s)':>12} {'error':>8} {'pair-wise':>9} {'90% interval':>15} "
          f"{'one pass':>9} {'error':>8} {'uncalibrated':>12} {'error':>8} {'self-check':>10} {'real compute':>12} {'no resume':>9} {'no load':>8} "
          f"{'queue kept':>10} {'all waits out':>13} {'real spread':>11} {'halves':>7} {'other':>10} {'2nd pass':>9} {'2nd real compute':>16} "
          f"{'plain compute':>13} {'loaded compute':>14} {'step noise':>10}")
    for name, r, p, e, er, f, u, pw, sc, spread, ci_p, ci_e, epw, oc, nr, nl, qk, aw, hv, oj, p2, oc2, pc, lc, sn in rows:
        print(f"{name:<18} {r:9.4f} {p:13.4f} {_pct(p, r):>8} {100 * pw:+8.2f}% {_span(ci_p):>15} {er:9.4f} {e:12.4f} "
              f"{_pct(e, er):>8} {100 * epw:+8.2f}% {_span(ci_e):>15} {f:9.4f} {_pct(f, r):>8} "
              f"{u:12.4f} {_pct(u, r):>8} {100 * sc:+9.2f}% {100 * oc:+11.2f}% {100 * nr:+8.2f}% {100 * nl:+7.2f}% {100 * qk:+9.2f}% {100 * aw:+12.2f}% "
              f"{100 * spread:10.2f}% {100 * hv:6.2f}% {100 * oj:+9.2f}% {100 * p2:+8.2f}% {100 * oc2:+15.2f}% "
              f"{100 * pc:+12.2f}% {100 * lc:+13.2f}% {100 * sn:9.2f}%")
    if STREAMED:
        print(f"warning: {len(STREAMED)} timed run(s) streamed their inputs (see the warnings above): the emulated "
              "and 2nd-pass figures of their pairs do not hold")
    print("emulated: against the real run of its own (with --turns a second record, taking turns with the emulations)")
    print("self-check: the calibration fed the real run's own node times (every rank real in one slice)")
    print("real compute: each pair's prediction with the real run's compute spans in place of the slices' and of the "
          "DP replicas measured in co-runs (pair-wise median): the error of the slices' communication and of the "
          "calibration alone")
    print("no resume: each pair's prediction with the compute spans as measured, not moved to the waits the "
          "timeline puts before them (calibrate/resume.py; pair-wise median): what the resume cost moved")
    print("no load: each pair's prediction from its plain slices alone, their loaded runs left out (pair-wise median; "
          "nan where no slice had one): what the loaded runs' neighbours (co-runs or the stand-in load) moved")
    print("queue kept: each pair's prediction with the slices' compute spans holding the ranks' waits for their "
          "core (pair-wise median): what taking out the part the assistant ran (sharing a rank's core) moved; "
          "all waits out: with every wait taken out, the ranks' own threads' and the rest of the machine's too "
          "(as the calibration did before)")
    if args.other_join:
        print(f"other: each pair's prediction with communication from plain slices whose virtual members joined "
              f"{'early' if args.join_late else 'late'} (pair-wise median), taking turns with the rest")
    if args.other_awake:
        print(f"other: each pair's prediction with communication from plain slices whose assistant's cores were "
              f"{'left to idle' if _load(args.config_name, args.steps, args.sandbox, virtual_spans=args.virtual_spans).emulation.keep_awake else 'kept awake'}"
              " (pair-wise median), taking turns with the rest")
    if args.other_corun:
        other = "normal" if _load(args.config_name, args.steps, args.sandbox, virtual_spans=args.virtual_spans).emulation.co_run_assistant == "idle" else "idle"
        print(f"other: each pair's prediction with compute from co-runs whose assistants ran in the {other} scheduling "
              "class (pair-wise median), taking turns with the rest")
    for name, measured, reordered, pairs in replicas:
        print(f"{name}: predicted with its DP replica's compute measured in the co-run {100 * measured:+.2f}%, with "
              f"the timed rank's steps reordered instead {100 * reordered:+.2f}% pair-wise (its pairs: "
              f"{', '.join(f'{100 * x:+.2f}' for x in pairs)}), from the same runs")
    for v in _variants(args):
        for name, default, other in others[v.suffix]:
            print(f"{name}: emulated as configured {_pairs(default)}, {v.describe(emulation)} {_pairs(other)} "
                  "pair-wise against the second record, in the same turns")
    if args.passes == 2 and args.turns > 0:
        print("2nd pass: each pair's prediction from slices replaying the first pass's timeline and loaded runs of "
              "their own, taking turns with the second record, against that record (pair-wise median); 2nd real "
              "compute: their communication with that record's compute spans")
    print("plain / loaded compute: the timed ranks' compute per step (their compute spans, the part of their waits for a "
          "core the assistant ran taken out) in the plain slices and in the loaded runs against the same ranks' in the record (median of the pairs)")
    print("90% interval: of the error, bootstrapped over the pairs (each resample draws whole pairs with "
          "replacement); an interval that holds 0 cannot tell the error apart from none")
    print("real spread: (slowest - fastest) / median of the real runs' figures: this machine's noise between runs; "
          "an error smaller than it cannot be told apart from none")
    print("step noise: the real run's figure's own standard error from its steps (bootstrap over its measured "
          "steps, median of the pairs): a pair's two figures differ by about 1.4 times it from their steps alone, "
          "so a pair's error well inside that cannot be told apart from none; more --steps shrink it")
    print("halves: how far a pair's second record ran from its first (median of the pairs' |second / first - 1|): the "
          "emulations replay a timeline timed in the first half of the pair, so the machine's move between the "
          "halves lands in the emulated error")


if __name__ == "__main__":
    main()
