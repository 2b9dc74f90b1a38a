"""In-process recording of one rank's PrismTrace while the real program runs.

The prism backend calls `issue` / `complete` / `wait_begin` / `wait_end` around every op;
`prism_core.annotate` calls `push` / `pop`; the runtime calls `iteration_end` after each
`optimizer.step()`. Each call closes the compute node that ran since the previous point. Rows
are kept as small Python lists (cheap to append) and turned into columns once, at the end.
Beside each compute node that had any, the time the recording thread waited for a core within it
(`trace/run_delay.py`), in the part's `queued_node` / `queued_s`, with the CPU time the process's
other threads ran within it (`queued_own_s`) and the launch's assistant ran (`queued_helper_s`,
zero where the launcher named none that shares the rank's core); beside each communication node,
the moment the backend handed the op over to the wire (a ring's thread starting it, or the call
into gloo beginning), in `wire_node` / `wire_t`: what the rank's own issue cost before its op could move.
Beside every compute node, the CPU time the recording thread itself ran within it (its thread CPU
clock), in `oncpu_node` / `oncpu_s`: a span longer than another run's at the same node splits into
this, the wait for a core, and time blocked (bench/MEASURED.md, item 34).
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from prism_core.trace.flight import ISSUING, WAITING
from prism_core.trace.run_delay import OwnThreads, ProcessCpu, RunDelay
from prism_core.trace.schema import COLUMNS, COMM, COMPUTE, OP_CODE, REDUCE_CODE, WAIT

_now = time.perf_counter
_thread_cpu = time.thread_time_ns   # exact for the running thread (schedstat's sum lags until the next tick)
_NCOL = len(COLUMNS)
_T_START, _T_END = list(COLUMNS).index("t_start"), list(COLUMNS).index("t_end")
_ASYNC = list(COLUMNS).index("async_")


class Recorder:
    def __init__(self, rank: int):
        self.rank = rank
        self.rows: list[list] = []
        self.groups: dict[str, tuple[int, ...]] = {}   # group name -> global ranks
        self._group_ids: dict[str, int] = {}
        self.labels: dict[str, int] = {"": 0}
        self.dtypes: dict[str, int] = {"": 0}
        self.splits: dict[str, int] = {"": 0}
        self._stack: list[tuple[int, int, int]] = []
        self.step = 0
        self.step_peaks: list[int | None] = []
        self._mark = _now()
        self._last_issue: int | None = None   # index of the comm node if it is the latest point
        self._seq: dict[tuple, int] = defaultdict(int)
        self.memory = None   # object with peak_bytes() / reset_peak() / current_bytes(), when memory is tracked
        self.live: list[tuple[int, int]] = []   # (compute node, live tensor bytes at its end): the memory plot
        self.flight = None   # trace.flight.Flight, when the launcher watches this rank
        self._compute_ns = 0   # time in compute nodes so far, for the flight record
        # a launch held stopped from outside (replay/stopped.py): its stopped seconds so far, which
        # the compute time in the flight record leaves out (read with the time: `_clock`)
        self.stopped = None
        self._held_mark = 0.0
        self._delay = RunDelay.of_this_thread()     # the thread that starts the recorder runs the program
        self._delay_mark = self._delay.read() if self._delay is not None else 0
        self._cpu_mark = _thread_cpu()
        self.oncpu: list[tuple[int, int]] = []     # (compute node, ns the recording thread ran within it)
        self._own = OwnThreads() if self._delay is not None else None
        self._own_mark = self._own.read() if self._own is not None else 0
        self._helper = ProcessCpu.of_helper() if self._delay is not None else None
        self._helper_mark = self._helper.read() if self._helper is not None else 0
        # (compute node, ns its thread waited for a core, ns the process's other threads ran,
        #  ns the assistant ran)
        self.queued: list[tuple[int, int, int, int]] = []
        self.wire: list[tuple[int, float]] = []     # (comm node, when the backend handed it over to the wire)

    # -- points ------------------------------------------------------------------------------
    def _clock(self) -> tuple[float, float]:
        """Now, and the launch's stopped seconds so far (0 where it is not stopped from outside),
        read with no stop between the two. The total is written before each continue, so a stop
        that fell between reading the time and reading the total came back as compute: the
        whole stop, 0.5 s, in 2 of 64 emulations of bench/fidelity.py (bench/MEASURED.md item 42), whose
        pace then read up to 1.39 and 1.96 for ten steps, and their virtual ranks computed that
        much slower. A total that moved while the time was read is read again."""
        if self.stopped is None:
            return _now(), 0.0
        while True:
            held = self.stopped.total()
            now = _now()
            if self.stopped.total() == held:
                return now, held

    def _close_compute(self, now: float, held: float = 0.0) -> None:
        """Close the compute node since the mark at `now`; `held`: the stopped seconds so far,
        read with `now` (`_clock`)."""
        label, mb, chunk = self._stack[-1] if self._stack else (0, -1, -1)
        self.rows.append([COMPUTE, 0, -1, -1, 0, 0, -1, -1, 0, -1, label, mb, chunk, self.step, 0, 0, self._mark, now])
        if self.flight is not None:
            self._compute_ns += max(int((now - self._mark - (held - self._held_mark)) * 1e9), 0)
            self.flight.computed(len(self.rows), self._compute_ns)
        if self.memory is not None:
            self.live.append((len(self.rows) - 1, self.memory.current_bytes()))
        cpu = _thread_cpu()
        self.oncpu.append((len(self.rows) - 1, cpu - self._cpu_mark))
        self._cpu_mark = cpu
        if self._delay is not None:
            delay, own = self._delay.read(), self._own.read()
            helper = self._helper.read() if self._helper is not None else 0
            if delay > self._delay_mark:
                self.queued.append((len(self.rows) - 1, delay - self._delay_mark, max(own - self._own_mark, 0),
                                    max(helper - self._helper_mark, 0)))
            self._delay_mark, self._own_mark, self._helper_mark = delay, own, helper
        self._mark, self._held_mark = now, held
        self._last_issue = None

    def _compute_from(self, now: float, held: float = 0.0) -> None:
        """Compute starts again at `now` (an op was issued, or a wait ended); `held` as in `_close_compute`."""
        self._mark, self._held_mark = now, held
        self._cpu_mark = _thread_cpu()
        if self._delay is not None:
            self._delay_mark, self._own_mark = self._delay.read(), self._own.read()
            if self._helper is not None:
                self._helper_mark = self._helper.read()

    def push(self, label: str, mb: int, chunk: int) -> None:
        self._close_compute(*self._clock())
        lid = self.labels.setdefault(label, len(self.labels))
        self._stack.append((lid, mb, chunk))

    def pop(self) -> None:
        self._close_compute(*self._clock())
        if self._stack:
            self._stack.pop()

    def iteration_end(self) -> None:
        self._close_compute(*self._clock())
        if self.memory is not None:
            self.step_peaks.append(self.memory.peak_bytes())
            self.memory.reset_peak()
        else:
            self.step_peaks.append(None)
        self.step += 1
        if self.flight is not None:
            self.flight.step(self.step)

    # -- communication -----------------------------------------------------------------------
    def group_id(self, name: str, ranks: tuple[int, ...]) -> int:
        gid = self._group_ids.get(name)
        if gid is None:
            gid = self._group_ids[name] = len(self._group_ids)
            self.groups[name] = ranks
            if self.flight is not None:
                self.flight.groups(self.groups)
        return gid

    def issue(self, op: str, group_name: str, ranks: tuple[int, ...], peer: int, nbytes: int, dtype: str,
              tag: int = -1, p2p_key: tuple | None = None, reduce: str = "", splits: list[int] | None = None) -> int:
        """Record an op at the moment it is issued; returns its node index."""
        now, held = self._clock()
        self._close_compute(now, held)
        gid = self.group_id(group_name, ranks)
        key = (gid,) if p2p_key is None else (gid, *p2p_key)
        seq = self._seq[key]
        self._seq[key] = seq + 1
        did = self.dtypes.setdefault(dtype, len(self.dtypes))
        text = ",".join(map(str, splits)) if splits else ""
        sid = self.splits.setdefault(text, len(self.splits))
        label, mb, chunk = self._stack[-1] if self._stack else (0, -1, -1)
        idx = len(self.rows)
        code = OP_CODE[op]
        self.rows.append([COMM, code, gid, peer, nbytes, did, seq, tag, 0, -1, label, mb, chunk, self.step,
                          REDUCE_CODE[reduce], sid, now, float("nan")])
        if self.flight is not None:
            self.flight.set(ISSUING, code, gid, seq, nbytes, peer)
            self.flight.issued(idx)
        return idx

    def issued(self, idx: int) -> None:
        """The issue call returned: later time is compute (or the wait) again."""
        self._compute_from(*self._clock())
        self._last_issue = idx
        if self.flight is not None:
            self.flight.idle()

    def on_wire(self, idx: int, when: float | None = None) -> None:
        """The op of node `idx` was handed over to the wire (from any thread)."""
        self.wire.append((idx, _now() if when is None else when))

    def complete(self, idx: int, when: float | None = None) -> None:
        """Completion time of an op (from a future callback, on any thread)."""
        row = self.rows[idx]
        t = _now() if when is None else when
        if not row[_T_END] <= t:   # NaN or later: keep the earliest completion seen
            row[_T_END] = t

    def wait_begin(self, idx: int, blocking: bool) -> tuple[bool, float]:
        """`blocking`: the wait is part of a blocking call; it joins the comm node if nothing came between."""
        now, held = self._clock()
        inline = blocking and self._last_issue == idx
        if not inline:
            self._close_compute(now, held)
        if self.flight is not None:
            row = self.rows[idx]
            self.flight.set(WAITING, row[1], row[2], row[6], row[4], row[3])
        return inline, now

    def wait_end(self, idx: int, inline: bool, began: float) -> None:
        now, held = self._clock()
        self.complete(idx, now)
        if self.flight is not None:
            self.flight.idle()
        if inline:
            self._compute_from(now, held)
            self._last_issue = None
            return
        self.rows[idx][_ASYNC] = 1
        label, mb, chunk = self._stack[-1] if self._stack else (0, -1, -1)
        self.rows.append([WAIT, self.rows[idx][1], self.rows[idx][2], -1, 0, 0, -1, -1, 0, idx, label, mb, chunk,
                          self.step, 0, 0, began, now])
        self._compute_from(now, held)

    # -- output ------------------------------------------------------------------------------
    def columns(self) -> dict[str, np.ndarray]:
        self._close_compute(*self._clock())
        if not self.rows:
            return {name: np.empty(0, dtype) for name, dtype in COLUMNS.items()}
        table = list(zip(*self.rows))
        return {name: np.asarray(table[i], dtype=dtype) for i, (name, dtype) in enumerate(COLUMNS.items())}

    def tables(self) -> dict:
        return {"rank": self.rank, "groups": {n: list(r) for n, r in self.groups.items()},
                "group_order": list(self._group_ids), "labels": list(self.labels), "dtypes": list(self.dtypes),
                "splits": list(self.splits),
                "step_peaks": self.step_peaks}

    def write_part(self, directory: Path) -> Path:
        """One file per rank, written atomically; the launcher merges them into the job's store."""
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{self.rank}.npz"
        tmp = directory / f".{self.rank}.{os.getpid()}.tmp.npz"
        columns = self.columns()           # closes the last compute node (and samples it)
        live = np.asarray(self.live, dtype=np.int64).reshape(-1, 2)
        queued = np.asarray(self.queued, dtype=np.int64).reshape(-1, 4)
        wire = sorted(self.wire)
        np.savez(tmp, tables=np.frombuffer(json.dumps(self.tables()).encode(), dtype=np.uint8), **columns,
                 live_node=live[:, 0], live_bytes=live[:, 1], queued_node=queued[:, 0], queued_s=queued[:, 1] * 1e-9,
                 queued_own_s=queued[:, 2] * 1e-9, queued_helper_s=queued[:, 3] * 1e-9,
                 oncpu_node=np.asarray([n for n, _ in self.oncpu], dtype=np.int64),
                 oncpu_s=np.asarray([ns for _, ns in self.oncpu], dtype=np.float64) * 1e-9,
                 wire_node=np.asarray([n for n, _ in wire], dtype=np.int64),
                 wire_t=np.asarray([t for _, t in wire], dtype=np.float64))
        os.replace(tmp, path)
        return path


_active: Recorder | None = None


def start(rank: int) -> Recorder:
    global _active
    from prism_core import annotations

    _active = Recorder(rank)
    annotations.set_sink(_active)
    return _active


def active() -> Recorder | None:
    return _active
