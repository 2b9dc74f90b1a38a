"""What the replay assistant's core costs a sandbox rank's compute: a plain slice run with the
assistant on another core, then on the rank's own core, alternating.

In a co-run on 2 cores (the loaded runs of the slices, replay/slices.py `run_together`) each
member's assistant shares its rank's core, and it runs while that rank waits for a collective
with its virtual peers. With the assistant on the other core, nothing but the rank runs on the
rank's core. The difference between the two is what the assistant's share of the core adds to
the rank's compute spans, which the calibration then carries into the prediction.

Printed per round: the rank's compute per measured step (the sum of its compute spans) and its
median step time in each placement, and their ratio; then the median ratio over rounds. By
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


def run(cfg, graph_dir: Path, rank: int, out: Path, own_core: bool) -> None:
    """One plain slice, `rank` real, the assistant on the rank's core or on the last core."""
    run_slice(cfg, graph_dir, [rank], out, cores=[machine_cores()[0]] if own_core else None)


def figures(cfg, graph, rank: int, out: Path) -> tuple[float, float]:
    """The slice's rank's compute per measured step and median step time (s)."""
    timing = slice_timings(graph.trace, match_ops(graph.trace), out, [rank])[rank]
    cols = graph.trace.rank(rank)
    measured = (cols["kind"] == COMPUTE) & (cols["step"] >= cfg.job.warmup)
    steps = len(timing.step_times) - cfg.job.warmup
    return float(timing.span[measured].sum()) / steps, \
        statistics.median(timing.step_times[cfg.job.warmup:])


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
            (oc, os_), (sc, ss) = got["other core"], got["own core"]
            rows.append((oc, sc, os_, ss))
            print(f"round {i + 1}/{args.rounds}: compute/step {1e3 * oc:.1f} ms (other core) {1e3 * sc:.1f} ms "
                  f"(own core) x{sc / oc:.3f}; step {1e3 * os_:.1f} / {1e3 * ss:.1f} ms x{ss / os_:.3f}", flush=True)
    a = np.array(rows)
    how = f"taking turns of {args.turns:g} s" if args.turns > 0 else "one after the other"
    print(f"\n{cfg.name}, rank {args.rank} real, {args.steps} steps ({args.steps - cfg.job.warmup} measured), "
          f"{args.rounds} rounds, the two runs of a round {how}, which goes first alternating")
    print(f"{'round':>5} {'compute other (ms)':>18} {'compute own (ms)':>16} {'ratio':>7} "
          f"{'step other (ms)':>15} {'step own (ms)':>13} {'ratio':>7}")
    for i, (oc, sc, os_, ss) in enumerate(a):
        print(f"{i + 1:>5} {1e3 * oc:18.1f} {1e3 * sc:16.1f} {sc / oc:7.3f} {1e3 * os_:15.1f} {1e3 * ss:13.1f} "
              f"{ss / os_:7.3f}")
    print(f"{'median':>5} {1e3 * np.median(a[:, 0]):18.1f} {1e3 * np.median(a[:, 1]):16.1f} "
          f"{np.median(a[:, 1] / a[:, 0]):7.3f} {1e3 * np.median(a[:, 2]):15.1f} {1e3 * np.median(a[:, 3]):13.1f} "
          f"{np.median(a[:, 3] / a[:, 2]):7.3f}")
    print("ratio: own core / other core, per round; the median is of the per-round ratios")


if __name__ == "__main__":
    main()
