"""The collect stage as the pipeline sees it: inputs hashed into the output directory, reuse on rerun.

The bare graph depends on the program (its source), its arguments and the config keys that
shape what it runs (job world size, steps and seed; model; parallel; the collection mode and
its rules),
not on slots, timeouts or ranks of interest. Those inputs are hashed; the graph lives in
`<root>/<hash>/` and a rerun with the same inputs returns it without running anything.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from prism_core.collect.context_switch import collect_context_switch, collect_rules, tensor_cache_path
from prism_core.config import PrismConfig
from prism_core.runtime import write_json_atomic
from prism_core.trace.schema import SCHEMA_VERSION
from prism_core.trace import STORE_NAME, Trace, load_trace

_WORKLOAD_DIR = Path(__file__).resolve().parents[1] / "workloads"
DONE = "collect.json"
COLLECT_OUTPUTS = 2


def program_digest(cfg: PrismConfig) -> str:
    h = hashlib.sha256()
    if cfg.job.is_builtin:
        name = cfg.job.program.split(":", 1)[1]
        for path in sorted((_WORKLOAD_DIR / name).rglob("*.py")):
            h.update(path.relative_to(_WORKLOAD_DIR).as_posix().encode())
            h.update(path.read_bytes())
    else:
        h.update(Path(cfg.job.program).read_bytes())
    return h.hexdigest()


def _cache_digest(cfg: PrismConfig) -> str | None:
    """Identity of the tensor cache a rules-mode collection reads: its per-rank indexes."""
    if cfg.emulation.tensor_cache is None or cfg.emulation.collect_mode != "rules":
        return None
    h = hashlib.sha256()
    root = tensor_cache_path(cfg)
    for path in sorted(p for p in root.glob("ranks/*/**/*") if p.is_file() and
                       (p.name == "zarr.json" or "checksums" in p.relative_to(root).parts)):
        h.update(path.relative_to(root).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def input_key(cfg: PrismConfig) -> str:
    job = cfg.job.model_dump(mode="json", exclude={"timeout_s", "device_memory_bytes"})
    job["program"] = cfg.job.program if cfg.job.is_builtin else Path(cfg.job.program).name
    shaped = {"job": job, "model": cfg.model.model_dump(mode="json"), "parallel": cfg.parallel.model_dump(mode="json"),
              "collect_mode": cfg.emulation.collect_mode, "rules": list(cfg.emulation.rules),
              "dp_dedup": cfg.emulation.dp_dedup,
              "program_source": program_digest(cfg), "tensor_cache": _cache_digest(cfg),
              "schema": SCHEMA_VERSION,   # a graph of an older trace schema is collected again
              # ... and one collected before the collection wrote all it writes now (2: a DP-expanded
              # graph's group_source.npy, which a replay hosting only some ranks reads)
              "outputs": COLLECT_OUTPUTS}
    return hashlib.sha256(json.dumps(shaped, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class CollectOutput:
    directory: Path
    key: str
    reused: bool
    trace: Trace
    wall_s: float | None = None
    switches: int | None = None


def collect(cfg: PrismConfig, root: Path, slots: int | None = None, progress=None) -> CollectOutput:
    """The bare graph of `cfg`'s job under `root/<input hash>/`, collected now or reused.
    `progress(done, total)`: called as ranks' graphs come in."""
    key = input_key(cfg)
    directory = Path(root) / key
    done = directory / DONE
    if done.is_file() and (directory / STORE_NAME).is_dir():
        return CollectOutput(directory, key, True, load_trace(directory / STORE_NAME))
    run = collect_rules if cfg.emulation.collect_mode == "rules" else collect_context_switch
    result = run(cfg, directory, slots=slots, progress=progress)
    write_json_atomic(done, {"key": key, "world_size": cfg.job.world_size, "slots": slots or cfg.emulation.slots,
                             "wall_s": result.wall_s, "switches": result.switches,
                             "nodes": int(result.trace.offsets[-1])})
    return CollectOutput(directory, key, False, result.trace, result.wall_s, result.switches)
