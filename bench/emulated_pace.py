"""What moved each emulation, read from kept fidelity pairs (`fidelity.py --turns ... --keep`).

Per emulation (a pair's rank of interest): its error against the pair's second record; the pace
its virtual ranks followed (`replay/stats.json` -> `follow_pace`, median and largest); its flight
record's compute over its trace's (what the pace is read from against what the rank computed: a
stop counted as compute reads above 1, bench/MEASURED.md item 42); `s`, the rank's compute per step over the
second record's same rank; `a`, the alone factor its pace is read against (the calibrated
timeline's `alone_span` over `span`, summed over the rank's compute nodes). A pace follows the
host's drift where s = a; its virtual ranks compute about s / a too slow otherwise. Where the
pair's emulations also ran a second way (`emulate_<rank>_<suffix>`), that way's error and pace
follow. Last, per config, the medians and the correlation of the error with s / a.

    .venv/bin/python bench/emulated_pace.py KEEP [KEEP ...]
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kept import read_kept, replayed_timeline, trace_part, warmup_steps
from prism_core.trace.flight import COMPUTE_NS_FIELD
from prism_core.trace.schema import COMPUTE

@dataclass
class Emulation:
    config: str
    pair: str
    rank: int
    error: float          # its rank's figure over the second record's, - 1
    pace: float           # median pace its virtual ranks followed
    pace_max: float
    flight: float         # flight record's compute over the trace's
    s: float              # the rank's compute per step over the second record's same rank
    a: float              # the alone factor its pace is read against
    others: dict[str, tuple[float, float]]   # suffix -> (error, median pace) of the second way


def compute_per_step(kind: np.ndarray, step: np.ndarray, t_start: np.ndarray, t_end: np.ndarray,
                     warmup: int) -> float:
    """A rank's compute per step: the median over its measured steps (the last, which the run's
    end closes, left out) of the summed span of its compute nodes. A trace part's times already
    leave out the launch's stops (replay/stopped.py)."""
    compute = kind == COMPUTE
    span, steps = (t_end - t_start)[compute], step[compute]
    per_step = [span[steps == i].sum() for i in range(warmup, int(steps.max()))]
    return float(np.median(per_step))


def alone_factor(span: np.ndarray, alone_span: np.ndarray, compute: np.ndarray) -> float:
    """The compute nodes' alone span over their calibrated span, summed."""
    return float(alone_span[compute].sum() / span[compute].sum())


def correlation(x: list[float], y: list[float]) -> float:
    return float(np.corrcoef(x, y)[0, 1]) if len(x) > 2 else float("nan")


def _part(run: Path, rank: int) -> dict[str, np.ndarray]:
    return trace_part(run, rank, ("kind", "step", "t_start", "t_end"))



def _figure(run: Path, rank: int) -> float:
    times = json.loads((run / "results" / f"{rank}.json").read_text())["step_times_s"][warmup_steps(run):]
    return statistics.median(times)


def _pace(run: Path) -> dict:
    return json.loads((run / "replay" / "stats.json").read_text()).get("follow_pace") or {}


def read_pair(config: str, pair: Path, offsets: np.ndarray, compute: np.ndarray) -> list[Emulation]:
    world = len(offsets) - 1
    record = pair / "record_e"
    real = statistics.mean(_figure(record, r) for r in range(world))
    with np.load(replayed_timeline(pair)) as timeline:
        span = timeline["span"]
        alone = timeline["alone_span"] if "alone_span" in timeline.files else None
    out = []
    for r in range(world):
        run = pair / f"emulate_{r}"
        if not (run / "results" / f"{r}.json").exists():
            continue
        own = _part(run, r)
        per_step = compute_per_step(**own, warmup=warmup_steps(run))
        compute_s = float(((own["t_end"] - own["t_start"])[own["kind"] == COMPUTE]).sum())
        flight_s = np.fromfile(run / "flight" / f"{r}.bin", dtype=np.int64)[COMPUTE_NS_FIELD] * 1e-9
        nodes = slice(int(offsets[r]), int(offsets[r + 1]))
        a = alone_factor(span[nodes], alone[nodes], compute[nodes]) if alone is not None else float("nan")
        pace = _pace(run)
        others = {}
        for other in sorted(pair.glob(f"emulate_{r}_*")):
            if (other / "results" / f"{r}.json").exists():
                others[other.name.split("_", 2)[2]] = (_figure(other, r) / real - 1,
                                                       _pace(other).get("median", float("nan")))
        out.append(Emulation(config, pair.name, r, _figure(run, r) / real - 1, pace.get("median", float("nan")),
                             pace.get("max", float("nan")), flight_s / compute_s,
                             per_step / compute_per_step(**_part(record, r), warmup=warmup_steps(record)), a, others))
    return out


def main() -> None:
    rows = read_kept(__doc__.split("\n\n")[0], lambda config, trace, pair: read_pair(
        config, pair, trace.offsets, trace.columns["kind"] == COMPUTE), "kept pair with a second record and its emulations")
    suffixes = sorted({s for e in rows for s in e.others})
    print(f"{'config':7} {'pair':6} {'rank':>4} {'error':>7} {'pace':>6} {'max':>6} {'flight':>7} {'s':>6} {'a':>6} "
          f"{'s/a':>6}" + "".join(f" {s + ' error':>13} {'pace':>6}" for s in suffixes))
    for e in rows:
        print(f"{e.config:7} {e.pair:6} {e.rank:4d} {e.error:+7.2%} {e.pace:6.3f} {e.pace_max:6.3f} {e.flight:7.3f} "
              f"{e.s:6.3f} {e.a:6.3f} {e.s / e.a:6.3f}"
              + "".join(f" {e.others[s][0]:+13.2%} {e.others[s][1]:6.3f}" if s in e.others else f" {'':13} {'':6}"
                        for s in suffixes))
    print()
    print(f"{'config':7} {'n':>3} {'error':>7} {'s':>6} {'a':>6} {'s/a':>6} {'r(error, s/a)':>14}"
          + "".join(f" {s + ' error':>13}" for s in suffixes))
    for config in [*sorted({e.config for e in rows}), "all"]:
        group = [e for e in rows if config in ("all", e.config)]
        print(f"{config:7} {len(group):3d} {statistics.median(e.error for e in group):+7.2%} "
              f"{statistics.median(e.s for e in group):6.3f} {statistics.median(e.a for e in group):6.3f} "
              f"{statistics.median(e.s / e.a for e in group):6.3f} "
              f"{correlation([e.error for e in group], [e.s / e.a for e in group]):14.2f}"
              + "".join(f" {statistics.median(e.others[s][0] for e in group if s in e.others):+13.2%}"
                        if any(s in e.others for e in group) else f" {'':13}" for s in suffixes))
    flights = [e.flight for e in rows]
    print(f"\nflight record's compute over the trace's: {min(flights):.3f}-{max(flights):.3f} "
          f"({sum(f > 1.01 for f in flights)} of {len(flights)} above 1.01)")
    print("error: the emulated rank's figure over its pair's second record's; pace: what its virtual ranks followed "
          "(median, largest); s: its rank's compute per step over the second record's same rank; a: the alone factor "
          "its pace is read against; the virtual ranks compute about s/a too slow where it is not 1")


if __name__ == "__main__":
    main()
