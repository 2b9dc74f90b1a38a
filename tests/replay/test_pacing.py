"""Pacing in a co-run: which virtual ranks keep to which real counterparts, and the wait itself —
released by the counterpart's flight record, nudged or not, and bounded by the deadline."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from prism_core.replay.pacing import ENV_NUDGE, POLL_S, Nudger, Pacer, co_run_pacing, socket_name
from prism_core.trace.flight import Flight


def test_each_member_keeps_to_the_members_running_its_virtual_ranks(tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    pa, pb, pc = co_run_pacing([([0, 1], a), ([2, 3], b), ([0, 1], c)])
    # a's ranks 2, 3 are b's real ranks; c runs a's ranks again (a twin): a keeps to b only
    assert pa.counterparts == {2: b / "flight" / "2.bin", 3: b / "flight" / "3.bin"}
    assert pb.counterparts == {0: a / "flight" / "0.bin", 1: a / "flight" / "1.bin"}
    assert pc.counterparts == {2: b / "flight" / "2.bin", 3: b / "flight" / "3.bin"}
    # b's ranks nudge a's and c's assistants, a's ranks b's; c's ranks are nobody's counterpart
    assert pb.nudge == [pa.socket, pc.socket] and pa.nudge == [pb.socket] and pc.nudge == []
    assert len({pa.socket, pb.socket, pc.socket}) == 3
    # a slice beside its own twin has nobody to keep to
    alone, twin = co_run_pacing([([0], a), ([0], b)])
    assert alone.counterparts == twin.counterparts == {} and alone.nudge == twin.nudge == []


def _waiter(pacer: Pacer, rank: int, node: int) -> tuple[threading.Thread, list]:
    out: list = []

    def wait() -> None:
        try:
            pacer.wait_for(rank, node)
            out.append(time.perf_counter())
        except BaseException as err:  # noqa: BLE001 - checked by the test
            out.append(err)
    thread = threading.Thread(target=wait)
    thread.start()
    return thread, out


def test_an_op_waits_until_its_counterpart_issued_the_node(tmp_path, monkeypatch):
    name = socket_name(tmp_path)
    pacer = Pacer({3: tmp_path / "b" / "3.bin"}, name)
    try:
        pacer.start(time.monotonic() + 30)
        thread, out = _waiter(pacer, 3, 4)        # before the counterpart's record exists
        monkeypatch.setenv(ENV_NUDGE, name)
        counterpart = Flight(tmp_path / "b", 3, Nudger.from_env())
        counterpart.issued(3)                     # nodes 0..3 issued: node 4 not yet
        time.sleep(3 * POLL_S)
        assert thread.is_alive() and not out
        issued = time.perf_counter()
        counterpart.issued(4)
        thread.join(timeout=5)
        assert out and out[0] - issued < 1.0, out
        # the watcher counts a nudge on its own thread: the wait may end on a poll before it
        # has counted the second one
        counted = time.monotonic() + 2.0
        while pacer.nudges < 2 and time.monotonic() < counted:
            time.sleep(POLL_S / 4)
        assert pacer.nudges >= 2 and pacer.waits == 1
        pacer.wait_for(3, 2)                      # a node already issued: no wait
        assert pacer.waits == 1
    finally:
        pacer.close()


def test_a_lost_nudge_is_made_good_and_a_counterpart_that_never_comes_times_out(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_NUDGE, raising=False)
    pacer = Pacer({1: tmp_path / "flight" / "1.bin"}, socket_name(tmp_path))
    try:
        pacer.start(time.monotonic() + 30)
        flight = Flight(tmp_path / "flight", 1)  # nudges nobody
        thread, out = _waiter(pacer, 1, 0)
        time.sleep(2 * POLL_S)
        flight.issued(0)
        thread.join(timeout=5)
        assert out and not isinstance(out[0], BaseException) and pacer.nudges == 0
        pacer.deadline = time.monotonic() + 0.2
        with pytest.raises(TimeoutError, match="rank 1 in the co-run never issued its node 5"):
            pacer.wait_for(1, 5)
    finally:
        pacer.close()
    assert not pacer.thread.is_alive()


def test_a_real_ranks_flight_record_counts_the_nodes_up_to_its_latest_op(tmp_path):
    flight = Flight(Path(tmp_path), 0)
    flight.issued(41)
    pacer = Pacer({0: tmp_path / "0.bin"}, socket_name(tmp_path / "x"))
    try:
        assert pacer.issued(0) == 42
    finally:
        pacer.close()
