"""The cheap structure check before a partial re-calibration (`prism recalibrate`).

A kernel change (a faster attention, another fused op) changes how long nodes take, not which
communication happens: then the bare graph still holds and only timing, calibration and
emulation need redoing. To know that without collecting all W ranks again, one representative
rank (the first rank of interest) is collected alone in rules mode, with the earlier
collection's tensor cache answering its collectives where it holds them (so value-dependent
sizes follow the same values), and its structure is compared node by node with the same rank
of the existing graph.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from prism_core.config import PrismConfig, config_from_dict, config_to_dict
from prism_core.trace import STORE_NAME, load_trace
from prism_core.trace.structure import structural_diff

CACHE_NAME = "tensors.zarr"


class StructureChanged(RuntimeError):
    pass


@dataclass
class ProbeResult:
    rank: int
    graph_dir: Path
    diff: str | None       # None: the rank's structure is unchanged


def existing_graph(base: Path, world_size: int, preferred: Path | None = None) -> Path:
    """The bare graph to recalibrate on: `preferred` (the latest version's) if it is there, else
    the most recently finished collection under `base/collect` for this world size."""
    if preferred is not None and (Path(preferred) / STORE_NAME).is_dir():
        return Path(preferred)
    found = []
    for done in Path(base, "collect").glob("*/collect.json"):
        try:
            record = json.loads(done.read_text())
        except (OSError, ValueError):
            continue
        if record.get("world_size") == world_size and (done.parent / STORE_NAME).is_dir():
            found.append((done.stat().st_mtime, done.parent))
    if not found:
        raise FileNotFoundError(f"no bare graph of a {world_size}-rank job under {Path(base, 'collect')}: "
                                "collect it first (`prism collect CONFIG` or `prism run CONFIG`)")
    return max(found)[1]


def probe(cfg: PrismConfig, graph_dir: Path, out_dir: Path, rank: int | None = None) -> ProbeResult:
    """Collect `rank` (default: the first rank of interest) alone and compare it with `graph_dir`'s.

    A program whose communication changed may no longer fit the earlier tensor cache (a tensor
    of another shape where the cache has one); the probe then runs once more on rules alone,
    so that the answer is the structural difference rather than the cache's complaint.
    """
    from prism_core.collect.context_switch import collect_ranks
    from prism_core.collect.coordinator import CollectError

    rank = cfg.emulation.ranks_of_interest[0] if rank is None else rank
    cache = Path(graph_dir) / CACHE_NAME
    try:
        fresh = collect_ranks(_probe_config(cfg, cache if cache.is_dir() else None), _fresh(out_dir), [rank])
    except CollectError:
        if not cache.is_dir():
            raise
        fresh = collect_ranks(_probe_config(cfg, None), _fresh(out_dir), [rank])
    diff = structural_diff(load_trace(Path(graph_dir) / STORE_NAME), fresh, ranks=[rank])
    return ProbeResult(rank, Path(graph_dir), diff)


def _probe_config(cfg: PrismConfig, cache: Path | None) -> PrismConfig:
    raw = config_to_dict(cfg)
    raw["emulation"]["collect_mode"] = "rules"
    raw["emulation"]["tensor_cache"] = str(cache) if cache is not None else None
    return config_from_dict(raw)


def _fresh(out_dir: Path) -> Path:
    shutil.rmtree(out_dir, ignore_errors=True)
    return Path(out_dir)


def require_unchanged(result: ProbeResult) -> None:
    if result.diff is not None:
        raise StructureChanged(
            f"the program's communication structure changed since the bare graph {result.graph_dir} was "
            f"collected ({result.diff}); a re-calibration cannot reuse it: collect again with `prism collect "
            "CONFIG` (or `prism run CONFIG`), then recalibrate after later kernel-only changes")
