"""Gloo's device loop in the idle scheduling class vs gloo's default, under `prism record`.

For each config it records the job alternately with `PRISM_GLOO_LOOP_IDLE=0` (gloo's default
policy) and `=1` (the default of every prism run; `prism_core/backend/transport_threads.py`),
which one goes first alternating too, and prints each run's step time (median over measured
steps, mean over ranks) and the ratio idle / default, then the median ratio and each variant's
spread over its runs.

    .venv/bin/python bench/transport.py [--configs pp2,dp2,tp2,ep2] [--pairs 3] [--steps 12]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from prism_core.config import load_config
from prism_core.record import RecordOptions, record

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _step_time(cfg, out: Path, idle: bool) -> float:
    os.environ["PRISM_GLOO_LOOP_IDLE"] = "1" if idle else "0"     # the ranks inherit the launcher's environment
    try:
        doc = record(cfg, out, options=RecordOptions(echo=False))
    finally:
        os.environ.pop("PRISM_GLOO_LOOP_IDLE", None)
    return statistics.mean(r["iteration_time_s"] for r in doc["ranks"].values())


def _spread(xs: list[float]) -> float:
    return (max(xs) - min(xs)) / statistics.median(xs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="pp2,dp2,tp2,ep2")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="prism-transport-") as tmp:
        for name in args.configs.split(","):
            path = Path(name) if name.endswith((".yaml", ".yml")) else CONFIGS / f"tiny_moe_w2_{name}.yaml"
            cfg = load_config(path, [f"job.iterations={args.steps}", "job.warmup=3"])
            runs = {False: [], True: []}
            for i in range(args.pairs):
                for idle in ((False, True) if i % 2 == 0 else (True, False)):
                    runs[idle].append(_step_time(cfg, Path(tmp) / f"{cfg.name}-{i}-{idle}", idle))
                print(f"{cfg.name} pair {i + 1}/{args.pairs}: default {runs[False][-1]:.4f} s  idle {runs[True][-1]:.4f} s  "
                      f"ratio {runs[True][-1] / runs[False][-1]:.3f}", flush=True)
            ratios = [b / a for a, b in zip(runs[False], runs[True])]
            rows.append((cfg.name, statistics.median(runs[False]), statistics.median(runs[True]),
                         statistics.median(ratios), _spread(runs[False]), _spread(runs[True])))
    print(f"\n{args.steps} steps per run ({args.steps - 3} measured), medians over {args.pairs} alternating pairs")
    print(f"{'config':<18} {'default (s)':>11} {'idle (s)':>9} {'ratio':>6} {'spread default':>14} {'spread idle':>11}")
    for name, d, i, r, sd, si in rows:
        print(f"{name:<18} {d:11.4f} {i:9.4f} {r:6.3f} {100 * sd:13.1f}% {100 * si:10.1f}%")
    print("ratio: idle / default step time, pair by pair; spread: (slowest - fastest) / median of a variant's runs")


if __name__ == "__main__":
    main()
