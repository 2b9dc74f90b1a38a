"""What a wait costs the compute after it, read from kept fidelity pairs (`fidelity.py --keep`).

For each kept pair and timed rank: how long the rank waited before its compute nodes (the time
since its previous compute node ended, median) in the record, the plain slice and the loaded run
(a co-run); its compute over the record's in the plain slice and in the loaded run as measured,
and after moving each node to the waits the record had before it at the cost the calibration
fits from the pair's slices (calibrate/resume.py); then that fit. Last, per config, how much a
loaded run's node took over the record's same node (median, us) against how much longer the rank
waited before it there than in the record: the relation the fit models.

    .venv/bin/python bench/resume_cost.py KEEP [KEEP ...]
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

from prism_core.calibrate.durations import load_ran, slice_timings
from prism_core.calibrate.predict import timed_ranks
from prism_core.calibrate.resume import ResumeCost
from prism_core.calibrate.stage import slice_jobs
from prism_core.config import load_config
from prism_core.trace import load_trace
from prism_core.trace.matching import match_ops
from prism_core.trace.schema import COMPUTE

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
# bins of (wait before a node in the loaded run) - (wait before it in the record), seconds
EDGES = (-np.inf, -200e-6, 0.0, 200e-6, 400e-6, 700e-6, 1e-3, 2e-3, np.inf)


def excess_by_wait(extra_wait: np.ndarray, excess: np.ndarray, edges=EDGES, least: int = 20) -> list[tuple[int, float]]:
    """Per bin of `extra_wait`: the nodes in it and their median `excess` (NaN under `least` nodes)."""
    out = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        m = (extra_wait >= lo) & (extra_wait < hi) & np.isfinite(excess)
        out.append((int(m.sum()), float(np.median(excess[m])) if m.sum() >= least else float("nan")))
    return out


def moved(span: np.ndarray, gap: np.ndarray, to_gap: np.ndarray, cost: ResumeCost | None) -> np.ndarray:
    """One rank's compute spans (node order) moved from the waits `gap` to `to_gap` at `cost`."""
    if cost is None:
        return span
    delta = cost(to_gap) - cost(gap)
    return span + np.where(np.isfinite(delta), np.clip(delta, -0.5 * span, 0.5 * span), 0.0)


def _bin_label(lo: float, hi: float) -> str:
    if lo == -np.inf:
        return f"<{1e6 * hi:.0f}"
    if hi == np.inf:
        return f">{1e6 * lo:.0f}"
    return f"{1e6 * lo:.0f}..{1e6 * hi:.0f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("keep", nargs="+", type=Path)
    ap.add_argument("--sandbox", type=int, default=1, help="S the bench ran with (its --sandbox)")
    args = ap.parse_args()
    pooled: dict[str, list[tuple[np.ndarray, np.ndarray]]] = defaultdict(list)
    print(f"{'config':<18} {'pair':<16} {'rank':>4} {'wait rec':>8} {'plain':>6} {'loaded':>6} "
          f"{'plain/rec':>9} {'loaded/rec':>10} {'moved plain':>11} {'moved loaded':>12}   fit (tau, cost, memory, share)")
    for keep in args.keep:
        for config_dir in sorted(p for p in keep.iterdir() if (p / "collect").is_dir()):
            name = config_dir.name
            path = CONFIGS / f"{name}.yaml"
            if not path.is_file():
                print(f"{config_dir}: no config {path.name}, skipped", file=sys.stderr)
                continue
            graph_dir = next((p for p in (config_dir / "collect").iterdir() if (p / "trace.zarr").is_dir()), None)
            if graph_dir is None:
                continue
            cfg = load_config(path, ["job.warmup=3", f"emulation.sandbox={args.sandbox}"])   # as fidelity.py ran it
            trace = load_trace(graph_dir / "trace.zarr")
            match = match_ops(trace)
            warmup = cfg.job.warmup
            for pair in sorted(p for p in config_dir.iterdir() if p.name.startswith("pair")):
                _, jobs = slice_jobs(cfg, trace, graph_dir, pair / "timing")
                jobs = [j for j in jobs if j.directory.is_dir() and j.loaded is not None and load_ran(j.loaded)]
                if not jobs or not (pair / "record" / "results").is_dir():
                    continue
                _, load = timed_ranks(trace, match, [(j.directory, j.sandbox) for j in jobs], [j.loaded for j in jobs],
                                      warmup=warmup)
                cost = ResumeCost.from_dict(load.get("resume"))
                fit = ("none" if cost is None else
                       f"{1e3 * cost.tau_s:g} ms, {1e6 * cost.cost_s:.0f} us, {cost.memory:g}, {100 * cost.share:+.1f}%")
                real = slice_timings(trace, match, pair / "record", list(range(trace.world_size)))
                for j in jobs:
                    plain = slice_timings(trace, match, j.directory, j.sandbox)
                    loaded = slice_timings(trace, match, j.loaded, j.sandbox)
                    for r in j.sandbox:
                        cols = trace.rank(r)
                        nodes = (cols["kind"] == COMPUTE) & (cols["step"] >= warmup)
                        rec_span, rec_gap = real[r].span[nodes], real[r].resume_gap[nodes]
                        p_span, p_gap = plain[r].span[nodes], plain[r].resume_gap[nodes]
                        l_span, l_gap = loaded[r].span[nodes], loaded[r].resume_gap[nodes]
                        total = rec_span.sum()
                        print(f"{name:<18} {keep.name + '/' + pair.name:<16} {r:>4} "
                              f"{1e6 * np.nanmedian(rec_gap):8.0f} {1e6 * np.nanmedian(p_gap):6.0f} "
                              f"{1e6 * np.nanmedian(l_gap):6.0f} {p_span.sum() / total:9.4f} {l_span.sum() / total:10.4f} "
                              f"{moved(p_span, p_gap, rec_gap, cost).sum() / total:11.4f} "
                              f"{moved(l_span, l_gap, rec_gap, cost).sum() / total:12.4f}   {fit}")
                        pooled[name].append((l_gap - rec_gap, l_span - rec_span))
    print("\nwait: median us before a compute node; x/rec: the compute over the record's same rank's; moved: each "
          "node moved to the wait the record had before it at the pair's fitted cost")
    print("\nloaded run's node over the record's same node (median us; nodes) by how much longer the rank waited before "
          "it in the loaded run than in the record (us)")
    print(f"{'config':<18} " + " ".join(f"{_bin_label(lo, hi):>16}" for lo, hi in zip(EDGES[:-1], EDGES[1:])))
    for name, parts in pooled.items():
        extra = np.concatenate([p[0] for p in parts])
        excess = np.concatenate([p[1] for p in parts])
        cells = excess_by_wait(extra, excess)
        print(f"{name:<18} " + " ".join(f"{1e6 * m:+8.1f} ({n:>5})" if np.isfinite(m) else f"{'':>8} ({n:>5})"
                                        for n, m in cells))
    if not pooled:
        print("no kept pair with a loaded run found", file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
