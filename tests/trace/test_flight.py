"""Flight record: per-rank communication state read from outside, and the hang explanation."""

from __future__ import annotations

import time

import pytest

from prism_core.replay.stopped import StoppedTime, StoppedWriter
from prism_core.trace.flight import (COMPUTE_NS_FIELD, COMPUTED_FIELD, IDLE, ISSUING, WAITING, Flight, explain,
                                     read_flights, read_issued, read_steps)
from prism_core.trace import recorder
from prism_core.trace.recorder import Recorder
from prism_core.trace.schema import OP_CODE

WORLD = (0, 1, 2, 3)


def test_mismatched_collectives_named(tmp_path):
    flights = [Flight(tmp_path, r) for r in range(4)]
    # ranks know the groups in different orders: the record must map ids through each rank's table
    flights[0].groups({"world": WORLD, "tp": (0, 1)})
    flights[1].groups({"tp": (0, 1), "world": WORLD})
    flights[2].groups({"world": WORLD})
    flights[3].groups({"world": WORLD})
    flights[0].set(WAITING, OP_CODE["allreduce"], 0, 5, 4096, -1)
    flights[1].set(WAITING, OP_CODE["broadcast"], 1, 5, 4096, 0)
    flights[2].set(ISSUING, OP_CODE["allreduce"], 0, 5, 4096, -1)
    flights[3].set(WAITING, OP_CODE["allreduce"], 0, 4, 4096, -1)
    flights[3].idle()                                  # done: not reported

    read = read_flights(tmp_path, 4)
    assert sorted(read) == [0, 1, 2]
    assert read[1] == {"state": WAITING, "op": "broadcast", "group": WORLD, "seq": 5, "bytes": 4096, "peer": 0}
    text = explain(read)
    lines = text.splitlines()
    assert lines[0] == ("mismatched collectives on group [0, 1, 2, 3] (call #5): rank 0 calls allreduce, "
                        "rank 1 calls broadcast, rank 2 calls allreduce")
    assert lines[1:] == [
        "rank 0 waits in allreduce #5 of group [0, 1, 2, 3] (4096 B)",
        "rank 1 waits in broadcast #5 of group [0, 1, 2, 3] (4096 B)",
        "rank 2 is issuing allreduce #5 of group [0, 1, 2, 3] (4096 B)",
    ]
    assert "rank 3" not in text


def test_matching_collectives_and_p2p(tmp_path):
    flights = [Flight(tmp_path, r) for r in range(3)]
    for f in flights:
        f.groups({"world": (0, 1, 2)})
    flights[0].set(WAITING, OP_CODE["allreduce"], 0, 2, 64, -1)
    flights[1].set(WAITING, OP_CODE["allreduce"], 0, 2, 64, -1)
    flights[2].set(WAITING, OP_CODE["recv"], 0, 0, 8, 1)
    text = explain(read_flights(tmp_path, 3))
    assert "mismatched" not in text
    assert text.splitlines()[-1] == "rank 2 waits in recv with rank 1 #0 of group [0, 1, 2] (8 B)"


def test_idle_missing_and_unknown_group_are_omitted(tmp_path):
    a, b = Flight(tmp_path, 0), Flight(tmp_path, 1)
    a.groups({"world": (0, 1, 2)})
    b.groups({"world": (0, 1, 2)})
    b.set(WAITING, OP_CODE["allreduce"], 3, 0, 8, -1)   # a group id the rank's table lacks
    # rank 0: idle from the start; rank 1: bad group; rank 2: no files at all
    assert read_flights(tmp_path, 3) == {}
    assert explain({}) == ""


def test_recorder_drives_the_flight(tmp_path):
    flights_dir = tmp_path / "flight"
    rec = Recorder(1)
    rec.flight = Flight(flights_dir, 1)
    assert read_flights(flights_dir, 2) == {}          # no group table yet
    idx = rec.issue("allreduce", "world", (0, 1), -1, 128, "float32")
    assert read_flights(flights_dir, 2)[1]["state"] == ISSUING
    rec.issued(idx)
    assert rec.flight.mm[0] == IDLE and read_flights(flights_dir, 2) == {}
    inline, began = rec.wait_begin(idx, blocking=True)
    assert read_flights(flights_dir, 2) == {1: {"state": WAITING, "op": "allreduce", "group": (0, 1), "seq": 0,
                                                "bytes": 128, "peer": -1}}
    rec.wait_end(idx, inline, began)
    assert read_flights(flights_dir, 2) == {}
    # a second group is added to the table the launcher reads
    idx = rec.issue("send", "pp", (1, 3), 3, 16, "float32", 4, (1, 3, 4))
    rec.issued(idx)
    rec.wait_begin(idx, blocking=True)
    assert explain(read_flights(flights_dir, 2)) == "rank 1 waits in send with rank 3 #0 of group [1, 3] (16 B)"


def test_steps_are_read_from_outside(tmp_path):
    a, b = Flight(tmp_path, 0), Flight(tmp_path, 1)
    a.step(3)
    a.set(1, 0, 0, 5, 8, -1)            # an op update keeps the step count
    assert read_steps(tmp_path, [0, 1, 2]) == {0: 3, 1: 0}
    b.step(1)
    assert read_steps(tmp_path, [0, 1]) == {0: 3, 1: 1}


def test_nodes_issued_are_read_from_outside(tmp_path):
    a, b = Flight(tmp_path, 0), Flight(tmp_path, 1)
    assert read_issued(tmp_path, [0, 1, 2]) == {0: 0, 1: 0}
    a.issued(41)                        # node 41 is being issued: 42 nodes reached
    a.step(2)
    b.issued(0)
    assert read_issued(tmp_path, [0, 1]) == {0: 42, 1: 1}
    assert read_steps(tmp_path, [0]) == {0: 2}


def test_recorder_publishes_its_compute_time(tmp_path):
    rec = Recorder(0)
    rec.flight = Flight(tmp_path, 0)
    rec.push("forward", 0, -1)              # closes the compute before it: node 0
    time.sleep(0.02)
    idx = rec.issue("allreduce", "world", (0, 1), -1, 8, "float32")     # closes node 1 (20 ms), issues node 2
    rec.issued(idx)
    nodes, ns = int(rec.flight.mm[COMPUTED_FIELD]), int(rec.flight.mm[COMPUTE_NS_FIELD])
    assert nodes == 2 == idx
    rows = rec.rows[:2]
    assert ns == sum(int((r[-1] - r[-2]) * 1e9) for r in rows) and ns >= 20_000_000


def test_compute_time_leaves_out_the_launch_s_stopped_time(tmp_path):
    writer = StoppedWriter(tmp_path / "stopped")
    rec = Recorder(0)
    rec.flight, rec.stopped = Flight(tmp_path, 0), StoppedTime(tmp_path / "stopped")
    idx = rec.issue("allreduce", "world", (0, 1), -1, 8, "float32")
    rec.issued(idx)
    before = int(rec.flight.mm[COMPUTE_NS_FIELD])
    time.sleep(0.03)
    writer.set(0.02)                        # 20 ms of that compute the launch was held stopped
    rec.push("backward", 0, -1)
    span = rec.rows[-1][-1] - rec.rows[-1][-2]
    assert int(rec.flight.mm[COMPUTE_NS_FIELD]) - before == pytest.approx((span - 0.02) * 1e9, abs=2)
    writer.set(0.05)                        # a stop while it waited in a collective: not compute
    idx = rec.issue("allreduce", "world", (0, 1), -1, 8, "float32")
    rec.issued(idx)
    before = int(rec.flight.mm[COMPUTE_NS_FIELD])
    rec.push("forward", 0, -1)
    assert int(rec.flight.mm[COMPUTE_NS_FIELD]) - before == pytest.approx(
        (rec.rows[-1][-1] - rec.rows[-1][-2]) * 1e9, abs=2)


class _StoppedHost:
    """A clock and a launch's stopped total where a stop can fall right after the time is read
    (`stop_after_next_read`), as SIGSTOP can between any two instructions."""

    def __init__(self):
        self.t, self.held, self.pending = 100.0, 0.0, 0.0

    def now(self) -> float:
        t = self.t
        if self.pending:       # stopped now; the total is written before the continue
            self.t += self.pending
            self.held += self.pending
            self.pending = 0.0
        return t

    def total(self) -> float:
        return self.held


def test_a_stop_right_after_the_time_is_read_is_not_compute(tmp_path, monkeypatch):
    host = _StoppedHost()
    monkeypatch.setattr(recorder, "_now", host.now)
    rec = Recorder(0)
    rec.flight, rec.stopped = Flight(tmp_path, 0), host

    def compute_ns() -> int:
        return int(rec.flight.mm[COMPUTE_NS_FIELD])

    idx = rec.issue("send", "world", (0, 1), 1, 8, "float32")
    host.pending = 0.5                  # stopped as the compute after the issue starts
    rec.issued(idx)
    before = compute_ns()
    host.t += 0.010
    rec.push("forward", 0, -1)          # 10 ms of compute, not 510
    assert compute_ns() - before == pytest.approx(10_000_000, abs=1_000)
    before = compute_ns()
    host.t += 0.020
    host.pending = 0.5                  # stopped as the next node closes
    rec.pop()
    host.t += 0.005
    rec.push("backward", 0, -1)         # 20 ms, then 5 ms: neither loses its time nor gains the stop
    assert compute_ns() - before == pytest.approx(25_000_000, abs=1_000)
    starts = [row[-2] for row in rec.rows[-2:]]
    assert starts[1] - starts[0] == pytest.approx(0.520)     # the node's times are the wall clock's
