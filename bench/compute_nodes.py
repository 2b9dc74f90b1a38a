"""Where the slices' compute differs from the real run's, node by node (reads `fidelity.py --keep`).

For each kept pair and timed rank: compute per step in the record, in the plain slice and in
the loaded run (a co-run, or beside the stand-in load), waits for a core taken out as the
calibration takes them; then by class of compute node — after a communication node or a wait,
binned by how long the record spent in that node (a long one is a rank that waited, its core
asleep), or after another compute node — the median ratio of the slice's span to the record's
at the same node and the difference per step. It tells a rate effect (every class off alike:
what computes beside the rank) from a cost after sleeping (only the nodes after long waits).

A last table sets, per config, the loaded run's compute over the record's (median over the kept
pairs and ranks) beside the bytes the rank's ops carry a step: the co-runs' excess is largest where
the ranks exchange the most, which are also the configs whose assistants work the most (bench/MEASURED.md,
item 34, where what it is not is measured).

    .venv/bin/python bench/compute_nodes.py KEEP        # KEEP: a `bench/fidelity.py --keep` directory
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from prism_core.calibrate.durations import load_ran, slice_timings
from prism_core.trace import load_trace
from prism_core.trace.matching import match_ops
from prism_core.trace.schema import COMM, COMPUTE

# bins of the record's time in the node before a compute node (seconds)
EDGES = (300e-6, 3e-3)


def classify(kind: np.ndarray, before_s: np.ndarray, edges=EDGES) -> np.ndarray:
    """Per node: -1 not compute; 0 after a compute node (or first); k >= 1 after a communication
    node or wait that took [edges[k-2], edges[k-1]) (open at both ends)."""
    kind = np.asarray(kind)
    prev = np.r_[COMPUTE, kind[:-1]] if len(kind) else kind
    out = np.where(kind == COMPUTE, 0, -1)
    after_comm = (kind == COMPUTE) & (prev != COMPUTE)
    out[after_comm] = 1 + np.searchsorted(np.asarray(edges), np.asarray(before_s)[after_comm], side="right")
    return out


def compare(classes: np.ndarray, measured: np.ndarray, steps: int, record: np.ndarray,
            other: np.ndarray) -> dict[int, tuple[float, float, float, float]]:
    """Per class over the `measured` nodes: (nodes a step, the record's median span, median of
    other / record at each node, (other - record) summed a step)."""
    out = {}
    for c in np.unique(classes[measured & (classes >= 0)]):
        m = measured & (classes == c) & (record > 0)
        if not m.any():
            continue
        out[int(c)] = (m.sum() / steps, float(np.median(record[m])), float(np.median(other[m] / record[m])),
                       float((other[m] - record[m]).sum() / steps))
    return out


def excess_per_mb(loaded_over_record: list[float], record_s: list[float], mb: list[float]) -> tuple[float, float, float]:
    """Over a config's kept (pair, rank) rows: the median loaded / record compute, the median
    megabytes a step the rank's ops carry, and the median excess a step (ms) per megabyte."""
    ratio, rec, mb = (np.asarray(x, dtype=float) for x in (loaded_over_record, record_s, mb))
    per_mb = (ratio - 1.0) * rec * 1e3 / np.where(mb > 0, mb, np.nan)
    return float(np.median(ratio)), float(np.median(mb)), float(np.nanmedian(per_mb)) if np.isfinite(per_mb).any() else float("nan")


def class_names(edges=EDGES) -> dict[int, str]:
    ms = [f"{e * 1e3:g}" for e in edges]
    bounds = ["0", *ms, "inf"]
    names = {0: "after compute"}
    for k in range(len(edges) + 1):
        names[k + 1] = f"after comm/wait of {bounds[k]}-{bounds[k + 1]} ms"
    return names


def kept_pairs(keep: Path):
    """(config name, graph directory, pair directory, [(sandbox, plain slice, loaded run or None)])."""
    for config in sorted(p for p in keep.iterdir() if (p / "collect").is_dir()):
        graphs = [p for p in (config / "collect").iterdir() if (p / "trace.zarr").is_dir()]
        if len(graphs) != 1:
            continue
        for pair in sorted(config.glob("pair*")):
            slices = []
            for d in sorted((pair / "timing").glob(f"{graphs[0].name}/s*/slice_*")):
                sandbox = json.loads((d / "slice.json").read_text())["sandbox"]
                index, key = d.name.split("_")[1:3]
                loaded = [p for p in d.parent.glob(f"loaded_{index}_{key}_*")
                          if not p.name.endswith(("_other", "_r2")) and "_twin" not in p.name and "_replica" not in p.name
                          and load_ran(p)]
                slices.append((sandbox, d, loaded[0] if loaded else None))
            yield config.name, graphs[0], pair, slices


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("keep", type=Path, help="a directory written by bench/fidelity.py --keep")
    args = parser.parse_args()
    names = class_names()
    found = False
    summary: dict[str, tuple[list[float], list[float], list[float]]] = {}
    for name, graph_dir, pair, slices in kept_pairs(args.keep):
        found = True
        graph = load_trace(graph_dir / "trace.zarr")
        match = match_ops(graph)
        warmup = json.loads((pair / "record" / "config.json").read_text())["job"]["warmup"]
        record_trace = load_trace(pair / "record" / "trace.zarr")
        record = slice_timings(graph, match, pair / "record", list(range(graph.world_size)))
        print(f"\n{name} {pair.name}")
        print(f"{'rank':>4}  {'class':34} {'nodes/step':>10} {'record':>10} {'plain / record, diff':>20} "
              f"{'loaded / record, diff':>22}")
        for sandbox, plain_dir, loaded_dir in slices:
            plain = slice_timings(graph, match, plain_dir, sandbox)
            loaded = slice_timings(graph, match, loaded_dir, sandbox) if loaded_dir else None
            for r in sandbox:
                cols, real = graph.rank(r), record_trace.rank(r)
                duration = real["t_end"] - real["t_start"]
                classes = classify(cols["kind"], np.r_[0.0, duration[:-1]])
                measured = cols["step"] >= warmup
                steps = int(cols["step"].max()) + 1 - warmup
                rec = record[r].span
                spans = {"plain": plain[r].span, "loaded": loaded[r].span if loaded is not None else None}
                computed = measured & (classes >= 0)
                cells = []
                for kind in ("plain", "loaded"):
                    other = spans[kind]
                    cells.append("-" if other is None else
                                 f"{other[computed].sum() / rec[computed].sum():.3f} "
                                 f"{(other[computed].sum() - rec[computed].sum()) / steps * 1e3:+.2f}ms")
                print(f"{r:4d}  {'all compute':34} {computed.sum() / steps:10.1f} "
                      f"{rec[computed].sum() / steps * 1e3:8.2f}ms {cells[0]:>20} {cells[1]:>22}")
                if spans["loaded"] is not None:
                    row = summary.setdefault(name, ([], [], []))
                    row[0].append(spans["loaded"][computed].sum() / rec[computed].sum())
                    row[1].append(rec[computed].sum() / steps)
                    row[2].append(cols["bytes"][measured & (cols["kind"] == COMM)].sum() / steps / 1e6)
                by_plain = compare(classes, measured, steps, rec, spans["plain"])
                by_loaded = compare(classes, measured, steps, rec, spans["loaded"]) if loaded is not None else {}
                for c, (n, med, ratio, diff) in sorted(by_plain.items()):
                    lr = by_loaded.get(c)
                    lcell = f"{lr[2]:.3f} {lr[3] * 1e3:+.2f}ms" if lr else "-"
                    print(f"{r:4d}  {names[c]:34} {n:10.1f} {med * 1e6:8.0f}us {f'{ratio:.3f} {diff * 1e3:+.2f}ms':>20} "
                          f"{lcell:>22}")
    if not found:
        sys.exit(f"{args.keep}: no kept config (a directory with collect/ and pair*/, as fidelity.py --keep writes)")
    if summary:
        print(f"\n{'config':24} {'rows':>4} {'loaded / record':>15} {'op bytes a step':>15} {'excess a step per MB':>20}")
        for name, (ratio, rec_s, mb) in sorted(summary.items()):
            r, m, per = excess_per_mb(ratio, rec_s, mb)
            print(f"{name:24} {len(ratio):4d} {r:15.4f} {m:12.1f} MB {per:17.3f} ms")
        print("(medians over the kept pairs and timed ranks; op bytes: the trace's bytes of the rank's "
              "communication nodes after the warm-up)")
    print("\nrecord: compute a step (all compute), else the median span; ratio: all compute, the sums' ratio, else "
          "the median over the nodes of the run's span / the record's at the same node; diff: the difference summed "
          "a step; spans less the waits for a core, as the calibration takes them")


if __name__ == "__main__":
    main()
