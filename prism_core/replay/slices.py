"""Stage 2a: slice-by-slice timing fill (paper §5.3).

A slice runs S ranks of the job for real — the unmodified program, instrumented exactly as in
`prism record` — while the replay assistant hosts every other rank as a virtual rank walking the
bare graph. Each sandbox rank records its node times; the assistant records when each virtual
rank issued each op. Slices go round-robin over one DP equivalence class when every DP replica
runs the same structure (the other replicas take their durations by renaming), otherwise over
all ranks; every timed rank is real in exactly one slice.

A slice's directory holds `slice.json` once it has succeeded; a rerun skips such slices.

A co-run (`run_together`) runs several slices at once, each slice's ranks and its assistant on
cores of their own: every real rank then computes beside real ranks of the job running the same
program, as in the full job, where a slice alone would leave the machine's other cores idle.
The calibration takes compute spans from it (calibrate/durations.py). Each assistant shares its
slice's cores (its gloo loops, idle class, run while its ranks wait), so that it takes no time
from the other slices' ranks.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from prism_core.backend.install import ENV_PUBLISH_GROUPS, ENV_SANDBOX
from prism_core.collect.context_switch import CACHE_NAME
from prism_core.config import PrismConfig, config_to_dict
from prism_core.launch.child_python import module_command
from prism_core.launch.launcher import LaunchSpec, LaunchStopped, launch, stop_all
from prism_core.launch.rank_main import ENV_CAPACITY, ENV_INSTRUMENT, ENV_MEMORY
from prism_core.replay.assistant import ENV_LAZY_GLOO
from prism_core.replay.pacing import ENV_NUDGE, Pacing, co_run_pacing, socket_name
from prism_core.runtime import write_json_atomic
from prism_core.topology import Topology
from prism_core.trace import Trace

SLICE_DONE = "slice.json"
CO_RUN = "co_run.json"     # in each member of a co-run that finished with every member bound to its cores


@dataclass
class TimingPlan:
    timed: list[int]          # ranks run for real, each in one slice
    source: np.ndarray        # per rank: the timed rank whose durations it takes
    slices: list[list[int]]   # sandbox ranks of each slice


# columns a DP renaming leaves alone: equal on a rank and its source means equal durations apply
_RENAMING_INVARIANT = ("kind", "op", "bytes", "dtype", "seq", "tag", "async_", "ref", "step", "reduce", "splits")


def plan_slices(cfg: PrismConfig, trace: Trace, sandbox: int | None = None) -> TimingPlan:
    """Slices of `sandbox` (S) ranks covering one DP equivalence class, or every rank."""
    s = sandbox or cfg.emulation.sandbox
    world = trace.world_size
    timed = list(range(world))
    source = np.arange(world)
    if cfg.job.is_builtin and (cfg.parallel.dp or 1) > 1:
        from prism_core.collect.dedup import rank_map

        topo = Topology.from_config(cfg)
        replica = sorted(topo.replica_ranks(0))
        candidate = np.arange(world)
        for d in range(topo.dp):
            image = rank_map(topo, d)
            candidate[image[replica]] = replica
        if _same_up_to_renaming(trace, candidate):
            timed, source = replica, candidate
    return TimingPlan(timed=timed, source=source, slices=[timed[i:i + s] for i in range(0, len(timed), s)])


def _same_up_to_renaming(trace: Trace, source: np.ndarray) -> bool:
    """Every rank runs its source rank's nodes (same ops, sizes and order): durations carry over."""
    sizes = np.diff(trace.offsets)
    if np.any(sizes != sizes[source]):
        return False
    rank_of = np.repeat(np.arange(trace.world_size), sizes)
    from_node = trace.offsets[source[rank_of]] + (np.arange(len(rank_of)) - trace.offsets[rank_of])
    return all(np.array_equal(trace.columns[c], trace.columns[c][from_node]) for c in _RENAMING_INVARIANT)


def slice_key(graph_key: str, cfg: PrismConfig, sandbox: list[int]) -> str:
    """What a slice's measurements depend on beyond the bare graph: its ranks (slices run without the
    device capacity, see `run_slice`) and the program's source, which a re-calibration changes
    while it keeps the graph."""
    from prism_core.collect.stage import program_digest

    shaped = {"graph": graph_key, "sandbox": sorted(sandbox), "warmup": cfg.job.warmup,
              "program": program_digest(cfg)}
    return hashlib.sha256(json.dumps(shaped, sort_keys=True).encode()).hexdigest()[:12]


@dataclass
class SliceOutput:
    directory: Path
    sandbox: list[int]
    reused: bool


def run_slice(cfg: PrismConfig, graph_dir: Path, sandbox: list[int], out_dir: Path,
              timing: Path | None = None, neighbour_load: bool = False, cores: list[int] | None = None,
              pacing: Pacing | None = None, stop: threading.Event | None = None,
              join_late: bool = False) -> SliceOutput:
    """Run one slice (or reuse a finished one): sandbox ranks real, the rest replayed by the assistant.

    `timing`: a calibrated `timeline.npz`; the virtual ranks then replay in calibrated time.
    Slices run without `job.device_memory_bytes`: they measure time and the exact peak, which
    the calibration compares with the capacity; the emulation is where a rank runs out.
    """
    out_dir = Path(out_dir)
    if (out_dir / SLICE_DONE).is_file():
        return SliceOutput(out_dir, sorted(sandbox), True)
    unbounded = cfg.model_copy(update={"job": cfg.job.model_copy(update={"device_memory_bytes": None})})
    # alone, each sandbox rank on the core it holds in the whole job: this machine's cores each
    # have their own speed from second to second (bench/host_noise.py), and the record's are those
    results = run_with_assistant(unbounded, graph_dir, sandbox, out_dir, timing, neighbour_load=neighbour_load,
                                 cores=cores, pacing=pacing, stop=stop, job_cores=cores is None, join_late=join_late)
    write_json_atomic(out_dir / SLICE_DONE, {"sandbox": sorted(sandbox), "pid": os.getpid(),
                                             "steps": {str(r): len(res["step_times_s"]) for r, res in results.items()}})
    return SliceOutput(out_dir, sorted(sandbox), False)


def awake_setting(cfg: PrismConfig, timed: bool) -> bool:
    """Whether a run placed alone keeps its assistant's cores awake: a plain slice's all along
    (`emulation.keep_awake`), a timed run's while its virtual ranks compute (`awake_while_computing`)."""
    return cfg.emulation.awake_while_computing if timed else cfg.emulation.keep_awake


def run_with_assistant(cfg: PrismConfig, graph_dir: Path, sandbox: list[int], out_dir: Path,
                       timing: Path | None = None, progress=None, neighbour_load: bool = False,
                       cores: list[int] | None = None, pacing: Pacing | None = None,
                       stop: threading.Event | None = None, job_cores: bool = False,
                       join_late: bool = False, virtual_ranks: str = "all") -> dict[int, dict]:
    """Launch the sandbox ranks (the real program, instrumented as in `prism record`) and the replay
    assistant for every other rank; return each sandbox rank's result or raise `LaunchError`.

    Used by the slices (structure only, or a refining pass) and by the emulation (calibrated time).
    `progress(steps)`: called as the steps every sandbox rank has completed grow. `cores`: the
    sandbox ranks' cores, when bound (one member of a co-run, `run_together`); `pacing`: that
    member's pacing (replay/pacing.py); `stop`: set to stop the launch (`LaunchStopped`);
    `job_cores`: each sandbox rank on the core it holds in the whole job (`launch/cores.place`);
    `join_late`: a plain slice's virtual members of collectives go on the wire once a sandbox
    member has issued the op (`replay/assistant.py` `--join-late`). `virtual_ranks`: "neighbours",
    the assistant replays only the virtual ranks the sandbox ranks talk to (replay/hosted.py; unless
    they are all, it writes no arrivals then, which a slice's calibration needs). A plain slice placed alone
    keeps its assistant's cores awake (`emulation.keep_awake`, launch/neighbour_load.py): its
    virtual peers arrive at once and wait blocked, and on a core that idled their answers came late.
    A timed run placed alone keeps them awake while its virtual ranks compute only
    (`emulation.awake_while_computing`, replay/awake.py).
    """
    if join_late and (pacing is not None or timing is not None):
        raise ValueError("join_late is for a plain slice: not with pacing (a co-run) or a timeline")
    out_dir = Path(out_dir)
    for sub in ("results", "errors", "trace_parts", "flight", "logs", "replay"):
        shutil.rmtree(out_dir / sub, ignore_errors=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    config_path = out_dir / "config.json"
    write_json_atomic(config_path, config_to_dict(cfg))
    env = {"PRISM_CONFIG": str(config_path.resolve()), ENV_INSTRUMENT: "1", ENV_MEMORY: "1", ENV_LAZY_GLOO: "1",
           ENV_PUBLISH_GROUPS: "1", ENV_SANDBOX: ",".join(map(str, sorted(sandbox)))}
    if cfg.job.device_memory_bytes is not None:
        env[ENV_CAPACITY] = str(cfg.job.device_memory_bytes)
    graph_dir = Path(graph_dir)
    helper = [*module_command("prism_core.replay.assistant"), "--graph", str(graph_dir / "trace.zarr"),
              "--sandbox", ",".join(map(str, sandbox)), "--result-dir", str(out_dir),
              "--timeout", str(0.9 * cfg.job.timeout_s)]   # its report of blocked virtual ranks comes first
    if (graph_dir / CACHE_NAME).is_dir():
        helper += ["--cache", str(graph_dir / CACHE_NAME)]
    if not cfg.emulation.ring_combine:
        helper += ["--no-ring-combine"]
    if virtual_ranks != "all":
        helper += ["--virtual-ranks", virtual_ranks]
    if timing is not None:
        helper += ["--timing", str(timing)]
        if not cfg.emulation.build_ahead:
            helper += ["--no-build-ahead"]
        if cfg.emulation.virtual_spans != "timed":
            helper += ["--virtual-spans", cfg.emulation.virtual_spans, "--steady-from", str(cfg.job.warmup)]
        if cfg.emulation.follow_pace:
            helper += ["--follow-pace", str(cfg.job.warmup), "--pace-reference", cfg.emulation.pace_reference,
                       "--pace-steps", str(cfg.emulation.pace_steps)]
    if join_late:
        name = socket_name(out_dir)
        helper += ["--pace-socket", name, "--join-late"]
        env[ENV_NUDGE] = name
    if pacing is not None:
        # A co-run member's assistant shares its ranks' cores; in the idle class it runs only while
        # they wait, so that its virtual members' work (gloo rings, the graph walk) does not land
        # inside their compute spans: they are what the loaded run is for.
        if cfg.emulation.co_run_assistant == "idle":
            helper.append("--idle")
        if pacing.counterparts:
            helper += ["--pace-socket", pacing.socket]
            helper += [f"--pace={r}={f}" for r, f in sorted(pacing.counterparts.items())]
        if pacing.nudge:
            env[ENV_NUDGE] = ",".join(pacing.nudge)
    spec = LaunchSpec(program=cfg.job.program, world_size=cfg.job.world_size, run_dir=out_dir,
                      timeout_s=cfg.job.timeout_s, args=list(cfg.job.args), env=env, ranks=sorted(sandbox),
                      helper=helper, progress=progress, bind_cores=cfg.job.cpu_binding == "core",
                      neighbour_load=neighbour_load, cores=cores, stop=stop, job_cores=job_cores,
                      keep_awake=awake_setting(cfg, timing is not None) and pacing is None,
                      awake_by_helper=timing is not None)
    return launch(spec)


def run_together(cfg: PrismConfig, graph_dir: Path, members: list[tuple[list[int], Path]],
                 cores: list[int]) -> list[SliceOutput]:
    """Run the slices `members` (sandbox ranks, directory) at once: a co-run, or reuse it.

    The members' ranks take `cores` in order (one each), each member's assistant its ranks'
    cores; every member has `co_run.json` when all of them finished bound to their cores. A
    co-run is reused only whole: one member left unfinished runs them all again, so that no
    member's spans come from a run without the others. The first member to fail stops the others
    (their virtual copies of its ranks keep to records that no longer move) and its error is
    raised once every member has ended; an interrupt stops every launch of this process
    (`stop_all`), the members' among them.
    """
    need = sum(len(sandbox) for sandbox, _ in members)
    if need > len(cores):
        raise ValueError(f"a co-run of {need} ranks needs as many cores; {len(cores)} given")
    dirs = [Path(d) for _, d in members]
    if all((d / SLICE_DONE).is_file() and (d / CO_RUN).is_file() for d in dirs):
        return [SliceOutput(d, sorted(sandbox), True) for (sandbox, _), d in zip(members, dirs)]
    for d in dirs:
        for name in (SLICE_DONE, CO_RUN):
            (d / name).unlink(missing_ok=True)
        shutil.rmtree(d / "flight", ignore_errors=True)    # no member may read another's old record
    errors: list[BaseException] = []     # in the order they happened
    lock, stop = threading.Lock(), threading.Event()
    pacing = co_run_pacing(members)

    def one(i: int, sandbox: list[int], first_core: int) -> None:
        try:
            run_slice(cfg, graph_dir, sandbox, dirs[i], cores=cores[first_core:first_core + len(sandbox)],
                      pacing=pacing[i], stop=stop)
        except BaseException as err:      # re-raised below, in the caller's thread
            with lock:
                errors.append(err)
            stop.set()

    threads, at = [], 0
    for i, (sandbox, _) in enumerate(members):
        threads.append(threading.Thread(target=one, args=(i, sorted(sandbox), at), name=f"co-run member {i}"))
        at += len(sandbox)
    for t in threads:
        t.start()
    try:
        for t in threads:
            t.join()
    except BaseException:
        stop_all()      # interrupted (Ctrl-C): the members' launches run on their threads; stop them too
        for t in threads:
            t.join()
        raise
    if errors:      # the member that failed first, not one it stopped
        raise next((e for e in errors if not isinstance(e, LaunchStopped)), errors[0])
    bound = all(json.loads((d / "placement.json").read_text()).get("bound") for d in dirs)
    if bound:
        for d in dirs:
            write_json_atomic(d / CO_RUN, {"members": [str(x) for x in dirs]})
    return [SliceOutput(d, sorted(sandbox), False) for (sandbox, _), d in zip(members, dirs)]
