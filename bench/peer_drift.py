"""What the followed pace gave each emulation's virtual peer, against what its real counterpart
computed in the same turns, read from kept two-rank fidelity pairs (`fidelity.py --turns ... --keep`).

An emulation of rank s replays its peer v at v's calibrated compute times the pace s computes at
against its own calibrated compute (replay/follow.py). That is right where the two ranks' speeds
moved alike between the timing (the first half of a pair) and the second record; where they moved
apart, no pace read from s can give v its speed. Per pair and emulated rank s, each rank's compute
per step (the median over the measured steps, as `emulated_pace.py` takes it) in the first record,
the second record and the calibrated timeline, and s's in its emulation; then

- `pace`: s's compute in its emulation over s's in the timeline (what the followed pace reads);
- `needed`: v's compute in the second record over v's in the timeline (the pace v needed);
- `peer`: pace / needed - 1, how much slower (+) or faster (-) the virtual peer computed than its
  real counterpart did beside the emulation, in the same turns;
- `apart`: (v's second record / v's timeline) / (s's second record / s's timeline) - 1, how far
  the two ranks' speeds moved apart from the timing to the second record (peer = -apart where s
  computed in its emulation as in the second record);
- `error`: the emulated rank's figure over the second record's (both ranks' mean).

Last, per config, the medians of peer, |apart| (a pair's two emulations read apart with
opposite signs) and error over its emulations. Since apart turns its sign between a pair's two
emulations, it sets no median: peer's median is how s computed in its emulation against the
second record (`emulated_pace.py`'s s), which the virtual peer follows (bench/MEASURED.md, item 60).

    .venv/bin/python bench/peer_drift.py KEEP [KEEP ...]
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from emulated_pace import compute_per_step
from fidelity import _rank_figure as figure
from kept import read_kept, replayed_timeline, trace_part, warmup_steps
from prism_core.trace import Trace

FIELDS = ("kind", "step", "t_start", "t_end")


@dataclass
class PeerDrift:
    config: str
    pair: str
    rank: int             # s, the emulated rank; its peer v is the other
    record: tuple[float, float]    # each rank's compute per step, first record (rank 0, rank 1)
    second: tuple[float, float]    # ... second record
    timeline: tuple[float, float]  # ... calibrated timeline
    emulated: float       # s's in its emulation
    error: float

    @property
    def pace(self) -> float:
        return self.emulated / self.timeline[self.rank]

    @property
    def needed(self) -> float:
        v = 1 - self.rank
        return self.second[v] / self.timeline[v]

    @property
    def peer(self) -> float:
        return self.pace / self.needed - 1

    @property
    def apart(self) -> float:
        return self.needed / (self.second[self.rank] / self.timeline[self.rank]) - 1


def timeline_per_step(trace: Trace, span: np.ndarray, rank: int, warmup: int) -> float:
    """A rank's calibrated compute per step: `compute_per_step` over its nodes of the graph with the
    timeline's spans for times."""
    nodes = trace.rank_slice(rank)
    spans = span[nodes]
    return compute_per_step(trace.columns["kind"][nodes], trace.columns["step"][nodes],
                            np.zeros(len(spans)), spans, warmup)


def read_pair(config: str, trace: Trace, pair: Path) -> list[PeerDrift]:
    if trace.world_size != 2:
        return []
    record, second = pair / "record", pair / "record_e"
    warmup = warmup_steps(second)
    with np.load(replayed_timeline(pair)) as timeline:
        span = timeline["span"]
    runs = {name: tuple(compute_per_step(**trace_part(run, r, FIELDS), warmup=warmup_steps(run)) for r in range(2))
            for name, run in (("record", record), ("second", second))}
    calibrated = tuple(timeline_per_step(trace, span, r, warmup) for r in range(2))
    real = statistics.mean(figure(second, r, warmup) for r in range(2))
    out = []
    for r in range(2):
        run = pair / f"emulate_{r}"
        if not (run / "trace_parts" / f"{r}.npz").exists():
            continue
        emulated = compute_per_step(**trace_part(run, r, FIELDS), warmup=warmup_steps(run))
        out.append(PeerDrift(config, pair.name, r, runs["record"], runs["second"], calibrated, emulated,
                             figure(run, r, warmup_steps(run)) / real - 1))
    return out


def main() -> None:
    rows = read_kept(__doc__.split("\n\n")[0], read_pair, "kept two-rank pair with a second record")
    ms = 1e3
    print(f"{'config':7} {'pair':6} {'rank':>4}   {'record (ms)':>13} {'second (ms)':>13} {'timeline (ms)':>13} "
          f"{'emulated':>8}   {'pace':>6} {'needed':>6} {'peer':>7} {'apart':>7} {'error':>7}")
    for d in rows:
        print(f"{d.config:7} {d.pair:6} {d.rank:4d}   {d.record[0] * ms:6.1f} {d.record[1] * ms:6.1f} "
              f"{d.second[0] * ms:6.1f} {d.second[1] * ms:6.1f} {d.timeline[0] * ms:6.1f} {d.timeline[1] * ms:6.1f} "
              f"{d.emulated * ms:8.1f}   {d.pace:6.3f} {d.needed:6.3f} {d.peer:+7.2%} {d.apart:+7.2%} {d.error:+7.2%}")
    print(f"\n{'config':7} {'n':>3} {'peer':>7} {'|apart|':>7} {'error':>7}")
    for config in [*sorted({d.config for d in rows}), "all"]:
        group = [d for d in rows if config in ("all", d.config)]
        print(f"{config:7} {len(group):3d} {statistics.median(d.peer for d in group):+7.2%} "
              f"{statistics.median(abs(d.apart) for d in group):7.2%} {statistics.median(d.error for d in group):+7.2%}")
    print("compute per step: the median over the measured steps, rank 0 then rank 1; pace: the emulated rank's "
          "emulation over its timeline; needed: its peer's second record over its timeline; peer: pace / needed - 1 "
          "(the virtual peer's compute against its real counterpart's in the same turns); apart: how far the two "
          "ranks' speeds moved apart from the timing to the second record (|apart|: either way); error: the emulated "
          "figure over the second record's")


if __name__ == "__main__":
    main()
