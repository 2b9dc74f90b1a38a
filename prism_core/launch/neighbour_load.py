"""What runs on the cores a launch leaves to its assistant, in the idle class: a neighbour load, or a spin.

A slice runs one real rank per core beside the replay assistant, whose virtual ranks compute
nothing: the rest of the machine idles. In the full job every core runs a rank, and a rank's
compute shares the chip's caches and memory with its neighbours' compute: the W=2 configs'
compute spans come out 2-9% longer in `prism record` than alone in a slice.

The load stands for those neighbours: a single-threaded torch MLP forward and backward on
small tensors (a working set of a few MiB, as a small rank's), run on one core in SCHED_IDLE,
so that any thread of the assistant in the normal class takes the core from it at once; one
in the idle class (the gloo loops) does not preempt it, so the load works in short units and
yields the core after each. It runs until its deadline or until the launcher that started
it is gone. Only the thread that computes is in the idle class: beside busy cores such a thread
gets about 0.15% of one, so torch's import had not ended a minute after it began there, and a process
wholly in the class did not notice its launcher had gone, nor exit, for over 10 s. The main
thread imports, watches and exits in the normal class; at the end it puts the compute thread back
in the normal class too, for a process is gone only once all its threads are. It also slows the
assistant's part of every collective on that core, so a slice takes only its compute spans from
a run beside it, a run of its own (calibrate/durations.py).

With `--awake` it computes nothing and only yields the core, again and again: the assistant's
cores of a plain slice are then never idle. This machine's virtual CPUs halt as soon as they
idle (`haltpoll.guest_halt_poll_ns=0` on the kernel's command line), and a thread woken on a core
that idled milliseconds answers late: a plain slice's virtual peer, waiting blocked from its
early arrival while its sandbox rank computed, had ep2's plain slices time a median 12.9 ms a step
more communication than the record's 38-51 ms (90 steps, eight comparisons); beside the spin,
4.0 ms more (bench/MEASURED.md, item 23). A thread of the idle class woken on the spun core (the assistant's
gloo loops) does not preempt the spin: it gets the core at the next yield, about a microsecond
later; a busy loop without the yields held it for the scheduler's tick (2.5 ms an op).

With `--awake --control FD` the spin runs only while the assistant says so on the pipe FD (b"1"
on, b"0" off; its end closed: leave), and blocks on the pipe otherwise, so the core halts: a timed
assistant keeps its cores awake while its virtual ranks compute and lets them idle while they
wait for the wire, as a real rank's core does (replay/awake.py).

    python -m prism_core.launch.neighbour_load --seconds S --parent PID [--awake [--control FD]]
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import sys
import threading
import time

CHECK_EVERY_S = 0.2
JOIN_S = 10.0   # a step takes the idle thread well under a second of wall time even when starved


class Load:
    """Neighbour compute in short units: each call, a forward and backward pass of the next block
    of a small MLP (four blocks, about 4 MiB of weights and gradients in all; a fraction of a
    millisecond a call), so that a thread of the idle class woken meanwhile (the assistant's gloo
    loops, transport_threads.py) waits at most that long: `run` yields the core after each."""

    def __init__(self) -> None:
        import torch

        torch.set_num_threads(1)
        torch.manual_seed(0)
        self.blocks = [torch.nn.Sequential(torch.nn.LayerNorm(128), torch.nn.Linear(128, 512), torch.nn.GELU(),
                                           torch.nn.Linear(512, 128)) for _ in range(4)]
        self.x = torch.randn(32, 128)
        self.calls = 0

    def __call__(self) -> None:
        block = self.blocks[self.calls % len(self.blocks)]
        self.calls += 1
        block.zero_grad(set_to_none=True)
        block(self.x).square().mean().backward()


def set_idle_class() -> bool:
    """The calling thread in SCHED_IDLE (False where the platform has no such class)."""
    if not hasattr(os, "SCHED_IDLE"):
        return False
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))   # Linux: pid 0 is this thread only
    return True


def leave_idle_class(tid: int) -> bool:
    """Thread `tid` back to the normal class, so that it finishes its step and exits at once; False
    where this process may not (unprivileged, RLIMIT_NICE 0): the thread then leaves as the idle
    class lets it, the process's id staying until it has."""
    try:
        os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
    except (AttributeError, PermissionError, ProcessLookupError):
        return False
    return True


def _nothing() -> None:
    pass


class Control:
    """The read end of an assistant's pipe that turns a spin on (b"1") and off (b"0")."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.on = False
        self.closed = False
        os.set_blocking(fd, False)

    def update(self, wait_s: float) -> None:
        """Take what the pipe says; while off, wait for it up to `wait_s` (blocked: the core may idle)."""
        if not self.on and not select.select([self.fd], [], [], wait_s)[0]:
            return
        try:
            data = os.read(self.fd, 4096)
        except BlockingIOError:
            return
        if not data:                     # the assistant is gone
            self.closed, self.on = True, False
        else:
            self.on = data[-1:] == b"1"


def run(seconds: float, parent: int | None, idle: bool = True, stop: threading.Event | None = None,
        awake: bool = False, control: Control | None = None) -> int:
    """Compute (`awake`: only yield) in a thread of the idle class (`idle`) until `seconds` pass,
    `parent` is no longer this process's parent or `stop` is set, watched from the calling thread;
    the steps run. `control`: step only while it is on, blocked on it otherwise; leave once it closes."""
    step = _nothing if awake else Load()
    stop = stop or threading.Event()
    done = 0

    def work() -> None:
        nonlocal done
        if idle:
            set_idle_class()
        while not stop.is_set():
            if control is not None:
                control.update(CHECK_EVERY_S)
                if control.closed:
                    stop.set()
                    return
                if not control.on:
                    continue
            step()
            done += 1
            os.sched_yield()

    deadline = time.monotonic() + seconds

    def wanted() -> bool:
        return (not stop.is_set() and time.monotonic() < deadline
                and (parent is None or os.getppid() == parent))

    worker = threading.Thread(target=work, name="keep-awake" if awake else "neighbour-load", daemon=True)
    if wanted():
        worker.start()
        while wanted():
            stop.wait(min(CHECK_EVERY_S, max(deadline - time.monotonic(), 0.0)))
        stop.set()
        leave_idle_class(worker.native_id)
        worker.join(timeout=JOIN_S)
    return done


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, required=True, help="run at most this long")
    parser.add_argument("--parent", type=int, default=None, help="stop when this process is gone")
    parser.add_argument("--awake", action="store_true", help="compute nothing: keep the core from idling")
    parser.add_argument("--control", type=int, default=None, metavar="FD",
                        help="with --awake: spin only while the pipe FD last said b'1'; leave when it closes")
    args = parser.parse_args(argv)
    from prism_core.launch.cores import bind_from_env

    bind_from_env()
    if not hasattr(os, "SCHED_IDLE"):
        print("neighbour load: no idle scheduling class here; not running", file=sys.stderr)
        return
    stop = threading.Event()
    # the launcher stops its job with SIGTERM: leave as at the deadline, not with a thread starved
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    if args.control is not None and not args.awake:
        parser.error("--control goes with --awake")
    control = Control(args.control) if args.control is not None else None
    steps = run(args.seconds, args.parent, stop=stop, awake=args.awake, control=control)
    print(f"{'keep awake' if args.awake else 'neighbour load'}: {steps} steps", file=sys.stderr, flush=True)
    os._exit(0)   # nothing to save; skip torch's teardown, and a compute thread not yet back from its step


if __name__ == "__main__":
    main()
