"""Per-rank runtime state inside a launched rank process: iteration boundaries and logged scalars.

An iteration ends when `optimizer.step()` completes (torch's global optimizer post-step hook;
only the first optimizer that steps is counted, so programs with several optimizers still
count one boundary per step). A program may also call `iteration_start()` so that time spent
between steps (logging, data loading outside the step) is left out; without it a step runs
from the previous step's end (the first step from `install()`). Outside a prism launch every
function here is a cheap no-op, so programs can call them unconditionally.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

ENV_RESULT_DIR = "PRISM_RESULT_DIR"


@dataclass
class RankRuntime:
    rank: int
    origin: float = field(default_factory=time.perf_counter)
    step_starts: list[float] = field(default_factory=list)
    step_ends: list[float] = field(default_factory=list)
    scalars: dict[str, list[float]] = field(default_factory=dict)
    _pending_start: float | None = None
    _optimizer_id: int | None = None
    _hook: object = None
    on_step: object = None  # called after each counted optimizer step (the trace recorder)

    def mark_start(self) -> None:
        self._pending_start = time.perf_counter()

    def on_optimizer_step(self, optimizer, args, kwargs) -> None:
        if self._optimizer_id is None:
            self._optimizer_id = id(optimizer)
        elif id(optimizer) != self._optimizer_id:
            return
        end = time.perf_counter()
        if self._pending_start is not None:
            start = self._pending_start
        else:
            start = self.step_ends[-1] if self.step_ends else self.origin
        self._pending_start = None
        self.step_starts.append(start)
        self.step_ends.append(end)
        if self.on_step is not None:
            self.on_step()

    def step_times(self) -> list[float]:
        return [e - s for s, e in zip(self.step_starts, self.step_ends)]

    def as_dict(self) -> dict:
        return {"rank": self.rank, "step_times_s": self.step_times(), "scalars": self.scalars}


_current: RankRuntime | None = None


def install(rank: int) -> RankRuntime:
    """Start recording for this process (called by the rank entry before the program runs)."""
    global _current
    import torch.optim.optimizer as optim_mod

    uninstall()
    _current = RankRuntime(rank=rank)
    _current._hook = optim_mod.register_optimizer_step_post_hook(_current.on_optimizer_step)
    return _current


def uninstall() -> None:
    global _current
    if _current is not None and _current._hook is not None:
        _current._hook.remove()
    _current = None


def current() -> RankRuntime | None:
    return _current


def iteration_start() -> None:
    """Mark the start of a training step (optional; a no-op outside prism)."""
    if _current is not None:
        _current.mark_start()


def log_scalar(name: str, value: float) -> None:
    """Record one value per step, e.g. the loss (a no-op outside prism)."""
    if _current is not None:
        _current.scalars.setdefault(name, []).append(float(value))


def write_json_atomic(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    os.replace(tmp, path)
