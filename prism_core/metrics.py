"""`metrics.json` (DESIGN.md §9): per-rank iteration times, peak memory and OOM, written atomically."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Literal

from prism_core.runtime import write_json_atomic

Mode = Literal["real", "predicted", "emulated"]


class MetricsError(RuntimeError):
    pass


def rank_metrics(rank: int, step_times: list[float], warmup: int, peak_memory_bytes: int | None = None,
                 oom: bool = False) -> dict:
    measured = step_times[warmup:]
    if not measured:
        raise MetricsError(
            f"rank {rank} completed {len(step_times)} optimizer steps, none after job.warmup={warmup}: "
            "nothing to measure (does the program call optimizer.step()? raise job.iterations or lower job.warmup)")
    return {"iteration_time_s": statistics.median(measured), "step_times_s": measured,
            "peak_memory_bytes": peak_memory_bytes, "oom": oom}


def metrics_document(mode: Mode, world_size: int, ranks: dict[int, dict]) -> dict:
    return {"mode": mode, "world_size": world_size, "ranks": {str(r): ranks[r] for r in sorted(ranks)}}


def write_metrics(path: Path, document: dict) -> None:
    write_json_atomic(path, document)
