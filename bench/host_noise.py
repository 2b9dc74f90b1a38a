"""How fast this machine's speed moves: the same compute on every core, counted per short window.

The fidelity figures (bench/fidelity.py) compare runs a minute apart; how far any two runs of
the same program can differ on this machine bounds what they can show. One process per core
(the first `--cores` this process may use, each bound to its core, as a W=2 job's ranks are)
runs a fixed single-threaded torch MLP forward and backward for `--seconds` and counts the
passes in every `--window`, the windows of all cores starting at one agreed moment. Printed per
core: the passes per window (median, 5th and 95th percentile) and their coefficient of
variation; the coefficient of variation of the means of `--block`-second blocks (about one
fidelity run's measured steps) and the slowest block's mean over the fastest's. Then the
per-window correlation of the first two cores (near 1: the whole machine speeds up and slows
down at once), and per block the first core's speed over the second's in the same seconds (far
from 1: where a rank runs, not only when, moves its compute).

    .venv/bin/python bench/host_noise.py [--seconds 60] [--window 0.5] [--block 6] [--cores 2]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys

import numpy as np

START_AFTER_S = 10.0    # every worker has imported torch and built its model by then, or fails

_WORKER = """
import json, os, sys, time, torch
os.sched_setaffinity(0, {core})
torch.set_num_threads(1)
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
x = torch.randn(64, 256)
start = float(sys.argv[1])
if time.time() > start:
    sys.exit("started late: ready %.2f s after the agreed start" % (time.time() - start))
while time.time() < start:
    time.sleep(0.001)
counts, edge = [], time.monotonic()
for _ in range({windows}):
    edge += {window}
    n = 0
    while time.monotonic() < edge:
        m.zero_grad()
        m(x).square().mean().backward()
        n += 1
    counts.append(n)
print(json.dumps(counts))
"""


def _cv(values: np.ndarray) -> float:
    return float(values.std() / values.mean()) if values.mean() > 0 else float("nan")


def measure(cores: list[int], seconds: float, window: float) -> dict[int, np.ndarray]:
    """Passes per window on each core, all cores at once; every worker killed if one fails."""
    import time

    windows = int(seconds / window)
    start = time.time() + START_AFTER_S
    procs = {}
    try:
        for core in cores:
            code = _WORKER.format(core={core}, windows=windows, window=window)
            procs[core] = subprocess.Popen([sys.executable, "-c", code, str(start)], stdout=subprocess.PIPE,
                                           text=True, start_new_session=True)
        out = {}
        for core, proc in procs.items():
            stdout, _ = proc.communicate(timeout=START_AFTER_S + seconds + 60)
            if proc.returncode != 0:
                raise RuntimeError(f"worker on core {core} exited with {proc.returncode} (its error is above)")
            out[core] = np.asarray(json.loads(stdout), dtype=float)
        return out
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--window", type=float, default=0.5)
    parser.add_argument("--block", type=float, default=6.0, help="seconds per block (about one run's measured steps)")
    parser.add_argument("--cores", type=int, default=2)
    args = parser.parse_args()
    if not 0 < args.window <= args.block <= args.seconds:
        parser.error("need 0 < --window <= --block <= --seconds")
    cores = sorted(os.sched_getaffinity(0))[:args.cores]
    counts = measure(cores, args.seconds, args.window)
    per_block = max(int(args.block / args.window), 1)
    print(f"{args.seconds:.0f} s, a fixed MLP pass counted per {args.window} s window, on cores {cores} at once")
    print(f"{'core':>4} {'windows':>7} {'median':>7} {'p5':>5} {'p95':>5} {'cv/window':>9} "
          f"{'cv/' + format(args.block, 'g') + ' s':>9} {'slowest/fastest block':>21}")
    for core, c in counts.items():
        blocks = c[:len(c) // per_block * per_block].reshape(-1, per_block).mean(axis=1)
        print(f"{core:>4} {len(c):>7} {np.median(c):>7.0f} {np.percentile(c, 5):>5.0f} {np.percentile(c, 95):>5.0f} "
              f"{100 * _cv(c):>8.1f}% {100 * _cv(blocks):>8.1f}% {blocks.min() / blocks.max():>21.3f}")
    if len(counts) > 1:
        a, b = (counts[c] for c in cores[:2])
        print(f"correlation of cores {cores[0]} and {cores[1]} per window: {np.corrcoef(a, b)[0, 1]:+.2f}")
        n = len(a) // per_block * per_block
        ratio = a[:n].reshape(-1, per_block).mean(axis=1) / b[:n].reshape(-1, per_block).mean(axis=1)
        print(f"core {cores[0]} over core {cores[1]} per {args.block:g} s block (the same seconds): median "
              f"{np.median(ratio):.3f}, from {ratio.min():.3f} to {ratio.max():.3f}; median |ratio - 1| "
              f"{100 * np.median(np.abs(ratio - 1)):.1f}%")


if __name__ == "__main__":
    main()
