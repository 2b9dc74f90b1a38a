"""Neighbour load: a busy core beside the sandbox ranks, where a slice or an emulation would leave one idle.

In the full job every core runs a rank, and a rank's core is never idle even while it waits:
its gloo loops spin then (`backend/transport_threads.py`). A slice or an emulation runs one
real rank per core beside the replay assistant, whose virtual ranks compute nothing, so the
assistant's core idles whenever no communication is under way. A rank computes more slowly
when the other core is busy, whatever runs there (`bench/neighbour.py`, torch MLP forward and
backward on one core: +2.4% beside a pure Python spin, +2.1% beside a copy of the same MLP,
+6.4% beside a memory stream): the cost is the core's neighbour being busy, not what it
touches. Slices timed their ranks' compute 2-6% faster than the real run.

The load stands for that busy neighbour: a spin, touching next to nothing, in SCHED_IDLE on
the assistant's cores. Any thread of the assistant in the normal or batch class takes the
core from it at once (the launcher puts the assistant's gloo loops in the batch class while a
load runs); a memory-touching load would evict the assistant's caches at every turn (a
pipe round trip through a process on the loaded core: 23 µs beside a spin, 41 µs beside a
torch load). It enters the kernel every `UNIT_S` (a yield): a thread woken from the other core
onto this one took it from the spin only at the spin's next entry to the kernel, not at once
(tp2 slices, three interleaved runs each: 0.130-0.139 s per step with 1 ms between yields,
0.110-0.117 s with 50 us, 0.110-0.121 s with no load). It runs until its deadline or until
the launcher that started it is gone.

    python -m prism_core.launch.neighbour_load --seconds S --parent PID
"""

from __future__ import annotations

import argparse
import os
import sys
import time

CHECK_EVERY_S = 0.2
UNIT_S = 50e-6           # spin this long between yields (see above)


def set_idle_class() -> bool:
    """This process in SCHED_IDLE (False where the platform has no such class)."""
    if not hasattr(os, "SCHED_IDLE"):
        return False
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    return True


def run(seconds: float, parent: int | None) -> int:
    """Spin until `seconds` pass or `parent` is no longer this process's parent; the units spun."""
    clock = time.perf_counter
    deadline = clock() + seconds
    done, next_check = 0, 0.0
    while True:
        now = clock()
        if now >= next_check:
            if now >= deadline or (parent is not None and os.getppid() != parent):
                return done
            next_check = now + CHECK_EVERY_S
        end = now + UNIT_S
        while clock() < end:
            pass
        done += 1
        os.sched_yield()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, required=True, help="run at most this long")
    parser.add_argument("--parent", type=int, default=None, help="stop when this process is gone")
    args = parser.parse_args(argv)
    from prism_core.launch.cores import bind_from_env

    bind_from_env()
    if not set_idle_class():
        print("neighbour load: no idle scheduling class here; not running", file=sys.stderr)
        return
    units = run(args.seconds, args.parent)
    print(f"neighbour load: {units} units of {UNIT_S * 1e6:.0f} us", file=sys.stderr)


if __name__ == "__main__":
    main()
