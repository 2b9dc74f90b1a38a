"""How a virtual rank's node-by-node noise sits beside its sandbox peer's, read from kept fidelity pairs.

Per kept pair of a two-rank config (`fidelity.py --turns ... --keep`) and per emulated rank `s`
(its peer `v` virtual), over the steady steps after the warm-up (`calibrate/durations.py
steady_compute`), each compute node's deviation from its position's median over the steps,
clipped to +-1 ms (a stop or a stall is another matter):

- `rho real`: the correlation of the two ranks' deviations node by node in the second record
  (how much of its noise a real rank shares with its peer, computing at the same moment);
- `rho timed`: the correlation of the virtual rank's calibrated spans' deviations with the same
  rank's in the second record (how much a node's draw in the timing run says about it in another);
- `real`, `timed`, `steady`: the 10th-90th percentiles of the peer's deviation less the rank's,
  node by node, in the second record (two real ranks), in the emulation with the virtual rank's
  spans as timed, and with its spans steady (replay/steady.py: nothing but the sandbox rank's own).
  Each emulation's own rank is read from the run that replayed the spans that way (`replay/stats.json`
  -> `virtual_spans`; a pair run with `--other-spans` has both), else from the configured one;
- `wait real / timed / steady`: the mean of that difference's positive part, about what the rank
  waits for its peer a node beyond what the medians make; `matched` too, where every pair of the
  config has an emulation whose virtual rank kept its share of noise (`emulation.virtual_spans:
  matched`, steady.py `kept_noise`).

Ranks with another number of compute nodes a step than their peer have no node-by-node
difference: only `rho timed` is printed for them.

    .venv/bin/python bench/node_noise.py KEEP [KEEP ...]
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from prism_core.replay.steady import deviations, matched_noise, node_moments, steady_spans
from kept import part_spans, read_kept, replayed_timeline, runs_by_spans, steady_grids, warmup_steps
from prism_core.trace import Trace


@dataclass
class NodeNoise:
    config: str
    pair: str
    rank: int                   # the emulated (sandbox) rank; its peer is virtual
    rho_real: float
    rho_timed: float
    real: tuple[float, float]   # 10th, 90th percentile of peer - rank, seconds
    timed: tuple[float, float]
    steady: tuple[float, float]
    wait: dict[str, float]      # "real" / "timed" / "steady" -> mean positive part, seconds


def correlation(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.corrcoef(a.ravel(), b.ravel())[0, 1]) if a.size > 2 else float("nan")


def spread(diff: np.ndarray) -> tuple[float, float]:
    return float(np.percentile(diff, 10)), float(np.percentile(diff, 90))


def read_pair(config: str, pair: Path, trace: Trace) -> list[NodeNoise]:
    if trace.world_size != 2:
        return []
    record = pair / "record_e"
    warmup = warmup_steps(record)
    with np.load(replayed_timeline(pair)) as timeline:
        span, moments = timeline["span"], node_moments(timeline)
    grids = steady_grids(trace, warmup)
    if grids is None:
        return []
    real = [deviations(part_spans(record, r)[grids[r]]) for r in range(2)]
    out = []
    for s in range(2):
        run = pair / f"emulate_{s}"
        if not (run / "trace_parts" / f"{s}.npz").exists():
            continue
        v = 1 - s
        local = span[trace.rank_slice(v)]
        timed = deviations(local[grids[v]])
        steady = deviations(steady_spans(trace, span, [v], warmup)[trace.rank_slice(v)][grids[v]])
        runs = runs_by_spans(pair, s)
        own = {way: deviations(part_spans(r, s)[grids[s]]) for way, r in runs.items()}
        ways = [("real", real[v], real[s]), ("timed", timed, own["timed"]), ("steady", steady, own["steady"])]
        if "matched" in own:
            kept = {r: w for r, (_, w) in matched_noise(trace, span, [v], [s], warmup, moments).items()}
            ways.append(("matched", deviations(steady_spans(trace, span, [v], warmup, kept=kept)
                                               [trace.rank_slice(v)][grids[v]]), own["matched"]))
        row = NodeNoise(config, pair.name, s, float("nan"), correlation(timed, real[v]), (np.nan, np.nan),
                        (np.nan, np.nan), (np.nan, np.nan), {})
        if grids[0].shape == grids[1].shape:
            row.rho_real = correlation(real[0], real[1])
            for name, peer, rank in ways:
                diff = peer - rank
                if name != "matched":
                    setattr(row, name, spread(diff))
                row.wait[name] = float(np.clip(diff, 0.0, None).mean())
        out.append(row)
    return out


def _ms(pct: tuple[float, float]) -> str:
    return f"{pct[0] * 1e3:+.2f} {pct[1] * 1e3:+.2f}"


def main() -> None:
    rows = read_kept(__doc__.split("\n\n")[0], lambda config, trace, pair: read_pair(config, pair, trace),
                     "kept two-rank pair with a second record and its emulations")
    print(f"{'config':7} {'pair':6} {'rank':>4} {'rho real':>8} {'rho timed':>9} {'real (ms)':>13} {'timed (ms)':>13} "
          f"{'steady (ms)':>13} {'wait real':>9} {'timed':>6} {'steady':>6}")
    for e in rows:
        waits = " ".join(f"{e.wait[k] * 1e3:6.3f}" if k in e.wait else f"{'':6}" for k in ("timed", "steady"))
        print(f"{e.config:7} {e.pair:6} {e.rank:4d} {e.rho_real:8.2f} {e.rho_timed:9.2f} {_ms(e.real):>13} "
              f"{_ms(e.timed):>13} {_ms(e.steady):>13} "
              + (f"{e.wait['real'] * 1e3:9.3f} " if "real" in e.wait else f"{'':9} ") + waits)
    print()
    print(f"{'config':7} {'n':>3} {'rho real':>8} {'rho timed':>9} {'wait real':>9} {'timed':>6} {'steady':>6} "
          f"{'matched':>7}  (medians; matched where each pair ran it)")
    for config in sorted({e.config for e in rows}):
        group = [e for e in rows if e.config == config]
        med = lambda f: statistics.median(f(e) for e in group)
        waits = [e for e in group if e.wait]
        line = f"{config:7} {len(group):3d} {med(lambda e: e.rho_real):8.2f} {med(lambda e: e.rho_timed):9.2f} "
        if waits:
            line += " ".join(f"{statistics.median(e.wait[k] for e in waits) * 1e3:{w}.3f}"
                             for k, w in (("real", 9), ("timed", 6), ("steady", 6)))
            if all("matched" in e.wait for e in waits):
                line += f" {statistics.median(e.wait['matched'] for e in waits) * 1e3:7.3f}"
        print(line)
    print("\nrho real: the two ranks' node-by-node deviations in the second record; rho timed: the virtual rank's "
          "calibrated deviations against its own in the second record; real / timed / steady: 10th-90th percentile "
          "of the peer's deviation less the rank's (ms); wait: the mean of its positive part a node (ms)")


if __name__ == "__main__":
    main()
