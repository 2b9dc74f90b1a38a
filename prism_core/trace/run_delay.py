"""How long a thread has waited for a core: the kernel's run delay of one thread (schedstat).

A rank's compute spans are wall time. In a co-run on 2 cores (replay/slices.py `run_together`)
each member's replay assistant shares its rank's core; whenever the assistant runs, the rank's
thread is ready but waits, and its compute spans grow by time the full job never spends (measured
on ep2: the rank's thread waited 110-190 ms per step in a co-run against about 10 in a plain
slice). The recorder notes this wait per compute node, and the calibration takes it out of the
compute spans of runs that had an assistant (calibrate/durations.py).

The figure is the second field of /proc/<pid>/task/<tid>/schedstat (nanoseconds spent ready on
a run queue), read with one pread on a descriptor kept open: about 1.5 us a read here.
"""

from __future__ import annotations

import os
import threading


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
