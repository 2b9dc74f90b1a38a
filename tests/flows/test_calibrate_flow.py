"""The Stage 2 flow: slices fanned out on Dask with slot resources, then calibration; a failing slice
fails the flow with its rank's error and the finished slices are reused on the rerun."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
from prefect.exceptions import PrefectException

from flows.calibrate import calibrate_flow, local_slots, run_calibrate, task_runner
from prism_core.collect.stage import collect
from prism_core.config import load_config
from prism_core.replay.slices import CO_RUN, SLICE_DONE

from tests.jobs import CRASH_IN_SLICE_SCRIPT, assert_nothing_left, make_job

CONFIGS = Path(__file__).resolve().parents[2] / "configs"

def test_local_runner_has_slot_resources():
    runner = task_runner()
    assert runner.cluster_kwargs["resources"] == {"slots": local_slots()}
    assert runner.cluster_kwargs["processes"] is False
    # a slice of S ranks must fit one worker, or Dask would hold it for ever
    assert task_runner(sandbox=64).cluster_kwargs["resources"] == {"slots": 64}


def test_local_cluster_listens_on_loopback_only():
    import psutil
    from distributed import LocalCluster

    def listening() -> set[tuple[str, int]]:
        return {(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections() if c.status == "LISTEN"}

    before = listening()
    with LocalCluster(**task_runner().cluster_kwargs):
        opened = listening() - before
    assert opened, "the cluster serves nothing over HTTP: this test no longer checks anything"
    assert {ip for ip, _ in opened} == {"127.0.0.1"}, opened


@pytest.mark.timeout(600)
def test_flow_predicts_every_rank(prefect_server, tmp_path):
    out = tmp_path / "calibrate"
    doc = run_calibrate(str(CONFIGS / "tiny_moe_w2_pp2.yaml"), ["job.iterations=3", "emulation.sandbox=1",
                        "emulation.loaded_compute=false"], str(out), None, root=str(tmp_path / "stages"))
    assert doc["mode"] == "predicted" and set(doc["ranks"]) == {"0", "1"}
    assert json.loads((out / "metrics.json").read_text()) == doc
    assert all(entry["iteration_time_s"] > 0 for entry in doc["ranks"].values())


@pytest.mark.timeout(600)
def test_failed_slice_fails_the_flow_and_the_rerun_reuses_the_rest(prefect_server, tmp_path, monkeypatch):
    flag = tmp_path / "crash"
    monkeypatch.setenv("CRASH_FLAG", str(flag))
    config, script = make_job(tmp_path, CRASH_IN_SLICE_SCRIPT, name="crashy", iterations=3, loaded_compute=True)
    stages = tmp_path / "stages"
    timeout_s = 240.0
    args = (str(config), ["emulation.sandbox=1", f"job.timeout_s={timeout_s}"], str(tmp_path / "out"))
    # collect first, without the flag, so that only the slice of rank 1 fails
    collect(load_config(config), stages / "collect")
    flag.write_text("")
    began = time.monotonic()
    with pytest.raises((PrefectException, RuntimeError), match=r"rank 1 failed(.|\n)*fails in its slice on purpose"):
        calibrate_flow(*args, root=str(stages))
    # rank 1's failure stopped the co-run member beside it, whose virtual rank 1 keeps to the
    # failed rank's record and would wait out its deadline (0.9 x job.timeout_s)
    assert time.monotonic() - began < timeout_s / 2
    assert_nothing_left(tmp_path, script)
    done = sorted(stages.glob(f"timing/*/s1/slice_*/{SLICE_DONE}"))
    assert len(done) == 1 and "slice_0_" in str(done[0])     # rank 0's slice finished and stays
    # the co-run of both slices failed with rank 1: rank 0's part ran beside a neighbour that
    # stopped, so it is no co-run and runs again
    assert not sorted(stages.glob(f"timing/*/s1/loaded_*/{CO_RUN}"))
    stamps = [p.stat().st_mtime_ns for p in done]
    flag.unlink()
    doc = calibrate_flow(*args, root=str(stages))
    assert set(doc["ranks"]) == {"0", "1"} and doc["loaded_compute"]["slices"] == 2
    assert [p.stat().st_mtime_ns for p in done] == stamps   # reused, not rerun
    assert len(sorted(stages.glob(f"timing/*/s1/slice_*/{SLICE_DONE}"))) == 2
    assert len(sorted(stages.glob(f"timing/*/s1/loaded_*/{CO_RUN}"))) == 2
    # the second timing pass (the default) ran its slices in calibrated time and loaded runs of its
    # own; its timeline's alone spans are those slices' compute, what an emulation's pace is read
    # against (emulation.pace_reference: timed, replay/follow.py)
    assert doc["timing_passes"] == 2
    assert len(sorted(stages.glob(f"timing/*/s1/refined_*/loaded_*/{CO_RUN}"))) == 2
    with np.load(tmp_path / "out" / "timeline.npz") as timeline:
        assert bool(timeline["timed_pass"]) and "alone_span" in timeline.files
    with np.load(tmp_path / "out" / "timeline_pass1.npz") as first:
        assert not bool(first["timed_pass"])
    assert_nothing_left(tmp_path, script)
