"""CoreSpin: what a timed assistant tells the spins on its cores."""

from __future__ import annotations

import os

from prism_core.replay.awake import CoreSpin


def _said(read: int) -> bytes:
    os.set_blocking(read, False)
    try:
        return os.read(read, 4096)
    except BlockingIOError:
        return b""


def test_on_while_a_timer_is_due_or_an_op_is_held_off_while_the_ranks_wait():
    read, write = os.pipe()
    spin = CoreSpin([write])
    spin.set_computing(False)
    assert _said(read) == b"" and not spin.on            # already off: nothing written
    spin.set_computing(True)
    spin.set_computing(True)
    assert _said(read) == b"1"                            # a change only, once
    with spin.hold():
        spin.set_computing(False)                         # the loop blocks, but an op is held to its clock
        assert spin.on and _said(read) == b""
    assert _said(read) == b"0" and not spin.on
    with spin.hold(), spin.hold():
        pass
    assert _said(read) == b"10" and spin.switches == 4
    spin.close()
    assert _said(read) == b"0" and spin.fds == []
    assert os.read(read, 1) == b""                        # its end closed: the spin leaves
    os.close(read)


def test_a_spin_that_is_gone_is_dropped():
    read, write = os.pipe()
    other_read, other_write = os.pipe()
    spin = CoreSpin([write, other_write])
    os.close(read)                                        # that core's spin stopped (a rank took the core)
    spin.set_computing(True)
    assert spin.fds == [other_write] and spin.on and spin.cores == 2
    assert _said(other_read) == b"1"
    spin.close()
    os.close(other_read)


def test_no_spins_no_writes():
    spin = CoreSpin([])
    spin.set_computing(True)
    with spin.hold():
        pass
    assert spin.switches == 0 and not spin.on
    spin.close()
