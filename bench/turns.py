"""Runs that take turns: several launches at once, one of them running at any moment.

Two runs of the same job a minute apart differ here by up to 46% (`bench/host_noise.py`: the
machine's speed moves by a quarter within seconds), so a real run and its prediction measured
one after the other cannot be compared at a few percent. Taking turns, every `turn_s` seconds
(SIGSTOP to one launch's process groups, SIGCONT to the next), the launches see the same
machine, second by second. Each launch's stops are noted on the monotonic clock the traces use;
`unstop_run` then takes the stopped time out of a finished run's trace parts, the assistant's
arrival times and the ranks' step times, so that the run reads as if it had run alone (what
stays is the cost of caches left cold after each stop, alike for every launch). A stop ends
where the continue is sent, after the next launch's process groups were read; and a launch
that has ended keeps its turns, idle, so that no launch runs its last steps unstopped while
the steps it is compared with were stopped every turn.

A replay in calibrated time (an emulation) cannot be corrected so afterwards: its assistant
waits on the wall clock, and a stop would shorten what it was waiting for. Each launch's
stopped time so far is therefore kept in a file the assistant reads as it goes
(prism_core/replay/stopped.py), and it moves its schedule by it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable

import numpy as np
import psutil

from prism_core.replay.stopped import ENV_STOPPED_FILE, StoppedWriter
from prism_core.trace.flight import read_issued

Stops = list[tuple[float, float]]       # (stopped at, continued at), time.monotonic


MAX_TURNS = 4.0   # a turn that catches up runs at most this many turns' length


class TurnsError(RuntimeError):
    """A launch failed or the turns ran past their time limit; the message names the launch."""


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _groups(pid: int) -> list[int]:
    """The process groups of a launch started as session leader `pid`: its children's first."""
    groups = []
    for p in _descendants(pid):
        try:
            g = os.getpgid(p.pid)
        except ProcessLookupError:
            continue
        if g != pid and g not in groups:
            groups.append(g)
    return groups + [pid]


def _signal_groups(groups: list[int], sig: int) -> None:
    for g in groups:
        try:
            os.killpg(g, sig)
        except ProcessLookupError:
            pass


def _session(sid: int) -> list[int]:
    """The live processes of the session `sid` (a launch is its session's leader; its ranks are
    in process groups of their own but stay in its session, and so do their children)."""
    members = []
    for pid in psutil.pids():
        try:
            if pid != sid and os.getsid(pid) == sid and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                members.append(pid)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return members


def _kill_session(p: subprocess.Popen, groups: set[int], timeout_s: float = 10.0) -> None:
    """Kill every process of launch `p`: its groups as last read, and then whatever is left in its
    session, until none is (a rank forked just as the groups were read moves to a group of its
    own after it, and would outlive a kill of the groups alone)."""
    groups |= set(_groups(p.pid))
    _signal_groups(sorted(groups), signal.SIGCONT)
    _signal_groups(sorted(groups), signal.SIGKILL)
    try:
        p.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pass
    deadline = time.monotonic() + timeout_s
    while (left := _session(p.pid)) and time.monotonic() < deadline:
        for pid in left:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        time.sleep(0.01)


def take_turns(cmds: list[list[str]], turn_s: float, timeout_s: float, logs: list[Path],
               keep_cadence: bool = True, progress: list[Callable[[], float]] | None = None,
               cwds: list[Path] | None = None) -> list[Stops]:
    """Run `cmds` (each in a session of its own, output to its log, in its directory of `cwds` where
    given) taking turns of `turn_s` seconds until all have exited; each one's stops. A launch that
    fails, or a timeout, stops every launch and kills all their processes (TurnsError).

    `keep_cadence`: a launch that has ended keeps its turns, idle, so that the others are stopped
    and continued as before to their own end (a launch left to run alone would run its last
    steps unstopped, unlike the steps it is compared with); False gives its turns to the others.

    `progress`: per launch, how far it has come (0 to 1, e.g. `graph_progress`). A turn then
    runs on past `turn_s` until the launch has caught up with the furthest of the others (at
    most `MAX_TURNS` turns' length), so that the launches keep level and each one's step k meets
    the machine of the same seconds. In plain turns a launch slower per step than another runs
    its later steps later, and a machine that slows meanwhile (here by 25-50% within a run)
    lands in more of its steps: a co-run took 61-63 turns to the record's 47-51 and ended 15-20 s
    after it (bench/MEASURED.md item 16).

    Each launch's stopped seconds so far are kept in `<log>.stopped`, named to it by
    `PRISM_STOPPED_FILE` and written before each continue: an emulation's assistant moves its
    schedule by them (prism_core/replay/stopped.py)."""
    procs: list[subprocess.Popen] = []
    known: list[set[int]] = []            # every process group seen per launch, for the cleanup
    stops: list[Stops] = [[] for _ in cmds]
    stopped_at: list[float | None] = [None] * len(cmds)
    stopped_files = [Path(f"{log}.stopped") for log in logs]
    writers: list[StoppedWriter] = []
    try:
        for i, (cmd, log) in enumerate(zip(cmds, logs)):
            stopped_files[i].unlink(missing_ok=True)
            writers.append(StoppedWriter(stopped_files[i]))
            with open(log, "wb") as out:
                procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                              start_new_session=True, cwd=cwds[i] if cwds else None,
                                              env={**os.environ, ENV_STOPPED_FILE: str(stopped_files[i])}))
            known.append({procs[-1].pid})
            if i:          # all but the first wait for their turn
                os.killpg(procs[-1].pid, signal.SIGSTOP)
                stopped_at[i] = time.monotonic()
        cur, deadline = 0, time.monotonic() + timeout_s
        while True:
            begun = time.monotonic()
            while time.monotonic() < begun + turn_s and (keep_cadence or procs[cur].poll() is None):
                time.sleep(0.01)
            if progress is not None:
                _catch_up(cur, procs, progress, begun + MAX_TURNS * turn_s)
            groups = _groups(procs[cur].pid)      # read while it runs: stopping is then one signal per group
            known[cur].update(groups)
            for i, p in enumerate(procs):
                if p.poll() not in (None, 0):
                    raise TurnsError(f"{' '.join(cmds[i][:4])} ... exited with status {p.returncode} (log: {logs[i]})")
            live = [i for i, p in enumerate(procs) if p.poll() is None]
            if not live:
                return stops
            if time.monotonic() > deadline:
                raise TurnsError(f"the launches ran past {timeout_s:g} s; still running: {live}")
            nxt = (cur + 1) % len(procs) if keep_cadence else min(live, key=lambda i: (i - cur - 1) % len(procs))
            if nxt != cur:
                if procs[cur].poll() is None:
                    _signal_groups(groups, signal.SIGSTOP)
                    stopped_at[cur] = time.monotonic()
                cur = nxt
                if procs[nxt].poll() is not None:     # an ended launch's turn: nothing runs in it
                    continue
                waking = _groups(procs[nxt].pid)
                # the stop ends here, just before the continue: what came before it (reading the
                # launch's groups, ~1-4 ms) was stopped time too
                stops[nxt].append((stopped_at[nxt], time.monotonic()))
                stopped_at[nxt] = None
                writers[nxt].set(sum(b - a for a, b in stops[nxt]))
                _signal_groups(waking, signal.SIGCONT)
    finally:
        for p, groups in zip(procs, known):
            if p.poll() is None or _session(p.pid):     # its groups all lie in its session
                _kill_session(p, groups)


def _catch_up(cur: int, procs: list[subprocess.Popen], progress: list[Callable[[], float]], until: float) -> None:
    """Let launch `cur` run on until it has come as far as the furthest of the other live
    launches, or `until`."""
    others = [i for i, p in enumerate(procs) if i != cur and p.poll() is None]
    if not others or procs[cur].poll() is not None:
        return
    lead = max(progress[i]() for i in others)     # they are stopped: their progress stands still
    while time.monotonic() < until and procs[cur].poll() is None and progress[cur]() < lead:
        time.sleep(0.02)


def graph_progress(launch: list[tuple[Path, list[int]]], nodes: dict[int, int]) -> Callable[[], float]:
    """How far a launch has come: over its run directories and the ranks each runs, the least
    fraction of a rank's graph nodes reached (its flight record), 0 before it has one."""
    def read() -> float:
        done = 1.0
        for run_dir, ranks in launch:
            issued = read_issued(Path(run_dir) / "flight", ranks)
            done = min([done] + [issued.get(r, 0) / nodes[r] for r in ranks])
        return done
    return read


def stopped_within(start: np.ndarray, end: np.ndarray, stops: Stops) -> np.ndarray:
    """How long the launch was stopped within each [start, end]."""
    out = np.zeros(np.broadcast(start, end).shape)
    for a, b in stops:
        out += np.clip(np.minimum(end, b) - np.maximum(start, a), 0.0, None)
    return out


def stop_free(t: np.ndarray, stops: Stops) -> np.ndarray:
    """Times `t` on a clock that stood still while the launch was stopped."""
    t = np.asarray(t, dtype=float)
    return t - stopped_within(np.full(t.shape, -np.inf), t, stops)


def _step_windows(run_dir: Path, rank: int, steps: list[float]) -> tuple[np.ndarray, np.ndarray]:
    """Each step's [start, end] on the run's own clock: its last node's end, less the step time."""
    with np.load(run_dir / "trace_parts" / f"{rank}.npz") as part:
        t_end, step = part["t_end"], part["step"]
    ends = np.array([t_end[np.nonzero(step == k)[0][-1]] for k in range(len(steps))])
    return ends - np.asarray(steps), ends


def unstop_run(run_dir: Path, stops: Stops) -> None:
    """Take the stopped time out of a finished run: the step times in `results/`, then every
    time in `trace_parts/` (node times, wire stamps, the compute nodes' waits for a core) and
    `replay/arrivals.npy` (in place)."""
    run_dir = Path(run_dir)
    for path in sorted((run_dir / "results").glob("*.json")):
        result = json.loads(path.read_text())
        if not result.get("step_times_s"):
            continue
        start, end = _step_windows(run_dir, int(path.stem), result["step_times_s"])
        result["step_times_s"] = [float(x) for x in end - start - stopped_within(start, end, stops)]
        path.write_text(json.dumps(result))
    for part in sorted((run_dir / "trace_parts").glob("*.npz")):
        with np.load(part) as data:
            columns = {k: data[k] for k in data.files}
        if len(columns.get("queued_node", ())):
            # A stop can come back as a wait for a core (the kernel's run delay): in the compute
            # nodes that held a stop (about 1% of them) lay 50-90% of a run's waits, and every
            # wait over 50 ms (up to 650 ms; bench/MEASURED.md item 15). A node's wait loses the time it
            # was stopped.
            nodes = columns["queued_node"]
            held = stopped_within(columns["t_start"][nodes], columns["t_end"][nodes], stops)
            columns["queued_s"] = np.maximum(columns["queued_s"] - held, 0.0)
        for key in ("t_start", "t_end", "wire_t"):      # wire_t: when each comm op went on the wire
            if key in columns:
                columns[key] = stop_free(columns[key], stops)
        np.savez(part, **columns)
    arrivals = run_dir / "replay" / "arrivals.npy"
    if arrivals.is_file():
        np.save(arrivals, stop_free(np.load(arrivals), stops))

