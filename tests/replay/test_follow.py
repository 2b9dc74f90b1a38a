"""Following the sandbox ranks' pace: the factor a timed replay puts on its virtual ranks' compute."""

from __future__ import annotations

import numpy as np
import pytest

from prism_core.replay import follow
from prism_core.replay.follow import PaceFollower, pace_ranks, reference_compute, reference_spans, shared_cores
from prism_core.trace.flight import Flight
from prism_core.trace.schema import COMM, COMPUTE

# one rank, two steps of (compute 10 ms, all-reduce, compute 30 ms), as timed in the loaded run
KIND = np.array([COMPUTE, COMM, COMPUTE, COMPUTE, COMM, COMPUTE])
STEP = np.array([0, 0, 0, 1, 1, 1])
SPAN = np.array([0.010, 0.0, 0.030, 0.010, 0.0, 0.030])


@pytest.fixture(autouse=True)
def _read_every_call(monkeypatch):
    monkeypatch.setattr(follow, "EVERY_S", 0.0)


def test_reference_is_the_calibrated_compute_per_step():
    cum, window, start = reference_compute(KIND, STEP, SPAN)
    assert cum == pytest.approx([0, 0.010, 0.010, 0.040, 0.050, 0.050, 0.080])
    assert window == pytest.approx(0.040) and start == 0          # per step


def test_warm_up_steps_are_left_out(tmp_path):
    cum, window, start = reference_compute(KIND, STEP, SPAN, warmup=1)
    assert start == 3 and window == pytest.approx(0.040)
    flight = Flight(tmp_path, 0)
    f = PaceFollower({0: tmp_path / "0.bin"}, {0: (cum, 0.030, start)})
    flight.computed(3, 900_000_000)                 # start-up: 0.9 s of compute in step 0
    assert f.factor() == 1.0
    flight.computed(4, 920_000_000)                 # node 3: 20 ms against 10
    flight.computed(6, 980_000_000)                 # node 5: 60 ms against 30
    assert f.factor() == pytest.approx(2.0)


def test_pace_is_one_until_a_window_is_seen_then_the_ratio_to_the_reference(tmp_path):
    flight = Flight(tmp_path, 0)
    f = PaceFollower({0: tmp_path / "0.bin"}, {0: reference_compute(KIND, STEP, SPAN)})
    assert f.factor() == 1.0                        # nothing closed yet
    flight.computed(1, 15_000_000)                  # node 0 took 15 ms against 10
    assert f.factor() == 1.0                        # less than a step's reference seen
    flight.computed(3, 60_000_000)                  # node 2: 45 ms against 30
    assert f.factor() == pytest.approx(1.5)
    flight.computed(4, 65_000_000)                  # node 3: 5 ms against 10 - the window slides past node 0
    assert f.factor() == pytest.approx((0.045 + 0.005) / 0.040)
    assert f.stats()["updates"] == 2


def test_pace_is_clipped_and_missing_records_are_skipped(tmp_path):
    flight = Flight(tmp_path, 0)
    f = PaceFollower({0: tmp_path / "0.bin", 1: tmp_path / "1.bin"},   # rank 1 never starts its record
                     {r: reference_compute(KIND, STEP, SPAN) for r in (0, 1)})
    flight.computed(1, 0)
    assert f.factor() == 1.0
    flight.computed(4, 400_000_000)                 # a stall: 10x the reference
    assert f.factor() == follow.CLIP[1]



def test_a_rank_that_computes_little_is_read_over_several_steps(tmp_path):
    """1 ms of compute a step: the pace waits for MIN_WINDOW_S of reference, not one step's."""
    kind, step = np.tile([COMPUTE, COMM], 40), np.repeat(np.arange(40), 2)
    cum, window, start = reference_compute(kind, step, np.tile([0.001, 0.0], 40))
    assert window == pytest.approx(follow.MIN_WINDOW_S)
    flight = Flight(tmp_path, 0)
    f = PaceFollower({0: tmp_path / "0.bin"}, {0: (cum, window, start)})
    flight.computed(1, 0)
    flight.computed(3, 500_000)                     # one step's node at half its reference: no pace yet
    assert f.factor() == 1.0
    flight.computed(43, 10_500_000)                 # 20 steps on, 10 ms against 20
    assert f.factor() == pytest.approx(follow.CLIP[0])


def test_only_ranks_that_compute_a_fair_share_of_their_virtual_peers_are_read():
    # four ranks of a warm-up step (one compute node of 1 s) and one step of compute 0.3 s, 0.003 s,
    # 0.2 s, 0.4 s; rank 3 has a comm node too
    kind = np.array([COMPUTE, COMPUTE] * 4 + [COMM])
    step = np.array([0, 1] * 4 + [1])
    span = np.array([1.0, 0.3, 1.0, 0.003, 1.0, 0.2, 1.0, 0.4, 5.0])
    offsets = np.array([0, 2, 4, 6, 9])
    # virtual ranks 0 and 3 compute a median 0.35 s a step: rank 1 (1%) is not read, rank 2 (57%) is
    assert pace_ranks(kind, step, offsets, span, [1, 2], warmup=1) == [2]
    assert pace_ranks(kind, step, offsets, span, [1], warmup=1) == []
    assert pace_ranks(kind, step, offsets, span, [1], warmup=0) == [1]     # the warm-up step dominates
    assert pace_ranks(kind, step, offsets, span, [0, 1, 2, 3], warmup=1) == [0, 1, 2, 3]  # none virtual
    # a rank with no nodes computes nothing
    assert pace_ranks(kind, step, np.array([0, 2, 2, 6, 9]), span, [1], warmup=1) == []
    # ... and virtual ranks with no nodes (not loaded: emulation.virtual_ranks=neighbours) do not pull
    # the median down to nothing, which would read rank 1's pace
    assert pace_ranks(kind, step, np.concatenate([offsets, [9] * 6]), span, [1, 2], warmup=1) == [2]


def test_no_pace_is_read_where_the_ranks_share_the_assistants_cores():
    assert shared_cores({"bound": True, "ranks": {"0": 0}, "assistant": [1]}) is None
    assert "cores [1]" in shared_cores({"bound": True, "ranks": {"0": 0, "1": 1}, "assistant": [1]})
    assert "3 cores" in shared_cores({"bound": False, "reason": "2 rank(s) and the assistant need 3 cores"})
    assert "no placement" in shared_cores({})


def test_pace_over_several_steps_grows_to_that_many_then_slides(tmp_path):
    kind, step, span = np.tile(KIND, 2), np.concatenate([STEP, STEP + 2]), np.tile(SPAN, 2)   # four steps
    flight = Flight(tmp_path, 0)
    f = PaceFollower({0: tmp_path / "0.bin"}, {0: reference_compute(kind, step, span)}, steps=2, against="alone")
    assert f.factor() == 1.0
    flight.computed(3, 60_000_000)                  # step 0: 60 ms against 40
    assert f.factor() == pytest.approx(1.5)         # one step seen: read over it
    flight.computed(6, 140_000_000)                 # step 1: 80 ms against 40
    assert f.factor() == pytest.approx(0.140 / 0.080)   # over both (over one step: 2.0)
    flight.computed(9, 180_000_000)                 # step 2: 40 ms against 40
    assert f.factor() == pytest.approx(0.120 / 0.080)   # steps 1 and 2: step 0 left the window
    stats = f.stats()
    assert stats["steps"] == 2 and stats["against"] == "alone" and stats["updates"] == 3


def test_the_timed_reference_reads_the_alone_spans_only_of_a_timed_pass():
    span, alone = np.array([1.0, 2.0]), np.array([0.9, 1.8])

    def read(alone_span, timed_pass, reference):
        against, name = reference_spans(span, alone_span, timed_pass, reference)
        return ("alone_span" if against is alone else "span" if against is span else "?"), name

    assert read(alone, True, "timed") == ("alone_span", "timed")
    # a timeline of one pass: its alone spans are a plain slice's, not an emulation's
    assert read(alone, False, "timed") == ("span", "loaded")
    assert read(None, True, "timed") == ("span", "loaded")
    assert read(alone, False, "alone") == ("alone_span", "alone")
    assert read(alone, True, "loaded") == ("span", "loaded")
    with pytest.raises(ValueError, match="alone, loaded or timed"):
        reference_spans(span, alone, True, "plain")
