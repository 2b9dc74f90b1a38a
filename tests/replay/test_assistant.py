"""The assistant's choice of the ops whose sends it builds while a virtual rank computes up to them."""

from __future__ import annotations

import numpy as np

from prism_core.replay.assistant import AHEAD_MIN_BYTES, builds_ahead, ops_ahead


def test_ops_within_the_horizon_of_calibrated_compute_are_built_once_each():
    # a dp2 step's three all-reduces (8 B, 1 MB, 3 MB): 3.9 ms of compute before the first, 130 ms
    # before the second, 0.8 ms before the third; two steps
    before = np.cumsum([0.0039, 0.130, 0.0008] * 2)
    # early in the long stretch (op 1 next) nothing is near enough
    assert ops_ahead(before, 0.0039 + 0.05, 1, 1, ahead_s=0.02) == range(1, 1)
    # near its end both gradient all-reduces come in, and the next step's 8 B one 3.9 ms after them
    assert ops_ahead(before, before[1] - 0.01, 1, 1, ahead_s=0.02) == range(1, 4)
    # in the 0.8 ms between the two the next step's 1 MB and 3 MB ones stay out: nothing new
    assert ops_ahead(before, before[1] + 0.0004, 2, 4, ahead_s=0.02) == range(4, 4)
    # no more than `most` at once, from the next op on
    assert ops_ahead(before, 0.0, 0, 0, ahead_s=1.0, most=2) == range(0, 2)
    assert ops_ahead(before, 0.0, 0, 0, ahead_s=1.0) == range(0, 6)
    assert ops_ahead(before, 0.0, 2, 0, ahead_s=1.0) == range(2, 6)
    # past the last op: nothing
    assert ops_ahead(before, before[-1] + 1.0, 6, 6) == range(6, 6)


def test_a_single_long_node_builds_what_follows_it_when_it_starts():
    # one 100 ms node before the op: the horizon counts from the node's end, where the rank sleeps to
    before = np.array([0.100])
    assert ops_ahead(before, 0.100, 0, 0, ahead_s=0.02) == range(0, 1)


def test_only_parts_that_read_much_of_the_cache_are_built_ahead():
    # dp2's 1 MB and 3 MB gradient all-reduces fold both members' partials: built ahead
    assert builds_ahead(1 << 20, 2) and builds_ahead(3 << 20, 2)
    # tp2's 128-256 KB activation all-reduces are built at the op, inside the timer's lead
    assert not builds_ahead(128 << 10, 2) and not builds_ahead(256 << 10, 2)
    # the same 256 KB op over a 64-member group reads 16 MB of partials: built ahead
    assert builds_ahead(256 << 10, 64)
    # the bound itself is in
    assert builds_ahead(AHEAD_MIN_BYTES // 4, 4) and not builds_ahead(AHEAD_MIN_BYTES // 4 - 1, 4)
    assert builds_ahead(100, 2, min_bytes=0)
