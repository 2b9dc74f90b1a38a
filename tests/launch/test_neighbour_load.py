"""The neighbour load: idle class, on its core, gone with its deadline or its launcher."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch

from prism_core.launch.cores import ENV_CPUS, machine_cores
from prism_core.launch.neighbour_load import Control, Load, run

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="needs the SCHED_IDLE class")


def test_load_runs_steps_until_its_deadline():
    t0 = time.monotonic()
    steps = run(0.5, parent=None, idle=False)   # the idle class is the subprocess test's: here a busy machine may starve it
    took = time.monotonic() - t0
    assert steps > 0 and 0.5 <= took < 5.0


def test_awake_spin_only_yields_until_its_deadline():
    t0 = time.monotonic()
    yields = run(0.3, parent=None, idle=False, awake=True)
    took = time.monotonic() - t0
    # a yield takes about a microsecond on a free core; beside busy threads each one gives the core
    # away for their slice (a few ms), as beside the parallel test workers
    assert yields > 50 and 0.3 <= took < 5.0


def test_load_stops_when_its_parent_is_not_the_one_given():
    assert run(60.0, parent=-1) == 0


def test_load_steps_are_forward_and_backward_passes_over_every_block():
    load = Load()
    for _ in range(len(load.blocks)):
        load()
    grads = [p.grad for b in load.blocks for p in b.parameters()]
    assert grads and all(g is not None and torch.count_nonzero(g) > 0 for g in grads)


def _wait_gone(pid: int, timeout: float) -> bool:
    try:
        psutil.Process(pid).wait(timeout=timeout)
    except psutil.NoSuchProcess:
        pass
    except psutil.TimeoutExpired:
        return False
    return True


def _classes(proc: psutil.Process) -> list[int]:
    """The scheduling classes of the process's threads, sorted (torch's own threads included)."""
    out = []
    for t in proc.threads():
        try:
            out.append(os.sched_getscheduler(t.id))
        except ProcessLookupError:
            pass
    return sorted(set(out))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["load", "awake"])
def test_process_is_idle_class_on_its_core_and_leaves_with_its_launcher(mode):
    core = machine_cores()[-1]
    awake = ", '--awake'" if mode == "awake" else ""
    # an intermediate launcher starts the load, reports its pid, then exits: the load must follow
    code = (
        "import os, subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-m', 'prism_core.launch.neighbour_load', '--seconds', '60',"
        f" '--parent', str(os.getpid()){awake}])\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(float(sys.argv[1]))\n"
    )
    env = {**os.environ, ENV_CPUS: str(core)}
    launcher = subprocess.Popen([sys.executable, "-c", code, "8"], env=env, stdout=subprocess.PIPE, text=True)
    try:
        pid = int(launcher.stdout.readline())
        load = psutil.Process(pid)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _classes(load) != [os.SCHED_OTHER, os.SCHED_IDLE]:
            time.sleep(0.1)   # binding and the class are set once the module runs
        # the compute thread alone is in the idle class; the main thread watches in the normal one
        assert _classes(load) == [os.SCHED_OTHER, os.SCHED_IDLE]
        assert os.sched_getscheduler(pid) == os.SCHED_OTHER
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and load.cpu_affinity() != [core]:
            time.sleep(0.1)
        assert load.cpu_affinity() == [core]
        launcher.wait(timeout=30)
        assert _wait_gone(pid, timeout=10), "the load outlived its launcher"
    finally:
        launcher.kill()
        launcher.wait()


@pytest.mark.timeout(120)
def test_sigterm_ends_the_load_at_once_beside_a_busy_core():
    core = machine_cores()[-1]
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"],
                            preexec_fn=lambda: os.sched_setaffinity(0, {core}))
    load = subprocess.Popen([sys.executable, "-m", "prism_core.launch.neighbour_load", "--seconds", "60"],
                            env={**os.environ, ENV_CPUS: str(core)}, stderr=subprocess.PIPE, text=True)
    try:
        proc = psutil.Process(load.pid)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and _classes(proc) != [os.SCHED_OTHER, os.SCHED_IDLE]:
            time.sleep(0.1)
        assert _classes(proc) == [os.SCHED_OTHER, os.SCHED_IDLE]
        load.send_signal(signal.SIGTERM)
        assert load.wait(timeout=10) == 0
        assert "neighbour load:" in load.stderr.read()
    finally:
        for p in (load, busy):
            p.kill()
            p.wait()


def test_a_controlled_spin_runs_only_while_its_pipe_says_on_and_leaves_when_it_closes():
    read, write = os.pipe()
    control = Control(read)
    steps: list[int] = []
    done = threading.Event()

    def spin() -> None:
        steps.append(run(30.0, parent=None, idle=False, awake=True, control=control))
        done.set()

    worker = threading.Thread(target=spin)
    worker.start()
    try:
        time.sleep(0.3)
        assert not control.on and not done.is_set()      # off until told: blocked on the pipe
        os.write(write, b"1")
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not control.on:
            time.sleep(0.01)
        assert control.on
        os.write(write, b"10")                            # the last word counts
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and control.on:
            time.sleep(0.01)
        assert not control.on
    finally:
        os.close(write)                                   # the assistant gone: the spin leaves
    assert done.wait(5.0)
    worker.join(5.0)
    assert control.closed and steps and steps[0] > 0


def test_control_needs_awake():
    proc = subprocess.run([sys.executable, "-m", "prism_core.launch.neighbour_load", "--seconds", "1", "--control", "0"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--control goes with --awake" in proc.stderr
