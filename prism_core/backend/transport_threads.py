"""Gloo's transport threads run in the idle scheduling class, in every process that talks gloo.

Each ProcessGroupGloo starts one device-loop thread (`gloo_tcp_loop`) that waits on
level-triggered epoll. When a peer's bytes arrive while another thread of the process holds
that connection's lock (a ring thread posting its next send or receive), the loop does not
block: it returns to epoll at once and spins. If the lock holder is waiting for the very CPU
the loop spins on, nothing moves until the scheduler's tick ends the spinner's slice. On a
machine with as many busy threads as cores, with the kernel built without preemption and a
250 Hz tick (this one), that stalled about one collective in ten by 2-4 ms, in both ranks at
once (seen with `perf sched timehist`: both loops on CPU for 2.2 and then 3.8 ms while both
ring threads slept). In the idle class any other thread that wakes takes the CPU from the
loop at once, so the lock holder runs and the loop's next epoll finds the lock free.

Every gloo group the prism backend or the replay assistant makes goes through
`make_gloo_group`, so every real run (record, slices, emulation) and the assistant share the
same transport; `PRISM_GLOO_LOOP_IDLE=0` keeps gloo's default policy (`bench/transport.py`
measures both). The loop names itself once it runs, which can be after the constructor
returned: the threads the constructor started are watched for a moment until one does.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import TypeVar

LOOP_THREAD = "gloo_tcp_loop"
NAMING_WAIT_S = 0.2      # how long a new thread may take to name itself

T = TypeVar("T")


def enabled() -> bool:
    return os.environ.get("PRISM_GLOO_LOOP_IDLE", "1") != "0" and hasattr(os, "sched_setscheduler")


def _tids() -> set[str]:
    try:
        return set(os.listdir("/proc/self/task"))
    except OSError:
        return set()


def _name(tid: str) -> str | None:
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:          # the thread ended
        return None


def make_gloo_group(make: Callable[[], T]) -> T:
    """`make()` (a ProcessGroupGloo constructor call), with the device loop it starts put in the idle class."""
    before = _tids()
    unnamed = _name(str(threading.get_native_id()))   # a new thread bears its creator's name until it names itself
    group = make()
    if not enabled():
        return group
    waiting = _tids() - before
    deadline = time.monotonic() + NAMING_WAIT_S
    while waiting:
        for tid in sorted(waiting):
            name = _name(tid)
            if name == LOOP_THREAD:
                try:
                    os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))
                except OSError:   # the thread ended, or the policy is not allowed here
                    pass
                waiting.clear()   # a group starts one loop
            elif name != unnamed:  # gone, or named something else: not the loop
                waiting.discard(tid)
        if not waiting or time.monotonic() > deadline:
            break
        time.sleep(0.0005)
    return group


def loop_policies() -> dict[int, int]:
    """The scheduling policy of each gloo device-loop thread of this process, by thread id."""
    out = {}
    for tid in _tids():
        if _name(tid) == LOOP_THREAD:
            try:
                out[int(tid)] = os.sched_getscheduler(int(tid))
            except OSError:
                continue
    return out
