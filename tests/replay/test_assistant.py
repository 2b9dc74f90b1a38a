"""The assistant's choice of the ops whose sends it builds while a virtual rank computes up to them,
and how far ahead of a rank's clock its timer fires."""

from __future__ import annotations

import numpy as np

import pytest

from prism_core.replay.assistant import AHEAD_MIN_BYTES, LATE_SHARE, LEAD_STEP_S, builds_ahead, moved_lead, ops_ahead


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


def test_the_lead_moves_up_more_for_a_late_op_than_down_for_an_early_one():
    assert moved_lead(100e-6, 3e-6) == pytest.approx(100e-6 + LEAD_STEP_S * (1 - LATE_SHARE))
    assert moved_lead(100e-6, -50e-6) == pytest.approx(100e-6 - LEAD_STEP_S * LATE_SHARE)
    # an op ready exactly at its due was not late
    assert moved_lead(100e-6, 0.0) < 100e-6
    # within 0 ... most
    assert moved_lead(0.0, -1e-3) == 0.0
    assert moved_lead(2e-3, 1e-3, most=2e-3) == 2e-3


def test_the_lead_settles_where_the_share_of_late_ops_is_asked_for():
    # wake-ups late by a skewed amount (a median 0.09 ms, a tail past 0.5 ms, as an ep2 emulation's
    # here): the lead ends near the wake-up lateness's 90th percentile, not its mean, and about a
    # tenth of the ops are late after it settles
    rng = np.random.default_rng(7)
    wake = 60e-6 + rng.lognormal(np.log(30e-6), 0.9, 40_000)
    lead, late = 0.0, []
    for k, w in enumerate(wake):
        on_time = w - lead
        if k >= 20_000:
            late.append(on_time > 0)
        lead = moved_lead(lead, on_time)
    assert np.mean(late) == pytest.approx(LATE_SHARE, abs=0.03)
    assert lead == pytest.approx(np.percentile(wake, 90), rel=0.15)


def test_resident_bytes_reads_this_processs_resident_memory():
    from prism_core.replay.assistant import resident_bytes

    import mmap

    before = resident_bytes()
    # 64 MiB written into a mapping of its own: a bytearray can reuse heap pages already resident
    # (it did in a pytest-xdist worker that had freed much), a new anonymous mapping cannot
    block = mmap.mmap(-1, 64 * 2**20)
    for at in range(0, len(block), mmap.PAGESIZE):
        block[at] = 1
    after = resident_bytes()
    block.close()
    assert before is not None and after - before >= 48 * 2**20


def test_peak_resident_bytes_is_this_programs_peak_not_its_launchers():
    # a child forked from a parent holding 256 MiB, then exec'ing a small Python: getrusage's
    # ru_maxrss carries the parent's pages over the exec, VmHWM does not
    import mmap
    import subprocess
    import sys

    block = mmap.mmap(-1, 256 * 2**20)
    for at in range(0, len(block), mmap.PAGESIZE):
        block[at] = 1
    code = ("import resource; from prism_core.replay.assistant import peak_resident_bytes, resident_bytes; "
            "print(peak_resident_bytes(), resident_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                             check=True, close_fds=False).stdout.split()
    finally:
        block.close()
    peak, now, maxrss = map(int, out)
    assert now <= peak + 2**20 and peak < 200 * 2**20 <= maxrss, (peak, now, maxrss)


def _blocked_graph():
    """Three ranks on one group listed out of order (2, 0, 1): per rank a compute node, a blocking
    all-reduce, an async all-reduce and its wait."""
    from prism_core.trace import Trace
    from prism_core.trace.schema import COLUMNS, COMM, COMPUTE, OP_CODE, WAIT

    kinds = [COMPUTE, COMM, COMM, WAIT]
    n = len(kinds) * 3
    c = {name: np.zeros(n, dtype=dtype) for name, dtype in COLUMNS.items()}
    c["kind"][:] = np.tile(kinds, 3)
    c["op"][:] = np.tile([0, OP_CODE["allreduce"], OP_CODE["allreduce"], 0], 3)
    c["seq"][:] = np.tile([-1, 0, 1, -1], 3)
    c["async_"][:] = np.tile([0, 0, 1, 0], 3)
    c["ref"][:] = np.tile([-1, -1, -1, 2], 3)
    c["bytes"][:] = np.tile([0, 4, 4, 0], 3)
    return Trace(world_size=3, columns=c, offsets=np.arange(0, n + 1, len(kinds), dtype=np.int64),
                 groups=[(2, 0, 1)], group_names=["0"], labels=[""], dtypes=[""], step_peaks=[[]] * 3)


@pytest.mark.parametrize("dict_members", [1024, 0])     # looked up in a dict, or by bisection
def test_a_ranks_position_is_its_place_in_the_groups_listing(monkeypatch, dict_members):
    from prism_core.replay import assistant
    from prism_core.replay.assistant import Assistant

    monkeypatch.setattr(assistant, "DICT_MEMBERS", dict_members)
    a = object.__new__(Assistant)        # only the group table: no replay
    a.trace, a._index = _blocked_graph(), {}
    assert [a._position(0, r) for r in (0, 1, 2)] == [1, 2, 0]
    a.trace.groups.append((5, 3))
    assert a._position(1, 3) == 1 and a._position(1, 5) == 0
    for outsider in (4, 6, -1):
        with pytest.raises(KeyError):
            a._position(1, outsider)


def test_the_timeout_report_says_where_each_blocked_rank_is():
    from prism_core.replay.assistant import Assistant

    a = object.__new__(Assistant)
    a.trace, a.timeout_s = _blocked_graph(), 5.0
    # rank 0 computing at its node 0, rank 1 in its blocking all-reduce, rank 2 waiting for its async one
    text = a._report({2: 8 + 2, 0: 0, 1: 4 + 1})
    assert text.startswith("replay did not finish within 5 s; ")
    assert "virtual rank 0 blocked computing at" in text
    assert "virtual rank 1 blocked in allreduce #0 of group [2, 0, 1]" in text
    assert "virtual rank 2 blocked waiting for allreduce #1 of group [2, 0, 1]" in text
    assert text.index("rank 0") < text.index("rank 1") < text.index("rank 2")
    assert a._report({}).endswith("no virtual rank is blocked")
