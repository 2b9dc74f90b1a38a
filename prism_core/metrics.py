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


def result_peak(result: dict, warmup: int) -> int | None:
    """A rank's peak live bytes over its measured steps (and at exit, when it stopped mid-step)."""
    peaks = result.get("step_peaks") or []
    measured = [p for p in peaks[warmup:] if p is not None]
    if result.get("peak_at_exit") is not None:
        measured.append(result["peak_at_exit"])
    return max(measured) if measured else None


def oom_document(mode: Mode, world_size: int, ranks: list[int], results: dict[int, dict], warmup: int,
                 message: str) -> dict:
    """metrics.json of a run stopped by a rank that ran out of device memory: what each rank measured
    until then, which ranks ran out and at which step (`oom_step`: that rank's 0-based step)."""
    entries = {}
    for rank in ranks:
        res = results.get(rank, {})
        times = res.get("step_times_s", [])[warmup:]
        oom = res.get("oom")
        entry = {"iteration_time_s": statistics.median(times) if times else None, "step_times_s": times,
                 "peak_memory_bytes": result_peak(res, warmup), "oom": bool(oom)}
        if oom:
            entry["oom_step"] = oom["step"]
        entries[rank] = entry
    document = metrics_document(mode, world_size, entries)
    oom_ranks = sorted(r for r, e in entries.items() if e["oom"])
    document["oom"] = {"ranks": oom_ranks, "step": min((entries[r]["oom_step"] for r in oom_ranks), default=None),
                       "message": message}
    return document
