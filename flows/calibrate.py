"""Prefect wiring of Stage 2: per timing pass, one task per slice fanned out on Dask, then calibration.

Each slice task asks Dask for `resources={"slots": S}` (S = emulation.sandbox), so a worker
never runs more slices than it has slots. Locally the runner starts a `LocalCluster` of threads
(no worker processes: they would each start their own Prefect server) with one worker whose
slots are the machine's cores less one, the core the replay assistant needs; `dask_address`
uses an existing scheduler instead (`dask worker --resources slots=N` on each machine).
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import time
from pathlib import Path

import dask
from prefect import flow, task
from prefect.exceptions import TerminationSignal
from prefect.futures import as_completed, wait
from prefect_dask import DaskTaskRunner

from flows.artifacts import Progress, echo
from flows.collect import collect_stage, stage_key, unfinished
from prism_core.calibrate.stage import calibrate_pass, co_runs, finish_passes, slice_jobs
from prism_core.config import PrismConfig, config_from_dict, config_to_dict, load_config
from prism_core.launch.cores import machine_cores
from prism_core.replay.slices import CO_RUN, SLICE_DONE, run_slice, run_together
from prism_core.trace import STORE_NAME, load_trace

logging.getLogger("distributed").setLevel(logging.WARNING)   # Dask's own chatter; Prefect logs the slices


def local_slots(sandbox: int = 1) -> int:
    """Cores less the assistant's, but never fewer than one slice needs (it would never be scheduled)."""
    return max(sandbox, (os.cpu_count() or 1) - 1)


def task_runner(dask_address: str | None = None, sandbox: int = 1) -> DaskTaskRunner:
    if dask_address:
        return DaskTaskRunner(address=dask_address)
    slots = local_slots(sandbox)
    # Dask serves HTTP (dashboard, health) from the scheduler and each worker even with the
    # dashboard off, on every interface unless told: loopback here, on a free port.
    return DaskTaskRunner(cluster_kwargs={"processes": False, "n_workers": 1, "threads_per_worker": slots,
                                          "resources": {"slots": slots},
                                          "dashboard_address": "127.0.0.1:0",
                                          "worker_dashboard_address": "127.0.0.1:0",
                                          "local_directory": str(Path(tempfile.gettempdir()) / "prism-dask")})


def _slice_cache_key(context, parameters: dict) -> str:
    return stage_key("slice", Path(parameters["directory"]))


@task(name="time-slice", task_run_name="pass {timing_pass} slice {index}: ranks {sandbox}",
      cache_key_fn=_slice_cache_key)
def slice_task(config: dict, graph_dir: str, timing_pass: int, index: int, sandbox: list[int], directory: str,
               timing: str | None) -> str:
    """Run one slice (sandbox ranks real, the rest replayed), or reuse it if it already finished."""
    run_slice(config_from_dict(config), Path(graph_dir), sandbox, Path(directory), Path(timing) if timing else None)
    return directory


@task(name="time-slice-loaded", task_run_name="slice {index} beside the neighbour load: ranks {sandbox}",
      cache_key_fn=_slice_cache_key)
def loaded_slice_task(config: dict, graph_dir: str, index: int, sandbox: list[int], directory: str) -> str:
    """Run one slice beside a compute load on the assistant's cores (its compute spans), or reuse it."""
    run_slice(config_from_dict(config), Path(graph_dir), sandbox, Path(directory), neighbour_load=True)
    return directory


def _co_run_cache_key(context, parameters: dict) -> str:
    return stage_key("co-run", Path(parameters["members"][0][1]))    # a co-run's first member names it


@task(name="time-co-run", task_run_name="co-run {index}: slices of ranks {ranks}", cache_key_fn=_co_run_cache_key)
def co_run_task(config: dict, graph_dir: str, index: int, ranks: list[list[int]], members: list[list]) -> list[str]:
    """Run slices at once on the worker's cores (their compute spans beside the job's own
    ranks, replay/slices.py `run_together`), or reuse the co-run."""
    run_together(config_from_dict(config), Path(graph_dir), [(list(sb), Path(d)) for sb, d in members],
                 machine_cores())
    return [d for _, d in members]


def _co_run_unfinished(members: list[tuple[list[int], Path]]) -> bool:
    return any(unfinished(Path(d), name) for _, d in members for name in (SLICE_DONE, CO_RUN))


@task(name="calibrate", task_run_name="calibrate pass {timing_pass}")
def calibrate_task(config: dict, graph_dir: str, timing_root: str, out_dir: str, timing_pass: int,
                   timing: str | None) -> tuple[dict, str]:
    cfg = config_from_dict(config)
    trace = load_trace(Path(graph_dir) / STORE_NAME)
    plan, jobs = slice_jobs(cfg, trace, Path(graph_dir), Path(timing_root), Path(timing) if timing else None)
    document, path = calibrate_pass(cfg, trace, plan, jobs, Path(out_dir), timing_pass - 1)
    return document, str(path)


def stage_root(name: str) -> Path:
    """`artifacts/<name>` under the working directory, as an absolute path: slices may run on
    Dask workers started elsewhere (multi-node: the same path on a shared file system)."""
    return Path("artifacts").resolve() / name


def _most_slots() -> float | None:
    """The most `slots` any worker of the flow's Dask cluster offers (None: not known)."""
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    if ctx is None or not isinstance(ctx.task_runner, DaskTaskRunner):
        return None
    client = ctx.task_runner.client     # made (or connected) on first use; the slices then use it
    workers = client.scheduler_info().get("workers", {})
    slots = [w.get("resources", {}).get("slots", 0) for w in workers.values()]
    return max(slots) if slots else None


def _slots_per_slice(sandbox: int) -> float:
    """S slots per slice, or a whole worker where none offers S (a served or default-runner flow
    on a small machine, a remote worker started with fewer): a slice then runs alone on a
    worker rather than waiting for ever for slots no worker has."""
    most = _most_slots()
    if most is not None and 0 < most < sandbox:
        print(f"prism: no Dask worker offers {sandbox} slots (emulation.sandbox); slices take a whole worker "
              f"({most:g} slots) each", file=sys.stderr)
        return most
    return sandbox


def _stop_slices(futures: list, timeout: float = 30.0) -> None:
    """Stop the slices of an interrupted pass and let their tasks end and report now, while the
    flow and its Prefect server are up. Inside a flow a SIGTERM reaches Prefect's handler (which
    raises `TerminationSignal`), not prism's: no rank has been stopped yet. Left running, a slice
    would keep the Dask cluster's close waiting, then end on a Dask thread while prism exits."""
    from prism_core.launch.launcher import stop_all

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stop_all()   # the running slices' ranks, and those of a slice Dask has started meanwhile
        try:
            if not wait(futures, timeout=0.5).not_done:
                return
        except (KeyboardInterrupt, TerminationSignal):
            pass     # a repeated signal (process managers often send two) must not cut this short


def time_and_calibrate(cfg: PrismConfig, graph_dir: str, base: Path, out: str) -> dict:
    """Inside a flow: per timing pass, the slices as tasks on the flow's Dask runner, then calibration."""
    config = config_to_dict(cfg)
    trace = load_trace(Path(graph_dir) / STORE_NAME)
    timing, documents = None, []
    for n in range(1, cfg.emulation.timing_passes + 1):
        _, jobs = slice_jobs(cfg, trace, Path(graph_dir), base / "timing", Path(timing) if timing else None)
        with dask.annotate(resources={"slots": _slots_per_slice(cfg.emulation.sandbox)}):
            futures = [slice_task.with_options(refresh_cache=unfinished(job.directory, SLICE_DONE)).submit(
                config, graph_dir, n, job.index, job.sandbox, str(job.directory), timing) for job in jobs]
        loaded = [job for job in jobs if job.loaded is not None]     # each pass its own (calibrate/stage.py)
        # a loaded run takes a whole worker: it runs beside no other slice (launch/cores.py)
        with dask.annotate(resources={"slots": _most_slots() or local_slots(cfg.emulation.sandbox)}):
            if cfg.emulation.neighbours == "stand_in":
                futures += [loaded_slice_task.with_options(refresh_cache=unfinished(job.loaded, SLICE_DONE)).submit(
                    config, graph_dir, job.index, job.sandbox, str(job.loaded)) for job in loaded]
            else:
                for i, group in enumerate(co_runs(loaded, len(machine_cores()), cfg.emulation.sandbox)):
                    futures.append(co_run_task.with_options(refresh_cache=_co_run_unfinished(group)).submit(
                        config, graph_dir, i, [sb for sb, _ in group], [[sb, str(d)] for sb, d in group]))
        what = "slices and their loaded runs" if loaded else "slices"
        progress = Progress(f"timing pass {n}: {what}", len(futures), echo=echo)
        try:
            for _ in as_completed(futures):   # every slice ends (or fails) before the flow reports
                progress.step()
        except BaseException:
            _stop_slices(futures)   # interrupted (Ctrl-C, SIGTERM)
            raise
        for f in futures:
            f.result()   # raises the first failed slice's error; finished slices stay for a rerun
        document, timing = calibrate_task(config, graph_dir, str(base / "timing"), out, n, timing)
        documents.append(document)
    return finish_passes(Path(out), documents)


@flow(name="prism-calibrate", task_runner=task_runner())
def calibrate_flow(config_path: str, overrides: list[str] | None = None, out_dir: str | None = None,
                   root: str | None = None) -> dict:
    """collect (reused when unchanged) -> per pass: slices on Dask, calibration; returns metrics.json's content."""
    cfg = load_config(config_path, overrides or [])
    base = Path(root).resolve() if root else stage_root(cfg.name)
    graph_dir = collect_stage(cfg.name, config_to_dict(cfg), str(base / "collect"))
    out = str(Path(out_dir).resolve()) if out_dir else str(base / "calibrate")
    return time_and_calibrate(cfg, graph_dir, base, out)


def run_calibrate(config_path: str, overrides: list[str], out_dir: str | None, dask_address: str | None,
                  root: str | None = None) -> dict:
    """The calibrate flow on a local Dask cluster, or on the scheduler at `dask_address` (its workers
    need `--resources slots=N` with N >= emulation.sandbox, or the slices wait for ever)."""
    cfg = load_config(config_path, overrides)
    runner = task_runner(dask_address, cfg.emulation.sandbox)
    return calibrate_flow.with_options(task_runner=runner)(config_path, overrides, out_dir, root)
