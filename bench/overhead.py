"""Tracing overhead: step time under `prism record` (prism backend, trace, memory counter) vs plain gloo.

Runs the two variants alternately (which one goes first alternates too), each a full launch of
the job, and prints each pair's median step times and their ratio, then the median ratio.
The bar (DESIGN.md §6) is <= 1.03.

    .venv/bin/python bench/overhead.py [--config configs/tiny_moe_w2_pp2.yaml] [--pairs 5] [--steps 30]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from prism_core.config import load_config
from prism_core.record import RecordOptions, record


def _step_time(cfg, out: Path, instrument: bool) -> float:
    doc = record(cfg, out, options=RecordOptions(instrument=instrument, echo=False))
    return statistics.mean(r["iteration_time_s"] for r in doc["ranks"].values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny_moe_w2_pp2.yaml")
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    cfg = load_config(args.config, [f"job.iterations={args.steps}", "job.warmup=3"])
    rows = []
    with tempfile.TemporaryDirectory(prefix="prism-overhead-") as tmp:
        for i in range(args.pairs):
            order = (True, False) if i % 2 == 0 else (False, True)
            times = {inst: _step_time(cfg, Path(tmp) / f"{i}-{inst}", inst) for inst in order}
            rows.append((times[False], times[True], times[True] / times[False]))
            print(f"pair {i + 1}/{args.pairs}: plain {times[False]:.4f} s  prism {times[True]:.4f} s  "
                  f"ratio {rows[-1][2]:.4f}", flush=True)
    print(f"\n{cfg.name}, {args.steps} steps per run ({args.steps - 3} measured), median step time over ranks")
    print(f"{'pair':>4}  {'plain gloo (s)':>14}  {'prism record (s)':>16}  {'ratio':>6}")
    for i, (plain, prism, ratio) in enumerate(rows, 1):
        print(f"{i:>4}  {plain:14.4f}  {prism:16.4f}  {ratio:6.3f}")
    ratios = [r[2] for r in rows]
    print(f"median ratio {statistics.median(ratios):.4f} (min {min(ratios):.4f}, max {max(ratios):.4f}); bar <= 1.03")


if __name__ == "__main__":
    main()
