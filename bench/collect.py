"""Graph collection cost: wall time, peak memory of the whole collection and rounds, per world size.

Context switching (K slots) for `--configs`, tensor rules with DP dedup for `--rules-configs`;
memory is the peak over 1 s samples of the summed proportional set size (PSS: shared pages split
between the processes sharing them) of the collector and every process it started. Rounds:
slot grants for context switching; ranks run / K for rules mode.

    .venv/bin/python bench/collect.py [--slots 2] [--configs ...] [--rules-configs configs/moe_w1024.yaml]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from pathlib import Path

import psutil

from prism_core.collect import collect_context_switch, collect_rules
from prism_core.config import load_config


class PeakMemory:
    def __init__(self, every_s: float = 1.0):
        self.peak, self.every_s = 0, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> int:
        me = psutil.Process(os.getpid())
        total = 0
        for p in [me, *me.children(recursive=True)]:
            try:
                total += p.memory_full_info().pss
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._sample())
            self._stop.wait(self.every_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--configs", nargs="+", default=["configs/moe_w16.yaml", "configs/moe_w64.yaml"])
    parser.add_argument("--rules-configs", nargs="*", default=["configs/moe_w1024.yaml"])
    parser.add_argument("--iterations", type=int, default=2)
    args = parser.parse_args()
    rows = []
    runs = [(p, "context_switch") for p in args.configs] + [(p, "rules") for p in args.rules_configs]
    for path, mode in runs:
        cfg = load_config(path, [f"job.iterations={args.iterations}", "job.warmup=1", "job.timeout_s=3600"])
        run = collect_context_switch if mode == "context_switch" else collect_rules
        with tempfile.TemporaryDirectory(prefix="prism-bench-collect-") as tmp, PeakMemory() as mem:
            start = time.monotonic()
            result = run(cfg, Path(tmp), slots=args.slots)   # rules mode: expansion and validation included
            wall = time.monotonic() - start
        nodes = int(result.trace.offsets[-1])
        rounds = result.switches if mode == "context_switch" else -(-result.switches // args.slots)
        rows.append((cfg.name, cfg.job.world_size, mode, args.slots, wall, mem.peak, rounds, nodes))
        print(f"{cfg.name} ({mode}): {wall:.1f} s, peak {mem.peak / 2**30:.2f} GiB, {rounds} rounds", flush=True)
    print(f"\n{'config':<12} {'W':>6} {'mode':<15} {'K':>3} {'wall (s)':>9} {'peak mem (GiB)':>15} "
          f"{'rounds':>15} {'nodes':>9}")
    for name, w, mode, k, wall, peak, swaps, nodes in rows:
        print(f"{name:<12} {w:>6} {mode:<15} {k:>3} {wall:>9.1f} {peak / 2**30:>15.2f} {swaps:>15} {nodes:>9}")


if __name__ == "__main__":
    main()
