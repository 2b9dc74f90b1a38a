"""Stopped time: how long a launch has been held stopped from outside, for a replay in real time.

A host may stop a whole launch (SIGSTOP to its process groups) and continue it later: the
bench's turns (bench/turns.py) do so every fraction of a second, so that a real run and its
emulation see the same machine. The ranks' times are corrected afterwards; an emulation's
assistant cannot be, since it waits on the wall clock for what the calibrated graph says is due,
and a stop would shorten those waits. So whoever stops the launch keeps, in a file named by
`PRISM_STOPPED_FILE`, the launch's stopped seconds so far (one float64), written before each
continue; the assistant reads it and moves every time it has yet to reach later by what it grew
(`Assistant._slip`): the schedule stands still while the launch is stopped.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

ENV_STOPPED_FILE = "PRISM_STOPPED_FILE"


class StoppedWriter:
    """The writer's side, its map kept open: each `set` is one store into a shared map, which every
    reader's map sees at once (opening and syncing a map took 4-7 ms here, time in which the
    launch would stay stopped uncounted if it came after the stop's end was noted)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        if not self.path.exists():
            np.zeros(1, dtype=np.float64).tofile(self.path)
        self.mm = np.memmap(self.path, dtype=np.float64, mode="r+", shape=(1,))

    def set(self, total_s: float) -> None:
        self.mm[0] = total_s


def write_stopped(path: Path, total_s: float) -> None:
    """Set the stopped seconds so far, once (a writer that stays open: `StoppedWriter`)."""
    StoppedWriter(path).set(total_s)


class StoppedTime:
    """The reader's side: the launch's stopped seconds so far, one load from a map per read."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.mm = np.memmap(self.path, dtype=np.float64, mode="r", shape=(1,))

    def total(self) -> float:
        return float(self.mm[0])

    @classmethod
    def from_env(cls) -> StoppedTime | None:
        name = os.environ.get(ENV_STOPPED_FILE)
        if not name:
            return None
        if not Path(name).is_file():
            raise FileNotFoundError(f"{ENV_STOPPED_FILE}={name}: no such file (its writer creates it first)")
        return cls(Path(name))
