"""How much of its noise a virtual rank shares with its sandbox peer: the records' figure against what
the calibration reads (replay/steady.py `shared_noise`), from kept fidelity pairs.

Per kept pair of a two-rank config (`fidelity.py --turns ... --keep`), rank 1 against rank 0, over
the steady steps after the warm-up, the correlation of the two ranks' compute nodes' deviations
from their positions' medians (clipped to +-1 ms):

- `record`, `record 2`: in the pair's first and second `prism record`: the figure to read;
- `as read`: in the calibrated timeline's spans, which the loaded co-run measured (both ranks at
  once, each keeping to the other through its assistant); `waits out`: the same spans less the
  wait for a core each still holds (`timeline.npz` -> `measured_queued`);
- `overlap measured` / `timeline`: how much the two ranks' same nodes ran at once there and in
  the timeline (steady.py `overlap`: shared time over the nodes' lengths, 1 the same interval);
- `read`: what `emulation.virtual_spans: matched` takes, `waits out` times the timeline's overlap
  over the measured one (`shared_noise` with the timeline's `NodeMoments`). A timeline
  calibrated before the measured times and waits were kept is calibrated again from the pair's
  kept slices (`--keep` keeps them; `calibrate/predict.py predict`, the figures marked `*`), and
  `-` where that cannot be done;
- `slope`: how the co-run's shared noise grew with the overlap node by node: the two ranks'
  deviations' product (over their spreads) fitted against each node pair's measured overlap.
  Where the overlap is all of it, a node pair that overlapped fully shares `slope` and one that
  did not, nothing, and the count by overlap holds; a small slope beside a large `as read`
  says the co-run shares its noise at other moments, which no overlap explains;
- `w`: the share of its noise the virtual rank keeps for it (`kept_noise`), and `w record`, what
  the first record's figure would give;
- `w needed`: the share that would have left each emulated rank as far from its virtual peer,
  node by node, as the second record's two ranks were from each other: with V the spread
  (variance of the deviations) of the second record's ranks, C their covariance, V_e the emulated
  rank's own where its peer was steady (`paired`) and V_d that of the timeline's spans,
  sqrt((2 V - V_e - 2 C) / V_d), 0 where that is negative (means of the two ranks and their two
  emulations; `-` where a steady emulation of each is missing).

    .venv/bin/python bench/shared_noise.py KEEP [KEEP ...]
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kept import part_spans, read_kept, replayed_timeline, runs_by_spans, steady_grids
from prism_core.calibrate.durations import steady_steps
from prism_core.calibrate.predict import predict
from prism_core.calibrate.stage import plan_orders, replica_runs, slice_jobs
from prism_core.config import config_from_dict
from prism_core.replay.steady import (NodeMoments, deviations, kept_noise, less_waits, node_moments, overlap, overlaps,
                                    shared_noise)
from prism_core.trace import Trace


@dataclass
class SharedNoise:
    config: str
    pair: str
    record: tuple[float | None, float | None]     # first and second record
    as_read: float | None
    waits_out: float | None                         # as read, the spans less their waits for a core
    measured: float | None                          # overlap where measured
    timeline: float | None                          # overlap in the timeline
    read: float | None                              # with the overlaps
    slope: float | None = None                      # the co-run's shared product against the overlap
    needed: float | None = None                     # the w that would have matched the second record
    again: bool = False                             # read from the pair's slices calibrated again


def _record_spans(run: Path, world: int) -> np.ndarray:
    return np.concatenate([part_spans(run, r) for r in range(world)])


def _needed(trace: Trace, span: np.ndarray, pair: Path, first_step: int) -> float | None:
    """`w needed` (the module's docstring), or None where an emulation with a steady peer is missing."""
    grids = steady_grids(trace, first_step)
    if grids is None or grids[0].shape != grids[1].shape:
        return None
    runs = [runs_by_spans(pair, r)["steady"] for r in range(2)]
    if not all((run / "trace_parts" / f"{r}.npz").is_file() for r, run in enumerate(runs)):
        return None
    real = [deviations(part_spans(pair / "record_e", r)[grids[r]]).ravel() for r in range(2)]
    own = [deviations(part_spans(runs[r], r)[grids[r]]).ravel() for r in range(2)]
    drawn = [deviations(span[trace.rank_slice(r)][grids[r]]).ravel() for r in range(2)]
    spread = lambda d: float(np.mean([x.var() for x in d]))       # noqa: E731
    covariance = float(np.mean((real[0] - real[0].mean()) * (real[1] - real[1].mean())))
    if spread(drawn) <= 0:
        return None
    return float(np.sqrt(max(0.0, (2 * spread(real) - spread(own) - 2 * covariance) / spread(drawn))))


def _common_nodes(trace: Trace, first_step: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Ranks 1 and 0's compute nodes of the steady steps both have, position for position."""
    found = [steady_steps(trace, r, first_step) for r in (1, 0)]
    if any(f is None for f in found) or found[0][1].shape[1] != found[1][1].shape[1]:
        return None
    common = sorted(set(found[0][0]) & set(found[1][0]))
    a, b = (grid[[steps.index(k) for k in common]] + int(trace.offsets[r])
            for r, (steps, grid) in zip((1, 0), found))
    return a, b


def _overlaps(trace: Trace, span: np.ndarray, moments: NodeMoments,
              first_step: int) -> tuple[float | None, float | None, float | None]:
    """The two ranks' same steady nodes' overlap where measured and in the timeline, and the
    slope of their deviations' product against the measured overlap, node pair by node pair."""
    nodes = _common_nodes(trace, first_step)
    if nodes is None:
        return None, None, None
    a, b = nodes
    each = overlaps(moments.measured_start[a], moments.measured_end[a], moments.measured_start[b], moments.measured_end[b])
    measured = None if each is None else float(each.mean())
    there = overlap(moments.start[a], moments.end[a], moments.start[b], moments.end[b])
    slope = None
    if each is not None:
        x, y = (deviations(span[n]).ravel() for n in (a, b))
        x, y = x - x.mean(), y - y.mean()
        if x.std() > 0 and y.std() > 0 and each.std() > 0:
            slope = float(np.polyfit(each, x * y / (x.std() * y.std()), 1)[0])
    return measured, there, slope


def read_pair(config: str, trace: Trace, pair: Path) -> list[SharedNoise]:
    if trace.world_size != 2:
        return []
    warmup = int(json.loads((pair / "record_e" / "config.json").read_text())["job"]["warmup"])
    record = tuple(shared_noise(trace, _record_spans(pair / run, 2), 1, 0, warmup) if (pair / run).is_dir() else None
                   for run in ("record", "record_e"))
    with np.load(replayed_timeline(pair)) as timeline:
        span, moments = timeline["span"], node_moments(timeline)
    drawn = span                  # what the pair's emulations replayed
    again = False
    if moments is None or moments.measured_queued is None:
        calibrated, found = _calibrated_again(trace, pair)
        if found is not None:
            span, moments, again = calibrated, found, True
    as_read = shared_noise(trace, span, 1, 0, warmup)
    waits_out = measured = there = read = slope = None
    if moments is not None:
        if moments.measured_queued is not None:
            waits_out = shared_noise(trace, less_waits(span, moments), 1, 0, warmup)
        measured, there, slope = _overlaps(trace, span, moments, warmup)
        read = shared_noise(trace, span, 1, 0, warmup, moments)
    return [SharedNoise(config, pair.name, record, as_read, waits_out, measured, there, read, slope,
                        needed=_needed(trace, drawn, pair, warmup), again=again)]


def _calibrated_again(trace: Trace, pair: Path) -> tuple[np.ndarray, NodeMoments | None]:
    """The pair's kept slices calibrated again with this code (the timeline's spans and
    `NodeMoments`), as its calibration ran them (its emulation's config); the kept timeline's spans
    and None where its slices are not all there."""
    with np.load(replayed_timeline(pair)) as timeline:
        span = timeline["span"]
    emulated = sorted(pair.glob("emulate_*/config.json"))
    collect = [d for d in (pair.parent / "collect").iterdir() if d.is_dir()] if (pair.parent / "collect").is_dir() else []
    if not emulated or len(collect) != 1:
        return span, None
    cfg = config_from_dict(json.loads(emulated[0].read_text()), str(emulated[0]))
    plan, jobs = slice_jobs(cfg, trace, collect[0], pair / "timing")
    if not all((j.directory / "results").is_dir() for j in jobs):
        return span, None
    prediction = predict(trace, [(j.directory, j.sandbox) for j in jobs], plan.source,
                         loaded=[j.loaded for j in jobs], warmup=cfg.job.warmup, orders=plan_orders(cfg, plan),
                         replicas=replica_runs(jobs), resume=cfg.emulation.resume_cost)
    m = prediction.model
    if m.measured_start is None or m.measured_end is None:
        return span, None
    return m.span, NodeMoments(prediction.start, prediction.end, m.measured_start, m.measured_end, m.measured_queued)


def _f(x: float | None, width: int = 6) -> str:
    return f"{x:{width}.2f}" if x is not None else f"{'-':>{width}}"


def main() -> None:
    rows = read_kept(__doc__.split("\n\n")[0], read_pair, "kept two-rank pair with a second record")
    print(f"{'config':7} {'pair':6} {'record':>6} {'record 2':>8} {'as read':>7} {'waits out':>9} {'overlap measured':>16} "
          f"{'timeline':>8} {'read':>6} {'slope':>6} {'w':>5} {'w record':>8} {'w needed':>8}")
    for e in rows:
        w = kept_noise(e.read if e.read is not None else e.as_read)
        print(f"{e.config:7} {e.pair:6} {_f(e.record[0])} {_f(e.record[1], 8)} {_f(e.as_read, 7)} {_f(e.waits_out, 9)} "
              f"{_f(e.measured, 16)} "
              f"{_f(e.timeline, 8)} {_f(e.read)} {_f(e.slope)} {w:5.2f} {kept_noise(e.record[0]):8.2f} {_f(e.needed, 8)}"
              + (" *" if e.again else ""))
    print()
    print(f"{'config':7} {'n':>3} {'record':>6} {'record 2':>8} {'as read':>7} {'waits out':>9} {'read':>6} {'overlap measured':>16} "
          f"{'timeline':>8}  (medians)")
    for config in sorted({e.config for e in rows}):
        group = [e for e in rows if e.config == config]

        def med(values):
            values = [v for v in values if v is not None]
            return statistics.median(values) if values else None
        print(f"{config:7} {len(group):3d} {_f(med(e.record[0] for e in group))} {_f(med(e.record[1] for e in group), 8)} "
              f"{_f(med(e.as_read for e in group), 7)} {_f(med(e.waits_out for e in group), 9)} {_f(med(e.read for e in group))} "
              f"{_f(med(e.measured for e in group), 16)} {_f(med(e.timeline for e in group), 8)}")
    print("\nrank 1 against rank 0: the correlation of their compute nodes' deviations, node by node over the steady "
          "steps; waits out = as read, each span less the wait for a core it holds; read = waits out x timeline / measured "
          "overlap (replay/steady.py shared_noise); w = sqrt(1 - 2 read), 0 from 0.5 (kept_noise); w needed: the w that "
          "would have left each emulated rank as far from its peer node by node as in the second record; * the pair's "
          "slices calibrated again (its timeline kept no measured times or waits)")


if __name__ == "__main__":
    main()
