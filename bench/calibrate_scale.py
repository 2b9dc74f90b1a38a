"""Calibration at scale: a W=8,192 graph (moe_w1024's layout with DP widened to 256, collected with
rules and DP dedup, expanded to every rank) calibrated with a synthetic slice timing.

Every timed rank (one DP replica) gets node times drawn from fixed distributions (compute
1-2 ms, transfers 0.05-0.15 ms) and the other replicas take them by renaming, as slices would
give them; the timed ranks fall into slices of two, and collectives whose members come from
different slices are pooled as `prism calibrate` pools them (`durations.pool_member_noise`), and
the replicas take the timed ranks' measured steps in up to four orders
(`durations.replica_noise`, `replica_orders`). Printed: nodes, the time to expand and match the graph, the time
of pooling and replica orders, the calibration's rounds and wall time on the quotient over the
replicas of distinct orders (what `prism calibrate` runs), and — unless
--no-full — the general solver over all W ranks for comparison, with the largest difference
between them (pooled, the model must stay symmetric under the DP renaming for them to agree).
A row after the quotient times what `prism calibrate` adds where loaded runs ran: each compute span
moved to the wait its timeline has before it (`predict.move_to_timeline`, synthetic waits and
cost) and the spans the pace of an emulation is read against (`predict.alone_spans`).

    .venv/bin/python bench/calibrate_scale.py [--dp 256] [--no-full]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from prism_core.calibrate.durations import RankTiming, pool_member_noise, replica_noise, replica_orders
from prism_core.calibrate.predict import alone_spans, move_to_timeline
from prism_core.calibrate.resume import ResumeCost, timeline_gaps
from prism_core.calibrate.timeline import OP_RELEASE, WAIT_RELEASE, NodeModel, solve
from prism_core.collect import collect_rules
from prism_core.config import load_config
from prism_core.replay.slices import plan_slices
from prism_core.trace.matching import match_ops
from prism_core.trace.schema import COMM, COMPUTE, WAIT

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "moe_w1024.yaml"


def synthetic_model(trace, source: np.ndarray, seed: int = 0) -> NodeModel:
    c = trace.columns
    n = len(c["kind"])
    rank_of = np.repeat(np.arange(trace.world_size), np.diff(trace.offsets))
    local = np.arange(n) - trace.offsets[rank_of]
    from_node = trace.offsets[source[rank_of]] + local          # each node takes its source rank's draw
    rng = np.random.default_rng(seed)
    kind = c["kind"]
    span = np.where(kind == 0, rng.uniform(1e-3, 2e-3, n), 1e-5)[from_node]
    release = np.zeros(n, np.int8)
    release[(kind == COMM) & (c["async_"] == 0)] = OP_RELEASE
    release[kind == WAIT] = WAIT_RELEASE
    ref = np.full(n, -1, dtype=np.int64)
    waits = kind == WAIT
    ref[waits] = trace.offsets[rank_of[waits]] + c["ref"][waits]
    transfer = np.where(kind == COMM, rng.uniform(0.5e-4, 1.5e-4, n), 0.0)[from_node]
    span[release == OP_RELEASE] = transfer[release == OP_RELEASE]
    return NodeModel(span=span, release=release, ref=ref, completes_synced=kind == COMM, transfer=transfer)


def slice_runs(timed: list[int], sandbox: int = 2) -> dict[int, RankTiming]:
    """Each timed rank's run, as slices of `sandbox` ranks would give them (only `run` is read)."""
    empty = np.empty(0)
    return {r: RankTiming(span=empty, release=empty, completes_synced=empty, transfer=empty, step_times=[], gaps=[],
                          peaks=[], run=f"slice_{k // sandbox}") for k, r in enumerate(timed)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, default=256)
    parser.add_argument("--no-full", action="store_true", help="skip the general solver over all ranks")
    args = parser.parse_args()
    world = 4 * 8 * args.dp
    cfg = load_config(CONFIG, [f"job.world_size={world}", f"parallel.dp={args.dp}", "job.iterations=3",
                               "job.warmup=1", f"name=moe_w{world}"])
    with tempfile.TemporaryDirectory(prefix="prism-calscale-") as tmp:
        t0 = time.perf_counter()
        trace = collect_rules(cfg, Path(tmp), slots=2).trace
        t_collect = time.perf_counter() - t0
    t0 = time.perf_counter()
    match = match_ops(trace)
    plan = plan_slices(cfg, trace)
    model = synthetic_model(trace, plan.source)
    t_prep = time.perf_counter() - t0
    t0 = time.perf_counter()
    model = pool_member_noise(trace, match, model, slice_runs(plan.timed), plan.source)
    t_pool = time.perf_counter() - t0
    t0 = time.perf_counter()
    orders = replica_orders(args.dp, cfg.parallel.ep)
    model, shares = replica_noise(trace, model, plan.source, cfg.job.warmup, orders)
    t_orders = time.perf_counter() - t0
    t0 = time.perf_counter()
    end_q, start_q, rounds_q = solve(model, match, trace.offsets, source=shares)
    t_quotient = time.perf_counter() - t0
    rows = [(f"quotient ({orders} orders)", len(np.unique(shares)), rounds_q, t_quotient, "")]
    # where loaded runs ran, `prism calibrate` then moves each compute span to the wait its timeline
    # has before it (calibrate/resume.py) and scales a copy by each rank's alone factor: here each
    # compute node was "measured" after its timeline's wait plus 0-1 ms, at a cost of 200 us
    compute = trace.columns["kind"] == COMPUTE
    measured_gap = timeline_gaps(trace.columns["kind"], start_q, end_q, trace.offsets)
    measured_gap[compute] += np.random.default_rng(1).uniform(0.0, 1e-3, int(compute.sum()))
    cost = ResumeCost(tau_s=1e-3, cost_s=200e-6, share=0.0, nodes=0, memory=0.5)
    t0 = time.perf_counter()
    moved, end_m, _, rounds_m = move_to_timeline(trace, match, replace(model, resume_gap=measured_gap), shares,
                                                 end_q, start_q, cost)
    alone_spans(trace, {r: replace(t, alone_factor=0.97) for r, t in slice_runs(plan.timed).items()}, plan.source,
                moved.span)
    rows.append(("+ moved to its waits", len(np.unique(shares)), rounds_m, time.perf_counter() - t0,
                 f"step end {end_m.max() - end_q.max():+.4f} s"))
    if not args.no_full:
        t0 = time.perf_counter()
        end, _, rounds = solve(model, match, trace.offsets)
        rows.append(("general (all ranks)", world, rounds, time.perf_counter() - t0,
                     f"max |diff| {np.abs(end - end_q).max():.2e} s"))
    print(f"\nW={world}: {int(trace.offsets[-1]):,} nodes, {match.n_ops:,} ops; collect (rules, DP dedup, "
          f"expansion) {t_collect:.1f} s; matching + model {t_prep:.1f} s; pooling {t_pool:.2f} s; replica "
          f"orders {t_orders:.2f} s")
    print(f"{'solver':<24} {'ranks solved':>12} {'rounds':>7} {'wall (s)':>9}")
    for name, ranks, rounds, wall, note in rows:
        print(f"{name:<24} {ranks:>12} {rounds:>7} {wall:9.2f}  {note}")
    print(f"predicted step end (max over ranks): {end_q.max():.4f} s")


if __name__ == "__main__":
    main()
