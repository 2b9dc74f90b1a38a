"""`prism record` under the placements and transport settings the backend has had: what each one buys.

Variants (every other setting as shipped):
  gloo      ranks where the scheduler puts them, gloo's device loop in its default class
  idle      ranks where the scheduler puts them, the loop in the idle class
            (`PRISM_GLOO_LOOP_IDLE`, `prism_core/backend/transport_threads.py`)
  bound     each rank on a core of its own and the loop idle: the default
            (`job.cpu_binding: core`, `prism_core/launch/cores.py`)

For each config it records the job once per variant per round, the order rotating between
rounds, and prints per round each variant's step time (median over measured steps, mean over
ranks), then per variant the median over rounds, its ratio to `gloo`, and its spread.

    .venv/bin/python bench/transport.py [--configs pp2,dp2,tp2,ep2] [--rounds 3] [--steps 12]
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
VARIANTS = {"gloo": ("0", "none"), "idle": ("1", "none"), "bound": ("1", "core")}


def _step_time(path: Path, steps: int, variant: str, out: Path) -> float:
    idle, binding = VARIANTS[variant]
    cfg = load_config(path, [f"job.iterations={steps}", "job.warmup=3", f"job.cpu_binding={binding}"])
    before = os.environ.get("PRISM_GLOO_LOOP_IDLE")
    os.environ["PRISM_GLOO_LOOP_IDLE"] = idle        # the ranks inherit the launcher's environment
    try:
        doc = record(cfg, out, options=RecordOptions(echo=False))
    finally:
        if before is None:
            os.environ.pop("PRISM_GLOO_LOOP_IDLE", None)
        else:
            os.environ["PRISM_GLOO_LOOP_IDLE"] = before
    return statistics.mean(r["iteration_time_s"] for r in doc["ranks"].values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="pp2,dp2,tp2,ep2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    names = list(VARIANTS)
    rows = []
    with tempfile.TemporaryDirectory(prefix="prism-transport-") as tmp:
        for name in args.configs.split(","):
            path = Path(name) if name.endswith((".yaml", ".yml")) else CONFIGS / f"tiny_moe_w2_{name}.yaml"
            times: dict[str, list[float]] = {v: [] for v in names}
            for i in range(args.rounds):
                order = names[i % len(names):] + names[:i % len(names)]
                for v in order:
                    times[v].append(_step_time(path, args.steps, v, Path(tmp) / f"{path.stem}-{i}-{v}"))
                print(f"{path.stem} round {i + 1}/{args.rounds}: " +
                      "  ".join(f"{v} {times[v][-1]:.4f} s" for v in names), flush=True)
            med = {v: statistics.median(times[v]) for v in names}
            rows.append((path.stem, med, {v: (max(t) - min(t)) / med[v] for v, t in times.items()}))
    print(f"\n{args.steps} steps per run ({args.steps - 3} measured), medians over {args.rounds} rounds")
    print(f"{'config':<18}" + "".join(f" {v + ' (s)':>10} {'vs gloo':>7} {'spread':>6}" for v in names))
    for name, med, spread in rows:
        print(f"{name:<18}" + "".join(f" {med[v]:10.4f} {med[v] / med['gloo']:7.3f} {100 * spread[v]:5.1f}%"
                                      for v in names))
    print("vs gloo: the variant's median step time over gloo's; spread: (slowest - fastest) / median of its runs")


if __name__ == "__main__":
    main()
