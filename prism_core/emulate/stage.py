"""Stage 3, emulate (paper §6, DESIGN.md §3): the ranks of interest run the unmodified program on
sandbox slots while the replay assistant hosts the virtual ranks in calibrated time: those the
ranks of interest talk to (`emulation.virtual_ranks: neighbours`, the default), or every other rank.

A virtual compute node takes its calibrated span; communication with a sandbox rank is the real
transfer, and a virtual rank waiting on it resumes when it completes, so a late sandbox rank
delays the virtual ranks that depend on it (and, through them, the others). Only the groups that
hold a rank of interest are instantiated for virtual ranks; `metrics.json` (mode "emulated")
says how many that was next to the job's groups. A rank of interest that runs past
`job.device_memory_bytes` stops the run as a GPU out of memory would, and the metrics say where.
"""

from __future__ import annotations

import json
from pathlib import Path

from prism_core.config import PrismConfig
from prism_core.launch import LaunchError
from prism_core.metrics import metrics_document, oom_document, rank_metrics, result_peak, write_metrics
from prism_core.replay.slices import run_with_assistant

STATS = ("virtual_ranks", "virtual_ranks_in_job", "hosted", "groups_in_job", "groups_instantiated", "gloo_groups",
         "nodes", "wall_s", "cpu_s", "inputs_streamed", "follow_pace")


def emulate(cfg: PrismConfig, graph_dir: Path, timeline: Path, out_dir: Path,
            predicted: dict | None = None, progress=None) -> dict:
    """Run the emulation; write `out_dir/metrics.json` (ranks of interest, mode "emulated") and return it.

    `timeline`: the calibrated `timeline.npz` of this graph; `predicted`: the calibration's
    metrics, whose figure for each rank of interest is kept beside the emulated one;
    `progress(steps)`: called as the steps every rank of interest has completed grow.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "metrics.json").unlink(missing_ok=True)   # a failed rerun must not leave an old result behind
    ranks = sorted(cfg.emulation.ranks_of_interest)
    warmup = cfg.job.warmup
    try:
        # each rank of interest on the core it holds in `prism record` where the job fits the machine:
        # this machine's cores each have their own speed from second to second (bench/host_noise.py)
        results = run_with_assistant(cfg, graph_dir, ranks, out_dir, Path(timeline), progress=progress,
                                     job_cores=True, virtual_ranks=cfg.emulation.virtual_ranks)
        document = metrics_document("emulated", cfg.job.world_size, {
            r: rank_metrics(r, res["step_times_s"], warmup, result_peak(res, warmup)) for r, res in results.items()})
    except LaunchError as err:
        if not (err.error or {}).get("oom"):
            raise
        document = oom_document("emulated", cfg.job.world_size, ranks, err.results, warmup,
                                err.error["traceback"].strip().splitlines()[-1])
    if predicted is not None:
        for r, entry in document["ranks"].items():
            entry["predicted_iteration_time_s"] = predicted["ranks"][r]["iteration_time_s"]
    stats = out_dir / "replay" / "stats.json"
    if stats.is_file():
        replay = json.loads(stats.read_text())
        document["emulation"] = {k: replay[k] for k in STATS if k in replay}
        placement = out_dir / "placement.json"
        if placement.is_file():     # whether the ranks of interest had cores of their own
            document["emulation"]["placement"] = json.loads(placement.read_text())
    write_metrics(out_dir / "metrics.json", document)
    return document
