"""The report stage: plots, the markdown report, and a new version under `artifacts/<job>/<n>/`.

`publish_run` is what `prism run`, `prism recalibrate` and the nightly flow end with. It draws the
plots into the run directory, compares the run with the job's previous version, writes the
report (figures, comparison, plots) and publishes the version with the content hashes of its
inputs. `raise_on_regression` then fails a checked run (the nightly one) whose figures moved
beyond `report.max_*_change`; the version is published either way, so the history keeps the
bad night too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from prism_core.config import PrismConfig, config_to_dict
from prism_core.report import plots, versions
from prism_core.report.markdown import render_report, write_report
from prism_core.report.regression import Change, RegressionError, compare

REPORT = "report.md"
PLOTS = "plots"


@dataclass
class Published:
    version: versions.Version
    previous: versions.Version | None
    changes: list[Change]
    report: Path


def input_hashes(cfg: PrismConfig, graph_dir: Path, timeline: Path) -> dict[str, str]:
    """Content hashes of what the run consumed: config, program source, bare graph, calibrated timeline."""
    from prism_core.collect.stage import program_digest

    graph_record = Path(graph_dir) / "collect.json"
    return {"config": versions.hash_json(config_to_dict(cfg)), "program": program_digest(cfg),
            "bare_graph": Path(graph_dir).name + ":" + (versions.hash_file(graph_record) if graph_record.is_file()
                                                          else "?"),
            "timeline": versions.hash_file(timeline)}


def draw(cfg: PrismConfig, run_dir: Path, graph_dir: Path, timeline: Path, history_points: list[tuple[int, dict]]
         ) -> dict[str, Path]:
    """The plots of this run, in `run_dir/plots/`: name -> path."""
    from prism_core.trace import STORE_NAME, load_trace

    out = Path(run_dir) / PLOTS
    made = {}
    trace = load_trace(Path(graph_dir) / STORE_NAME)
    with np.load(timeline) as t:
        start, end = t["start"], t["end"]
    roi = sorted(cfg.emulation.ranks_of_interest)
    step = cfg.job.iterations - 1        # the last whole step
    made["timeline"] = plots.timeline(trace, start, end, plots.sample_ranks(trace.world_size, roi), roi,
                                      out / "timeline.png", step)
    if history_points:
        made["history"] = plots.history(history_points, out / "history.png")
    samples = {}
    for r in roi:
        part = Path(run_dir) / "trace_parts" / f"{r}.npz"
        if part.is_file() and (s := plots.memory_samples(part, step)) is not None:
            samples[r] = s
    if samples:
        made["memory"] = plots.memory(samples, out / "memory.png")
    return made


def _comparison(previous: versions.Version | None, changes: list[Change]) -> list[str]:
    if previous is None:
        return ["", "## Compared with the previous version", "", "- first version of this job"]
    lines = ["", f"## Compared with version {previous.number} ({previous.record.get('created', '?')})", "",
             "| rank | figure | before | now | change | limit |", "| ---: | --- | ---: | ---: | ---: | ---: |"]
    for c in changes:
        if c.figure == "oom":
            if c.exceeded:
                lines.append(f"| {c.rank} | OOM | {c.before} | {c.after} | changed | – |")
            continue
        fmt = (lambda v: "–" if v is None else f"{v * 1e3:.2f} ms") if c.figure == "iteration time" else \
            (lambda v: "–" if v is None else f"{int(v):,} B")
        rel = "–" if c.relative is None else f"{c.relative:+.2%}" + (" **(beyond limit)**" if c.exceeded else "")
        lines.append(f"| {c.rank} | {c.figure} | {fmt(c.before)} | {fmt(c.after)} | {rel} | ±{c.limit:.2%} |")
    return lines


def publish_run(cfg: PrismConfig, emulated: dict, predicted: dict, stages: dict[str, str], run_dir: Path,
                graph_dir: Path, timeline: Path, job_dir: Path) -> Published:
    """`job_dir`: where the job's versions live (`artifacts/<job>`)."""
    run_dir = Path(run_dir)
    previous = versions.latest(job_dir)
    changes = [] if previous is None else compare(previous.metrics, emulated, cfg.report.max_iteration_time_change,
                                                  cfg.report.max_peak_memory_change)
    points = [(v.number, v.metrics) for v in versions.history(job_dir)]
    upcoming = (points[-1][0] if points else 0) + 1
    made = draw(cfg, run_dir, graph_dir, timeline, points + [(upcoming, emulated)])
    text = render_report(cfg, emulated, predicted, stages)
    text += "\n".join(_comparison(previous, changes)) + "\n"
    if made:
        text += "\n## Plots\n\n" + "\n\n".join(f"![{name}]({PLOTS}/{p.name})" for name, p in made.items()) + "\n"
    report = write_report(run_dir / REPORT, text)
    files: dict[str, Path | str] = {"config.json": json.dumps(config_to_dict(cfg), indent=1),
                                    "metrics.json": run_dir / "metrics.json", REPORT: report}
    files.update({f"{PLOTS}/{p.name}": p for p in made.values()})
    summary = {r: {"iteration_time_s": m.get("iteration_time_s"), "peak_memory_bytes": m.get("peak_memory_bytes"),
                   "oom": m.get("oom")} for r, m in emulated["ranks"].items()}
    version = versions.publish(job_dir, cfg.name, files, input_hashes(cfg, graph_dir, timeline),
                               stages, summary)
    return Published(version, previous, changes, report)


def raise_on_regression(cfg: PrismConfig, published: Published) -> None:
    bad = [c for c in published.changes if c.exceeded]
    if bad:
        raise RegressionError(
            f"{cfg.name} version {published.version.number} compared with version {published.previous.number}: "
            + "; ".join(c.sentence() for c in bad)
            + f" (limits: report.max_iteration_time_change={cfg.report.max_iteration_time_change}, "
              f"report.max_peak_memory_change={cfg.report.max_peak_memory_change}; "
              f"report: {published.version.path / REPORT})")
