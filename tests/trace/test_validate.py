"""Validator: a valid job has no problems; each broken invariant is reported naming ranks and ops."""

from __future__ import annotations

import numpy as np
import pytest

from prism_core.trace import TraceError, problems, validate
from prism_core.trace.recorder import Recorder
from prism_core.trace.schema import COMM, COMPUTE, WAIT

from ._build import blocking, finish, merged, recv, reference_job, send, start


def trace_of(tmp_path, world_size, script):
    """Run `script(rec)` for every simulated rank and merge their parts."""
    recs = [Recorder(r) for r in range(world_size)]
    for rec in recs:
        script(rec)
        rec.iteration_end()
    return merged(tmp_path, recs)


def only_problem(trace) -> str:
    found = problems(trace)
    assert len(found) == 1, found
    return found[0]


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_reference_job_is_valid(tmp_path, world_size):
    trace = merged(tmp_path, reference_job(world_size))
    kinds = trace.columns["kind"]
    assert np.any(kinds == WAIT) and np.any(kinds == COMM)   # the job does hold an async op
    assert problems(trace) == []
    validate(trace)


def test_valid_async_ops_on_world_and_subgroup(tmp_path):
    world = (0, 1, 2)

    def script(rec):
        r = rec.rank
        a = start(rec, "allreduce", "world", world, 64)
        if r < 2:
            b = start(rec, "reduce_scatter_single", "g01", (0, 1), 32)
            finish(rec, b)
        finish(rec, a)
        # uneven alltoall byte counts are legal
        blocking(rec, "all_to_all_single", "world", world, 100 * (r + 1))
        if r == 2:
            send(rec, 0, 8, tag=1, ranks=world)
        if r == 0:
            recv(rec, 2, 8, tag=1, ranks=world)

    assert problems(trace_of(tmp_path, 3, script)) == []


def test_collective_missing_on_one_member(tmp_path):
    world = (0, 1, 2)

    def script(rec):
        blocking(rec, "allreduce", "world", world, 64)
        if rec.rank != 2:
            blocking(rec, "barrier", "world", world, 0)

    msg = only_problem(trace_of(tmp_path, 3, script))
    assert "#1" in msg and "barrier" in msg and "[0, 1, 2]" in msg and "missing on ranks [2]" in msg


def test_subgroup_collective_missing_on_one_member(tmp_path):
    world = (0, 1, 2, 3)

    def script(rec):
        blocking(rec, "broadcast", "world", world, 64, peer=0)
        if rec.rank in (1, 3):
            blocking(rec, "allgather", "g13", (1, 3), 64)

    assert problems(trace_of(tmp_path, 4, script)) == []

    def broken(rec):
        blocking(rec, "broadcast", "world", world, 64, peer=0)
        if rec.rank == 1:
            blocking(rec, "allgather", "g13", (1, 3), 64)

    msg = only_problem(trace_of(tmp_path / "b", 4, broken))
    assert "allgather" in msg and "[1, 3]" in msg and "missing on ranks [3]" in msg


def test_mismatched_ops_at_the_same_seq(tmp_path):
    def script(rec):
        op = "allreduce" if rec.rank == 0 else "broadcast"
        blocking(rec, op, "world", (0, 1), 256, peer=-1 if op == "allreduce" else 0)

    msg = only_problem(trace_of(tmp_path, 2, script))
    assert "mismatched" in msg and "#0" in msg
    assert "rank 0: allreduce" in msg and "rank 1: broadcast" in msg


def test_allreduce_sizes_disagree(tmp_path):
    def script(rec):
        blocking(rec, "allreduce", "world", (0, 1, 2), 4096 if rec.rank != 1 else 2048)

    msg = only_problem(trace_of(tmp_path, 3, script))
    assert msg.startswith("allreduce #0") and "size" in msg
    assert "rank 0: 4096 B" in msg and "rank 1: 2048 B" in msg and "rank 2: 4096 B" in msg


def test_allreduce_dtypes_disagree(tmp_path):
    def script(rec):
        blocking(rec, "allreduce", "world", (0, 1), 4096, "float32" if rec.rank == 0 else "int32")

    msg = only_problem(trace_of(tmp_path, 2, script))
    assert "allreduce #0" in msg


def test_send_without_recv(tmp_path):
    def script(rec):
        if rec.rank == 0:
            send(rec, 1, 512, tag=3)

    msg = only_problem(trace_of(tmp_path, 2, script))
    assert msg == "send #0 from rank 0 to rank 1 (tag 3) has no matching recv"


def test_recv_without_send(tmp_path):
    def script(rec):
        if rec.rank == 2:
            recv(rec, 1, 512, tag=0, ranks=(0, 1, 2))
        else:
            blocking(rec, "barrier", "world", (0, 1, 2), 0)
            if rec.rank == 1:
                # a send that exists, but to another rank
                send(rec, 0, 512, tag=0, ranks=(0, 1, 2))
            else:
                recv(rec, 1, 512, tag=0, ranks=(0, 1, 2))

    trace = trace_of(tmp_path, 3, script)
    found = problems(trace)
    assert found == ["collective #0 of group [0, 1, 2] (barrier) is missing on ranks [2]",
                     "recv #0 from rank 1 to rank 2 (tag 0) has no matching send"]


def test_send_recv_tag_mismatch_is_two_problems(tmp_path):
    def script(rec):
        if rec.rank == 0:
            send(rec, 1, 64, tag=1)
        else:
            recv(rec, 0, 64, tag=2)

    found = problems(trace_of(tmp_path, 2, script))
    assert sorted(found) == ["recv #0 from rank 0 to rank 1 (tag 2) has no matching send",
                             "send #0 from rank 0 to rank 1 (tag 1) has no matching recv"]


def test_send_recv_size_mismatch(tmp_path):
    def script(rec):
        if rec.rank == 0:
            send(rec, 1, 512, tag=0)
        else:
            recv(rec, 0, 256, tag=0)

    msg = only_problem(trace_of(tmp_path, 2, script))
    assert msg == "send #0 from rank 0 to rank 1 carries 512 B but the recv expects 256 B"


def _wait_nodes(trace, rank):
    s = trace.rank_slice(rank)
    kind = trace.columns["kind"][s]
    return s, np.nonzero(kind == WAIT)[0]


def test_wait_referring_forward(tmp_path):
    trace = merged(tmp_path, reference_job(2))
    s, waits = _wait_nodes(trace, 1)
    w = int(waits[0])
    trace.columns["ref"][s.start + w] = w + 1
    msg = only_problem(trace)
    assert msg == f"rank 1: wait node {w} refers to node {w + 1}, not an earlier op"


def test_wait_referring_to_itself_or_nothing(tmp_path):
    trace = merged(tmp_path, reference_job(2))
    s, waits = _wait_nodes(trace, 0)
    w = int(waits[0])
    trace.columns["ref"][s.start + w] = w
    assert f"rank 0: wait node {w} refers to node {w}" in only_problem(trace)
    trace.columns["ref"][s.start + w] = -1
    assert f"rank 0: wait node {w} refers to node -1" in only_problem(trace)


def test_wait_referring_to_compute_and_unpaired_async(tmp_path):
    trace = merged(tmp_path, reference_job(2))
    s, waits = _wait_nodes(trace, 0)
    w = int(waits[0])
    assert trace.columns["kind"][s.start] == COMPUTE
    trace.columns["ref"][s.start + w] = 0
    found = problems(trace)
    assert any(p.startswith("rank 0:") and "not a communication op" in p for p in found), found

    trace = merged(tmp_path / "b", reference_job(2))
    s, waits = _wait_nodes(trace, 1)
    comm = int(trace.columns["ref"][s.start + int(waits[0])])
    trace.columns["async_"][s.start + comm] = 0
    assert only_problem(trace) == "rank 1: async ops and their waits do not pair up one to one"


def test_steps_and_times_going_backwards(tmp_path):
    trace = merged(tmp_path, reference_job(2))
    s = trace.rank_slice(1)
    trace.columns["step"][s.stop - 1] = 0
    assert only_problem(trace).startswith("rank 1: iteration numbers go backwards at node")
    trace = merged(tmp_path / "b", reference_job(2))
    s = trace.rank_slice(0)
    trace.columns["t_start"][s.start + 5] = trace.columns["t_start"][s.start] - 1.0
    assert only_problem(trace) == "rank 0: node start times go backwards"


def test_validate_raises_listing_problems(tmp_path):
    def script(rec):
        blocking(rec, "allreduce", "world", (0, 1), 64 if rec.rank == 0 else 32)
        if rec.rank == 0:
            send(rec, 1, 8, tag=9)

    trace = trace_of(tmp_path, 2, script)
    found = problems(trace)
    assert len(found) == 2
    with pytest.raises(TraceError) as err:
        validate(trace)
    text = str(err.value)
    assert text.startswith("invalid trace: ")
    for p in found:
        assert p in text


def test_validate_caps_the_list(tmp_path):
    def script(rec):
        if rec.rank == 0:
            for tag in range(25):
                send(rec, 1, 8, tag=tag)

    trace = trace_of(tmp_path, 2, script)
    assert len(problems(trace)) == 25
    with pytest.raises(TraceError, match=r"\(and 5 more\)$"):
        validate(trace)


def _uneven_all_to_all(splits_of):
    def script(rec):
        world = (0, 1)
        node = rec.issue("all_to_all_single", "0", world, -1, 4 * sum(splits_of[rec.rank]), "float32",
                         splits=splits_of[rec.rank])
        rec.issued(node)
        inline, began = rec.wait_begin(node, True)
        rec.wait_end(node, inline, began)
    return script


def test_uneven_all_to_all_keeps_its_splits_through_the_store(tmp_path):
    from prism_core.trace import load_trace, write_trace

    trace = trace_of(tmp_path, 2, _uneven_all_to_all({0: [3, 0], 1: [1, 2]}))
    assert problems(trace) == []
    back = load_trace(write_trace(trace, tmp_path / "t.zarr"))
    comm = back.columns["kind"] == COMM
    assert [back.splits[i] for i in back.columns["splits"][comm]] == ["3,0", "1,2"]


def test_splits_that_do_not_fit_the_group_are_reported(tmp_path):
    trace = trace_of(tmp_path, 2, _uneven_all_to_all({0: [3, 0, 1], 1: [1, 2]}))
    assert "all_to_all_single splits [3, 0, 1] do not fit its group of 2" in only_problem(trace)
