"""Scripts written on torch's own parallel APIs run unmodified through `prism record`.

Each script (tests/scripts/) runs twice: through `prism record` (prism backend, trace, memory
counter) and launched the same way on plain gloo. Losses must be identical and the trace valid.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prism_core.config import config_from_dict
from prism_core.record import RecordOptions, record
from prism_core.trace import load_trace, problems

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
CASES = {"pipeline_1f1b": 2, "tp_fsdp_mesh": 4, "ddp": 2}


def _run(name: str, world: int, out: Path, instrument: bool) -> list[float]:
    losses = out / "losses.json"
    cfg = config_from_dict({"name": name, "job": {
        "program": str(SCRIPTS / f"{name}.py"), "world_size": world, "iterations": 4, "warmup": 1,
        "args": ["--steps", "4", "--losses-out", str(losses)], "timeout_s": 240}})
    doc = record(cfg, out, options=RecordOptions(instrument=instrument, echo=False))
    assert sorted(map(int, doc["ranks"])) == list(range(world))
    return json.loads(losses.read_text())


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", list(CASES))
def test_torch_api_script_runs_unmodified_with_the_same_losses(name, tmp_path):
    world = CASES[name]
    traced = _run(name, world, tmp_path / "prism", instrument=True)
    plain = _run(name, world, tmp_path / "gloo", instrument=False)
    assert len(traced) == 4
    assert traced == plain
    trace = load_trace(tmp_path / "prism" / "trace.zarr")
    assert problems(trace) == []
    assert (trace.columns["kind"] == 1).sum() > 0
    doc = json.loads((tmp_path / "prism" / "metrics.json").read_text())
    assert all(isinstance(r["peak_memory_bytes"], int) for r in doc["ranks"].values())
