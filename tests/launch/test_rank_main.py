"""A launched rank whose exit stalls after its result is written says where: every thread's stack
goes to its log (the launcher waits for its exit code)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

STALLING = textwrap.dedent("""
    import sys, time
    from prism_core.launch.rank_main import _stacks_if_exit_stalls

    def an_atexit_handler_that_hangs():
        time.sleep({sleep})

    _stacks_if_exit_stalls(0.3)
    an_atexit_handler_that_hangs()
""")


def _run(sleep: float) -> str:
    proc = subprocess.run([sys.executable, "-c", STALLING.format(sleep=sleep)], capture_output=True, text=True,
                          timeout=60, start_new_session=True)
    assert proc.returncode == 0, proc.stderr
    return proc.stderr


def test_a_stalled_exit_writes_every_threads_stack():
    err = _run(sleep=1.5)
    assert "Timeout (0:00:00" in err
    assert "an_atexit_handler_that_hangs" in err


def test_an_exit_in_time_writes_nothing():
    assert _run(sleep=0.0) == ""
