"""`prism run` as a Prefect flow: collect -> timing -> calibrate -> emulate -> report, end to end on a torch
pipelining script, and a failing stage failing the flow with nothing left running."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prefect.exceptions import PrefectException

from flows.pipeline import REPORT, run_flow, run_pipeline
from prism_core.collect.stage import collect
from prism_core.config import load_config

from tests.jobs import CRASH_IN_SLICE_SCRIPT, assert_no_rank_processes, assert_nothing_left, make_job

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.mark.timeout(600)
def test_run_emulates_a_pipelining_script_and_reports(prefect_server, tmp_path):
    config = tmp_path / "pp.yaml"
    config.write_text(json.dumps({"name": "pp", "job": {"program": str(SCRIPTS / "pipeline_1f1b.py"),
                                                         "world_size": 2, "iterations": 4, "warmup": 1,
                                                         "args": ["--steps", "4"]},
                                  "emulation": {"sandbox": 1, "ranks_of_interest": [1]}}))
    out = tmp_path / "run"
    doc = run_pipeline(str(config), [], str(out), None, root=str(tmp_path / "stages"))
    assert doc["mode"] == "emulated" and set(doc["ranks"]) == {"1"}
    version = doc.pop("version")
    assert json.loads((out / "metrics.json").read_text()) == doc
    assert version["number"] == 1 and (Path(version["path"]) / "report.md").is_file()
    assert doc["ranks"]["1"]["iteration_time_s"] > 0 and doc["ranks"]["1"]["peak_memory_bytes"] > 0
    report = (out / REPORT).read_text()
    assert "| 1 |" in report and "virtual ranks: 1" in report
    predicted = json.loads((tmp_path / "stages" / "calibrate" / "metrics.json").read_text())
    assert predicted["mode"] == "predicted" and set(predicted["ranks"]) == {"0", "1"}
    assert_no_rank_processes()


@pytest.mark.timeout(600)
def test_a_failing_rank_fails_the_run_with_its_error(prefect_server, tmp_path, monkeypatch):
    flag = tmp_path / "crash"
    monkeypatch.setenv("CRASH_FLAG", str(flag))
    config, script = make_job(tmp_path, CRASH_IN_SLICE_SCRIPT, name="crashy", iterations=3)
    stages = tmp_path / "stages"
    collect(load_config(config), stages / "collect")
    flag.write_text("")
    with pytest.raises((PrefectException, RuntimeError), match="fails in its slice on purpose"):
        run_flow(str(config), ["emulation.sandbox=1"], str(tmp_path / "run"), root=str(stages))
    assert_nothing_left(tmp_path, script)
    assert not (tmp_path / "run" / "metrics.json").exists()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_demo_runs_end_to_end_with_a_rank_of_another_replica(prefect_server, tmp_path):
    # what `make demo` runs: 64 ranks, rules-mode graph with DP expansion; rank 63 sits in the
    # last DP replica, so its expanded groups' names come from the sandbox
    config = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"
    doc = run_pipeline(str(config), [], str(tmp_path / "run"), None, root=str(tmp_path / "stages"))
    assert doc["mode"] == "emulated" and set(doc["ranks"]) == {"0", "63"}
    assert all(m["iteration_time_s"] > 0 and m["peak_memory_bytes"] > 0 for m in doc["ranks"].values())
    # by default only the ranks of interest's neighbours are hosted (emulation.virtual_ranks)
    assert doc["emulation"]["virtual_ranks_in_job"] == 62 and 0 < doc["emulation"]["virtual_ranks"] < 62
    assert (tmp_path / "run" / REPORT).is_file()
    assert_no_rank_processes()
