"""Flight record: what each rank is doing with communication right now, readable from outside.

Each rank keeps a tiny memory-mapped file (`flight/<rank>.bin`) with its latest communication
state — issuing, waiting or idle, and the op, group, sequence number, size and peer — plus its
group table (`flight/<rank>.groups.json`, rewritten only when a new group is first used). An
update is one slice store into the map, no system call. When a job hangs or fails, the launcher
reads every rank's record to name who waits in which op and to spot mismatched collectives.
The record also counts the rank's nodes up to its latest op issued, which the other members of
a co-run keep their virtual copy of this rank to (`replay/pacing.py`; only there is a nudge
sent, one datagram per op), and the time it has spent in compute, which a timed replay can
follow (`replay/follow.py`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from prism_core.trace.schema import OPS

IDLE, ISSUING, WAITING = 0, 1, 2
_STATE_NAMES = {ISSUING: "is issuing", WAITING: "waits in"}
# state, op, group, seq, bytes, peer, optimizer steps done, nodes up to the latest op issued,
# nodes up to the latest compute node closed, ns spent in compute nodes so far
_FIELDS = 10
ISSUED_FIELD = 7
COMPUTED_FIELD, COMPUTE_NS_FIELD = 8, 9


class Flight:
    def __init__(self, directory: Path, rank: int, nudger=None):
        directory.mkdir(parents=True, exist_ok=True)
        self.directory, self.rank = directory, rank
        self.mm = np.memmap(directory / f"{rank}.bin", dtype=np.int64, mode="w+", shape=(_FIELDS,))
        self.mm[:] = (IDLE, 0, -1, -1, 0, -1, 0, 0, 0, 0)
        self.nudger = nudger   # replay.pacing.Nudger: the co-run members that keep a virtual rank to this one

    def issued(self, node: int) -> None:
        """The op at node index `node` is being issued: read by co-run members (replay/pacing.py)."""
        self.mm[ISSUED_FIELD] = node + 1
        if self.nudger is not None:
            self.nudger.nudge()

    def computed(self, nodes: int, ns: int) -> None:
        """The rank has closed its compute nodes up to node index `nodes` - 1, `ns` of compute in all:
        read by a timed replay that follows this rank's pace (replay/follow.py). The time goes in
        before the count, so a reader never counts a node whose time is missing."""
        self.mm[COMPUTE_NS_FIELD] = ns
        self.mm[COMPUTED_FIELD] = nodes

    def set(self, state: int, op: int, group: int, seq: int, nbytes: int, peer: int) -> None:
        self.mm[:6] = (state, op, group, seq, nbytes, peer)

    def step(self, done: int) -> None:
        """Optimizer steps this rank has completed (progress, read from outside)."""
        self.mm[6] = done

    def idle(self) -> None:
        self.mm[0] = IDLE

    def groups(self, groups: dict[str, tuple[int, ...]]) -> None:
        path = self.directory / f"{self.rank}.groups.json"
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps([list(g) for g in groups.values()]))
        os.replace(tmp, path)


def read_flights(directory: Path, world_size: int) -> dict[int, dict]:
    """Each rank's current state, for ranks that are issuing or waiting."""
    out = {}
    for rank in range(world_size):
        path = directory / f"{rank}.bin"
        try:
            state, op, group, seq, nbytes, peer, *_ = (int(v) for v in np.fromfile(path, dtype=np.int64,
                                                                                  count=_FIELDS))
            groups = json.loads((directory / f"{rank}.groups.json").read_text())
        except (OSError, ValueError):
            continue
        if state in _STATE_NAMES and 0 <= group < len(groups):
            out[rank] = {"state": state, "op": OPS[op], "group": tuple(groups[group]), "seq": seq, "bytes": nbytes,
                         "peer": peer}
    return out


def _read_field(directory: Path, ranks: list[int], field: int) -> dict[int, int]:
    out = {}
    for rank in ranks:
        try:
            values = np.fromfile(directory / f"{rank}.bin", dtype=np.int64, count=_FIELDS)
        except OSError:
            continue
        if len(values) == _FIELDS:
            out[rank] = int(values[field])
    return out


def read_steps(directory: Path, ranks: list[int]) -> dict[int, int]:
    """Optimizer steps each rank has completed, for the ranks whose record is there."""
    return _read_field(directory, ranks, 6)


def read_issued(directory: Path, ranks: list[int]) -> dict[int, int]:
    """How many of its graph's nodes each rank has come to (up to its latest op issued), for the
    ranks whose record is there: progress finer than a step."""
    return _read_field(directory, ranks, ISSUED_FIELD)


def explain(flights: dict[int, dict]) -> str:
    """One paragraph: mismatched collectives first, then where every busy rank stands."""
    if not flights:
        return ""
    lines = []
    by_call: dict[tuple, dict[int, str]] = {}
    for rank, f in flights.items():
        if f["op"] not in ("send", "recv"):
            by_call.setdefault((f["group"], f["seq"]), {})[rank] = f["op"]
    for (group, seq), ops in sorted(by_call.items()):
        if len(set(ops.values())) > 1:
            calls = ", ".join(f"rank {r} calls {op}" for r, op in sorted(ops.items()))
            lines.append(f"mismatched collectives on group {list(group)} (call #{seq}): {calls}")
    for rank, f in sorted(flights.items()):
        peer = f" with rank {f['peer']}" if f["op"] in ("send", "recv") else ""
        lines.append(f"rank {rank} {_STATE_NAMES[f['state']]} {f['op']}{peer} #{f['seq']} of group "
                     f"{list(f['group'])} ({f['bytes']} B)")
    return "\n".join(lines)
