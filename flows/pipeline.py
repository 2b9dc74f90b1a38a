"""Prefect wiring of the whole pipeline: collect -> timing -> calibrate -> emulate -> report.

`emulate_flow` stops after the emulation (`prism emulate`); `run_flow` adds the report (`prism
run`). Every stage reuses what is unchanged: the bare graph by its input hash, finished slices
by their `slice.json`; calibration (seconds) is redone, the emulation always runs.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow, task

from flows.calibrate import stage_root, task_runner, time_and_calibrate
from flows.collect import collect_task
from prism_core.config import config_from_dict, config_to_dict, load_config
from prism_core.emulate.stage import emulate
from prism_core.report.markdown import render_report, write_report

REPORT = "report.md"


@task(name="emulate", task_run_name="emulate ranks {ranks}")
def emulate_task(config: dict, graph_dir: str, timeline: str, out_dir: str, predicted: dict,
                 ranks: list[int]) -> dict:
    """The ranks of interest real, every other rank replayed in calibrated time; metrics.json's content."""
    return emulate(config_from_dict(config), Path(graph_dir), Path(timeline), Path(out_dir), predicted)


@task(name="report")
def report_task(config: dict, emulated: dict, predicted: dict, stages: dict[str, str], path: str) -> str:
    text = render_report(config_from_dict(config), emulated, predicted, stages)
    return str(write_report(Path(path), text))


def _pipeline(config_path: str, overrides: list[str] | None, out_dir: str | None, root: str | None,
              report: bool) -> dict:
    cfg = load_config(config_path, overrides or [])
    base = Path(root) if root else stage_root(cfg.name)
    out = Path(out_dir) if out_dir else base / ("run" if report else "emulate")
    config = config_to_dict(cfg)
    graph_dir = collect_task(cfg.name, config, str(base / "collect"))
    calibrated = str(base / "calibrate")
    predicted = time_and_calibrate(cfg, graph_dir, base, calibrated)
    emulated = emulate_task(config, graph_dir, str(Path(calibrated) / "timeline.npz"), str(out), predicted,
                            sorted(cfg.emulation.ranks_of_interest))
    if report:
        stages = {"bare graph": graph_dir, "slices": str(base / "timing"), "calibration": calibrated,
                  "emulation": str(out)}
        report_task(config, emulated, predicted, stages, str(out / REPORT))
    return emulated


@flow(name="prism-emulate", task_runner=task_runner())
def emulate_flow(config_path: str, overrides: list[str] | None = None, out_dir: str | None = None,
                 root: str | None = None) -> dict:
    """collect, timing and calibration (reused where unchanged), then the emulation."""
    return _pipeline(config_path, overrides, out_dir, root, report=False)


@flow(name="prism-run", task_runner=task_runner())
def run_flow(config_path: str, overrides: list[str] | None = None, out_dir: str | None = None,
             root: str | None = None) -> dict:
    """The whole pipeline and its markdown report; returns the emulation's metrics.json content."""
    return _pipeline(config_path, overrides, out_dir, root, report=True)


def run_pipeline(config_path: str, overrides: list[str], out_dir: str | None, dask_address: str | None,
                 root: str | None = None, report: bool = True) -> dict:
    """`run_flow` (or `emulate_flow`) on a local Dask cluster, or on the scheduler at `dask_address`."""
    cfg = load_config(config_path, overrides)
    runner = task_runner(dask_address, cfg.emulation.sandbox)
    chosen = run_flow if report else emulate_flow
    return chosen.with_options(task_runner=runner)(config_path, overrides, out_dir, root)
