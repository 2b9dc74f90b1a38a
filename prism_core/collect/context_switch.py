"""Stage 1: the bare graph of a W-rank job on K slots (paper §5.2, Appendices A-C).

Context switching: every logical rank runs the real, unmodified program (so value-dependent
control flow is followed with real values), forked from a zygote; at most K of them run at once
under the coordinator; collectives execute on the CPU when all their inputs are in.
Rules: each collected rank runs alone against a fake world, K processes at a time, with
collective outputs from tensor rules (`rules.py`); for the built-in workloads only one DP
replica runs and its graph is expanded to all W ranks (`dedup.py`). Either way each rank
records its PrismTrace structure as in `prism record`; the parts are merged, validated and
stored as `trace.zarr`; context switching also keeps every rank's communication inputs in the
tensor cache `tensors.zarr`. Timing in this graph is meaningless; Stage 2 fills it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from prism_core.collect.client import ENV_SOCKET
from prism_core.collect.coordinator import CollectError, Coordinator
from prism_core.collect.dedup import expand_replica_with_groups, replica_source
from prism_core.cache import CacheError
from prism_core.collect.cached import ENV_TENSOR_CACHE
from prism_core.collect.local import ENV_CACHE_OUT, ENV_RULES, ENV_USER_RULES
from prism_core.topology import Topology
from prism_core.workloads.moe_gpt.rules import RULES as MOE_GPT_RULES
from prism_core.config import PrismConfig, config_to_dict
from prism_core.launch.child_python import module_command
from prism_core.launch.launcher import host_store, read_errors
from prism_core.runtime import write_json_atomic
from prism_core.trace import STORE_NAME, Trace, merge_parts, validate, write_trace


BUILTIN_RULES = {"builtin:moe_gpt": MOE_GPT_RULES}
CACHE_NAME = "tensors.zarr"
REPLICA_SOURCE = "replica_source.npy"   # rules mode with DP dedup: per rank, the replica-0 rank it copies
GROUP_SOURCE = "group_source.npy"       # ... and per group, the group its nodes copy (-1: none)


@dataclass
class CollectResult:
    trace: Trace
    path: Path
    wall_s: float
    switches: int


def _first_error(run_dir: Path) -> str | None:
    errors = read_errors(run_dir)
    if not errors:
        return None
    first = min(errors, key=lambda e: e["time"])
    return f"rank {first['rank']} failed:\n{first['traceback'].rstrip()}"


def tensor_cache_path(cfg: PrismConfig) -> Path:
    """The config's `emulation.tensor_cache`, checked to be a tensor cache."""
    path = Path(cfg.emulation.tensor_cache).resolve()
    if not (path / "ranks").is_dir():
        raise CacheError(f"emulation.tensor_cache: {path} is not a tensor cache (no ranks/ in it); point it at the "
                         f"{CACHE_NAME} of a context-switching collection")
    return path


def _dedup_ranks(cfg: PrismConfig) -> list[int] | None:
    """One DP replica's ranks when the topology is known (built-in workloads) and dp > 1."""
    if not cfg.job.is_builtin or (cfg.parallel.dp or 1) == 1 or not cfg.emulation.dp_dedup:
        return None
    return sorted(Topology.from_config(cfg).replica_ranks(0))


Progress = Callable[[int, int], None]   # (ranks whose graph is in, ranks to collect)


def collect_context_switch(cfg: PrismConfig, out_dir: Path, slots: int | None = None,
                           progress: Progress | None = None) -> CollectResult:
    """Every rank real, K at a time, collectives on the CPU (paper §5.2)."""
    return _collect(cfg, out_dir, slots or cfg.emulation.slots, "context_switch", progress=progress)


def collect_rules(cfg: PrismConfig, out_dir: Path, slots: int | None = None,
                  progress: Progress | None = None) -> CollectResult:
    """Every collected rank alone against a fake world, K at a time; one DP replica, then expanded."""
    return _collect(cfg, out_dir, slots or cfg.emulation.slots, "rules", progress=progress)


def collect_ranks(cfg: PrismConfig, out_dir: Path, ranks: list[int]) -> Trace:
    """Only `ranks`, each alone against a fake world (rules mode), not expanded or matched across
    ranks: a probe of their structure (`collect.probe`)."""
    return _collect(cfg, out_dir, min(len(ranks), cfg.emulation.slots), "rules", only=sorted(ranks)).trace


def _collect(cfg: PrismConfig, out_dir: Path, slots: int, mode: str, only: list[int] | None = None,
             progress: Progress | None = None) -> CollectResult:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for sub in ("results", "errors", "trace_parts", "flight", "logs"):
        shutil.rmtree(out_dir / sub, ignore_errors=True)
    config_path = out_dir / "config.json"
    write_json_atomic(config_path, config_to_dict(cfg))
    ranks = only if only is not None else (_dedup_ranks(cfg) if mode == "rules" else None)

    sock_dir = Path(tempfile.mkdtemp(prefix="prism-collect-"))   # Unix socket paths must be short
    try:
        return _collect_in(cfg, out_dir, slots, mode, ranks, sock_dir, whole=only is None, progress=progress)
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)


def _collect_in(cfg: PrismConfig, out_dir: Path, slots: int, mode: str, ranks: list[int] | None,
                sock_dir: Path, whole: bool = True, progress: Progress | None = None) -> CollectResult:
    world = cfg.job.world_size
    config_path = out_dir / "config.json"
    store, port = host_store(cfg.job.timeout_s)
    coordinator = Coordinator(str(sock_dir / "coord.sock"), world, slots, cache_root=out_dir / CACHE_NAME) \
        if mode == "context_switch" else None
    rules = list(cfg.emulation.rules) + (BUILTIN_RULES.get(cfg.job.program, []) if cfg.job.is_builtin else [])
    cache = {}
    if mode == "rules" and cfg.emulation.tensor_cache is not None:
        cache = {ENV_TENSOR_CACHE: str(tensor_cache_path(cfg))}
    if mode == "rules":   # each collected rank keeps what it sent, for the replay of virtual ranks
        shutil.rmtree(out_dir / CACHE_NAME, ignore_errors=True)
        cache[ENV_CACHE_OUT] = str(out_dir / CACHE_NAME)
    env = dict(os.environ, WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), ROLE_WORLD_SIZE=str(world),
               GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True",
               OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1", PRISM_LAUNCHER_PID=str(os.getpid()),
               PRISM_CONFIG=str(config_path.resolve()), PRISM_INSTRUMENT="1", PRISM_MEMORY="0",
               **{ENV_SOCKET: str(sock_dir / "coord.sock"), ENV_RULES: ",".join(rules),
                  ENV_USER_RULES: str(len(cfg.emulation.rules))}, **cache)
    cmd = [*module_command("prism_core.collect.zygote"), "--world", str(world), "--program", cfg.job.program,
           "--result-dir", str(out_dir), "--mode", mode]
    if mode == "rules":
        cmd += ["--concurrency", str(slots)] + (["--ranks", ",".join(map(str, ranks))] if ranks else [])
    cmd += ["--", *cfg.job.args]
    start = time.monotonic()
    try:
        with open(out_dir / "zygote.log", "wb") as log:
            zygote = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                      process_group=0)
    except OSError:
        if coordinator is not None:
            coordinator.close()
        raise

    total, done = len(ranks) if ranks is not None else world, [-1]

    def alive() -> None:
        if zygote.poll() not in (None, 0) or (out_dir / "errors").is_dir() and any((out_dir / "errors").iterdir()):
            time.sleep(0.2)
            raise CollectError(_first_error(out_dir) or f"the zygote exited with status {zygote.returncode}; "
                               f"see {out_dir / 'zygote.log'}")
        if progress is not None:     # a rank's graph is in once its trace part is written
            parts = out_dir / "trace_parts"
            n = sum(1 for p in parts.iterdir() if p.suffix == ".npz" and not p.name.startswith(".")) \
                if parts.is_dir() else 0
            if n != done[0]:
                done[0] = n
                progress(n, total)

    try:
        if coordinator is not None:
            try:
                coordinator.serve(cfg.job.timeout_s, alive)
            except CollectError as err:
                detail = _first_error(out_dir) if "disconnected" in str(err) else None
                raise CollectError(detail or str(err)) from None
            shutil.rmtree(out_dir / CACHE_NAME, ignore_errors=True)
            coordinator.write_cache()
        deadline = start + cfg.job.timeout_s
        while zygote.poll() is None:
            alive()
            if time.monotonic() > deadline:
                raise CollectError(f"collection timed out after {cfg.job.timeout_s:g} s (job.timeout_s)")
            time.sleep(0.1)
        if zygote.returncode != 0:
            raise CollectError(_first_error(out_dir) or f"the zygote exited with status {zygote.returncode}")
    finally:
        if coordinator is not None:
            coordinator.abort("collection stopped")
        if zygote.poll() != 0:   # failure or still running: take down the zygote and every rank it forked
            try:
                os.killpg(zygote.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        zygote.wait(timeout=10)
        if coordinator is not None:
            coordinator.close()
        del store
    wall = time.monotonic() - start
    trace = merge_parts(out_dir / "trace_parts", world, ranks)
    if not whole:               # a probe of some ranks: nothing to expand, peers absent by design
        return CollectResult(trace=trace, path=None, wall_s=time.monotonic() - start, switches=len(ranks))
    if ranks is not None:
        topo = Topology.from_config(cfg)
        trace, group_source = expand_replica_with_groups(trace, topo)
        np.save(out_dir / REPLICA_SOURCE, replica_source(topo))   # whose cached inputs each rank replays
        np.save(out_dir / GROUP_SOURCE, group_source)
    validate(trace)
    path = write_trace(trace, out_dir / STORE_NAME)
    switches = coordinator.switches if coordinator is not None else len(ranks or range(world))
    return CollectResult(trace=trace, path=path, wall_s=wall, switches=switches)
