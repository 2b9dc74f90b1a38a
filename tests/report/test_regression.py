"""Regression detection between versions: fires beyond the limits, in either direction, and not within."""

from __future__ import annotations

import pytest

from prism_core.report.regression import RegressionError, check, compare


def _metrics(t, mem, oom=False):
    return {"ranks": {"0": {"iteration_time_s": t, "peak_memory_bytes": mem, "oom": oom}}}


def test_within_the_limits_nothing_fires():
    changes = check(_metrics(0.100, 1000), _metrics(0.104, 1000), 0.05, 0.0)
    assert {c.figure for c in changes} == {"iteration time", "peak memory", "oom"}
    assert not any(c.exceeded for c in changes)


@pytest.mark.parametrize("after,fires", [(0.106, True), (0.094, True), (0.105, False), (0.1, False)])
def test_iteration_time_beyond_the_limit_fires_either_way(after, fires):
    changes = compare(_metrics(0.100, 1000), _metrics(after, 1000), 0.05, 0.0)
    assert any(c.exceeded for c in changes) == fires


def test_one_byte_more_memory_fires_at_a_zero_limit_and_the_message_names_it():
    with pytest.raises(RegressionError) as info:
        check(_metrics(0.1, 1000), _metrics(0.1, 1001), 0.05, 0.0, previous_label="version 3")
    message = str(info.value)
    assert "version 3" in message and "rank 0: peak memory 1,000 B -> 1,001 B" in message


def test_an_oom_appearing_fires_and_new_ranks_are_not_compared():
    with pytest.raises(RegressionError, match="out of memory now"):
        check(_metrics(0.1, 1000), _metrics(0.1, 1000, oom=True), 1.0, 1.0)
    assert compare(_metrics(0.1, 1000), {"ranks": {"5": {"iteration_time_s": 9.0}}}, 0.05, 0.0) == []
