"""The report's plots (matplotlib, written as PNG): what one iteration looks like across ranks, how
the figures moved across versions, and each rank of interest's memory over its step.

- `timeline`: one row per rank (the ranks of interest, then a sample of the others) over one
  iteration of the calibrated timeline: compute, communication (waiting for peers included),
  and idle time between them.
- `history`: iteration time and peak memory of each rank of interest, version after version.
- `memory`: live tensor bytes of each rank of interest across its last measured step of the
  emulation, sampled at every compute node's end.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

COMPUTE_COLOUR, COMM_COLOUR = "#4c72b0", "#dd8452"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def sample_ranks(world_size: int, ranks_of_interest: list[int], others: int = 6) -> list[int]:
    """The ranks of interest, then up to `others` more spread evenly over the job."""
    spread = np.linspace(0, world_size - 1, num=min(world_size, others + len(ranks_of_interest)))
    rest = [int(r) for r in dict.fromkeys(np.round(spread).astype(int).tolist()) if r not in ranks_of_interest]
    return sorted(ranks_of_interest) + rest[:others]


def timeline(trace, start: np.ndarray, end: np.ndarray, ranks: list[int], ranks_of_interest: list[int],
             path: Path, step: int) -> Path:
    """Iteration `step` of the calibrated timeline (nodes after the last optimizer step carry the
    step count itself: pass the last whole one, iterations - 1); returns `path`."""
    from prism_core.trace.schema import COMPUTE

    plt = _pyplot()
    c = trace.columns
    rows = []
    for r in ranks:
        s = trace.rank_slice(r)
        sel = np.nonzero(c["step"][s] == step)[0] + s.start
        rows.append((r, sel))
    lo = min((start[sel].min() for _, sel in rows if len(sel)), default=0.0)
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(ranks) + 1.4))
    for y, (r, sel) in enumerate(rows):
        spans = np.stack([(start[sel] - lo) * 1e3, (end[sel] - start[sel]) * 1e3], axis=1)
        compute = c["kind"][sel] == COMPUTE
        ax.broken_barh([tuple(x) for x in spans[compute]], (y - 0.4, 0.8), facecolors=COMPUTE_COLOUR)
        ax.broken_barh([tuple(x) for x in spans[~compute]], (y - 0.4, 0.8), facecolors=COMM_COLOUR)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"rank {r}" + (" (real)" if r in ranks_of_interest else "") for r, _ in rows])
    ax.invert_yaxis()
    ax.set_xlabel("ms into the iteration (calibrated timeline)")
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color=COMPUTE_COLOUR, label="compute"),
                       Patch(color=COMM_COLOUR, label="communication (incl. waiting for peers)"),
                       Patch(facecolor="white", edgecolor="grey", label="idle")],
              loc="upper center", bbox_to_anchor=(0.5, -0.18 - 0.3 / max(len(rows), 1)), ncol=3, frameon=False)
    fig.tight_layout()
    return _save(fig, plt, path)


def history(points: list[tuple[int, dict]], path: Path) -> Path:
    """`points`: (version, metrics.json content) in version order."""
    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True)
    ranks = sorted({r for _, m in points for r in m["ranks"]}, key=int)
    for r in ranks:
        xs = [v for v, m in points if r in m["ranks"]]
        it = [m["ranks"][r].get("iteration_time_s") for v, m in points if r in m["ranks"]]
        mem = [m["ranks"][r].get("peak_memory_bytes") for v, m in points if r in m["ranks"]]
        top.plot(xs, [np.nan if t is None else t * 1e3 for t in it], marker="o", label=f"rank {r}")
        bottom.plot(xs, [np.nan if b is None else b / 2**20 for b in mem], marker="o", label=f"rank {r}")
    top.set_ylabel("iteration time (ms)")
    bottom.set_ylabel("peak memory (MiB)")
    bottom.set_xlabel("version")
    bottom.set_xticks([v for v, _ in points])
    top.legend(fontsize="small")
    fig.tight_layout()
    return _save(fig, plt, path)


def memory(samples: dict[int, tuple[np.ndarray, np.ndarray]], path: Path) -> Path:
    """`samples`: rank -> (seconds into the step, live bytes)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.5))
    for r, (t, b) in sorted(samples.items()):
        ax.step(t * 1e3, b / 2**20, where="post", label=f"rank {r}")
    ax.set_xlabel("ms into the step")
    ax.set_ylabel("live tensors (MiB)")
    ax.legend(fontsize="small")
    fig.tight_layout()
    return _save(fig, plt, path)


def memory_samples(part: Path, step: int) -> tuple[np.ndarray, np.ndarray] | None:
    """A sandbox rank's live-bytes samples over `step`, from its trace part (None without samples)."""
    with np.load(part) as data:
        if "live_node" not in data.files or not len(data["live_node"]):
            return None
        nodes, live = data["live_node"], data["live_bytes"]
        steps, t_start, t_end = data["step"], data["t_start"], data["t_end"]
    keep = steps[nodes] == step
    if not keep.any():
        return None
    begin = t_start[steps == step].min()
    return t_end[nodes[keep]] - begin, live[keep].astype(np.float64)


def _save(fig, plt, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
    return path
