"""Iteration boundaries from optimizer.step(), explicit start marks, and scalar logging."""

from __future__ import annotations

import time

import pytest
import torch

from prism_core import runtime


@pytest.fixture
def rt():
    yield runtime.install(rank=3)
    runtime.uninstall()


def _step(opt, model):
    model(torch.ones(1, 2)).sum().backward()
    opt.step()


def test_each_optimizer_step_ends_an_iteration(rt):
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        time.sleep(0.02)
        _step(opt, model)
    times = rt.step_times()
    assert len(times) == 3 and all(t >= 0.02 for t in times)
    assert rt.as_dict()["rank"] == 3


def test_start_mark_excludes_time_between_steps(rt):
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _step(opt, model)
    time.sleep(0.1)  # outside the step
    runtime.iteration_start()
    _step(opt, model)
    assert rt.step_times()[1] < 0.05


def test_only_the_first_optimizer_counts(rt):
    a, b = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    for _ in range(2):
        _step(opt_a, a)
        _step(opt_b, b)
    assert len(rt.step_times()) == 2


def test_log_scalar_and_noop_outside_prism(rt):
    runtime.log_scalar("loss", 1.5)
    assert rt.scalars == {"loss": [1.5]}
    runtime.uninstall()
    runtime.log_scalar("loss", 2.0)  # no runtime installed: ignored, no error
    runtime.iteration_start()
    assert runtime.current() is None
