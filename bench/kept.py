"""Reading kept fidelity runs (`fidelity.py --turns ... --keep DIR`): each config's graph and its pairs
with a second record, and the command line of the scripts that read them."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from prism_core.calibrate.durations import steady_compute
from prism_core.trace import Trace, load_trace


def kept_pairs(keep: Path) -> Iterator[tuple[str, Trace, Path]]:
    """(config name without its `tiny_moe_w2_` prefix, the config's graph, pair directory) for every
    kept pair that ran a second record."""
    for config in sorted(p for p in keep.iterdir() if (p / "collect").is_dir()):
        trace = load_trace(next((config / "collect").rglob("trace.zarr")))
        for pair in sorted(config.glob("pair*")):
            if (pair / "record_e").is_dir():
                yield config.name.removeprefix("tiny_moe_w2_"), trace, pair


def chosen_pairs(keep: Path, configs: str | None, per_config: int) -> dict[str, list[tuple[Path, Path, Trace]]]:
    """Per config (short name), its first `per_config` kept pairs as (pair directory, graph
    directory, graph), of the `configs` named (comma-separated; None: every kept one); SystemExit
    where none is kept."""
    wanted = None if configs is None else set(configs.split(","))
    pairs: dict[str, list[tuple[Path, Path, Trace]]] = {}
    for config, trace, pair in kept_pairs(keep):
        graph = next((keep / f"tiny_moe_w2_{config}" / "collect").glob("*/trace.zarr")).parent
        if (wanted is None or config in wanted) and len(pairs.setdefault(config, [])) < per_config:
            pairs[config].append((pair, graph, trace))
    pairs = {c: p for c, p in pairs.items() if p}
    if not pairs:
        raise SystemExit(f"no kept pair with a second record under {keep}" + (f" for {configs}" if wanted else ""))
    return pairs


def replayed_timeline(pair: Path) -> Path:
    """The timeline a kept pair's emulations replayed: the second pass's where the pair ran it by
    itself before them (`fidelity.py --emulate-second`: its turns' stops in `logs/p_stops.json`),
    else the first pass's. Emulating such a pair again on the first pass's timeline would read
    `timed` on a timeline that has no timed pass, that is, against the loaded spans."""
    if (pair / "logs" / "p_stops.json").is_file():
        return pair / "calibrate2" / "timeline_pass2.npz"
    return pair / "calibrate" / "timeline.npz"


def warmup_steps(run: Path) -> int:
    """A kept run's warm-up steps, as it ran them (bench/fidelity.py sets its own)."""
    return int(json.loads((run / "config.json").read_text())["job"]["warmup"])


def trace_part(run: Path, rank: int, fields: tuple[str, ...]) -> dict[str, np.ndarray]:
    """`fields` of a kept run's trace part of `rank` (`trace_parts/<rank>.npz`)."""
    with np.load(run / "trace_parts" / f"{rank}.npz") as z:
        return {k: z[k] for k in fields}


def read_kept(description: str, read_pair: Callable[[str, Trace, Path], list], what: str) -> list:
    """Parse `KEEP [KEEP ...]` and return `read_pair`'s rows over every kept pair; exit naming `what`
    was looked for where there are none."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("keep", type=Path, nargs="+")
    args = parser.parse_args()
    rows = [row for keep in args.keep for config, trace, pair in kept_pairs(keep) for row in read_pair(config, trace, pair)]
    if not rows:
        raise SystemExit(f"no {what} under " + ", ".join(map(str, args.keep)))
    return rows


def steady_grids(trace: Trace, first_step: int) -> list[np.ndarray] | None:
    """Ranks 0 and 1's steady compute nodes ([step, position], `steady_compute`) over the steps both
    ran steadily (a rank's last may differ); None where one has none."""
    grids = [steady_compute(trace, r, first_step) for r in range(2)]
    if any(g is None for g in grids):
        return None
    n = min(len(g) for g in grids)
    return [g[:n] for g in grids]


def part_spans(run: Path, rank: int) -> np.ndarray:
    """Each node's span (end less start) in a kept run's trace part of `rank`."""
    with np.load(run / "trace_parts" / f"{rank}.npz") as z:
        return z["t_end"] - z["t_start"]


def runs_by_spans(pair: Path, rank: int) -> dict[str, Path]:
    """The rank's emulations of the pair by how their virtual ranks took their spans ("timed",
    "steady" or "matched"); the configured run stands for timed or steady where none ran that way,
    matched is left out where none ran."""
    configured = pair / f"emulate_{rank}"
    found = {}
    for run in [configured, *sorted(pair.glob(f"emulate_{rank}_*"))]:
        stats = run / "replay" / "stats.json"
        if (run / "trace_parts" / f"{rank}.npz").exists() and stats.exists():
            way = json.loads(stats.read_text()).get("virtual_spans") or "timed"
            found.setdefault(way if way in ("timed", "matched") else "steady", run)   # at W=2 paired is steady
    return {way: found.get(way, configured) for way in ("timed", "steady")} | \
        ({"matched": found["matched"]} if "matched" in found else {})
