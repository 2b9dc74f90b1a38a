"""bench/kept.py: the kept pairs of a `fidelity.py --keep` directory, each with its config's graph."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from kept import kept_pairs, replayed_timeline, warmup_steps  # noqa: E402

from prism_core.trace import write_trace  # noqa: E402
from tests.replay.test_steady import _two_ranks  # noqa: E402


def test_kept_pairs_are_those_with_a_second_record_under_configs_with_a_graph(tmp_path):
    trace, _ = _two_ranks([[0.01, 0.02]] * 3)
    config = tmp_path / "tiny_moe_w2_ep2"
    write_trace(trace, config / "collect" / "abc" / "trace.zarr")
    for pair in ("pair0", "pair1", "pair2"):
        (config / pair).mkdir()
    (config / "pair0" / "record_e").mkdir()
    (config / "pair2" / "record_e").mkdir()
    (tmp_path / "notes").mkdir()                          # no graph: not a config
    found = list(kept_pairs(tmp_path))
    assert [(name, pair.name) for name, _, pair in found] == [("ep2", "pair0"), ("ep2", "pair2")]
    assert found[0][1].world_size == 2


def test_warmup_steps_are_those_the_kept_run_ran_with(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"job": {"warmup": 3, "iterations": 60}}))
    assert warmup_steps(tmp_path) == 3


def test_the_replayed_timeline_is_the_second_passes_where_the_pair_ran_it_by_itself(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    (one / "logs").mkdir(parents=True)
    (two / "logs").mkdir(parents=True)
    (one / "logs" / "stops.json").write_text("{}")
    (two / "logs" / "p_stops.json").write_text("{}")    # fidelity.py --emulate-second's own turns
    assert replayed_timeline(one) == one / "calibrate" / "timeline.npz"
    assert replayed_timeline(two) == two / "calibrate2" / "timeline_pass2.npz"
