"""The markdown report of a `prism run`: what a training engineer looks at first.

Each rank of interest's emulated iteration time beside the calibrated prediction, its peak
memory and OOM; the whole job's predicted iteration time across all W ranks (with the slowest
ranks, and the slice-only figure the calibration corrects); what the emulation instantiated.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from prism_core.config import PrismConfig


def _s(value: float | None) -> str:
    return "–" if value is None else f"{value * 1e3:.2f} ms"


def _bytes(value: int | None) -> str:
    return "–" if value is None else f"{value:,} B ({value / 2**20:.1f} MiB)"


def render_report(cfg: PrismConfig, emulated: dict, predicted: dict, stages: dict[str, str]) -> str:
    """The report's text. `stages`: stage name -> the directory of its output."""
    w = emulated["world_size"]
    lines = [f"# {cfg.name}: {w}-rank job, emulated", "",
             f"Program `{cfg.job.program}`, {cfg.job.iterations} steps ({cfg.job.warmup} warm-up left out); "
             f"ranks of interest {sorted(cfg.emulation.ranks_of_interest)} ran the real program, the other "
             f"{w - len(emulated['ranks'])} were replayed from the calibrated graph.", "",
             "## Ranks of interest", "",
             "| rank | emulated iteration time | predicted | emulated − predicted | peak memory | OOM |",
             "| ---: | ---: | ---: | ---: | ---: | :---: |"]
    for r, m in emulated["ranks"].items():
        e, p = m["iteration_time_s"], predicted["ranks"][r]["iteration_time_s"]
        diff = "–" if e is None or p is None else f"{(e - p) / p:+.2%}"
        oom = f"yes (step {m['oom_step']})" if m["oom"] else "no"
        lines.append(f"| {r} | {_s(e)} | {_s(p)} | {diff} | {_bytes(m['peak_memory_bytes'])} | {oom} |")
    if "oom" in emulated:
        o = emulated["oom"]
        lines += ["", f"**Out of memory**: rank(s) {o['ranks']} at step {o['step']} with "
                      f"`job.device_memory_bytes` = {cfg.job.device_memory_bytes:,}: {o['message']}"]
    times = {r: m["iteration_time_s"] for r, m in predicted["ranks"].items() if m["iteration_time_s"] is not None}
    if times:
        slowest = sorted(times, key=times.get, reverse=True)[:5]
        lines += ["", "## The whole job (calibrated prediction, every rank)", "",
                  f"- iteration time: median {_s(statistics.median(times.values()))}, "
                  f"min {_s(min(times.values()))}, max {_s(max(times.values()))}",
                  "- slowest ranks: " + ", ".join(f"{r} ({_s(times[r])})" for r in slowest)]
        alone = [m.get("uncalibrated_iteration_time_s") for m in predicted["ranks"].values()]
        alone = [t for t in alone if t is not None]
        if alone:
            lines.append(f"- each rank as timed in its own slice, before inter-slice calibration: median "
                         f"{_s(statistics.median(alone))}")
    if "emulation" in emulated:
        e = emulated["emulation"]
        lines += ["", "## Emulation", "",
                  _virtual_line(e),
                  f"- process groups: {e['groups_instantiated']} of the job's {e['groups_in_job']} instantiated "
                  f"(those holding a rank of interest), {e['gloo_groups']} gloo groups for virtual members",
                  f"- assistant: {e['wall_s']:.1f} s wall, {e['cpu_s']:.1f} s CPU"]
        pace = e.get("follow_pace") or {}
        if pace.get("median") is not None:
            lines.append(f"- virtual ranks' compute followed the pace of ranks {pace['ranks']}: median "
                         f"{pace['median']:.2f} of the calibrated spans")
        elif pace.get("off"):
            lines.append(f"- virtual ranks' compute as calibrated: no pace read ({pace['off']})")
    lines += ["", "## Outputs", ""] + [f"- {name}: `{path}`" for name, path in stages.items()]
    return "\n".join(lines) + "\n"


def write_report(path: Path, text: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return path


def _virtual_line(e: dict) -> str:
    """How many virtual ranks the assistant replayed: every one, or the sandbox's neighbours of how many."""
    if e.get("hosted") == "neighbours":
        return (f"- virtual ranks: {e['virtual_ranks']} replayed (the ranks of interest's neighbours) of the job's "
                f"{e['virtual_ranks_in_job']}, {e['nodes']:,} nodes")
    return f"- virtual ranks: {e['virtual_ranks']}, replaying {e['nodes']:,} nodes"
