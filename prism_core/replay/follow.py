"""Following the sandbox ranks' pace: a timed replay scales its virtual ranks' compute by how fast
the sandbox ranks compute now against how fast they computed when they were timed.

The calibrated timeline is timed in the slices, minutes before an emulation runs. On a host whose
speed moves between the two, a rank of interest computes at the speed of the moment while its
virtual peers replay the speed of the timing (bench/fidelity.py: the emulated error goes with how
far the machine moved in between). With `emulation.follow_pace` the assistant reads each sandbox
rank's flight record (nodes closed, nanoseconds of compute so far: trace/flight.py) and compares
its compute over about its last `emulation.pace_steps` steps with a reference for the same
nodes; each virtual compute node then takes its calibrated span times that pace.

The pace is to say how far the host moved since the timing, and so the reference is to be the
rank's compute where it computed as it does in the emulation. The calibrated spans are the loaded
runs' (a neighbour computing beside the rank), what its virtual peers are to take; an emulated
rank, beside its assistant, has computed 0.97-1.00 of its record's same rank from day to day
(bench/MEASURED.md items 42, 52, 59, 60), and read against the loaded spans its virtual peers
followed it that much too fast (items 59-60: the emulations a median 2% low on ep2 and tp2).
The default reference (`emulation.pace_reference: timed`) is the rank's compute in its slice
of the last timing pass, where that pass is a second one (`emulation.timing_passes: 2`): that
slice's assistant replays the first pass's timeline in calibrated time, as an emulation's does,
beside the same spin, and its rank computed as an emulated one does (item 61: its compute over
its loaded run's, a median 0.975, against the emulated rank's 0.981 of its record). It is the
timeline's `alone_span` there: the loaded spans times the slice's compute over its loaded run's at
equal waits (calibrate/durations.py `alone_factor`), the loaded run of the same pass
(calibrate/stage.py). A timeline of one pass has no such spans, and "timed" reads the loaded spans.
`alone` reads `alone_span` whatever the pass: of a first pass, the compute of a plain slice,
whose assistant replays as fast as the graph allows; it came 2.5-3.7 points worse than the loaded
spans in item 43. The pace is read over up to ten steps: the
calibrated spans carry their timing run's step-to-step noise already, and a pace read over one
step put the emulated rank's noise of the previous step on top of it (item 36). Only sandbox
ranks that compute a fair share of what their virtual peers compute are read (`pace_ranks`), and
only where they have cores apart from the assistant's (`shared_cores`).
"""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path

import numpy as np

from prism_core.trace.flight import COMPUTE_NS_FIELD, COMPUTED_FIELD
from prism_core.trace.schema import COMPUTE

CLIP = (0.5, 2.0)    # a pace outside this is a stall or a start-up, not the host's speed
EVERY_S = 2e-3       # the flight records are read at most this often
# the least calibrated compute a pace is taken over: a rank that computes a few milliseconds a step
# (one that mostly waits for its peers) reads over several steps, or not at all in a short run (over
# one step such a rank's pace came 0.58 in a 7-step emulation on a loaded machine, and the virtual
# ranks computed that much faster)
MIN_WINDOW_S = 0.02
# the least share of the virtual ranks' calibrated compute (median rank) a sandbox rank computes for
# its pace to be read: a rank that barely computes says little about how long its peers' compute
# takes (in a make test a rank computing ~1% of its peer's read 0.5 -- it had computed beside the
# peer's slice in the timing and alone in the emulation -- and the peer's 0.3 s came in 0.15 s)
MIN_SHARE = 0.25


def reference_compute(kind: np.ndarray, step: np.ndarray, span: np.ndarray,
                      warmup: int = 0) -> tuple[np.ndarray, float, int]:
    """One rank's reference: the cumulative calibrated compute before each node (length nodes + 1),
    the window to compare over (its calibrated compute per step after `warmup`, at least
    `MIN_WINDOW_S`), and the node the comparison starts at (the first after the warm-up steps, whose
    start-up compute is no pace)."""
    ref = np.where(kind == COMPUTE, span, 0.0)
    cum = np.concatenate([[0.0], np.cumsum(ref)])
    measured = np.nonzero(step >= warmup)[0]
    if not len(measured):
        return cum, 0.0, len(kind)
    start = int(measured[0])
    steps = int(step.max()) + 1 - warmup
    return cum, max(float(cum[-1] - cum[start]) / steps, MIN_WINDOW_S), start


def shared_cores(placement: dict) -> str | None:
    """Why a launch's ranks compute beside its assistant (`placement.json`, launch/launcher.py), or
    None where each has a core of its own. Beside the assistant a rank's pace is the assistant's
    load on it, not the host's speed, and its virtual peers, which stand for ranks with cores of
    their own, are not to take it: the demo's two ranks of interest, unbound beside an assistant
    replaying 62 virtual ranks, read a pace of 1.30 and 1.51 in two runs (the second with the
    assistant's CPU time within their compute left out), and their virtual peers computed that
    much slower."""
    if not placement.get("bound"):
        return f"not bound to cores: {placement.get('reason', 'no placement')}"
    shared = sorted(set(placement.get("assistant") or []) & set((placement.get("ranks") or {}).values()))
    return f"the assistant shares cores {shared} with the ranks" if shared else None


def reference_spans(span: np.ndarray, alone_span: np.ndarray | None, timed_pass: bool,
                    reference: str) -> tuple[np.ndarray, str]:
    """What a pace is read against (`emulation.pace_reference`), and its name for the run's stats:
    "loaded", the calibrated spans; "alone", the timeline's alone spans where it has them; "timed",
    those only where its last pass was timed (`timed_pass`), else the calibrated spans."""
    if reference not in ("alone", "loaded", "timed"):
        raise ValueError(f"pace reference {reference!r}: alone, loaded or timed")
    if alone_span is not None and (reference == "alone" or (reference == "timed" and timed_pass)):
        return alone_span, reference
    return span, "loaded"


def pace_ranks(kind: np.ndarray, step: np.ndarray, offsets: np.ndarray, span: np.ndarray,
               sandbox: list[int], warmup: int = 0) -> list[int]:
    """The sandbox ranks whose pace is read: those whose calibrated compute after the warm-up steps
    is at least `MIN_SHARE` of the virtual ranks' median (all of them where no rank is virtual).
    Ranks that hold no nodes (a graph loaded for the sandbox's neighbours only) do not count."""
    cum = np.concatenate([[0.0], np.cumsum(np.where((kind == COMPUTE) & (step >= warmup), span, 0.0))])
    per_rank = cum[offsets[1:]] - cum[offsets[:-1]]
    held = np.nonzero(np.diff(offsets) > 0)[0]
    virtual = np.setdiff1d(held, sandbox)
    if not len(virtual):
        return sorted(sandbox)
    floor = MIN_SHARE * float(np.median(per_rank[virtual]))
    return [r for r in sorted(sandbox) if per_rank[r] >= floor]


class PaceFollower:
    """`flights`: sandbox rank -> its flight record; `reference`: sandbox rank -> (cumulative
    reference compute per node count, window in reference seconds, first node compared), from
    `reference_compute`."""

    def __init__(self, flights: dict[int, Path], reference: dict[int, tuple[np.ndarray, float, int]],
                 off: str | None = None, steps: int = 1, against: str = "loaded"):
        self.flights, self.reference, self.off = flights, reference, off   # off: why no pace is read
        self.against = against            # what the reference is (for the run's stats)
        self.steps = max(int(steps), 1)   # the pace is read over up to this many windows (steps)
        self.maps: dict[int, np.memmap] = {}
        self.history: dict[int, deque] = {r: deque() for r in flights}
        self.pace, self._read_at = 1.0, -np.inf
        self.paces: list[float] = []      # each new pace, for the run's stats

    def _map(self, rank: int):
        mm = self.maps.get(rank)
        if mm is None:
            try:
                mm = self.maps[rank] = np.memmap(self.flights[rank], dtype=np.int64, mode="r")
            except (OSError, ValueError):     # the rank has not started its record yet
                return None
        return mm if len(mm) > COMPUTE_NS_FIELD else None

    def factor(self) -> float:
        """The pace now: the sandbox ranks' compute over about their last `steps` steps (fewer
        until that many have been seen) against the reference for the same nodes (1 until a whole
        window has been seen)."""
        now = time.perf_counter()
        if now - self._read_at < EVERY_S:
            return self.pace
        self._read_at = now
        live = ref = 0.0
        for rank, history in self.history.items():
            mm = self._map(rank)
            if mm is None:
                continue
            nodes = int(mm[COMPUTED_FIELD])        # the count first: the writer stores the time before it
            ns = int(mm[COMPUTE_NS_FIELD])
            cum, window, start = self.reference[rank]
            if nodes < start:
                continue
            at = float(cum[min(nodes, len(cum) - 1)])
            if not history or history[-1][0] != nodes:
                history.append((nodes, ns * 1e-9, at))
            # the oldest sample kept is the newest one `steps` whole windows back
            while len(history) > 2 and at - history[1][2] >= self.steps * window:
                history.popleft()
            first = history[0]
            if at - first[2] >= window > 0:
                live += history[-1][1] - first[1]
                ref += at - first[2]
        if ref > 0:
            pace = min(max(live / ref, CLIP[0]), CLIP[1])
            if pace != self.pace:
                self.paces.append(pace)
            self.pace = pace
        return self.pace

    def stats(self) -> dict:
        p = np.asarray(self.paces)
        return {"ranks": sorted(self.flights), "off": self.off, "updates": len(p),
                "against": self.against, "steps": self.steps, "median": float(np.median(p)) if len(p) else None,
                "min": float(p.min()) if len(p) else None, "max": float(p.max()) if len(p) else None}
