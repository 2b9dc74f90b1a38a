"""Prefect wiring of the whole pipeline: collect -> timing -> calibrate -> emulate -> report.

`emulate_flow` stops after the emulation (`prism emulate`); `run_flow` adds the report and a new
version of the job's artifacts (`prism run`; with `check`, the nightly verdict against the
previous version); `recalibrate_flow` redoes timing, calibration and emulation on the existing
bare graph once a probe of one rank shows the structure unchanged (`prism recalibrate`). Every
stage reuses what is unchanged: the bare graph by its input hash, finished slices by their
`slice.json` (keyed by the program's source too); calibration (seconds) is redone, the
emulation always runs.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow, task

from flows.artifacts import Progress, echo, mirror
from flows.calibrate import stage_root, task_runner, time_and_calibrate
from flows.collect import collect_stage
from prism_core.collect.probe import existing_graph, probe, require_unchanged
from prism_core.config import PrismConfig, config_from_dict, config_to_dict, load_config
from prism_core.emulate.stage import emulate
from prism_core.report import versions
from prism_core.report.publish import REPORT, publish_run, raise_on_regression  # noqa: F401 - REPORT for callers


@task(name="emulate", task_run_name="emulate ranks {ranks}")
def emulate_task(config: dict, graph_dir: str, timeline: str, out_dir: str, predicted: dict,
                 ranks: list[int]) -> dict:
    """The ranks of interest real, the virtual ranks replayed in calibrated time; metrics.json's content."""
    cfg = config_from_dict(config)
    bar = Progress(f"emulation of ranks {ranks}: steps", cfg.job.iterations, echo=echo)
    return emulate(cfg, Path(graph_dir), Path(timeline), Path(out_dir), predicted,
                   progress=lambda done: bar.step(done - bar.done))


@task(name="report")
def report_task(config: dict, emulated: dict, predicted: dict, stages: dict[str, str], run_dir: str,
                graph_dir: str, timeline: str, job_dir: str, check: bool) -> dict:
    """Plots, report, a new version (mirrored as Prefect artifacts); with `check`, the verdict
    against the previous version."""
    cfg = config_from_dict(config)
    published = publish_run(cfg, emulated, predicted, stages, Path(run_dir), Path(graph_dir), Path(timeline),
                            Path(job_dir))
    mirror(cfg.name, published, emulated)
    if check:
        raise_on_regression(cfg, published)
    return {"number": published.version.number, "path": str(published.version.path),
            "report": str(published.report)}


@task(name="probe-structure", task_run_name="probe rank {rank}'s structure")
def probe_task(config: dict, graph_dir: str, out_dir: str, rank: int) -> str:
    """Collect one rank alone and compare it with the bare graph; refuse if the structure changed."""
    result = probe(config_from_dict(config), Path(graph_dir), Path(out_dir), rank)
    require_unchanged(result)
    return graph_dir


def _after_graph(cfg: PrismConfig, graph_dir: str, base: Path, out: Path, report: bool, check: bool) -> dict:
    """timing -> calibrate -> emulate (-> report and version) on the bare graph at `graph_dir`."""
    config = config_to_dict(cfg)
    calibrated = str(base / "calibrate")
    predicted = time_and_calibrate(cfg, graph_dir, base, calibrated)
    timeline = str(Path(calibrated) / "timeline.npz")
    emulated = emulate_task(config, graph_dir, timeline, str(out), predicted, sorted(cfg.emulation.ranks_of_interest))
    if report:
        stages = {"bare graph": graph_dir, "slices": str(base / "timing"), "calibration": calibrated,
                  "emulation": str(out)}
        version = report_task(config, emulated, predicted, stages, str(out), graph_dir, timeline, str(base), check)
        emulated = dict(emulated, version=version)
    return emulated


def _pipeline(config_path: str, overrides: list[str] | None, out_dir: str | None, root: str | None,
              report: bool, check: bool = False) -> dict:
    cfg = load_config(config_path, overrides or [])
    base = Path(root).resolve() if root else stage_root(cfg.name)
    out = Path(out_dir).resolve() if out_dir else base / ("run" if report else "emulate")
    graph_dir = collect_stage(cfg.name, config_to_dict(cfg), str(base / "collect"))
    return _after_graph(cfg, graph_dir, base, out, report, check)


@flow(name="prism-emulate", task_runner=task_runner())
def emulate_flow(config_path: str, overrides: list[str] | None = None, out_dir: str | None = None,
                 root: str | None = None) -> dict:
    """collect, timing and calibration (reused where unchanged), then the emulation."""
    return _pipeline(config_path, overrides, out_dir, root, report=False)


@flow(name="prism-run", task_runner=task_runner())
def run_flow(config_path: str, overrides: list[str] | None = None, out_dir: str | None = None,
             root: str | None = None, check: bool = False) -> dict:
    """The whole pipeline, its report and a new version of the job's artifacts; returns the
    emulation's metrics.json content with the version. `check`: fail when a figure moved beyond
    the config's `report.max_*_change` since the previous version (the nightly run)."""
    return _pipeline(config_path, overrides, out_dir, root, report=True, check=check)


@flow(name="prism-recalibrate", task_runner=task_runner())
def recalibrate_flow(config_path: str, overrides: list[str] | None = None, out_dir: str | None = None,
                     root: str | None = None, check: bool = False) -> dict:
    """After a kernel change: probe one rank's structure against the existing bare graph (refuse
    with the structural difference if it moved), then timing, calibration, emulation and report
    on that graph."""
    cfg = load_config(config_path, overrides or [])
    base = Path(root).resolve() if root else stage_root(cfg.name)
    out = Path(out_dir).resolve() if out_dir else base / "run"
    last = versions.latest(base)
    preferred = Path(last.record["stages"]["bare graph"]) if last and "bare graph" in last.record["stages"] else None
    graph_dir = str(existing_graph(base, cfg.job.world_size, preferred))
    probe_task(config_to_dict(cfg), graph_dir, str(base / "probe"), cfg.emulation.ranks_of_interest[0])
    return _after_graph(cfg, graph_dir, base, out, report=True, check=check)


def run_pipeline(config_path: str, overrides: list[str], out_dir: str | None, dask_address: str | None,
                 root: str | None = None, report: bool = True, check: bool = False,
                 recalibrate: bool = False) -> dict:
    """`run_flow` (`emulate_flow`, `recalibrate_flow`) on a local Dask cluster, or on the scheduler
    at `dask_address`."""
    cfg = load_config(config_path, overrides)
    runner = task_runner(dask_address, cfg.emulation.sandbox)
    if recalibrate:
        return recalibrate_flow.with_options(task_runner=runner)(config_path, overrides, out_dir, root, check)
    if not report:
        return emulate_flow.with_options(task_runner=runner)(config_path, overrides, out_dir, root)
    return run_flow.with_options(task_runner=runner)(config_path, overrides, out_dir, root, check)
