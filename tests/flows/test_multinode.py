"""Multi-node as the README describes it, on loopback: an existing `dask scheduler`, a `dask worker
--resources slots=N` pointed at it, and a Prefect server URL; the slices run on that worker."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flows.calibrate import run_calibrate

from tests.jobs import assert_no_rank_processes, make_job

BODY = """
dist.init_process_group("gloo")
model = torch.nn.Linear(16, 16)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(3):
    model(torch.randn(8, 16)).sum().backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    opt.step()
dist.destroy_process_group()
"""


def _start(cmd: list[str], env: dict, log: Path) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def _scheduler_address(scheduler_file: Path, log: Path, timeout_s: float = 60) -> str:
    # the scheduler creates the file before it writes it: an empty or half-written file is read again
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return json.loads(scheduler_file.read_text())["address"]
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            time.sleep(0.2)
    raise AssertionError(f"no scheduler address in {scheduler_file} after {timeout_s} s:\n{log.read_text()[-2000:]}")


@pytest.mark.timeout(600)
def test_slices_run_on_an_existing_scheduler_and_worker(prefect_server, tmp_path):
    from distributed import Client
    from prefect.settings import PREFECT_API_URL

    dask = str(Path(sys.executable).parent / "dask")
    env = dict(os.environ, PREFECT_API_URL=PREFECT_API_URL.value())
    scheduler_file = tmp_path / "scheduler.json"
    procs = []
    try:
        procs.append(_start([dask, "scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard",
                             "--scheduler-file", str(scheduler_file)], env, tmp_path / "scheduler.log"))
        address = _scheduler_address(scheduler_file, tmp_path / "scheduler.log")
        worker = _start([dask, "worker", address, "--host", "127.0.0.1", "--nthreads", "1", "--resources", "slots=1",
                         "--no-nanny", "--no-dashboard", "--local-directory", str(tmp_path / "worker")],
                        env, tmp_path / "worker.log")
        procs.append(worker)
        with Client(address, timeout=60) as client:
            client.wait_for_workers(1, timeout=60)
        config, script = make_job(tmp_path, BODY, name="multi", iterations=3, timeout_s=120,
                                  loaded_compute=True)     # the loaded runs too take the whole worker
        # the stand-in load here: the co-runs' own flow path is tested in test_calibrate_flow.py
        doc = run_calibrate(str(config), ["emulation.sandbox=1", "emulation.neighbours=stand_in"],
                            str(tmp_path / "calibrate"), address,
                            root=str(tmp_path / "stages"))
        assert doc["mode"] == "predicted" and set(doc["ranks"]) == {"0", "1"}
        ran = [json.loads(p.read_text())["pid"] for p in (tmp_path / "stages" / "timing").rglob("slice.json")]
        assert ran and set(ran) == {worker.pid}, "the slices ran elsewhere than on the worker"
        assert any(p.parent.name.startswith("loaded_") for p in (tmp_path / "stages" / "timing").rglob("slice.json"))
    finally:
        for proc in reversed(procs):
            _stop(proc)
    assert all(p.poll() is not None for p in procs)
    assert_no_rank_processes()
