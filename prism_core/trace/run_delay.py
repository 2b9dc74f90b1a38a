"""How long a thread has waited for a core: the kernel's run delay of one thread (schedstat).

A rank's compute spans are wall time. In a co-run on 2 cores (replay/slices.py `run_together`)
each member's replay assistant shares its rank's core; whenever the assistant runs, the rank's
thread is ready but waits, and its compute spans grow by time the full job never spends (measured
on ep2: the rank's thread waited 110-190 ms per step in a co-run against about 10 in a plain
slice). The recorder notes this wait per compute node, and the calibration takes it out of the
compute spans of runs that had an assistant (calibrate/durations.py).

The figure is the second field of /proc/<pid>/task/<tid>/schedstat (nanoseconds spent ready on
a run queue), read with one pread on a descriptor kept open: about 1.5 us a read here.

Not all of that wait is foreign to the job. A rank's own other threads (the ring transports of its
asynchronous ops, gloo's) run on the rank's core too, and take it in the full job as well; and a
`prism record` run, with no assistant, waits too (pp2 on this machine: 0.7-1.6% of its compute,
of which its own threads 0.5%; the launcher and the rest of the machine the others). What the
job never spends is what the assistant took. `OwnThreads` gives the CPU time the rank's other
threads ran, `ProcessCpu` the assistant's (its pid from `PRISM_HELPER_PID`, set by the launcher
where the assistant may run on the rank's core): the calibration takes out of a compute node
the part of its wait the assistant ran (calibrate/durations.py).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
import time

ENV_HELPER_PID = "PRISM_HELPER_PID"


class RunDelay:
    """The run delay of the thread that opened it."""

    def __init__(self, fd: int):
        self.fd = fd

    @classmethod
    def of_this_thread(cls) -> RunDelay | None:
        """None where the kernel does not keep the figure (not Linux, or schedstat left out)."""
        try:
            fd = os.open(f"/proc/self/task/{threading.get_native_id()}/schedstat", os.O_RDONLY)
        except OSError:
            return None
        delay = cls(fd)
        try:
            delay.read()
        except (OSError, ValueError, IndexError):
            delay.close()
            return None
        return delay

    def read(self) -> int:
        """Nanoseconds the thread has waited for a core since it started."""
        return int(os.pread(self.fd, 64, 0).split()[1])

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self):
        self.close()


class OwnThreads:
    """CPU time taken by the threads of this process other than the calling one."""

    @staticmethod
    def read() -> int:
        """Nanoseconds of CPU the process's other threads have run (process CPU time less this thread's)."""
        return time.clock_gettime_ns(time.CLOCK_PROCESS_CPUTIME_ID) - time.thread_time_ns()


class ProcessCpu:
    """CPU time of another process, all its threads (one clock read, nanoseconds)."""

    def __init__(self, pid: int):
        self.pid = pid
        self._clock = _cpu_clock(pid)
        self._last = 0

    @classmethod
    def of_helper(cls) -> ProcessCpu | None:
        """The launch's assistant, where the launcher named it (`PRISM_HELPER_PID`); None otherwise."""
        text = os.environ.get(ENV_HELPER_PID)
        if not text:
            return None
        try:
            cpu = cls(int(text))
            cpu.read()
        except (OSError, ValueError):
            return None
        return cpu

    def read(self) -> int:
        """Its CPU time so far; once it has ended, the last time read."""
        try:
            self._last = time.clock_gettime_ns(self._clock)
        except OSError:
            pass
        return self._last


def _cpu_clock(pid: int) -> int:
    """The clock id of `pid`'s CPU time (clock_getcpuclockid, which Python's time module lacks)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    clock = ctypes.c_int()
    err = libc.clock_getcpuclockid(int(pid), ctypes.byref(clock))
    if err:
        raise OSError(err, f"no CPU clock for process {pid}: {os.strerror(err)}")
    return clock.value
