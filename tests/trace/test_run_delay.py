"""RunDelay: a thread that shares its core with a busy process waits for it, and says so."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from prism_core.trace.run_delay import RunDelay

_SPIN = """
import os, sys, time
os.sched_setaffinity(0, {%d})
print("spinning", flush=True)
end = time.monotonic() + 20
while time.monotonic() < end:
    pass
"""


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_a_thread_sharing_its_core_with_a_busy_process_waits_about_half_the_time():
    delay = RunDelay.of_this_thread()
    if delay is None:
        pytest.skip("this kernel keeps no per-thread run delay")
    before_affinity = os.sched_getaffinity(0)
    core = min(before_affinity)
    os.sched_setaffinity(0, {core})        # this thread only: pid 0 is the calling thread
    child = subprocess.Popen([sys.executable, "-c", _SPIN % core], stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        assert child.stdout.readline().strip() == "spinning"
        start = delay.read()
        _spin(0.6)
        waited = (delay.read() - start) * 1e-9
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait(timeout=10)
        os.sched_setaffinity(0, before_affinity)
        delay.close()
    # two runnable threads on one core share it: this one waited for about half of the 0.6 s
    assert 0.1 < waited < 0.6
    assert child.poll() is not None


def test_the_figure_only_grows():
    delay = RunDelay.of_this_thread()
    if delay is None:
        pytest.skip("this kernel keeps no per-thread run delay")
    try:
        first = delay.read()
        time.sleep(0.01)
        assert delay.read() >= first >= 0
    finally:
        delay.close()


def test_the_wait_another_thread_of_the_process_causes_holds_its_cpu_time():
    """Two threads of one process on one core, both outside the GIL (hashing a large buffer): the
    calling thread's wait for the core holds what the other thread ran."""
    import hashlib
    import threading

    from prism_core.trace.run_delay import OwnThreads

    delay = RunDelay.of_this_thread()
    if delay is None:
        pytest.skip("this kernel keeps no per-thread run delay")
    before_affinity = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(before_affinity)})    # this thread; the one it starts inherits it
    data, stop = bytes(1 << 20), threading.Event()

    def hash_until_stopped():
        while not stop.is_set():
            hashlib.sha256(data).digest()

    other = threading.Thread(target=hash_until_stopped, daemon=True)
    try:
        own = OwnThreads()
        d0, o0 = delay.read(), own.read()
        other.start()
        end = time.perf_counter() + 0.6
        while time.perf_counter() < end:
            hashlib.sha256(data).digest()
        waited, ran = (delay.read() - d0) * 1e-9, (own.read() - o0) * 1e-9
    finally:
        stop.set()
        other.join(timeout=10)
        os.sched_setaffinity(0, before_affinity)
        delay.close()
    assert not other.is_alive()
    assert 0.1 < waited < 0.6 and 0.1 < ran < 0.6
    # every moment the other thread ran on the core this one waited; the wait may hold more (a
    # process of the machine on the same core, as a parallel test run has), never much less
    assert ran <= waited * 1.25 + 0.03


def test_the_wait_another_process_on_the_core_causes_holds_its_cpu_time():
    """A process spinning on this thread's core: the thread's wait holds the CPU time it ran."""
    from prism_core.trace.run_delay import ProcessCpu

    delay = RunDelay.of_this_thread()
    if delay is None:
        pytest.skip("this kernel keeps no per-thread run delay")
    before_affinity = os.sched_getaffinity(0)
    core = min(before_affinity)
    os.sched_setaffinity(0, {core})
    child = subprocess.Popen([sys.executable, "-c", _SPIN % core], stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        assert child.stdout.readline().strip() == "spinning"
        other = ProcessCpu(child.pid)
        # a parallel test run may hold the core through a whole spin, leaving the child little of
        # it (one make test saw it run 0.03 s of 0.6): such a sample says nothing; take another
        for _ in range(3):
            d0, c0 = delay.read(), other.read()
            _spin(0.6)
            waited, ran = (delay.read() - d0) * 1e-9, (other.read() - c0) * 1e-9
            if ran > 0.1:
                break
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait(timeout=10)
        os.sched_setaffinity(0, before_affinity)
        delay.close()
    assert 0.1 < waited < 0.6 and 0.1 < ran < 0.6
    # the child ran only on this thread's core while this thread was runnable: all it ran is wait
    # here; the wait may hold more (another process of the machine on the same core)
    assert ran <= waited * 1.25 + 0.03
    assert other.read() == other.read() > 0        # ended: its last figure stays


def test_a_helper_pid_that_names_no_process_is_none(monkeypatch):
    from prism_core.trace.run_delay import ENV_HELPER_PID, ProcessCpu

    monkeypatch.delenv(ENV_HELPER_PID, raising=False)
    assert ProcessCpu.of_helper() is None
    monkeypatch.setenv(ENV_HELPER_PID, "not a pid")
    assert ProcessCpu.of_helper() is None
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=30)
    monkeypatch.setenv(ENV_HELPER_PID, str(dead.pid))
    assert ProcessCpu.of_helper() is None
    monkeypatch.setenv(ENV_HELPER_PID, str(os.getppid()))
    assert ProcessCpu.of_helper().read() > 0
