"""Unit tests of the global timeline solver (`prism_core.calibrate.timeline.solve`).

Each test builds a small timed graph by hand (a Trace for op matching plus a NodeModel of spans,
releases and transfers) whose earliest timeline is worked out by hand in the test: every node of a
rank ends at max(previous end, release) + span, a synchronising op is released when its last
member arrives, an async op completes at last arrival (or own issue) + transfer, and a wait is
released at that completion. Covered: a forward pipeline, an async ring, a collective with a
straggler, non-synchronising ops, graphs that never settle, and the DP-symmetric quotient solve.
"""

from __future__ import annotations

import numpy as np
import pytest

from prism_core.calibrate.timeline import NO_RELEASE, OP_RELEASE, WAIT_RELEASE, CalibrationError, NodeModel, solve
from prism_core.trace.matching import match_ops
from prism_core.trace.schema import COLUMNS, COMM, COMPUTE, OP_CODE, WAIT
from prism_core.trace.store import Trace

EXACT = 1e-12


# ---------------------------------------------------------------- graph building

def compute(span: float) -> dict:
    return dict(kind=COMPUTE, span=span)


def comm(op: str, span: float, group: int = 0, seq: int = 0, peer: int = -1, tag: int = -1,
         release: int = OP_RELEASE, async_: bool = False, synced: bool = True,
         transfer: float | None = None) -> dict:
    """A comm node. Blocking by default (synchronising, its transfer is its span); with async_=True
    it is only issued here (span = issue cost) and completes `transfer` after the last arrival
    (synced) or after its own issue (not synced)."""
    return dict(kind=COMM, op=OP_CODE[op], group=group, seq=seq, peer=peer, tag=tag, span=span,
                release=NO_RELEASE if async_ else release, async_=int(async_), synced=synced,
                transfer=span if transfer is None else transfer)


def send(dst: int, span: float, seq: int = 0, **kw) -> dict:
    return comm("send", span, peer=dst, seq=seq, tag=0, **kw)


def recv(src: int, span: float, seq: int = 0, **kw) -> dict:
    return comm("recv", span, peer=src, seq=seq, tag=0, **kw)


def allreduce(group: int, seq: int, span: float, **kw) -> dict:
    return comm("allreduce", span, group=group, seq=seq, **kw)


def wait(ref: int, span: float) -> dict:
    """A wait on the comm node at local index `ref` of the same rank."""
    return dict(kind=WAIT, op=0, ref=ref, span=span, release=WAIT_RELEASE)


_DEFAULTS = dict(kind=COMPUTE, op=0, group=-1, peer=-1, bytes=0, dtype=0, seq=-1, tag=-1, async_=0, ref=-1,
                 label=0, mb=-1, chunk=-1, step=0, reduce=0, splits=0, t_start=np.nan, t_end=np.nan)


def build(ranks: list[list[dict]], groups: list[tuple[int, ...]]) -> tuple[Trace, NodeModel]:
    """The Trace (every schema column, right dtypes, untimed) and NodeModel of per-rank node lists."""
    nodes = [node for rank in ranks for node in rank]
    columns = {name: np.array([node.get(name, _DEFAULTS[name]) for node in nodes], dtype=dtype)
               for name, dtype in COLUMNS.items()}
    columns["bytes"][columns["kind"] == COMM] = 1024
    offsets = np.zeros(len(ranks) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(rank) for rank in ranks])
    trace = Trace(world_size=len(ranks), columns=columns, offsets=offsets, groups=list(groups),
                  group_names=[f"g{i}" for i in range(len(groups))], labels=[""], dtypes=["float32"])
    global_ref = [int(offsets[r]) + node["ref"] if node["kind"] == WAIT else -1
                  for r, rank in enumerate(ranks) for node in rank]
    model = NodeModel(span=np.array([node["span"] for node in nodes], dtype=np.float64),
                      release=np.array([node.get("release", NO_RELEASE) for node in nodes], dtype=np.int8),
                      ref=np.array(global_ref, dtype=np.int64),
                      completes_synced=np.array([node.get("synced", False) for node in nodes], dtype=bool),
                      transfer=np.array([node.get("transfer", 0.0) for node in nodes], dtype=np.float64))
    return trace, model


def run(trace: Trace, model: NodeModel, **kw) -> tuple[np.ndarray, np.ndarray, int]:
    return solve(model, match_ops(trace), trace.offsets, **kw)


def per_rank(trace: Trace, values: np.ndarray) -> list[list[float]]:
    return [values[trace.rank_slice(r)].tolist() for r in range(trace.world_size)]


def assert_ranks(trace: Trace, values: np.ndarray, expected: list[list[float]]) -> None:
    got = per_rank(trace, values)
    assert [len(g) for g in got] == [len(e) for e in expected]
    for r, (g, e) in enumerate(zip(got, expected)):
        assert g == pytest.approx(e, abs=EXACT), f"rank {r}"


def starts_of(expected_ends: list[list[float]]) -> list[list[float]]:
    """A node's start is its rank's previous node's end (0 for a rank's first node)."""
    return [[0.0] + ends[:-1] for ends in expected_ends]


# ---------------------------------------------------------------- graphs

WORLD4 = (0, 1, 2, 3)
PIPE_COMPUTE = (1.0, 2.0, 1.5, 0.5)     # forward time of stages 0..3
PIPE_XFER = 0.25


def pipeline() -> tuple[Trace, NodeModel]:
    """4 stages, 2 microbatches, forward only; blocking send/recv that both synchronise."""
    ranks = []
    for s, c in enumerate(PIPE_COMPUTE):
        nodes = []
        for mb in range(2):
            if s > 0:
                nodes.append(recv(s - 1, PIPE_XFER, seq=mb))
            nodes.append(compute(c))
            if s < 3:
                nodes.append(send(s + 1, PIPE_XFER, seq=mb))
        ranks.append(nodes)
    return build(ranks, [WORLD4])


# Worked by hand (x = 0.25; a send and its recv both end at max(their arrivals) + x):
#  r0: F 1.0 | send0 (r1's recv0 arrived at 0) 1.25 | F 2.25 | send1: r1's recv1 arrives 3.5 -> 3.75
#  r1: recv0 1.25 | F 3.25 | send0 (r2 arrived at 0) 3.5 | recv1 max(3.5, 2.25)+x 3.75 | F 5.75 | send1 ->
#      r2's recv1 arrives 5.25 -> 6.0
#  r2: recv0 3.5 | F 5.0 | send0 (r3 arrived at 0) 5.25 | recv1 max(5.25, 5.75)+x 6.0 | F 7.5 |
#      send1: r3's recv1 arrives 5.75 -> 7.75
#  r3: recv0 5.25 | F 5.75 | recv1 max(5.75, 7.5)+x 7.75 | F 8.25
PIPE_ENDS = [
    [1.0, 1.25, 2.25, 3.75],
    [1.25, 3.25, 3.5, 3.75, 5.75, 6.0],
    [3.5, 5.0, 5.25, 6.0, 7.5, 7.75],
    [5.25, 5.75, 7.75, 8.25],
]


# ---------------------------------------------------------------- tests

def test_pipeline_forward():
    trace, model = pipeline()
    end, start, rounds = run(trace, model)
    assert end[trace.offsets[4] - 1] == pytest.approx(8.25, abs=EXACT)   # last stage, last microbatch
    assert_ranks(trace, end, PIPE_ENDS)
    assert_ranks(trace, start, starts_of(PIPE_ENDS))
    assert rounds >= 1


def test_async_ring():
    """Each rank computes, isends to r+1, irecvs from r-1, waits on both, computes again."""
    c, d = (1.0, 3.0, 2.0, 0.5), (0.5, 0.25, 1.0, 2.0)
    issue, xfer, w = 0.125, 0.25, 0.0625
    ranks = [[compute(c[r]),
              send((r + 1) % 4, issue, async_=True, transfer=xfer),
              recv((r - 1) % 4, issue, async_=True, transfer=xfer),
              wait(1, w), wait(2, w),
              compute(d[r])] for r in range(4)]
    trace, model = build(ranks, [WORLD4])
    end, start, _ = run(trace, model)
    # The op r -> r+1 completes at max(isend issue on r = c_r, irecv issue on r+1 = c_{r+1} + 0.125) + 0.25:
    #   0->1: max(1.0, 3.125) + .25 = 3.375   1->2: max(3.0, 2.125) + .25 = 3.25
    #   2->3: max(2.0, 0.625) + .25 = 2.25    3->0: max(0.5, 1.125) + .25 = 1.375
    # Rank r: c_r, +issue, +issue, wait(own send) max(., S_r) + w, wait(recv) max(., S_{r-1}) + w, + d_r
    expected = [
        [1.0, 1.125, 1.25, 3.4375, 3.5, 4.0],           # 3.375+w, max(3.4375, 1.375)+w
        [3.0, 3.125, 3.25, 3.3125, 3.4375, 3.6875],     # max(3.25, 3.25)+w, max(3.3125, 3.375)+w
        [2.0, 2.125, 2.25, 2.3125, 3.3125, 4.3125],     # max(2.25, 2.25)+w, max(2.3125, 3.25)+w
        [0.5, 0.625, 0.75, 1.4375, 2.3125, 4.3125],     # max(.75, 1.375)+w, max(1.4375, 2.25)+w
    ]
    assert_ranks(trace, end, expected)
    assert_ranks(trace, start, starts_of(expected))


def test_collective_straggler():
    """Rank 2 arrives late at the first allreduce; everyone leaves it at its arrival + transfer."""
    before, after, tail = (1.0, 1.5, 4.0), 1.0, (0.25, 0.5, 0.75)
    xfer = 0.5
    ranks = [[compute(before[r]), allreduce(0, 0, xfer), compute(after), allreduce(0, 1, xfer), compute(tail[r])]
             for r in range(3)]
    trace, model = build(ranks, [(0, 1, 2)])
    end, _, _ = run(trace, model)
    # allreduce 0: last arrival 4.0 -> 4.5 on all; compute -> 5.5; allreduce 1: all arrive 5.5 -> 6.0
    expected = [[before[r], 4.5, 5.5, 6.0, 6.0 + tail[r]] for r in range(3)]
    assert_ranks(trace, end, expected)
    assert end.tolist()[-1] == pytest.approx(6.75, abs=EXACT)


def test_non_synchronising_blocking_send():
    """A buffered send (blocking, no release) does not wait for its late receiver; the receiver
    is released by the send's arrival, here earlier than its own."""
    ranks = [[compute(1.0), send(1, 0.25, release=NO_RELEASE), compute(1.0)],
             [compute(5.0), recv(0, 0.25), compute(1.0)]]
    trace, model = build(ranks, [(0, 1)])
    end, _, _ = run(trace, model)
    assert_ranks(trace, end, [[1.0, 1.25, 2.25],
                              [5.0, 5.25, 6.25]])


def test_early_receiver_waits_for_buffered_send():
    ranks = [[compute(3.0), send(1, 0.25, release=NO_RELEASE), compute(1.0)],
             [compute(1.0), recv(0, 0.25), compute(1.0)]]
    trace, model = build(ranks, [(0, 1)])
    end, _, _ = run(trace, model)
    # the recv is released when the send arrives (3.0), not when the send ends
    assert_ranks(trace, end, [[3.0, 3.25, 4.25],
                              [1.0, 3.25, 4.25]])


def test_async_completion_synced_or_not():
    """An async op that did not synchronise completes at its own issue + transfer; one that did,
    at the last arrival + transfer (rank 2 arrives last)."""
    def rank(first: float, synced: bool) -> list[dict]:
        return [compute(first), allreduce(0, 0, 0.125, async_=True, synced=synced, transfer=0.5), wait(1, 0.0625),
                compute(1.0)]

    trace, model = build([rank(1.0, False), rank(1.0, True), rank(4.0, True)], [(0, 1, 2)])
    end, _, _ = run(trace, model)
    # rank 0: completes at its issue 1.0 + .5 = 1.5; wait max(1.125, 1.5) + .0625
    # ranks 1, 2: complete at max(1.0, 1.0, 4.0) + .5 = 4.5; wait max(1.125 or 4.125, 4.5) + .0625
    assert_ranks(trace, end, [[1.0, 1.125, 1.5625, 2.5625],
                              [1.0, 1.125, 4.5625, 5.5625],
                              [4.0, 4.125, 4.5625, 5.5625]])


def test_too_few_rounds_is_reported():
    trace, model = pipeline()
    _, _, rounds = run(trace, model)
    assert rounds > 3
    end, _, again = run(trace, model, max_rounds=rounds)      # exactly enough still settles
    assert again == rounds
    assert_ranks(trace, end, PIPE_ENDS)
    with pytest.raises(CalibrationError, match="did not settle"):
        run(trace, model, max_rounds=3)


def test_deadlock_is_reported():
    """Both ranks receive before they send: each recv waits for the other rank's send, which waits
    for that rank's recv; every round pushes the timeline further, so it never settles."""
    ranks = [[recv(1, 0.25), send(1, 0.25)],
             [recv(0, 0.25), send(0, 0.25)]]
    trace, model = build(ranks, [(0, 1)])
    with pytest.raises(CalibrationError, match="did not settle after 200 rounds"):
        run(trace, model, max_rounds=200)


def dp_pipeline() -> tuple[Trace, NodeModel]:
    """2 DP replicas x 2 pipeline stages: ranks (0, 1) and (2, 3), p2p 0->1 and 2->3 on world, then
    gradient allreduces in DP groups {0, 2} (blocking) and {1, 3} (async, overlapped, waited).
    Replica 1 has exactly replica 0's spans."""
    stage0 = [compute(1.0), send(1, 0.25), compute(2.0), allreduce(1, 0, 0.5), compute(0.25)]
    stage1 = [recv(0, 0.25), compute(3.0), allreduce(2, 0, 0.125, async_=True, transfer=0.5), compute(0.25),
              wait(2, 0.0625), compute(0.25)]
    ranks = [stage0, stage1,
             [dict(n, peer=3) if n.get("op") == OP_CODE["send"] else n for n in stage0],
             [dict(n, peer=2) if n.get("op") == OP_CODE["recv"] else n for n in stage1]]
    return build(ranks, [WORLD4, (0, 2), (1, 3)])


# stage 0: F 1.0 | send (stage 1 arrived at 0) 1.25 | 3.25 | allreduce (both replicas arrive 3.25) 3.75 | 4.0
# stage 1: recv 1.25 | 4.25 | issue (completes at 4.25 + .5 = 4.75) 4.375 | 4.625 | wait max(4.625, 4.75)
#          + .0625 = 4.8125 | 5.0625
DP_ENDS = [[1.0, 1.25, 3.25, 3.75, 4.0], [1.25, 4.25, 4.375, 4.625, 4.8125, 5.0625]] * 2


def test_dp_symmetric_quotient():
    trace, model = dp_pipeline()
    end, start, _ = run(trace, model)
    assert_ranks(trace, end, DP_ENDS)
    assert_ranks(trace, start, starts_of(DP_ENDS))
    q_end, q_start, _ = run(trace, model, source=np.array([0, 1, 0, 1]))
    np.testing.assert_allclose(q_end, end, rtol=0, atol=EXACT)
    np.testing.assert_allclose(q_start, start, rtol=0, atol=EXACT)
    assert_ranks(trace, q_end, DP_ENDS)


def test_identity_source_is_the_plain_solve():
    trace, model = dp_pipeline()
    end, start, rounds = run(trace, model)
    i_end, i_start, i_rounds = run(trace, model, source=np.arange(4))
    np.testing.assert_array_equal(i_end, end)
    np.testing.assert_array_equal(i_start, start)
    assert i_rounds == rounds
