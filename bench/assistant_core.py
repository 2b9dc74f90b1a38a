"""What the replay assistant's core costs a sandbox rank's compute: a plain slice run with the
assistant on another core, then on the rank's own core, alternating.

In a co-run on 2 cores (the loaded runs of the slices, replay/slices.py `run_together`) each
member's assistant shares its rank's core. Here, in a plain slice, it works mostly while its rank
waits in a collective with its virtual peers (in a co-run its pacing also has it work while its
rank computes). With the assistant on the other core, nothing but the rank runs on the rank's
core. The difference between the two is what sharing the core adds to the rank's compute spans,
beyond the waits for the core that the calibration takes out.

Printed per round, in each placement and as their ratio: the rank's compute per measured step
(the sum of its compute spans), the same less its thread's waits for its core (as the calibration
takes it, trace/run_delay.py) and its median step time; then the medians over rounds. By
default the two runs of a round take turns of `--turns` seconds on the machine (bench/turns.py),
their stopped time taken out, so that both see the same machine; `--turns 0` runs them one after
the other (the machine's speed then moves the ratio by tens of percent, bench/host_noise.py).

    .venv/bin/python bench/assistant_core.py [--config ep2] [--rounds 3] [--steps 20] [--rank 0] [--turns 0.3]

Names resolve to configs/tiny_moe_w2_<name>.yaml. Needs 2 cores.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

from prism_core.calibrate.durations import slice_timings
from prism_core.collect.stage import collect
from prism_core.launch.cores import machine_cores
from prism_core.replay.slices import run_slice
from prism_core.trace.matching import match_ops
from prism_core.trace.schema import COMPUTE

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fidelity import _load  # noqa: E402  (bench scripts beside this one)
from turns import take_turns, unstop_run  # noqa: E402

PLACEMENTS = ("other core", "own core")
FIGURES = ("compute", "compute less waits", "step")


def run(cfg, graph_dir: Path, rank: int, out: Path, own_core: bool) -> None:
    """One plain slice, `rank` real, the assistant on the rank's core or on the last core."""
    run_slice(cfg, graph_dir, [rank], out, cores=[machine_cores()[0]] if own_core else None)


def figures(cfg, graph, rank: int, out: Path) -> tuple[float, float, float]:
    """The slice's rank's compute per measured step as measured (wall) and less its thread's
    the part of its waits for its core the assistant ran (as the calibration takes it), and its
    median step time (s)."""
    match = match_ops(graph.trace)
    cols = graph.trace.rank(rank)
    measured = (cols["kind"] == COMPUTE) & (cols["step"] >= cfg.job.warmup)
    wall, unqueued = (slice_timings(graph.trace, match, out, [rank], waits_out=u)[rank] for u in ("none", "assistant"))
    steps = len(wall.step_times) - cfg.job.warmup
    return (float(wall.span[measured].sum()) / steps, float(unqueued.span[measured].sum()) / steps,
            statistics.median(wall.step_times[cfg.job.warmup:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="ep2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--turns", type=float, default=0.3, help="turn length (s); 0: one run after the other")
    parser.add_argument("--launch", nargs=3, metavar=("OUT", "GRAPH", "PLACEMENT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    cfg = _load(args.config, args.steps, 1)
    if args.launch:       # one run of a round that takes turns, in a process of its own
        out, graph_dir, where = args.launch
        run(cfg, Path(graph_dir), args.rank, Path(out), where == "own")
        return
    if len(machine_cores()) < 2:
        parser.error("needs 2 cores: one for the rank, one for the assistant")
    rows = []
    with tempfile.TemporaryDirectory(prefix="prism-assistant-core-") as tmp:
        graph = collect(cfg, Path(tmp) / "collect")
        for i in range(args.rounds):
            order = PLACEMENTS if i % 2 == 0 else PLACEMENTS[::-1]    # neither always first
            outs = {where: Path(tmp) / f"r{i}-{where.split()[0]}" for where in order}
            if args.turns > 0:
                cmds = [[sys.executable, str(Path(__file__).resolve()), "--launch", str(outs[w]), str(graph.directory),
                         w.split()[0], "--config", args.config, "--steps", str(args.steps), "--rank", str(args.rank)]
                        for w in order]
                stops = take_turns(cmds, args.turns, 1800, [Path(tmp) / f"r{i}-{n}.log" for n in range(len(order))])
                for where, s in zip(order, stops):
                    unstop_run(outs[where], s)
            else:
                for where in order:
                    run(cfg, graph.directory, args.rank, outs[where], where == "own core")
            got = {where: figures(cfg, graph, args.rank, outs[where]) for where in order}
            rows.append([*got["other core"], *got["own core"]])
            print(f"round {i + 1}/{args.rounds}: " + "; ".join(
                f"{what} {1e3 * a:.1f} / {1e3 * b:.1f} ms x{b / a:.3f}"
                for what, a, b in zip(FIGURES, got["other core"], got["own core"])), flush=True)
    a = np.array(rows)
    how = f"taking turns of {args.turns:g} s" if args.turns > 0 else "one after the other"
    print(f"\n{cfg.name}, rank {args.rank} real, {args.steps} steps ({args.steps - cfg.job.warmup} measured), "
          f"{args.rounds} rounds, the two runs of a round {how}, which goes first alternating; per step, ms: "
          "assistant on the other core / on the rank's own core, and their ratio")
    print(f"{'round':>6}" + "".join(f" {what:>26} {'ratio':>6}" for what in FIGURES))
    for i, row in enumerate(a):
        print(f"{i + 1:>6}" + "".join(f" {1e3 * row[k]:12.1f} / {1e3 * row[k + 3]:11.1f} {row[k + 3] / row[k]:6.3f}"
                                      for k in range(3)))
    print(f"{'median':>6}" + "".join(f" {1e3 * np.median(a[:, k]):12.1f} / {1e3 * np.median(a[:, k + 3]):11.1f} "
                                     f"{np.median(a[:, k + 3] / a[:, k]):6.3f}" for k in range(3)))
    print("compute: the sum of the rank's compute spans; less waits: without its thread's waits for its core "
          "(what the calibration takes); the median ratio is of the per-round ratios")


if __name__ == "__main__":
    main()
