"""Nightly runs: the `prism-run` flow registered with Prefect under a cron schedule (`prism serve`).

The served flow runs with `check=True`: each night's version is compared with the previous one
and the run fails, naming the figures, when a rank of interest's iteration time or peak memory
moved beyond `report.max_iteration_time_change` / `report.max_peak_memory_change`.
"""

from __future__ import annotations

from pathlib import Path

from flows.pipeline import run_flow
from prism_core.config import load_config


def nightly_parameters(config_path: str, overrides: list[str] | None = None, root: str | None = None) -> dict:
    """What each scheduled run of `run_flow` receives (absolute paths: the server runs it from anywhere)."""
    params = {"config_path": str(Path(config_path).resolve()), "overrides": list(overrides or []), "check": True}
    if root is not None:
        params["root"] = str(Path(root).resolve())
    return params


def nightly_deployment(config_path: str, overrides: list[str] | None = None, cron: str | None = None,
                       name: str | None = None, root: str | None = None):
    """A RunnerDeployment of `run_flow` on `cron` (default: the config's `report.schedule`)."""
    cfg = load_config(config_path, overrides or [])
    return run_flow.to_deployment(
        name=name or f"{cfg.name}-nightly", cron=cron or cfg.report.schedule,
        parameters=nightly_parameters(config_path, overrides, root),
        description=f"PrismLLM emulation of {cfg.name} ({cfg.job.world_size} ranks), compared with the previous "
                    "version: fails when iteration time or peak memory moved beyond the configured limits",
        tags=["prism", "nightly", cfg.name])


def serve_nightly(config_path: str, overrides: list[str] | None = None, cron: str | None = None,
                  name: str | None = None) -> None:
    """Register the deployment and run its schedule in this process until interrupted."""
    from prefect import serve

    serve(nightly_deployment(config_path, overrides, cron, name))
