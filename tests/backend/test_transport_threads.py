"""Gloo's device-loop threads run in the idle scheduling class wherever the prism backend makes a gloo group."""

from __future__ import annotations

import datetime
import os
import time

import pytest
import torch.distributed as dist

from prism_core.backend.transport_threads import loop_policies, make_gloo_group
from prism_core.config import load_config
from prism_core.record import record

from tests.jobs import assert_nothing_left, make_job, rank_result


def _gloo_group(prefix: str):
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, dist.HashStore()), 0, 1, datetime.timedelta(seconds=10))


@pytest.mark.parametrize("switch, policy", [("1", os.SCHED_IDLE), ("0", os.SCHED_OTHER)])
def test_the_loop_a_new_group_starts_is_idle_unless_switched_off(monkeypatch, switch, policy):
    monkeypatch.setenv("PRISM_GLOO_LOOP_IDLE", switch)
    for i in range(5):      # the loop names itself after the constructor returns: a race, run a few times
        before = set(loop_policies())
        pg = make_gloo_group(lambda: _gloo_group(f"loop-{switch}-{i}/"))
        deadline = time.monotonic() + 2.0      # switched off, nothing waits for the loop to name itself
        while not (new := {tid: p for tid, p in loop_policies().items() if tid not in before}):
            assert time.monotonic() < deadline, "no device-loop thread appeared"
            time.sleep(0.001)
        assert len(new) == 1, "a ProcessGroupGloo starts one device-loop thread"
        assert set(new.values()) == {policy}
        del pg


LOOPS = """
    dist.init_process_group("gloo")
    sub = dist.new_group([0, 1])
    x = torch.ones(4)
    dist.all_reduce(x, group=sub)
    policies = []
    for tid in os.listdir("/proc/self/task"):
        if open(f"/proc/self/task/{tid}/comm").read().strip() == "gloo_tcp_loop":
            policies.append(os.sched_getscheduler(int(tid)))
    print("RESULT " + json.dumps({"loops": len(policies), "idle": policies.count(os.SCHED_IDLE),
                                  "sum": x.tolist()}), flush=True)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.ones(2)).sum().backward()
        opt.step()
    dist.destroy_process_group()
"""


@pytest.mark.timeout(120)
def test_every_loop_of_a_recorded_rank_is_idle(tmp_path):
    config, script = make_job(tmp_path, LOOPS)
    record(load_config(config), tmp_path / "out", echo=False)
    for rank in range(2):
        result = rank_result(tmp_path / "out", rank)
        assert result["sum"] == [2.0] * 4
        assert result["loops"] >= 2 and result["idle"] == result["loops"], f"rank {rank}: {result}"
    assert_nothing_left(tmp_path, script)
