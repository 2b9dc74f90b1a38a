"""A timed assistant's cores: kept awake while its virtual ranks compute, left to idle while they wait.

In the job a rank's core is busy while the rank computes and idles once the rank waits for a
late peer; on this machine an idle core halts at once, and a thread woken on a core that idled
answers late, more so the longer it idled and the busier the host (the record's transfers after a
skew of a millisecond or more ran a median 0.3-1.5 ms longer than a plain slice's with a spun
peer; bench/MEASURED.md, item 25). A timed assistant (an emulation, a second timing pass) sleeps through
its virtual ranks' compute, so without a spin its core would idle through the compute and the
wait alike (late answers after every compute span), and with a spin through both it would never
answer late. `CoreSpin` tells the spins on its cores (launch/neighbour_load.py `--control`) to
run while a virtual rank computes (a timer is due, or an op is held to its clock) and to stop
while every virtual rank waits for the wire.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class CoreSpin:
    """The write ends of the pipes to the spins on the assistant's cores (none: does nothing)."""

    def __init__(self, fds: list[int]) -> None:
        self.fds = list(fds)
        self.cores = len(self.fds)
        self.lock = threading.Lock()
        self.on = False
        self.computing = False
        self.holding = 0
        self.switches = 0

    def set_computing(self, computing: bool) -> None:
        """From the replay loop before it blocks: whether a virtual rank's timer is due."""
        with self.lock:
            self.computing = computing
            self._apply()

    @contextmanager
    def hold(self) -> Iterator[None]:
        """Around a hold of an op to its clock: the rank still computes until then."""
        with self.lock:
            self.holding += 1
            self._apply()
        try:
            yield
        finally:
            with self.lock:
                self.holding -= 1
                self._apply()

    def _apply(self) -> None:
        want = self.computing or self.holding > 0
        if want == self.on or not self.fds:
            return
        self.on = want
        self.switches += 1
        for fd in list(self.fds):
            try:
                os.write(fd, b"1" if want else b"0")
            except (BrokenPipeError, BlockingIOError):   # that spin was stopped (a rank took its core)
                self.fds.remove(fd)
                os.close(fd)

    def close(self) -> None:
        """Stop the spins and let them leave (their pipes close)."""
        with self.lock:
            for fd in self.fds:
                try:
                    os.write(fd, b"0")
                except (BrokenPipeError, BlockingIOError):
                    pass
                os.close(fd)
            self.fds = []
            self.on = False
