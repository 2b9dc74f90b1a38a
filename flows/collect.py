"""Prefect wiring of Stage 1: one task around `prism_core.collect.stage.collect`, and a flow to run it alone."""

from __future__ import annotations

from pathlib import Path

from prefect import flow, task

from prism_core.collect.stage import collect
from prism_core.config import config_from_dict, config_to_dict, load_config


@task(name="collect-bare-graph", task_run_name="collect {name}")
def collect_task(name: str, config: dict, root: str, slots: int | None = None) -> str:
    """The bare graph's directory (`<root>/<input hash>/`); reused when the inputs are unchanged."""
    return str(collect(config_from_dict(config), Path(root), slots).directory)


@flow(name="prism-collect")
def collect_flow(config_path: str, overrides: list[str] | None = None, root: str | None = None,
                 slots: int | None = None) -> str:
    cfg = load_config(config_path, overrides or [])
    return collect_task(cfg.name, config_to_dict(cfg), root or str(Path("artifacts") / cfg.name / "collect"),
                        slots)
