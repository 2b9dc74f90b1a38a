"""The collect task wraps the library stage: same directory on rerun, no work done the second time."""

from __future__ import annotations

from pathlib import Path

import pytest

from flows.collect import collect_task
from prism_core.config import load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.timeout(300)
def test_collect_task_reuses_unchanged_inputs(tmp_path, capsys):
    cfg = load_config(CONFIGS / "tiny_moe_w2_pp2.yaml", ["job.iterations=3"])
    first = collect_task.fn(cfg.name, cfg.model_dump(mode="json"), str(tmp_path), 2)
    shown = capsys.readouterr().err     # progress as the ranks' graphs come in
    assert f"collect {cfg.name}: ranks: [" in shown and "] 2/2" in shown
    stamp = (Path(first) / "collect.json").stat().st_mtime_ns
    again = collect_task.fn(cfg.name, cfg.model_dump(mode="json"), str(tmp_path), 1)
    assert again == first and (Path(first) / "collect.json").stat().st_mtime_ns == stamp
    changed = load_config(CONFIGS / "tiny_moe_w2_pp2.yaml", ["job.iterations=4"])
    other = collect_task.fn(changed.name, changed.model_dump(mode="json"), str(tmp_path), 2)
    assert other != first and (Path(other) / "trace.zarr").is_dir()
