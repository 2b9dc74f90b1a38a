"""Core placement: a core of its own per rank of a launch, concurrent launches apart, the last core for the assistant."""

from __future__ import annotations

import os

import pytest

from prism_core.launch import cores
from prism_core.launch.cores import ENV_CPUS, bind_from_env, keep_awake, place, place_on


@pytest.fixture
def four_cores(monkeypatch):
    monkeypatch.setattr(cores, "machine_cores", lambda: [0, 1, 2, 3])
    monkeypatch.setattr(cores, "_held", set())
    monkeypatch.setattr(cores, "_placed", 0)
    monkeypatch.setattr(cores, "_awake", {})


def test_ranks_get_distinct_cores_and_concurrent_launches_never_share_one(four_cores):
    a, _ = place([0, 1], helper=False)
    b, _ = place([5, 6], helper=False)
    assert a.ranks == {0: 0, 1: 1} and b.ranks == {5: 2, 6: 3}
    c, why = place([7], helper=False)
    assert c is None and "0 of the machine's 4 are free" in why
    a.release()
    c, _ = place([7], helper=False)
    assert c.ranks == {7: 0}


def test_with_an_assistant_the_last_core_stays_free_for_it(four_cores):
    a, _ = place([2, 3, 4], helper=True)
    assert a.ranks == {2: 0, 3: 1, 4: 2} and a.helper == [3]
    b, why = place([5], helper=True)
    assert b is None and "need 2 cores" in why
    a.release()
    b, _ = place([5], helper=True)
    assert b.ranks == {5: 0} and b.helper == [1, 2, 3]    # every core no rank holds


def test_job_cores_put_each_rank_where_the_whole_job_has_it(four_cores):
    a, _ = place([3], helper=True, job_cores=True)         # an emulation of rank 3 of a W<=4 job
    assert a.ranks == {3: 3} and a.helper == [0, 1, 2]
    a.release()
    b, _ = place([1, 2], helper=True, job_cores=True)
    assert b.ranks == {1: 1, 2: 2} and b.helper == [0, 3]
    b.release()
    c, _ = place([9], helper=True, job_cores=True)         # a job larger than the machine: the usual cores
    assert c.ranks == {9: 0} and c.helper == [1, 2, 3]
    c.release()
    e, _ = place([0, 1, 2, 3], helper=True, job_cores=True)   # no core left for the assistant: none bound
    assert e is None
    other, _ = place([5], helper=True)                        # beside another launch: the usual cores
    f, _ = place([2], helper=True, job_cores=True)
    assert other.ranks == {5: 0} and f.ranks == {2: 1}


def test_load_cores_go_to_a_launch_placed_alone_and_are_held_from_later_ones(four_cores):
    a, _ = place([0], helper=True, loads=2)
    assert a.ranks == {0: 0} and a.helper == [1, 2, 3] and a.loads == [1, 2]
    b, why = place([5], helper=True, loads=1)
    assert b is None and "need 2 cores" in why        # no rank on a core under a load
    a.release()
    b, _ = place([5], helper=True, loads=1)
    assert b.loads == [1]
    c, _ = place([6], helper=True, loads=1)
    assert c.ranks == {6: 2} and c.helper == [3] and c.loads == []   # another launch is placed: no load
    b.release()
    c.release()
    d, _ = place([7], helper=True, loads=1)
    assert d.loads == [1]


def test_a_launch_alone_keeps_its_assistant_cores_awake_until_a_rank_needs_one(four_cores):
    a, _ = place([0], helper=True, loads=1, awake=True)
    assert a.helper == [1, 2, 3] and a.loads == [1] and a.awake == [2, 3]     # the load's core computes anyway
    a.release()
    a, _ = place([0], helper=True, awake=True)
    assert a.awake == [1, 2, 3]
    stopped = []
    assert keep_awake(1, lambda: stopped.append(1))       # spins on cores 1 and 3 (core 2's not yet begun)
    assert keep_awake(3, lambda: stopped.append(3))
    b, _ = place([5], helper=True, awake=True)            # a later launch: its rank where nothing spins
    assert b.ranks == {5: 2} and b.awake == [] and stopped == []
    c, _ = place([6], helper=True)                        # only a spun core left for a rank: the spin ends
    assert c.ranks == {6: 1} and stopped == [1]
    assert not keep_awake(2, lambda: stopped.append(2))   # a spin begun on a core a rank took meanwhile
    assert stopped == [1, 2]
    a.release()
    assert cores._awake == {}
    d, _ = place_on([7], [3])                             # the spin a released launch left is not stopped twice
    assert d.ranks == {7: 3} and stopped == [1, 2]


def test_co_run_launches_take_the_cores_given_their_assistants_too(four_cores):
    a, _ = place_on([0], [0])
    b, _ = place_on([1], [1])
    assert a.ranks == {0: 0} and b.ranks == {1: 1} and a.helper == [0] and b.helper == [1]
    c, why = place_on([0], [1])
    assert c is None and "[1] held by another launch" in why
    d, why = place([5], helper=True)          # a plain slice: core 0 is held, core 2 is free
    assert d.ranks == {5: 2}
    b.release()
    e, _ = place_on([7], [1])
    assert e.ranks == {7: 1}
    f, why = place_on([8], [9])
    assert f is None and "[9] not on this machine" in why
    g, why = place_on([8, 9], [3, 3])
    assert g is None and "one core per rank" in why


def test_too_few_cores_leaves_the_launch_unbound(monkeypatch):
    monkeypatch.setattr(cores, "machine_cores", lambda: [0])
    monkeypatch.setattr(cores, "_held", set())
    placement, why = place([0], helper=True)
    assert placement is None and "need 2 cores" in why


def test_a_launched_process_binds_to_the_cores_it_is_given(monkeypatch):
    before = os.sched_getaffinity(0)
    core = min(before)
    monkeypatch.setenv(ENV_CPUS, str(core))
    try:
        bind_from_env()
        assert os.sched_getaffinity(0) == {core}
    finally:
        os.sched_setaffinity(0, before)
