"""The nightly deployment: its schedule and parameters fit the flow it runs."""

from __future__ import annotations

import inspect
import json

from flows.nightly import nightly_deployment, nightly_parameters
from flows.pipeline import run_flow


def _config(tmp_path, **report):
    path = tmp_path / "n.yaml"
    path.write_text(json.dumps({"name": "nightly-job", "job": {"program": str(tmp_path / "t.py"), "world_size": 2},
                                "report": report}))
    (tmp_path / "t.py").write_text("")
    return path


def test_schedule_and_parameters_match_the_flow_signature(tmp_path):
    config = _config(tmp_path)
    dep = nightly_deployment(str(config), ["job.iterations=4"])
    assert dep.name == "nightly-job-nightly"
    assert [s.schedule.cron for s in dep.schedules] == ["0 2 * * *"]
    params = dep.parameters
    assert params == {"config_path": str(config.resolve()), "overrides": ["job.iterations=4"], "check": True}
    signature = inspect.signature(run_flow.fn)
    assert set(params) <= set(signature.parameters)
    signature.bind(**params)                       # every required parameter is there
    run_flow.validate_parameters(params)           # and each has the type the flow declares
    assert set(dep._parameter_openapi_schema.properties) == set(signature.parameters)


def test_the_schedule_comes_from_the_config_or_the_command_line(tmp_path):
    config = _config(tmp_path, schedule="30 3 * * 1-5")
    assert [s.schedule.cron for s in nightly_deployment(str(config)).schedules] == ["30 3 * * 1-5"]
    assert [s.schedule.cron for s in nightly_deployment(str(config), cron="0 4 * * *").schedules] == ["0 4 * * *"]
    assert nightly_parameters(str(config), root=str(tmp_path))["root"] == str(tmp_path.resolve())
