"""Prefect wiring of Stage 1: one task around `prism_core.collect.stage.collect`, and a flow to run it alone."""

from __future__ import annotations

from pathlib import Path

from prefect import flow, task

from flows.artifacts import Progress, echo
from prism_core.collect.stage import DONE, collect, input_key
from prism_core.config import config_from_dict, config_to_dict, load_config


def stage_key(stage: str, directory: Path) -> str:
    """The Prefect cache key of a stage whose output directory is keyed by its inputs: the
    directory itself. Callers submit with `refresh_cache` while the directory's completion
    record is missing (`unfinished`), so a deleted or half-made output is made again rather than
    served from the cache; a finished one shows as Cached in the UI."""
    return f"prism-{stage}-{Path(directory).resolve()}"


def unfinished(directory: Path, marker: str) -> bool:
    return not (Path(directory) / marker).is_file()


def _graph_dir(config: dict, root: str) -> Path:
    return Path(root) / input_key(config_from_dict(config))


def _collect_cache_key(context, parameters: dict) -> str:
    return stage_key("collect", _graph_dir(parameters["config"], parameters["root"]))


@task(name="collect-bare-graph", task_run_name="collect {name}", cache_key_fn=_collect_cache_key)
def collect_task(name: str, config: dict, root: str, slots: int | None = None) -> str:
    """The bare graph's directory (`<root>/<input hash>/`); reused when the inputs are unchanged."""
    bar: list[Progress] = []

    def progress(done: int, total: int) -> None:
        if not bar:
            bar.append(Progress(f"collect {name}: ranks", total, echo=echo))
        bar[0].step(done - bar[0].done)

    return str(collect(config_from_dict(config), Path(root), slots, progress).directory)


def collect_stage(name: str, config: dict, root: str, slots: int | None = None) -> str:
    """`collect_task` inside a flow, from Prefect's cache when the graph is there."""
    refresh = unfinished(_graph_dir(config, root), DONE)
    return collect_task.with_options(refresh_cache=refresh)(name, config, root, slots)


@flow(name="prism-collect")
def collect_flow(config_path: str, overrides: list[str] | None = None, root: str | None = None,
                 slots: int | None = None) -> str:
    cfg = load_config(config_path, overrides or [])
    return collect_stage(cfg.name, config_to_dict(cfg), root or str(Path("artifacts") / cfg.name / "collect"),
                        slots)
