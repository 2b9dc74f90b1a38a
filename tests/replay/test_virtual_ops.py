"""Inputs: the tensor cache read ahead of a replay, all at once or streamed step by step."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import torch

import prism_core.replay.virtual_ops as virtual_ops
from prism_core.cache import TensorCacheWriter
from prism_core.replay.virtual_ops import Inputs

STEPS, OPS = 12, 3


def _cache(root: Path) -> dict[tuple[int, str], torch.Tensor]:
    """Two ranks, OPS collectives a step, each entry 4 KiB of values that name it."""
    out = {}
    for rank in (0, 1):
        with TensorCacheWriter(root, rank) as w:
            for step in range(STEPS):
                for op in range(OPS):
                    key = f"c/g/{step * OPS + op}"
                    t = torch.full((1024,), float(rank * 10_000 + step * OPS + op))
                    w.put(f"{key}/0", t)
                    out[(rank, key)] = t
    return out


def _wanted() -> list[tuple[int, str, int]]:
    return [(rank, f"c/g/{step * OPS + op}", step) for rank in (0, 1) for step in range(STEPS) for op in range(OPS)]


def _until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "the stream did not get there"
        time.sleep(0.005)


def test_inputs_that_fit_are_all_read_before_the_replay(tmp_path: Path):
    values = _cache(tmp_path)
    inputs = Inputs(tmp_path, [0, 1])
    try:
        held = inputs.preload(_wanted())
        assert held == len(values) * 4096 and not inputs.streamed
        for (rank, key), t in values.items():
            assert torch.equal(inputs.get(rank, key)[0], t)
        assert inputs.on_demand == 0
    finally:
        inputs.close()


def test_inputs_beyond_the_bound_stream_a_few_steps_ahead_and_leave_none_behind(tmp_path: Path, monkeypatch):
    values = _cache(tmp_path)
    step_bytes = 2 * OPS * 4096
    monkeypatch.setattr(virtual_ops, "PRELOAD_BYTES", 5 * step_bytes)
    inputs = Inputs(tmp_path, [0, 1])
    try:
        held = inputs.preload(_wanted())
        assert inputs.streamed
        assert held == (virtual_ops.AHEAD_STEPS + 1) * step_bytes      # the first steps, before the replay
        most = 0
        for step in range(STEPS):
            # the replay asks for a step once the stream had the time to read it
            _until(lambda: step in inputs._held_at)
            for rank in (0, 1):
                for op in range(OPS):
                    key = f"c/g/{step * OPS + op}"
                    got = inputs.get(rank, key)[0]
                    assert torch.equal(got, values[(rank, key)])
                    got += 1                          # a copy: the held entry is not changed
                    assert torch.equal(inputs.get(rank, key)[0], values[(rank, key)])
            most = max(most, inputs._held_bytes)
            # steps left behind are dropped: at most BEHIND + this one + AHEAD held
            assert min(inputs._held_at) >= step - virtual_ops.BEHIND_STEPS
        assert inputs.on_demand == 0
        assert most <= (virtual_ops.BEHIND_STEPS + 1 + virtual_ops.AHEAD_STEPS) * step_bytes
        # an entry dropped long ago is still there, read on demand
        assert torch.equal(inputs.get(0, "c/g/0")[0], values[(0, "c/g/0")])
        assert inputs.on_demand == 1
    finally:
        inputs.close()
    assert not any(t.name == "inputs-stream" for t in threading.enumerate())


def test_closing_mid_stream_stops_the_thread(tmp_path: Path, monkeypatch):
    _cache(tmp_path)
    monkeypatch.setattr(virtual_ops, "PRELOAD_BYTES", 2 * OPS * 4096)
    inputs = Inputs(tmp_path, [0, 1])
    inputs.preload(_wanted())
    assert inputs.streamed and inputs._thread.is_alive()     # waiting for the replay to move on
    inputs.close()
    assert not inputs._thread.is_alive()


def test_preload_bound_is_a_share_of_memory_or_what_the_variable_says(monkeypatch):
    monkeypatch.delenv(virtual_ops.ENV_PRELOAD, raising=False)
    assert 1 << 30 <= virtual_ops._preload_bound() <= 32 << 30
    monkeypatch.setenv(virtual_ops.ENV_PRELOAD, str(3 << 29))
    assert virtual_ops._preload_bound() == 3 << 29
