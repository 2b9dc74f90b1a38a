"""What a slice's times say about one sandbox rank's nodes (`prism_core.calibrate.durations`).

Hand-built: rank 0 posts an asynchronous receive, computes, then waits for it; rank 1 (the peer)
sends. The receive's completion is only seen at the wait (gloo p2p works have no callback).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from prism_core.calibrate.durations import _rank_timing
from prism_core.trace.matching import match_ops

from tests.calibrate.test_timeline import build, compute, recv, send, wait


def _timing(tmp_path, peer_arrives: float, wait_from: float, wait_to: float):
    trace, _ = build([[recv(1, 0.0, async_=True), compute(1.0), wait(0, 0.0), compute(0.5)],
                      [send(0, 0.1)]], [(0, 1)])
    cols = {k: v.copy() for k, v in trace.rank(0).items()}
    cols["t_start"] = np.array([1.0, 1.01, wait_from, wait_to])
    cols["t_end"] = np.array([wait_to, wait_from, wait_to, wait_to + 0.5])   # the recv's end: seen at the wait
    match = match_ops(trace)
    last = np.full(match.n_ops, -np.inf)
    last[match.op_id[0]] = max(1.0, peer_arrives)             # the op's last member's arrival
    (tmp_path / "results").mkdir(exist_ok=True)
    (tmp_path / "results" / "0.json").write_text(json.dumps({"step_times_s": [wait_to + 0.5 - 1.0]}))
    return _rank_timing(trace, match, 0, cols, last, tmp_path)


def test_a_peer_there_before_the_wait_makes_the_wait_take_the_time(tmp_path):
    # the peer arrived at 1.5, while rank 0 computed; the wait ran 3.0 -> 3.2: the 1.5 s between
    # was rank 0's own work (a bound rank moves the bytes only once it blocks), and the 0.2 s the
    # wait's, so a timeline with the peer later or earlier moves the op, not rank 0's work
    t = _timing(tmp_path, peer_arrives=1.5, wait_from=3.0, wait_to=3.2)
    assert t.transfer[0] == 0.0 and t.completes_synced[0]
    assert t.span[2] == pytest.approx(0.2)


def test_a_peer_later_than_the_wait_counts_from_its_arrival(tmp_path):
    t = _timing(tmp_path, peer_arrives=3.1, wait_from=3.0, wait_to=3.2)
    assert t.transfer[0] == pytest.approx(0.1)
    assert t.span[2] == pytest.approx(0.0)


def test_a_wait_on_a_finished_op_takes_nothing(tmp_path):
    t = _timing(tmp_path, peer_arrives=1.5, wait_from=3.0, wait_to=3.0)
    assert t.transfer[0] == 0.0 and t.span[2] == pytest.approx(0.0)
