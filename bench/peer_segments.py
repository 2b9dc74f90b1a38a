"""Where an emulation's rank of interest spends its collectives, read from kept fidelity pairs
(`fidelity.py --turns ... --keep`), against the second record's same rank.

Per emulation of a two-rank config and per way it ran (`emulate_<rank>` as configured,
`emulate_<rank>_<suffix>` the other way), each a step's sum, the median over the measured steps:
- wait: the rank's wait at its collectives for its peer's issue (the peer's issue less its own,
  where positive); in the record the peer is the real rank, in the emulation the virtual one,
  whose issue is the assistant's arrival (`replay/arrivals.npy`);
- after: the time from both having issued to the rank leaving the collective (the transfer);
- segments: the peer's, from the rank leaving a collective to the peer's issue of its next one;
- timeline x pace: the calibrated spans of the peer's nodes between those two collectives
  (`span` of the timeline it replayed, `kept.replayed_timeline`) times the pace its virtual rank followed
  (`replay/stats.json` -> `follow_pace`): what the virtual peer's clock runs between them. Its
  arrival is its hand-over to gloo less the issue cost it was held for, so that cost is not in
  its segments; what they take beyond this is the virtual peer's lag (late hand-overs, and its
  collective completing after the rank's).
Last, per config and way, the medians of the emulation less the record.

    .venv/bin/python bench/peer_segments.py KEEP [KEEP ...]
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kept import read_kept, replayed_timeline, trace_part, warmup_steps
from prism_core.trace.schema import COMM, P2P_OPS

FIELDS = ("kind", "op", "group", "seq", "step", "t_start", "t_end")


@dataclass
class Collectives:
    """A rank's collectives in the measured steps, each matched with its peer's same one."""
    step: np.ndarray
    wait: np.ndarray      # for the peer's issue (s)
    after: np.ndarray     # from both having issued to the rank's leaving (s)
    segment: np.ndarray   # the peer's, from the rank's leaving to the peer's next issue (s); nan at the last
    peer: np.ndarray      # the peer's node index of the collective
    peer_next: np.ndarray  # the peer's node index of its next collective; -1 at the last


def _collective(part: dict) -> np.ndarray:
    """Its group collectives (sends and receives left out: a peer's issue is not a pair's meeting)."""
    p2p = np.isin(part["op"], sorted(P2P_OPS))
    return (part["kind"] == COMM) & (part["seq"] >= 0) & ~p2p


def collectives(own: dict, peer: dict, peer_issue: np.ndarray, warmup: int) -> Collectives:
    """Match the rank's collectives in its steps `warmup` … last − 1 (the last, which the run's end
    closes, left out) with its peer's by (group, seq), and time each against the peer's issue."""
    peer_comm = np.flatnonzero(_collective(peer))
    where = {(int(peer["group"][j]), int(peer["seq"][j])): n for n, j in enumerate(peer_comm)}
    mine = np.flatnonzero(_collective(own) & (own["step"] >= warmup) & (own["step"] < own["step"].max()))
    order = np.array([where[(int(own["group"][i]), int(own["seq"][i]))] for i in mine], dtype=np.int64)
    j = peer_comm[order]
    nxt = np.where(order + 1 < len(peer_comm), peer_comm[np.minimum(order + 1, len(peer_comm) - 1)], -1)
    issued = peer_issue[j]
    start, end = own["t_start"][mine], own["t_end"][mine]
    segment = np.where(nxt >= 0, peer_issue[np.maximum(nxt, 0)] - end, np.nan)
    return Collectives(own["step"][mine], np.clip(issued - start, 0.0, None), end - np.maximum(start, issued),
                       segment, j, nxt)


def per_step(step: np.ndarray, values: np.ndarray) -> float:
    """The median over steps of each step's sum (nan values left out, and steps with none else)."""
    sums = [np.nansum(v) for v in (values[step == s] for s in np.unique(step)) if not np.isnan(v).all()]
    return float(np.median(sums))


def replayed(c: Collectives, span: np.ndarray) -> np.ndarray:
    """Per collective, the sum of the peer's calibrated spans (`span`: its own nodes) up to its next
    collective; nan at its last."""
    cum = np.concatenate([[0.0], np.cumsum(span)])
    ok = c.peer_next >= 0
    return np.where(ok, cum[np.maximum(c.peer_next, 0)] - cum[c.peer + 1], np.nan)


@dataclass
class Emulation:
    config: str
    pair: str
    rank: int
    way: str                      # "as configured" or the other way's suffix
    record: dict[str, float]      # wait, after, segments (s a step)
    emulated: dict[str, float]    # the same, and "timeline x pace"


def _part(run: Path, rank: int) -> dict[str, np.ndarray]:
    return trace_part(run, rank, FIELDS)


def _figures(c: Collectives) -> dict[str, float]:
    return {"wait": per_step(c.step, c.wait), "after": per_step(c.step, c.after),
            "segments": per_step(c.step, c.segment)}


def read_pair(config: str, pair: Path, offsets: np.ndarray) -> list[Emulation]:
    if len(offsets) != 3:       # two ranks: each emulation's peer is the one virtual rank
        return []
    record = pair / "record_e"
    with np.load(replayed_timeline(pair)) as timeline:
        span = timeline["span"]
    out = []
    for r in (0, 1):
        o = 1 - r
        peer = _part(record, o)
        real = collectives(_part(record, r), peer, peer["t_start"], warmup_steps(record))
        if not real.step.size:      # a pipeline's stages meet in sends and receives only
            continue
        base = _figures(real)
        nodes = slice(int(offsets[o]), int(offsets[o + 1]))
        for run in sorted(pair.glob(f"emulate_{r}*")):
            if not (run / "replay" / "arrivals.npy").exists() or not (run / "trace_parts" / f"{r}.npz").exists():
                continue
            way = run.name.split("_", 2)[2] if run.name.count("_") > 1 else "as configured"
            arrivals = np.load(run / "replay" / "arrivals.npy")[nodes]
            c = collectives(_part(run, r), peer, arrivals, warmup_steps(run))
            pace = json.loads((run / "replay" / "stats.json").read_text()).get("follow_pace") or {}
            emulated = _figures(c) | {"timeline x pace": per_step(c.step, replayed(c, span[nodes]))
                                      * pace.get("median", 1.0)}
            out.append(Emulation(config, pair.name, r, way, base, emulated))
    return out


def main() -> None:
    rows = read_kept(__doc__.split("\n\n")[0], lambda config, trace, pair: read_pair(config, pair, trace.offsets),
                     "kept two-rank pair with a second record and its emulations")
    ms = 1e3
    print(f"{'config':7} {'pair':6} {'rank':>4} {'way':14} {'wait rec':>9} {'emu':>7} {'after rec':>10} {'emu':>7} "
          f"{'segments rec':>13} {'emu':>7} {'timeline x pace':>16}   (ms a step)")
    for e in rows:
        print(f"{e.config:7} {e.pair:6} {e.rank:4d} {e.way:14} {e.record['wait'] * ms:9.2f} "
              f"{e.emulated['wait'] * ms:7.2f} {e.record['after'] * ms:10.2f} {e.emulated['after'] * ms:7.2f} "
              f"{e.record['segments'] * ms:13.2f} {e.emulated['segments'] * ms:7.2f} "
              f"{e.emulated['timeline x pace'] * ms:16.2f}")
    print()
    print(f"{'config':7} {'way':14} {'n':>3} {'wait':>7} {'after':>7} {'segments':>9} {'replayed':>9} {'lag':>7}"
          "   (emulation less record, ms a step, medians)")
    for config, way in sorted({(e.config, e.way) for e in rows}):
        group = [e for e in rows if (e.config, e.way) == (config, way)]

        def med(f):
            return statistics.median(f(e) for e in group) * ms
        print(f"{config:7} {way:14} {len(group):3d} {med(lambda e: e.emulated['wait'] - e.record['wait']):+7.2f} "
              f"{med(lambda e: e.emulated['after'] - e.record['after']):+7.2f} "
              f"{med(lambda e: e.emulated['segments'] - e.record['segments']):+9.2f} "
              f"{med(lambda e: e.emulated['timeline x pace'] - e.record['segments']):+9.2f} "
              f"{med(lambda e: e.emulated['segments'] - e.emulated['timeline x pace']):+7.2f}")
    print("\nwait: the rank's wait at its collectives for its peer's issue; after: from both having issued to its "
          "leaving; segments: the peer's, from the rank's leaving a collective to the peer's next issue; "
          "replayed: the timeline's spans between them times the followed pace, less the record's segments; lag: the "
          "virtual peer's segments less the timeline's spans times the pace")


if __name__ == "__main__":
    main()
