"""Stage 2's packing of the slices' loaded runs into co-runs that fill the machine's cores; the
settings a slice's directory names."""

from __future__ import annotations

from pathlib import Path

import pytest

from prism_core.calibrate.stage import SliceJob, _timed_kind, co_runs, replica_runs
from prism_core.config import load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _jobs(n: int, sandbox: int = 1) -> list[SliceJob]:
    return [SliceJob(i, list(range(i * sandbox, (i + 1) * sandbox)), Path(f"/t/slice_{i}"), Path(f"/t/loaded_{i}"))
            for i in range(n)]


def test_slices_pair_up_on_two_cores_in_order():
    groups = co_runs(_jobs(4), cores=2, sandbox=1)
    assert [[d.name for _, d in g] for g in groups] == [["loaded_0", "loaded_1"], ["loaded_2", "loaded_3"]]
    assert [[sb for sb, _ in g] for g in groups] == [[[0], [1]], [[2], [3]]]


def test_a_short_last_co_run_is_filled_with_twins_in_directories_of_their_own():
    groups = co_runs(_jobs(3), cores=2, sandbox=1)
    assert [[d.name for _, d in g] for g in groups] == [["loaded_0", "loaded_1"], ["loaded_2", "loaded_0_twin0"]]
    assert groups[1][1][0] == [0]
    # one slice (every DP replica renamed from it) on four cores: three twins of it
    (alone,) = co_runs(_jobs(1), cores=4, sandbox=1)
    assert [d.name for _, d in alone] == ["loaded_0", "loaded_0_twin0", "loaded_0_twin1", "loaded_0_twin2"]


def test_slices_of_two_ranks_fill_four_cores_two_at_a_time_and_unloaded_jobs_are_left_out():
    jobs = _jobs(3, sandbox=2)
    jobs[1].loaded = None
    groups = co_runs(jobs, cores=4, sandbox=2)
    assert [[(sb, d.name) for sb, d in g] for g in groups] == [[([0, 1], "loaded_0"), ([4, 5], "loaded_2")]]
    assert co_runs([], cores=2, sandbox=1) == []


def test_a_short_co_run_is_filled_with_the_slices_dp_replicas_before_twins():
    (job,) = _jobs(1)
    job.replicas = [[1], [2]]                    # replicas taking orders 1 and 2
    (alone,) = co_runs([job], cores=4, sandbox=1)
    assert [(sb, d.name) for sb, d in alone] == [([0], "loaded_0"), ([1], "loaded_0_replica1"),
                                                 ([2], "loaded_0_replica2"), ([0], "loaded_0_twin2")]
    assert replica_runs([job]) == [(Path("/t/loaded_0_replica1"), [1]), (Path("/t/loaded_0_replica2"), [2])]
    jobs = _jobs(3)
    jobs[0].replicas = [[3]]
    groups = co_runs(jobs, cores=2, sandbox=1)
    assert [[(sb, d.name) for sb, d in g] for g in groups] == [[([0], "loaded_0"), ([1], "loaded_1")],
                                                               [([2], "loaded_2"), ([3], "loaded_0_replica1")]]


@pytest.mark.parametrize("timed, settings, kind", [
    (False, [], "_awake"),
    (False, ["emulation.keep_awake=false"], ""),
    (False, ["emulation.follow_pace=false"], "_awake"),    # a plain slice replays no timeline: no pace
    (False, ["emulation.virtual_spans=timed"], "_awake"),  # ... nor virtual ranks taking its spans
    (True, [], "_awake_pace_matched"),
    (True, ["emulation.follow_pace=false"], "_awake_matched"),
    (True, ["emulation.virtual_spans=paired"], "_awake_pace_paired"),
    (True, ["emulation.virtual_spans=steady"], "_awake_pace_steady"),
    (True, ["emulation.awake_while_computing=false", "emulation.follow_pace=false",
            "emulation.virtual_spans=timed"], ""),
    (True, ["emulation.awake_while_computing=false", "emulation.virtual_spans=timed"], "_pace"),
    (False, ["emulation.ring_combine=false"], "_awake_nocombine"),
    (True, ["emulation.ring_combine=false"], "_awake_pace_matched_nocombine"),
])
def test_a_slice_directory_names_the_settings_its_spans_depend_on(timed, settings, kind):
    cfg = load_config(CONFIGS / "tiny_moe_w2_pp2.yaml", settings)
    assert _timed_kind(cfg, timed) == kind
