"""Launch W rank processes on this machine the way torchrun would, and bring them all down on failure.

The launcher hosts the rendezvous TCPStore itself on 127.0.0.1 (a listening socket bound to a
free port and handed to the store, so there is no port race), starts every rank in one process
group with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT,
TORCHELASTIC_USE_AGENT_STORE) and one intra-op thread, and watches them. The first rank to fail
(by the time it recorded its error) is reported with its traceback; then, as on a timeout or an
interrupt, the whole process group is terminated and reaped, so nothing is left running.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from prism_core.launch.child_python import module_command
from prism_core.launch.cores import ENV_CPUS, Placement, keep_awake, place, place_on
from prism_core.trace.run_delay import ENV_HELPER_PID
from prism_core.runtime import write_json_atomic

KILL_GRACE_S = 3.0
POLL_S = 0.05


class LaunchError(RuntimeError):
    """A launch that failed; `rank` is the rank blamed (None for a timeout with no culprit).

    `error` is the blamed rank's recorded error (traceback, and `oom` for an out-of-memory
    failure); `results` holds what ranks recorded before the job stopped.
    """

    def __init__(self, message: str, rank: int | None = None, error: dict | None = None):
        super().__init__(message)
        self.rank = rank
        self.error = error or {}
        self.results: dict[int, dict] = {}


class LaunchStopped(LaunchError):
    """The launch was stopped from outside (`LaunchSpec.stop`): it did not fail on its own."""


@dataclass
class LaunchSpec:
    program: str
    world_size: int
    run_dir: Path
    timeout_s: float
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    echo_rank: int | None = None  # stream this rank's output to our stdout, as progress
    ranks: list[int] | None = None  # the ranks to start (a slice's sandbox); None: all of the world
    helper: list[str] | None = None  # argv of one more process in the job (the replay assistant)
    progress: Callable[[int], None] | None = None  # called with the steps every started rank has done
    bind_cores: bool = False  # each started rank on a core of its own, when they fit (launch/cores.py)
    neighbour_load: bool = False  # bound, with a helper, alone: compute on the helper's cores (launch/neighbour_load.py)
    cores: list[int] | None = None  # one launch of a co-run: its started ranks on these cores, the helper too
    job_cores: bool = False  # bound alone: each started rank on the core it holds in the whole job (`place`)
    keep_awake: bool = False  # bound, with a helper, alone: a spin keeps the helper's cores awake (neighbour_load.py)
    awake_by_helper: bool = False  # with keep_awake: the helper turns the spins on and off (replay/awake.py)
    stop: threading.Event | None = None  # set from outside: the job is killed and `LaunchStopped` raised

    @property
    def started_ranks(self) -> list[int]:
        return list(range(self.world_size)) if self.ranks is None else sorted(self.ranks)


HELPER = "assistant"


class _StepWatch:
    """Reports the optimizer steps all started ranks have completed, as they grow."""

    def __init__(self, spec: LaunchSpec):
        self.spec, self.done = spec, -1

    def check(self) -> None:
        if self.spec.progress is None:
            return
        ranks = self.spec.started_ranks
        from prism_core.trace.flight import read_steps

        steps = read_steps(self.spec.run_dir / "flight", ranks)
        done = min(steps.values()) if len(steps) == len(ranks) else 0
        if done != self.done:
            self.done = done
            self.spec.progress(done)


def _store_backend() -> dict:
    """The libuv store accepts a handed-over socket only from torch 2.8; older releases use the classic one."""
    import torch

    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    return {} if (major, minor) >= (2, 8) else {"use_libuv": False}


def host_store(timeout_s: float):
    """A rendezvous TCPStore served from here on 127.0.0.1 at a free port; returns (store, port).

    The socket is bound first and handed to the store, so no other process can take the port.
    """
    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    port = sock.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, None, True, timeout=datetime.timedelta(seconds=timeout_s),
                          wait_for_workers=False, master_listen_fd=sock.fileno(), **_store_backend())
    sock.detach()  # the store owns the listening socket now and closes it itself
    return store, port


def read_errors(run_dir: Path) -> list[dict]:
    """The error records ranks left in `run_dir/errors/` (unreadable ones skipped)."""
    errors = []
    for path in (run_dir / "errors").glob("*.json"):
        try:
            errors.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return errors


def helper_may_share(placement: Placement | None, rank: int) -> bool:
    """Whether a launch's assistant may run on `rank`'s core: unbound, or bound to it (a co-run's)."""
    p = placement
    return p is None or not p.helper or rank not in p.ranks or p.ranks[rank] in p.helper


def _rank_env(spec: LaunchSpec, rank: int, port: int) -> dict[str, str]:
    env = dict(os.environ)
    env.pop(ENV_CPUS, None)      # only this launch's placement binds its processes
    env.pop(ENV_HELPER_PID, None)   # set below for the ranks the assistant may share a core with
    env.update(spec.env)
    env.update({
        "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
        "WORLD_SIZE": str(spec.world_size), "LOCAL_WORLD_SIZE": str(spec.world_size),
        "ROLE_WORLD_SIZE": str(spec.world_size),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True",
        "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
        "PYTHONUNBUFFERED": "1", "PRISM_LAUNCHER_PID": str(os.getpid()),
    })
    return env


_LIVE: set = set()   # jobs running in this process (launches may run on several threads: Dask slices)
_LIVE_LOCK = threading.RLock()   # re-entrant: stop_all runs in a signal handler on the main thread


def stop_all() -> None:
    """Stop every job this process launched and has not finished (on SIGTERM / Ctrl-C of the CLI,
    whose launches may be running on worker threads that would otherwise keep their ranks alive)."""
    with _LIVE_LOCK:
        jobs = list(_LIVE)
    for job in jobs:
        job.kill()


class _Job:
    """The running ranks of one launch, in one process group."""

    def __init__(self, spec: LaunchSpec):
        self.spec = spec
        self.ranks: dict[int, subprocess.Popen] = {}
        self.helper: subprocess.Popen | None = None
        self.loads: list[subprocess.Popen] = []
        self.spins: list[subprocess.Popen] = []
        self.logs = []
        self.pgid: int | None = None
        self.placement: Placement | None = None

    @property
    def procs(self) -> list[subprocess.Popen]:
        return list(self.ranks.values()) + ([self.helper] if self.helper is not None else []) + self.loads + self.spins

    def _spawn(self, cmd: list[str], env: dict[str, str], log_name: str,
               pass_fds: tuple[int, ...] = ()) -> subprocess.Popen:
        log = open(self.spec.run_dir / "logs" / log_name, "wb")
        self.logs.append(log)
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                process_group=0 if self.pgid is None else self.pgid, pass_fds=pass_fds)
        if self.pgid is None:
            self.pgid = proc.pid
        return proc

    def start(self, port: int) -> None:
        with _LIVE_LOCK:
            _LIVE.add(self)
        (self.spec.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        cpus = self._place()
        awake = self.placement.awake if self.placement is not None else []
        # the helper says when the spins run: a pipe to each, its write end the helper's alone
        pipes = {core: os.pipe() for core in awake} if self.spec.awake_by_helper and self.spec.helper else {}
        try:
            self._start_processes(port, cpus, awake, pipes)
        finally:
            for read, write in pipes.values():
                os.close(read)
                os.close(write)

    def _start_processes(self, port: int, cpus: dict, awake: list[int], pipes: dict[int, tuple[int, int]]) -> None:
        if self.spec.helper is not None:
            env = _rank_env(self.spec, -1, port)
            for key in ("RANK", "LOCAL_RANK", "ROLE_RANK"):
                env.pop(key)
            env.update(cpus.get(HELPER, {}))
            writes = tuple(write for _, write in pipes.values())
            helper = [*self.spec.helper, "--awake-fds", ",".join(map(str, writes))] if writes else self.spec.helper
            self.helper = self._spawn(helper, env, f"{HELPER}.log", pass_fds=writes)
        cmd = [*module_command("prism_core.launch.neighbour_load"), "--seconds", str(self.spec.timeout_s),
               "--parent", str(os.getpid())]
        for core in self._load_cores():
            env = {**os.environ, ENV_CPUS: str(core), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
            self.loads.append(self._spawn(cmd, env, f"neighbour_load_{core}.log"))
        for core in awake:
            control = ["--control", str(pipes[core][0])] if core in pipes else []
            spin = self._spawn([*cmd, "--awake", *control], {**os.environ, ENV_CPUS: str(core)},
                               f"keep_awake_{core}.log", pass_fds=(pipes[core][0],) if core in pipes else ())
            self.spins.append(spin)
            keep_awake(core, spin.terminate)    # a rank of a later launch placed there stops it
        for rank in self.spec.started_ranks:
            cmd = [*module_command("prism_core.launch.rank_main"), "--program", self.spec.program,
                   "--result-dir", str(self.spec.run_dir), "--", *self.spec.args]
            env = _rank_env(self.spec, rank, port)
            env.update(cpus.get(rank, {}))
            if self.helper is not None and helper_may_share(self.placement, rank):
                env[ENV_HELPER_PID] = str(self.helper.pid)     # its recorder notes what the assistant ran
            self.ranks[rank] = self._spawn(cmd, env, f"rank_{rank}.log")

    def _place(self) -> dict:
        """Each process's `PRISM_CPUS` (none when not bound); the choice goes to placement.json."""
        env: dict = {}
        doc: dict = {"bound": False, "reason": "job.cpu_binding is none"}
        if self.spec.bind_cores:
            # as many loads as the job has ranks besides the launched ones, on the helper's cores
            loads = self.spec.world_size - len(self.spec.started_ranks) if self.spec.neighbour_load else 0
            if self.spec.cores is not None:
                self.placement, why = place_on(self.spec.started_ranks, self.spec.cores)
            else:
                self.placement, why = place(self.spec.started_ranks, self.spec.helper is not None, max(loads, 0),
                                            job_cores=self.spec.job_cores, awake=self.spec.keep_awake)
            if self.placement is None:
                doc = {"bound": False, "reason": why}
            else:
                doc = {"bound": True, **self.placement.describe()}
                env = {r: {ENV_CPUS: str(c)} for r, c in self.placement.ranks.items()}
                if self.placement.helper:
                    env[HELPER] = {ENV_CPUS: ",".join(map(str, self.placement.helper))}
                doc["neighbour_load"] = self._load_cores()
                doc["awake"] = list(self.placement.awake)
                doc["awake_by_helper"] = bool(self.placement.awake) and self.spec.awake_by_helper
        write_json_atomic(self.spec.run_dir / "placement.json", doc)
        return env

    def _load_cores(self) -> list[int]:
        """The cores that get a neighbour load: those `place` held for it (a bound launch that asks
        for it, placed while no other launch was)."""
        if not self.spec.neighbour_load or self.placement is None:
            return []
        return list(self.placement.loads)

    def note_loads(self) -> None:
        """In `placement.json`, the cores whose load was still running at the end (a load that
        could not take the idle class, or failed, ended early: its run was not loaded)."""
        if not self.loads:
            return
        path = self.spec.run_dir / "placement.json"
        doc = json.loads(path.read_text())
        doc["neighbour_load_ran"] = [c for c, p in zip(self._load_cores(), self.loads) if p.poll() is None]
        write_json_atomic(path, doc)

    def kill(self) -> None:
        if self.pgid is None or all(p.poll() is not None for p in self.procs):
            return  # nothing left to stop (and the group id may already be reused)
        for sig, grace in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.pgid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
                time.sleep(POLL_S)
            if not _group_alive(self.pgid):
                break
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass

    def close(self) -> None:
        with _LIVE_LOCK:
            _LIVE.discard(self)
        if self.placement is not None:
            self.placement.release()
        for log in self.logs:
            log.close()

    def log_path(self, rank: int | str) -> Path:
        return self.spec.run_dir / "logs" / (f"{HELPER}.log" if rank == HELPER else f"rank_{rank}.log")


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def _first_failure(job: _Job, failed: dict[int, int]) -> LaunchError:
    """Blame the rank whose error was recorded first; ranks that died of a peer's death come later.

    A failed rank that recorded no error died abruptly (a signal, os._exit): rank_main records every
    Python exception, so that rank is the cause and any recorded errors are its peers' collectives
    failing after it; it is blamed first.
    """
    time.sleep(0.3)  # let ranks that are failing right now finish writing their error files
    # and see again who has ended: a rank killed by a signal tears down (its sockets closed, its
    # peers failing) before it can be reaped, so a peer may be seen failed first
    failed = {**{r: c for r, p in job.ranks.items() if (c := p.poll()) not in (None, 0)}, **failed}
    errors = read_errors(job.spec.run_dir)
    recorded = {e["rank"] for e in errors}
    abrupt = sorted(r for r in failed if r not in recorded)  # exited ranks: their error file is final
    flights = _flights(job) + _early_exits(job, failed)
    if errors and not abrupt:
        first = min(errors, key=lambda e: e["time"])
        rank = first["rank"]
        if rank == HELPER:
            return LaunchError(f"the replay assistant failed:\n{first['traceback'].rstrip()}\n"
                               f"(log: {job.log_path(HELPER)})", error=first)
        return LaunchError(f"rank {rank} failed:\n{first['traceback'].rstrip()}\n"
                           f"(log: {job.log_path(rank)}){flights}", rank=rank, error=first)
    rank = abrupt[0]
    code = failed[rank]
    how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
    return LaunchError(f"rank {rank} {how}; last output:\n{_tail(job.log_path(rank))}\n"
                       f"(log: {job.log_path(rank)}){flights}", rank=rank)


def _helper_failure(job: _Job) -> LaunchError:
    """The replay assistant stopped with an error: its recorded traceback, or its log's tail; but
    where a rank failed too (recorded an error, or has exited failing), as `_first_failure` blames:
    a rank whose own error closed its sockets fails the assistant's collective with it, and the
    assistant may be seen stopped while that rank still tears down."""
    time.sleep(0.2)
    if (any(e["rank"] != HELPER for e in read_errors(job.spec.run_dir))
            or any(p.poll() not in (None, 0) for p in job.ranks.values())):
        return _first_failure(job, {})
    path = job.spec.run_dir / "errors" / f"{HELPER}.json"
    try:
        detail = json.loads(path.read_text())["traceback"].rstrip()
    except (OSError, ValueError, KeyError):
        code = job.helper.returncode
        how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
        detail = f"it {how}; last output:\n{_tail(job.log_path(HELPER))}"
    return LaunchError(f"the replay assistant failed:\n{detail}\n(log: {job.log_path(HELPER)})")


def _early_exits(job: _Job, failed: dict[int, int]) -> str:
    """Ranks that finished (status 0) while peers still expected them: a common cause of peer errors."""
    done = [r for r, p in job.ranks.items() if r not in failed and p.poll() == 0]
    if not done:
        return ""
    return (f"\nnote: rank(s) {done} had already exited with status 0 while other ranks were still "
            "communicating; a program whose ranks run different numbers of collectives fails this way")


def _flights(job: _Job) -> str:
    """Where the ranks stood in communication (record mode only), as a paragraph to append."""
    from prism_core.trace.flight import explain, read_flights

    text = explain(read_flights(job.spec.run_dir / "flight", job.spec.world_size))
    return f"\ncommunication in flight:\n{text}" if text else ""


class _MismatchWatch:
    """Reads the ranks' flight records every second; reports a collective mismatch seen twice in a row.

    Ranks blocked in different ops at the same call of the same group can never proceed, so the
    job is stopped at once instead of at job.timeout_s. Two consecutive sightings guard against
    reading a record while it is being rewritten.
    """

    def __init__(self, spec: LaunchSpec, every_s: float = 1.0):
        self.spec, self.every_s = spec, every_s
        self.next_check = time.monotonic() + every_s
        self.seen: set[str] = set()

    def check(self) -> str | None:
        if time.monotonic() < self.next_check or not (self.spec.run_dir / "flight").is_dir():
            return None
        from prism_core.trace.flight import explain, read_flights

        self.next_check = time.monotonic() + self.every_s
        text = explain(read_flights(self.spec.run_dir / "flight", self.spec.world_size))
        lines = {line for line in text.splitlines() if line.startswith("mismatched")}
        if lines & self.seen:
            return text
        self.seen = lines
        return None


def _results(run_dir: Path, ranks: list[int]) -> dict[int, dict]:
    out = {}
    for rank in ranks:
        try:
            out[rank] = json.loads((run_dir / "results" / f"{rank}.json").read_text())
        except (OSError, ValueError):
            continue
    return out


class _Echo:
    """Copies one rank's new output lines to our stdout, prefixed with the rank."""

    def __init__(self, path: Path | None, rank: int | None):
        self.path, self.offset = path, 0
        self.prefix = f"[rank {rank}] "

    def pump(self) -> None:
        if self.path is None or not self.path.exists():
            return
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1
        if end:
            text = data[:end].decode(errors="replace")
            sys.stdout.write("".join(self.prefix + line for line in text.splitlines(keepends=True)))
            sys.stdout.flush()
            self.offset += end


def launch(spec: LaunchSpec) -> dict[int, dict]:
    """Run all ranks to completion; return each rank's result, or raise LaunchError."""
    if spec.world_size < 1:
        raise ValueError("world_size must be >= 1")
    spec.run_dir.mkdir(parents=True, exist_ok=True)
    for sub in ("results", "errors", "trace_parts", "flight"):
        for stale in (spec.run_dir / sub).glob("*"):
            stale.unlink()
    store, port = host_store(spec.timeout_s)
    job = _Job(spec)
    echo = _Echo(job.log_path(spec.echo_rank) if spec.echo_rank is not None else None, spec.echo_rank)
    started = spec.started_ranks
    try:
        job.start(port)
        deadline = time.monotonic() + spec.timeout_s
        watch = _MismatchWatch(spec)
        steps = _StepWatch(spec)
        while True:
            codes = {r: p.poll() for r, p in job.ranks.items()}
            echo.pump()
            steps.check()
            failed = {r: c for r, c in codes.items() if c not in (None, 0)}
            if failed:
                err = _first_failure(job, failed)
                err.results = _results(spec.run_dir, started)
                raise err
            if job.helper is not None and job.helper.poll() not in (None, 0):
                raise _helper_failure(job)
            if all(c == 0 for c in codes.values()) and (job.helper is None or job.helper.poll() == 0):
                break
            if spec.stop is not None and spec.stop.is_set():
                raise LaunchStopped(f"stopped from outside (ranks {started}, {spec.run_dir})")
            mismatch = watch.check()
            if mismatch:
                raise LaunchError(f"ranks called mismatched collectives and can never proceed:\n{mismatch}")
            if time.monotonic() > deadline:
                running = [r for r, c in codes.items() if c is None] or [HELPER]
                raise LaunchError(f"timed out after {spec.timeout_s:g} s (job.timeout_s); still running: "
                                  f"{running}; last output of {running[0]}:\n{_tail(job.log_path(running[0]))}"
                                  f"{_flights(job)}")
            time.sleep(POLL_S)
        echo.pump()
        job.note_loads()
        results = _results(spec.run_dir, started)
        for rank in started:
            if rank not in results:
                raise LaunchError(f"rank {rank} exited cleanly but left no result "
                                  f"({spec.run_dir / 'results' / f'{rank}.json'})", rank=rank)
        return results
    finally:
        try:
            job.kill()
        finally:
            job.close()      # gives back the job's cores whatever happened
            del store
