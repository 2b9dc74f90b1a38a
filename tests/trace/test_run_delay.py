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
