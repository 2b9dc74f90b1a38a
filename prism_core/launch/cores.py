"""Core placement: each rank process of a launch on a core of its own, when the machine has enough.

A rank stands for a device. Left to the scheduler, two ranks' threads share cores: a thread
woken while another rank computes is often queued on that busy core while the other core
idles, and waits there for the scheduler's tick (this machine: no kernel preemption, 250 Hz).
Recording tp2 on 2 cores, that made about one all-reduce in ten take 1.5-2 ms instead of
0.4 ms, and the run 30% slower than its ranks' own work accounts for; slices and emulations,
one real rank beside a mostly idle assistant, did not see it. With each rank bound to its
own core, every real run sees the same placement: its ranks' threads on their own cores, the
replay assistant on the cores no rank of the launch holds (the last core at least, which the
timing pass's Dask slots leave free).

Placement is per launch and process-wide: concurrent launches (Dask's slices) never share a
rank core. A launch that does not fit runs unbound, and says so in its `placement.json`.
`job.cpu_binding: none` turns binding off. A slice or an emulation placed on its own puts each
sandbox rank on the core that rank holds in the whole job, where the job fits the machine
(`job_cores`): this machine's two cores each have a speed of their own from second to second
(`bench/host_noise.py`: the same work 8% apart in a median 6-s block, 0.80-1.08), and rank 1
timed or emulated on core 0 was measured on another device than the record's. A launch may also
ask for cores for a neighbour load (launch/neighbour_load.py): it gets them only while no other
launch is placed, and holds them, so that the load never runs beside another launch's ranks or
assistant. The launches of a co-run (replay/slices.py `run_together`) are each given their
ranks' cores (`place_on`), each assistant on its own slice's cores: it then takes no time from
the other slices' ranks, whose compute spans are what a co-run measures.

A launch placed alone may also ask for its helper's other cores to be kept awake (a spin in the
idle class, launch/neighbour_load.py `--awake`). Those cores are not held: a launch placed later
takes its ranks' cores from the others first, and one that must take a spun core stops the spin
there (`keep_awake`), so that no real rank ever runs beside one.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

ENV_CPUS = "PRISM_CPUS"

_lock = threading.Lock()
_held: set[int] = set()
_placed = 0          # launches placed and not yet released
_awake: dict[int, Callable[[], None]] = {}   # core kept awake -> what stops the spin there


def machine_cores() -> list[int]:
    """The cores this process may run on."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


@dataclass
class Placement:
    """Cores of one launch: rank -> its core; the helper's (the assistant's) cores."""
    ranks: dict[int, int]
    helper: list[int] = field(default_factory=list)
    loads: list[int] = field(default_factory=list)     # helper cores that also get a neighbour load
    placed: bool = True                                 # counted among the launches placed
    awake: list[int] = field(default_factory=list)     # helper cores to keep awake (not held)

    def release(self) -> None:
        global _placed
        with _lock:
            if self.placed:
                _placed -= 1
            _held.difference_update(self.ranks.values())
            _held.difference_update(self.loads)
            for core in self.awake:
                _awake.pop(core, None)
        self.ranks, self.loads, self.awake, self.placed = {}, [], [], False

    def describe(self) -> dict:
        return {"ranks": {str(r): c for r, c in sorted(self.ranks.items())}, "assistant": self.helper}


def place(ranks: list[int], helper: bool, loads: int = 0, job_cores: bool = False,
          awake: bool = False) -> tuple[Placement | None, str]:
    """A core for each of `ranks` (and, with a helper, at least one other core for it), or None
    and why not; with a helper, up to `loads` of its cores held for a neighbour load when no
    other launch is placed (`Placement.loads`, empty otherwise), and with `awake` the rest of its
    cores to keep awake, also only when no other launch is placed (`Placement.awake`). `job_cores`:
    rank r on the r-th core, the one it holds when the whole job is placed (`prism record`), where
    no other launch is placed and a core is left for the helper (a slice or an emulation on its own)."""
    global _placed
    cores = machine_cores()
    if not cores:
        return None, "this platform cannot bind a process to cores"
    need = len(ranks) + (1 if helper else 0)
    with _lock:
        pool = cores[:-1] if helper else cores        # the last core stays for the assistant
        free = [c for c in pool if c not in _held]
        if len(free) < len(ranks) or len(cores) < need:
            return None, (f"{len(ranks)} rank(s){' and the assistant' if helper else ''} need {need} cores; "
                          f"{len(free) + (1 if helper else 0)} of the machine's {len(cores)} are free")
        chosen = sorted(free, key=lambda c: c in _awake)[:len(ranks)]   # spun cores last
        if job_cores and _placed == 0 and all(r < len(cores) for r in ranks) and len(cores) > len(ranks):
            chosen = [cores[r] for r in ranks]
        _take_awake(chosen)
        rest = [c for c in cores if c not in _held and c not in chosen] if helper else []
        loaded = rest[:loads] if _placed == 0 else []
        spun = [c for c in rest if c not in loaded] if awake and _placed == 0 else []
        _held.update(chosen)
        _held.update(loaded)
        _placed += 1
    return Placement(dict(zip(ranks, chosen)), rest, loaded, awake=spun), ""


def _take_awake(cores: list[int]) -> None:
    """Stop the spins on `cores`, which ranks are about to take (under `_lock`)."""
    for core in cores:
        stop = _awake.pop(core, None)
        if stop is not None:
            stop()


def keep_awake(core: int, stop: Callable[[], None]) -> bool:
    """Register the spin started on `core` (one of a placement's `awake`), which `stop` ends; a
    core that a rank took meanwhile stops it at once (False)."""
    with _lock:
        if core in _held:
            stop()
            return False
        _awake[core] = stop
    return True


def place_on(ranks: list[int], cores: list[int]) -> tuple[Placement | None, str]:
    """Each of `ranks` on the core given for it, the helper on those same cores; or None and why
    not (a core outside the machine's, or held by another launch)."""
    global _placed
    machine = machine_cores()
    if not machine:
        return None, "this platform cannot bind a process to cores"
    with _lock:
        unknown = [c for c in cores if c not in machine]
        taken = [c for c in cores if c in _held]
        if unknown or taken or len(set(cores)) != len(ranks):
            return None, (f"cores {cores} for ranks {ranks}: " + (f"{unknown} not on this machine" if unknown else
                          f"{taken} held by another launch" if taken else "one core per rank needed"))
        _take_awake(cores)
        _held.update(cores)
        _placed += 1
    return Placement(dict(zip(ranks, cores)), sorted(cores), []), ""


def bind_from_env() -> None:
    """In a launched process: run on the cores the launcher chose (`PRISM_CPUS`), if any."""
    text = os.environ.get(ENV_CPUS)
    if text and hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, {int(c) for c in text.split(",")})
        except (OSError, ValueError) as err:     # a core outside this process's cpuset: run unbound
            print(f"prism: cannot bind to cores {text!r} ({err}); running unbound", file=sys.stderr, flush=True)
