"""What steady virtual spans do to a calibrated timeline at the job's size: the timeline solved again
with the virtual ranks' steady steps at their positions' trimmed means, and with the ranks of
interest's steps in another order (their live noise another draw than the timeline's) beside virtual
ranks as timed. The step time of each rank of interest (median over the steps after the warm-up)
against the timeline as calibrated.

    .venv/bin/python bench/steady_timeline.py RUN_DIR   # a `prism run` / `prism calibrate` output, e.g. artifacts/demo
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from prism_core.calibrate.durations import steady_compute, step_ends
from prism_core.calibrate.timeline import NodeModel, solve
from prism_core.replay.steady import paired_ranks, steady_spans
from prism_core.trace import Trace, load_trace
from prism_core.trace.matching import match_ops
from prism_core.trace.schema import WAIT


def rolled(trace: Trace, span: np.ndarray, ranks: list[int], first_step: int, shift: int) -> np.ndarray:
    """`span` with the ranks' steady steps' spans in another order (rolled by `shift` steps)."""
    out = span.copy()
    for r in ranks:
        grid = steady_compute(trace, r, first_step)
        if grid is not None:
            nodes = grid + trace.offsets[r]
            out[nodes] = np.roll(out[nodes], shift, axis=0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="directory with collect/<key>/trace.zarr and calibrate/timeline.npz")
    args = parser.parse_args()
    timeline = np.load(args.run / "calibrate" / "timeline.npz")
    # the collection the timeline was calibrated on: the one with as many nodes
    traces = [(g, load_trace(g)) for g in sorted(args.run.glob("collect/*/trace.zarr"))]
    found = [(g, t) for g, t in traces if len(t.columns["kind"]) == len(timeline["span"])]
    if not found:
        raise SystemExit(f"no collection under {args.run}/collect has the calibrated timeline's nodes")
    graph, trace = found[0]
    cfg = json.loads((graph.parent / "config.json").read_text())
    warmup, interest = int(cfg["job"]["warmup"]), sorted(cfg["emulation"]["ranks_of_interest"] or [0])
    c = trace.columns
    rank_of = np.repeat(np.arange(trace.world_size), np.diff(trace.offsets))
    ref = np.where(c["kind"] == WAIT, trace.offsets[rank_of] + c["ref"], -1)
    match = match_ops(trace)

    def step_times(span: np.ndarray) -> dict[int, float]:
        model = NodeModel(span=span, release=timeline["release"], ref=ref,
                          completes_synced=timeline["completes_synced"], transfer=timeline["transfer"])
        end, _, _ = solve(model, match, trace.offsets)
        return {r: float(np.median(np.diff(step_ends(trace, end, r))[max(warmup - 1, 0):])) for r in interest}

    virtual = [r for r in range(trace.world_size) if r not in interest]
    paired = paired_ranks(trace, virtual, interest)
    base = step_times(timeline["span"])
    rows = [("virtual ranks steady", step_times(steady_spans(trace, timeline["span"], virtual, warmup))),
            (f"paired ranks steady ({len(paired)} of {len(virtual)})",
             step_times(steady_spans(trace, timeline["span"], paired, warmup)))]
    for shift in (1, 2, 4):
        live = rolled(trace, timeline["span"], interest, warmup, shift)
        rows.append((f"interest redrawn ({shift}), virtual timed", step_times(live)))
        rows.append((f"interest redrawn ({shift}), virtual steady", step_times(steady_spans(trace, live, virtual, warmup))))
    print(f"W={trace.world_size}, ranks of interest {interest}, warm-up {warmup}; step as calibrated: "
          + ", ".join(f"rank {r} {base[r] * 1e3:.1f} ms" for r in interest))
    for name, times in rows:
        print(f"{name:45} " + "  ".join(f"rank {r} {times[r] / base[r] - 1:+7.2%}" for r in interest))


if __name__ == "__main__":
    main()
