"""Stage 0, record: run the job for real at full world size and measure every rank (DESIGN.md §3).

Ranks run on the prism backend (gloo underneath) with the trace recorder and the native memory
counter. After the run the per-rank trace parts are merged into `trace.zarr` and validated;
`metrics.json` gets each rank's median step time and its peak live tensor bytes. A rank that
runs past `job.device_memory_bytes` fails like a GPU out of memory: the run is stopped, and
`metrics.json` says which rank ran out at which step.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from prism_core.config import ConfigError, PrismConfig, config_to_dict
from prism_core.launch import LaunchError, LaunchSpec, launch
from prism_core.launch.rank_main import ENV_CAPACITY, ENV_INSTRUMENT, ENV_MEMORY
from prism_core.metrics import metrics_document, oom_document, rank_metrics, result_peak, write_metrics
from prism_core.runtime import write_json_atomic
from prism_core.trace import STORE_NAME, merge_parts, validate, write_trace


@dataclass
class RecordOptions:
    instrument: bool = True   # False: plain gloo, no trace, no memory (the overhead baseline)
    memory: bool = True
    echo: bool = True
    force: bool = False       # launch even when the world looks too large for this machine


# resident memory of one CPU rank process with torch loaded, measured here: ~0.2-0.3 GiB
RANK_PROCESS_BYTES = 300 * 2**20


def check_fits(world_size: int) -> None:
    """Refuse a real run that cannot fit this machine's memory (a 1,024-rank record would swap it to death)."""
    import psutil

    available = psutil.virtual_memory().available
    need = world_size * RANK_PROCESS_BYTES
    if need > available:
        raise ConfigError(f"job.world_size: recording {world_size} ranks for real needs about {need / 2**30:.0f} GiB "
                          f"({RANK_PROCESS_BYTES >> 20} MiB per rank process) but {available / 2**30:.0f} GiB is "
                          "available: too large to run for real here (pass --force to try anyway)")


def _launch_spec(cfg: PrismConfig, out_dir: Path, opts: RecordOptions) -> LaunchSpec:
    config_path = out_dir / "config.json"
    write_json_atomic(config_path, config_to_dict(cfg))
    env = {"PRISM_CONFIG": str(config_path.resolve()), ENV_INSTRUMENT: "1" if opts.instrument else "0",
           ENV_MEMORY: "1" if opts.instrument and opts.memory else "0"}
    if cfg.job.device_memory_bytes is not None:
        env[ENV_CAPACITY] = str(cfg.job.device_memory_bytes)
    world = cfg.job.world_size
    return LaunchSpec(program=cfg.job.program, world_size=world, run_dir=out_dir, timeout_s=cfg.job.timeout_s,
                      args=list(cfg.job.args), env=env, bind_cores=cfg.job.cpu_binding == "core",
                      echo_rank=(world - 1 if cfg.job.is_builtin else 0) if opts.echo else None)


def record(cfg: PrismConfig, out_dir: Path, echo: bool = True, options: RecordOptions | None = None) -> dict:
    """Launch all W ranks, write `out_dir/metrics.json` (mode "real") and return its content.

    Per-rank details (step times, per-step peaks, logged scalars such as the loss) stay in
    `out_dir/results/`, rank output in `out_dir/logs/`, the merged trace in `out_dir/trace.zarr`.
    """
    opts = options or RecordOptions(echo=echo)
    if not opts.force:
        check_fits(cfg.job.world_size)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "metrics.json").unlink(missing_ok=True)  # a failed rerun must not leave an old result behind
    spec = _launch_spec(cfg, out_dir, opts)
    try:
        results = launch(spec)
    except LaunchError as err:
        if not err.error.get("oom"):
            raise
        return _record_oom(cfg, out_dir, err)
    warmup = cfg.job.warmup
    ranks = {r: rank_metrics(r, res["step_times_s"], warmup, result_peak(res, warmup)) for r, res in results.items()}
    if opts.instrument:
        trace = merge_parts(out_dir / "trace_parts", cfg.job.world_size)
        validate(trace)
        write_trace(trace, out_dir / STORE_NAME)
    document = metrics_document("real", cfg.job.world_size, ranks)
    write_metrics(out_dir / "metrics.json", document)
    return document


def _record_oom(cfg: PrismConfig, out_dir: Path, err: LaunchError) -> dict:
    """A rank ran out of device memory: the job stops there, as it would on GPUs; report what was measured."""
    document = oom_document("real", cfg.job.world_size, list(range(cfg.job.world_size)), err.results,
                            cfg.job.warmup, err.error["traceback"].strip().splitlines()[-1])
    write_metrics(out_dir / "metrics.json", document)
    return document
