"""Cost of the native counting CPU allocator on a CPU training step (1 intra-op thread).

Each round runs the same MLP training loop twice, in two fresh processes, once without and once
with the allocator installed (the order alternates between rounds); each process reports the
median wall time of its steps, and the median CPU time of the stepping thread (with 1 intra-op
thread all step work runs on it; CPU time shrugs off preemption on a busy machine, wall time
does not). The table gives, per model size, the median over rounds of with/without. Sizes: `tiny` stresses the per-allocation cost (many small tensors, ~100 us steps),
`mlp` is a more typical small step.

    .venv/bin/python bench/memory_overhead.py [--rounds 9] [--steps 300] [--stable-malloc]

On a default glibc the larger step's time swings run to run with malloc's adaptive mmap/trim
thresholds (hundreds to thousands of page faults per step, in both variants alike);
`--stable-malloc` fixes them for both variants (MALLOC_MMAP_THRESHOLD_=32 MiB,
MALLOC_TRIM_THRESHOLD_=4 GiB), which removes that noise from the comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STABLE_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(4 << 30)}
SIZES = {"tiny": (16, 64, 3), "mlp": (32, 512, 4)}  # batch, width, layers


def worker(size: str, counted: bool, steps: int) -> None:
    import torch

    torch.set_num_threads(1)
    if counted:
        from prism_core import memory

        memory.install()
    batch, width, layers = SIZES[size]
    torch.manual_seed(0)
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.GELU()]
    model = torch.nn.Sequential(*mods, torch.nn.Linear(width, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(batch, width), torch.randint(0, 10, (batch,))

    def step() -> None:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    for _ in range(max(20, steps // 10)):
        step()
    times, cpu_times = [], []
    for _ in range(steps):
        t, c = time.perf_counter(), time.thread_time()
        step()
        cpu_times.append(time.thread_time() - c)
        times.append(time.perf_counter() - t)
    out = {"median_s": statistics.median(times), "cpu_s": statistics.median(cpu_times)}
    if counted:
        out["peak_bytes"] = memory.peak_bytes()
    print(json.dumps(out))


def measure(size: str, counted: bool, steps: int, env: dict[str, str]) -> dict:
    cmd = [sys.executable, __file__, "--worker", size, "--counted", str(int(counted)), "--steps", str(steps)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, check=False, env=env)
    if done.returncode != 0:
        raise SystemExit(f"worker failed ({size}, counted={counted}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--worker", choices=sorted(SIZES))
    parser.add_argument("--counted", type=int, default=0)
    parser.add_argument("--stable-malloc", action="store_true", help="fix glibc's mmap/trim thresholds")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, bool(args.counted), args.steps)
        return

    subprocess.run([sys.executable, "-m", "prism_core.memory.native", "--build"], cwd=REPO, check=True, timeout=600)
    env = {**os.environ, **(STABLE_MALLOC if args.stable_malloc else {})}
    rows = []
    for size in SIZES:
        ratios, cpu_ratios, off_all, on_all, peaks = [], [], [], [], set()
        for r in range(args.rounds):
            order = (False, True) if r % 2 == 0 else (True, False)
            res = {counted: measure(size, counted, args.steps, env) for counted in order}
            off_all.append(res[False]["median_s"])
            on_all.append(res[True]["median_s"])
            peaks.add(res[True]["peak_bytes"])
            ratios.append(res[True]["median_s"] / res[False]["median_s"])
            cpu_ratios.append(res[True]["cpu_s"] / res[False]["cpu_s"])
        rows.append((size, statistics.median(off_all), statistics.median(on_all), statistics.median(ratios),
                     min(ratios), max(ratios), statistics.median(cpu_ratios), peaks))  # fmt: skip
    malloc = "fixed glibc malloc thresholds" if args.stable_malloc else "default glibc malloc"
    print(f"\n{args.rounds} rounds x {args.steps} timed steps, 1 thread, each variant in its own process, "
          f"alternating; {malloc}")  # fmt: skip
    print(f"{'model':<6} {'step off (ms)':>14} {'step on (ms)':>13} {'median on/off':>14} {'min':>7} {'max':>7}"
          f" {'cpu on/off':>11}  peak bytes (all rounds)")  # fmt: skip
    for size, off, on, med, lo, hi, cpu, peaks in rows:
        peak = ", ".join(str(p) for p in sorted(peaks))
        print(f"{size:<6} {off * 1e3:>14.3f} {on * 1e3:>13.3f} {med:>14.4f} {lo:>7.4f} {hi:>7.4f} {cpu:>11.4f}  {peak}")


if __name__ == "__main__":
    main()
