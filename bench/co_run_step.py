"""How far a co-run's members are from running in step, against the record (reads `fidelity.py --keep`).

A co-run (replay/slices.py `run_together`) runs a W=2 job's two slices at once so that each rank
computes beside the other, as in the record. Its members exchange with their own virtual peers,
not with each other, and keep in step only through pacing (replay/pacing.py). For each kept pair
this prints, for the record and for each co-run found (the default's and a `--other-corun`
variant's): how far apart the two ranks leave each blocking collective (median and p90 of
|end of rank 1 - end of rank 0| over the measured steps), how much of a rank's compute ran
beside the other rank's compute and beside its communication (the record's ranks are in step:
mostly beside compute), and, in a co-run, how long after a rank that arrived last issued an op
its own member's assistant put the virtual peer's part on the wire (`replay/arrivals.npy`);
and, where the recorder noted it (`oncpu_s`), the CPU time each rank's own thread ran in its compute
nodes against the record's same rank (mean of the two ranks).

    .venv/bin/python bench/co_run_step.py KEEP       # KEEP: a `bench/fidelity.py --keep` directory
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from prism_core.trace import load_trace
from prism_core.trace.schema import COMM, COMPUTE, P2P_OPS, WAIT

WARMUP = 3   # bench/fidelity.py's job.warmup


def overlap(a_start: np.ndarray, a_end: np.ndarray, b_start: np.ndarray, b_end: np.ndarray) -> float:
    """Total time two sets of intervals (each disjoint within itself) overlap."""
    a = np.argsort(a_start)
    b = np.argsort(b_start)
    a_start, a_end, b_start, b_end = a_start[a], a_end[a], b_start[b], b_end[b]
    i = j = 0
    total = 0.0
    while i < len(a_start) and j < len(b_start):
        lo, hi = max(a_start[i], b_start[j]), min(a_end[i], b_end[j])
        if hi > lo:
            total += hi - lo
        if a_end[i] < b_end[j]:
            i += 1
        else:
            j += 1
    return total


def blocking_collectives(rank: dict, warmup: int = WARMUP) -> np.ndarray:
    """A rank's blocking collectives after the warm-up (not point-to-point ops)."""
    return ((rank["kind"] == COMM) & (rank["step"] >= warmup) & (rank["async_"] == 0)
            & ~np.isin(rank["op"], list(P2P_OPS)))


def in_step(ranks: list[dict], warmup: int = WARMUP) -> dict[str, float]:
    """Of two ranks' traces (the same graph): the end skew of their blocking collectives and the
    shares of each rank's compute beside the other's compute and beside its blocking communication
    or waits (an asynchronous op's node spans its whole flight, compute included: left out)."""
    sync = blocking_collectives(ranks[0], warmup)
    skew = np.abs(ranks[1]["t_end"][sync] - ranks[0]["t_end"][sync])
    shares = {"compute": [], "comm": []}
    for r in (0, 1):
        me, other = ranks[r], ranks[1 - r]
        mine = (me["kind"] == COMPUTE) & (me["step"] >= warmup)
        total = float((me["t_end"][mine] - me["t_start"][mine]).sum())
        waiting = ((other["kind"] == COMM) & (other["async_"] == 0)) | (other["kind"] == WAIT)
        for what, sel in (("compute", other["kind"] == COMPUTE), ("comm", waiting)):
            sel = sel & (other["step"] >= warmup)
            shares[what].append(overlap(me["t_start"][mine], me["t_end"][mine],
                                        other["t_start"][sel], other["t_end"][sel]) / total if total else np.nan)
    steps = int(ranks[0]["step"].max()) + 1 - warmup
    return {"ops": sync.sum() / max(steps, 1), "skew_med": float(np.median(skew)) if len(skew) else np.nan,
            "skew_p90": float(np.percentile(skew, 90)) if len(skew) else np.nan,
            "beside_compute": float(np.mean(shares["compute"])), "beside_comm": float(np.mean(shares["comm"]))}


def on_cpu(rank: dict, warmup: int = WARMUP) -> float:
    """Seconds the rank's recording thread ran in its compute nodes after the warm-up (NaN where
    the trace has no `oncpu_s`)."""
    if "oncpu_node" not in rank:
        return np.nan
    nodes = np.asarray(rank["oncpu_node"], dtype=np.int64)
    keep = rank["step"][nodes] >= warmup
    return float(np.asarray(rank["oncpu_s"])[keep].sum())


def late_hand_over(ranks: list[dict], handed: list[np.ndarray], warmup: int = WARMUP) -> float:
    """Median seconds from the issue of a blocking collective by the rank that arrived last to the
    moment its own member's assistant handed the virtual peer's part to gloo (`handed[r]`: member
    r's assistant's hand-over time of each of the peer's nodes, NaN where none)."""
    sync = blocking_collectives(ranks[0], warmup)
    t0, t1 = ranks[0]["t_start"][sync], ranks[1]["t_start"][sync]
    late1 = t1 > t0
    lags = np.concatenate([(handed[1][sync] - t1)[late1], (handed[0][sync] - t0)[~late1]])
    lags = lags[np.isfinite(lags)]
    return float(np.median(lags)) if len(lags) else np.nan


def _parts(run: Path, rank: int) -> dict | None:
    path = run / "trace_parts" / f"{rank}.npz"
    return dict(np.load(path)) if path.is_file() else None


def co_runs(pair: Path) -> dict[str, tuple[Path, Path]]:
    """The pair's co-runs of two W=2 members: name -> (member of rank 0, member of rank 1)."""
    found: dict[str, dict[int, Path]] = {}
    for d in sorted(pair.glob("timing/*/s*/loaded_*_co_run_*")):
        if "_replica" in d.name:
            continue
        index = int(d.name.split("_")[1])
        name = d.name.split("_co_run_", 1)[1]
        found.setdefault(name, {})[index] = d
    return {name: (m[0], m[1]) for name, m in found.items() if set(m) == {0, 1}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("keep", type=Path, help="a directory written by bench/fidelity.py --keep")
    args = parser.parse_args()
    rows = []
    for config in sorted(p for p in args.keep.iterdir() if (p / "collect").is_dir()):
        graphs = sorted(config.glob("collect/*/trace.zarr"))
        if len(graphs) != 1:
            continue
        graph = load_trace(graphs[0])
        if graph.world_size != 2:
            continue
        for pair in sorted(config.glob("pair*")):
            record = [_parts(pair / "record", r) for r in (0, 1)]
            if any(x is None for x in record):
                continue
            rows.append((config.name, pair.name, "record", in_step(record), np.nan, np.nan))
            for name, members in co_runs(pair).items():
                ranks = [_parts(members[r], r) for r in (0, 1)]
                if any(x is None for x in ranks):
                    continue
                handed = []
                for r in (0, 1):        # member r's assistant hosts the other rank as its virtual peer
                    arrivals = np.load(members[r] / "replay" / "arrivals.npy")
                    peer = 1 - r
                    handed.append(arrivals[int(graph.offsets[peer]):int(graph.offsets[peer + 1])])
                cpu = np.mean([on_cpu(ranks[r]) / on_cpu(record[r]) for r in (0, 1)])
                rows.append((config.name, pair.name, f"co-run {name}", in_step(ranks), late_hand_over(ranks, handed), cpu))
    if not rows:
        sys.exit(f"{args.keep}: no kept W=2 pair with its record (a directory with collect/ and pair*/, "
                 "as fidelity.py --keep writes)")
    print(f"{'config':18} {'pair':6} {'run':18} {'ops/step':>8} {'end skew med':>12} {'p90':>8} {'beside compute':>15} "
          f"{'beside comm':>12} {'late hand-over':>15} {'on-CPU / record':>15}")
    for config, pair, run, s, lag, cpu in rows:
        lag_cell = "-" if np.isnan(lag) else f"{lag * 1e6:.0f} us"
        cpu_cell = "-" if np.isnan(cpu) else f"{cpu:.4f}"
        print(f"{config:18} {pair:6} {run:18} {s['ops']:8.1f} {s['skew_med'] * 1e6:9.0f} us {s['skew_p90'] * 1e6:5.0f} us "
              f"{s['beside_compute']:15.3f} {s['beside_comm']:12.3f} {lag_cell:>15} {cpu_cell:>15}")
    print("\nops/step: blocking collectives a step (few, and the medians say little); end skew: |end of rank 1 - "
          "end of rank 0| over them after the warm-up; beside: "
          "share of a rank's compute time during which the other rank computed / was in a blocking op or a wait "
          "(mean of the two ranks); late hand-over: median time from the issue by the rank that arrived last to its own "
          "member's assistant handing the virtual peer's part to gloo; on-CPU / record: the ranks' own "
          "thread's CPU time in their compute nodes against the record's same rank (mean of the two; traces "
          "recorded since the recorder notes it)")


if __name__ == "__main__":
    main()
