"""bench/peer_segments.py: a rank's collectives split into its wait for its peer and the transfer, and
its peer's segments against what the virtual peer replays, from a kept pair."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from peer_segments import collectives, per_step, read_pair, replayed  # noqa: E402

from prism_core.trace.schema import COMM, COMPUTE, OP_CODE  # noqa: E402

STEPS = 5


def _rank(compute_s: float, comm_s: float, op: str = "allreduce") -> dict[str, np.ndarray]:
    """Per step a compute node of `compute_s` then a collective of `comm_s` (group 0, seq = step)."""
    cols = {k: [] for k in ("kind", "op", "group", "seq", "step", "t_start", "t_end")}
    t = 0.0
    for s in range(STEPS):
        for kind, d in ((COMPUTE, compute_s), (COMM, comm_s)):
            cols["kind"].append(kind), cols["op"].append(OP_CODE[op] if kind == COMM else 0)
            cols["group"].append(0 if kind == COMM else -1), cols["seq"].append(s if kind == COMM else -1)
            cols["step"].append(s), cols["t_start"].append(t), cols["t_end"].append(t + d)
            t += d
    return {k: np.array(v) for k, v in cols.items()}


def test_a_late_peer_is_waited_for_and_the_transfer_counts_from_its_issue():
    own = _rank(0.010, 0.004)
    peer = _rank(0.010, 0.004)
    issue = peer["t_start"] + 0.001          # the peer issues each node 1 ms after the rank
    c = collectives(own, peer, issue, warmup=1)
    assert list(c.step) == [1, 2, 3]          # the warm-up step and the last (the run's end) left out
    assert c.wait == pytest.approx([0.001] * 3)
    assert c.after == pytest.approx([0.003] * 3)
    # from the rank's leaving its collective (t_end) to the peer's next issue: 10 ms of compute + 1 ms
    assert c.segment == pytest.approx([0.011] * 3)
    assert per_step(c.step, c.wait) == pytest.approx(0.001)


def test_an_early_peer_costs_no_wait_and_its_last_collective_has_no_segment():
    own = _rank(0.010, 0.004)
    whole = _rank(0.010, 0.004)
    peer = {k: v[whole["step"] < STEPS - 1] for k, v in whole.items()}    # one step short
    c = collectives(own, peer, peer["t_start"] - 0.002, warmup=0)
    assert c.wait == pytest.approx([0.0] * 4)
    assert c.after == pytest.approx([0.004] * 4)
    peer_comm = np.flatnonzero(peer["kind"] == COMM)
    assert list(c.peer) == list(peer_comm) and list(c.peer_next) == [*peer_comm[1:], -1]
    assert c.segment[:3] == pytest.approx([0.008] * 3) and np.isnan(c.segment[3])
    assert per_step(c.step, c.segment) == pytest.approx(0.008)


def test_sends_and_receives_are_not_collectives():
    own, peer = _rank(0.010, 0.004, op="send"), _rank(0.010, 0.004, op="recv")
    assert collectives(own, peer, peer["t_start"], warmup=0).step.size == 0


def test_replayed_sums_the_peers_spans_up_to_its_next_collective():
    peer = _rank(0.010, 0.004)
    c = collectives(_rank(0.010, 0.004), peer, peer["t_start"], warmup=1)
    span = np.where(peer["kind"] == COMPUTE, 0.010, 0.004)
    assert replayed(c, span) == pytest.approx([0.010] * 3)


def _run(directory: Path, rank: int, part: dict, arrivals: np.ndarray | None = None, pace: float | None = None):
    (directory / "trace_parts").mkdir(parents=True, exist_ok=True)
    np.savez(directory / "trace_parts" / f"{rank}.npz", **part)
    (directory / "config.json").write_text(json.dumps({"job": {"warmup": 1}}))
    if arrivals is not None:
        (directory / "replay").mkdir()
        np.save(directory / "replay" / "arrivals.npy", arrivals)
        (directory / "replay" / "stats.json").write_text(json.dumps({"follow_pace": {"median": pace}}))


def test_read_pair_sets_each_emulations_virtual_peer_against_the_records_real_one(tmp_path):
    n = 2 * STEPS
    for r in (0, 1):
        _run(tmp_path / "record_e", r, _rank(0.010, 0.004))
    nan = np.full(n, np.nan)
    late = _rank(0.010, 0.004)["t_start"] + 0.002            # the virtual peer issues 2 ms late
    _run(tmp_path / "emulate_0", 0, _rank(0.010, 0.004), np.concatenate([nan, late]), pace=1.1)
    _run(tmp_path / "emulate_0_spans", 0, _rank(0.010, 0.004), np.concatenate([nan, late - 0.001]), pace=1.0)
    one = _rank(0.010, 0.004)
    span = np.tile(np.where(one["kind"] == COMPUTE, 0.010, 0.004), 2)
    (tmp_path / "calibrate").mkdir()
    np.savez(tmp_path / "calibrate" / "timeline.npz", span=span)
    rows = read_pair("ep2", tmp_path, np.array([0, n, 2 * n]))
    assert [(e.rank, e.way) for e in rows] == [(0, "as configured"), (0, "spans")]
    configured, spans = rows
    assert configured.record == pytest.approx({"wait": 0.0, "after": 0.004, "segments": 0.010})
    assert configured.emulated == pytest.approx({"wait": 0.002, "after": 0.002, "segments": 0.012,
                                                 "timeline x pace": 0.011})
    assert spans.emulated["wait"] == pytest.approx(0.001) and spans.emulated["timeline x pace"] == pytest.approx(0.010)


def test_read_pair_leaves_out_worlds_other_than_two(tmp_path):
    assert read_pair("dp4", tmp_path, np.array([0, 1, 2, 3, 4])) == []
