"""Stage 0, record: run the job for real at full world size and measure every rank (DESIGN.md §3)."""

from __future__ import annotations

from pathlib import Path

from prism_core.config import PrismConfig
from prism_core.launch import LaunchSpec, launch
from prism_core.metrics import metrics_document, rank_metrics, write_metrics
from prism_core.runtime import write_json_atomic


def record(cfg: PrismConfig, out_dir: Path, echo: bool = True) -> dict:
    """Launch all W ranks, write `out_dir/metrics.json` (mode "real") and return its content.

    Per-rank details (step times, logged scalars such as the loss) stay in `out_dir/results/`,
    rank output in `out_dir/logs/`. `peak_memory_bytes` stays null until memory is tracked.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "metrics.json").unlink(missing_ok=True)  # a failed rerun must not leave an old result behind
    config_path = out_dir / "config.json"
    write_json_atomic(config_path, cfg.model_dump(mode="json"))
    world = cfg.job.world_size
    spec = LaunchSpec(program=cfg.job.program, world_size=world, run_dir=out_dir, timeout_s=cfg.job.timeout_s,
                      args=list(cfg.job.args), env={"PRISM_CONFIG": str(config_path.resolve())},
                      echo_rank=(world - 1 if cfg.job.is_builtin else 0) if echo else None)
    results = launch(spec)
    ranks = {r: rank_metrics(r, res["step_times_s"], cfg.job.warmup) for r, res in results.items()}
    document = metrics_document("real", world, ranks)
    write_metrics(out_dir / "metrics.json", document)
    return document
