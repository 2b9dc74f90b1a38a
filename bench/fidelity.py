"""Fidelity of Stages 2 and 3: predicted and emulated iteration time of each rank vs the real run.

For each config it collects the bare graph once, then alternates, pair by pair (the order
alternating too): `prism record` (the job run for real, every rank) and the model (every slice
run afresh, S sandbox ranks real and the rest replayed, then calibration; then one emulation per
rank, that rank real and the others replayed in calibrated time). A rank's iteration time is
the median of its measured steps; a run's figure is the mean over ranks. Printed per config:
the real, predicted and emulated medians over pairs with their errors, a 90% interval of each
error bootstrapped over the pairs (how far this machine's noise between runs moves it), and
beside them the ablation without inter-slice calibration (each rank as timed in its own slice),
the prediction with the real run's compute spans in place of the slices' (what of the error
is communication and calibration, and what is compute measured in another run), and the
prediction from the plain slices alone, their loaded runs left out (what the neighbour load moved).

    .venv/bin/python bench/fidelity.py [--configs pp2,dp2,tp2,ep2] [--pairs 3] [--passes 1] [--steps 12]

Names resolve to configs/tiny_moe_w2_<name>.yaml; a path takes any config (larger W on a
machine with more cores: the real run must fit, W <= cores, for the comparison to mean much).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
from pathlib import Path

import numpy as np

from prism_core.calibrate import predict
from prism_core.calibrate.durations import load_ran, slice_timings, with_loaded_compute
from prism_core.calibrate.predict import predict_from, timed_ranks
from prism_core.calibrate.stage import plan_orders, slice_jobs, time_and_calibrate
from prism_core.collect.stage import collect
from prism_core.config import load_config
from prism_core.emulate.stage import emulate
from prism_core.record import RecordOptions, record
from prism_core.trace import load_trace
from prism_core.trace.matching import match_ops

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


def _variant(cfg, graph, root: Path, compute: str) -> float | None:
    """The pair's prediction rebuilt from its own runs with the compute spans changed.

    "real": every timed rank's compute spans from the pair's real run instead of its slice (ranks
    renamed from a timed rank take them, in other orders, as in the calibration): what is left of
    the error is the model of communication and synchronisation (the slices' transfer times and
    the calibration); the rest was compute measured in another run.
    "plain": the plain slices alone, their loaded runs left out: what the stand-in neighbour load
    moved (None where no slice's load ran).
    """
    plan, jobs = slice_jobs(cfg, graph.trace, graph.directory, root / "timing")
    match = match_ops(graph.trace)
    if compute == "plain":
        if not any(j.loaded is not None and load_ran(j.loaded) for j in jobs):
            return None
        timings, _ = timed_ranks(graph.trace, match, [(j.directory, j.sandbox) for j in jobs])
    else:
        timings, _ = timed_ranks(graph.trace, match, [(j.directory, j.sandbox) for j in jobs],
                                 [j.loaded for j in jobs])
        real = slice_timings(graph.trace, match, root / "record", list(range(cfg.job.world_size)))
        timings = with_loaded_compute(graph.trace, timings, real)     # swaps in the real run's compute spans
    prediction = predict_from(graph.trace, match, timings, plan.source, cfg.job.warmup, plan_orders(cfg, plan))
    return statistics.mean(statistics.median(t[cfg.job.warmup:]) for t in prediction.step_times.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="pp2,dp2,tp2,ep2")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--passes", type=int, default=1, help="timing passes (2: refined with a timed replay)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--sandbox", type=int, default=1, help="S, sandbox ranks per slice")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="prism-fidelity-") as tmp:
        for name in args.configs.split(","):
            cfg = load_config(_config_path(name), [f"job.iterations={args.steps}", "job.warmup=3",
                                                   f"emulation.sandbox={args.sandbox}"])
            if cfg.job.world_size > (os.cpu_count() or 1):
                print(f"note: {cfg.name} has {cfg.job.world_size} ranks on {os.cpu_count()} cores: its real run is "
                      "oversubscribed, so the comparison says little")
            root = Path(tmp) / cfg.name
            graph = collect(cfg, root / "collect")
            real, pred, uncal, first, selfcheck, emul, oracle, plain = [], [], [], [], [], [], [], []
            for i in range(args.pairs):
                for what in (("real", "pred") if i % 2 == 0 else ("pred", "real")):
                    if what == "real":
                        real.append(_mean(record(cfg, root / "record", options=RecordOptions(echo=False)),
                                          "iteration_time_s"))
                        # the calibration fed the real run's own node times must give back its figure
                        own = predict(load_trace(root / "record" / "trace.zarr"),
                                      [(root / "record", list(range(cfg.job.world_size)))],
                                      np.arange(cfg.job.world_size))
                        selfcheck.append(statistics.mean(statistics.median(t[cfg.job.warmup:])
                                                         for t in own.step_times.values()))
                        continue
                    shutil.rmtree(root / "timing", ignore_errors=True)
                    doc = time_and_calibrate(cfg, graph.trace, graph.directory, root / "timing", root / "calibrate",
                                             passes=args.passes)
                    pred.append(_mean(doc, "iteration_time_s"))
                    uncal.append(_mean(doc, "uncalibrated_iteration_time_s"))
                    first.append(_mean(doc, "first_pass_iteration_time_s") if args.passes > 1 else pred[-1])
                    emul.append(statistics.mean(
                        emulate(cfg.model_copy(update={"emulation": cfg.emulation.model_copy(
                            update={"ranks_of_interest": [r]})}), graph.directory, root / "calibrate" / "timeline.npz",
                            root / "emulate")["ranks"][str(r)]["iteration_time_s"]
                        for r in range(cfg.job.world_size)))
                oracle.append(_variant(cfg, graph, root, "real") if args.passes == 1 else float("nan"))
                unloaded = _variant(cfg, graph, root, "plain") if args.passes == 1 else None
                plain.append(float("nan") if unloaded is None else unloaded)
                print(f"{cfg.name} pair {i + 1}/{args.pairs}: real {real[-1]:.4f} s  predicted {pred[-1]:.4f} s "
                      f"({_pct(pred[-1], real[-1])})  emulated {emul[-1]:.4f} s ({_pct(emul[-1], real[-1])})  "
                      f"with the real compute {oracle[-1]:.4f} s ({_pct(oracle[-1], real[-1])})  "
                      f"without the load {plain[-1]:.4f} s ({_pct(plain[-1], real[-1])})  one pass {first[-1]:.4f} s  "
                      f"uncalibrated {uncal[-1]:.4f} s", flush=True)
            r, p, u, f, e = (statistics.median(x) for x in (real, pred, uncal, first, emul))
            rows.append((cfg.name, r, p, e, f, u, statistics.median([b / a - 1 for a, b in zip(real, pred)]),
                         statistics.median([b / a - 1 for a, b in zip(real, selfcheck)]), (max(real) - min(real)) / r,
                         _interval(real, pred), _interval(real, emul),
                         statistics.median([b / a - 1 for a, b in zip(real, oracle)]),
                         statistics.median([b / a - 1 for a, b in zip(real, plain)])))
    print(f"\n{args.steps} steps per run ({args.steps - 3} measured), S={args.sandbox}, {args.passes} timing "
          f"pass(es), medians over {args.pairs} pairs; error = predicted (or emulated) vs real")
    print(f"{'config':<18} {'real (s)':>9} {'predicted (s)':>13} {'error':>8} {'pair-wise':>9} "
          f"{'90% interval':>15} {'emulated (s)':>12} {'error':>8} {'90% interval':>15} "
          f"{'one pass':>9} {'error':>8} {'uncalibrated':>12} {'error':>8} {'self-check':>10} {'real compute':>12} {'no load':>8} {'real spread':>11}")
    for name, r, p, e, f, u, pw, sc, spread, ci_p, ci_e, oc, nl in rows:
        print(f"{name:<18} {r:9.4f} {p:13.4f} {_pct(p, r):>8} {100 * pw:+8.2f}% {_span(ci_p):>15} {e:12.4f} "
              f"{_pct(e, r):>8} {_span(ci_e):>15} {f:9.4f} {_pct(f, r):>8} "
              f"{u:12.4f} {_pct(u, r):>8} {100 * sc:+9.2f}% {100 * oc:+11.2f}% {100 * nl:+7.2f}% {100 * spread:10.2f}%")
    print("self-check: the calibration fed the real run's own node times (every rank real in one slice)")
    print("real compute: each pair's prediction with the real run's compute spans in place of the slices' (pair-wise "
          "median): the error of the slices' communication and of the calibration alone")
    print("no load: each pair's prediction from its plain slices alone, their loaded runs left out (pair-wise median; "
          "nan where no slice had one): what the stand-in neighbour load moved")
    print("90% interval: of the error, bootstrapped over the pairs (each resample draws whole pairs with "
          "replacement); an interval that holds 0 cannot tell the error apart from none")
    print("real spread: (slowest - fastest) / median of the real runs' figures: this machine's noise between runs; "
          "an error smaller than it cannot be told apart from none")


if __name__ == "__main__":
    main()
