"""Recorder: the node sequence the backend's calls produce, annotations, steps, sequence numbers."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

import prism_core
from prism_core import annotations
from prism_core.trace import recorder as recorder_module
from prism_core.trace.recorder import Recorder
from prism_core.trace.schema import COMM, COMPUTE, OP_CODE, WAIT

from ._build import FakeMemory, blocking, finish, recv, send, start

WORLD = (0, 1, 2, 3)


@pytest.fixture
def no_sink():
    annotations.set_sink(None)
    try:
        yield
    finally:
        annotations.set_sink(None)


def kinds(rec: Recorder) -> list[int]:
    return [row[0] for row in rec.rows]


@pytest.mark.parametrize("callback", [False, True])
def test_blocking_collective_is_one_comm_node_without_wait(callback):
    rec = Recorder(0)
    idx = blocking(rec, "allreduce", "world", WORLD, 4096, "float32", callback=callback)
    assert idx == 1
    assert kinds(rec) == [COMPUTE, COMM]
    cols = rec.columns()   # closes the trailing compute
    assert cols["kind"].tolist() == [COMPUTE, COMM, COMPUTE]
    assert not np.any(cols["kind"] == WAIT)
    comm = {k: v[idx] for k, v in cols.items()}
    assert comm["op"] == OP_CODE["allreduce"] and comm["async_"] == 0 and comm["ref"] == -1
    assert comm["group"] == 0 and comm["bytes"] == 4096 and comm["seq"] == 0 and comm["peer"] == -1
    assert rec.tables()["dtypes"][comm["dtype"]] == "float32"
    assert rec.groups == {"world": WORLD}
    assert math.isfinite(comm["t_end"]) and comm["t_end"] >= comm["t_start"]
    # the compute nodes tile the time around it
    assert cols["t_end"][0] == cols["t_start"][1]
    assert cols["t_start"][2] >= comm["t_end"] if not callback else cols["t_start"][2] >= comm["t_start"]


def test_complete_keeps_the_earliest_completion():
    rec = Recorder(0)
    idx = start(rec, "allreduce", "world", WORLD, 8)
    rec.complete(idx, when=5.0)
    rec.complete(idx, when=7.0)
    assert rec.rows[idx][-1] == 5.0
    rec.complete(idx, when=3.0)
    assert rec.rows[idx][-1] == 3.0


def _boundary_annotation(rec):
    rec.push("fwd", 0, 0)
    rec.pop()


def _boundary_other_op(rec):
    blocking(rec, "broadcast", "world", WORLD, 64, "int64", peer=0)


def _boundary_iteration(rec):
    rec.iteration_end()


@pytest.mark.parametrize(("between", "blocking_wait"), [
    (_boundary_annotation, False), (_boundary_other_op, False), (_boundary_iteration, False),
    (_boundary_annotation, True), (_boundary_other_op, True),   # a blocking wait that is no longer adjacent
    (None, False),                                              # work.wait() from user code right away
])
def test_async_op_gets_a_wait_node_referring_to_it(between, blocking_wait):
    rec = Recorder(0)
    idx = start(rec, "allreduce", "world", WORLD, 1024)
    if between is not None:
        between(rec)
    n_before = len(rec.rows)
    finish(rec, idx, blocking=blocking_wait)
    cols = rec.columns()
    waits = np.nonzero(cols["kind"] == WAIT)[0]
    assert len(waits) == 1
    w = int(waits[0])
    assert w == n_before + 1 and cols["kind"][w - 1] == COMPUTE   # the compute before the wait is closed
    assert cols["ref"][w] == idx
    assert cols["kind"][idx] == COMM and cols["async_"][idx] == 1
    assert cols["op"][w] == OP_CODE["allreduce"] and cols["group"][w] == cols["group"][idx]
    assert cols["t_start"][w] <= cols["t_end"][w]
    assert cols["t_end"][idx] <= cols["t_end"][w]
    # every other comm node (the blocking broadcast) stays inline
    others = np.nonzero((cols["kind"] == COMM) & (np.arange(len(cols["kind"])) != idx))[0]
    assert all(cols["async_"][o] == 0 for o in others)


def test_labels_mb_chunk_and_steps():
    rec = Recorder(0)
    rec.push("fwd", 3, 1)                 # closes the unlabelled start
    rec.push("attn", 3, 2)                # nested: closes a "fwd" node
    idx = blocking(rec, "allreduce", "world", WORLD, 16)   # closes an "attn" node; the op is labelled too
    rec.pop()                             # closes an "attn" node
    rec.pop()                             # closes a "fwd" node
    rec.iteration_end()                   # closes an unlabelled node of step 0
    rec.push("optim", -1, -1)
    rec.pop()
    rec.iteration_end()
    cols = rec.columns()
    labels = rec.tables()["labels"]
    got = [(int(k), labels[l], int(m), int(c), int(s)) for k, l, m, c, s in
           zip(cols["kind"], cols["label"], cols["mb"], cols["chunk"], cols["step"])]
    assert got == [
        (COMPUTE, "", -1, -1, 0),
        (COMPUTE, "fwd", 3, 1, 0),
        (COMPUTE, "attn", 3, 2, 0),
        (COMM, "attn", 3, 2, 0),
        (COMPUTE, "attn", 3, 2, 0),
        (COMPUTE, "fwd", 3, 1, 0),
        (COMPUTE, "", -1, -1, 0),
        (COMPUTE, "", -1, -1, 1),
        (COMPUTE, "optim", -1, -1, 1),
        (COMPUTE, "", -1, -1, 1),
        (COMPUTE, "", -1, -1, 2),
    ]
    assert idx == 3
    assert rec.step == 2 and rec.step_peaks == [None, None]
    assert labels == ["", "fwd", "attn", "optim"]


def test_iteration_end_reads_and_resets_peak_memory():
    rec = Recorder(0)
    rec.memory = FakeMemory([111, 222, 333])
    rec.iteration_end()
    rec.iteration_end()
    assert rec.step_peaks == [111, 222] and rec.memory.resets == 2


def test_live_bytes_are_sampled_at_every_compute_nodes_end(tmp_path):
    import numpy as np

    rec = Recorder(0)
    rec.memory = FakeMemory([10, 20, 30])
    blocking(rec, "allreduce", "world", WORLD, 8)     # closes a compute node first
    rec.iteration_end()
    blocking(rec, "allreduce", "world", WORLD, 8)
    rec.iteration_end()
    with np.load(rec.write_part(tmp_path)) as part:
        compute = np.nonzero(part["kind"] == 0)[0]
        assert part["live_node"].tolist() == compute.tolist()
        assert part["live_bytes"].tolist() == [10, 10, 20, 20, 30]
    plain = Recorder(1)                                 # no memory counter: no samples, same file layout
    with np.load(plain.write_part(tmp_path)) as part:
        assert part["live_node"].size == 0 and part["live_bytes"].size == 0


def test_wire_stamps_are_kept_per_comm_node_and_read_back(tmp_path):
    from prism_core.calibrate.durations import _issue_cost
    from prism_core.trace.store import read_wire

    rec = Recorder(0)
    first = rec.issue("allreduce", "world", WORLD, -1, 8, "float32")
    rec.issued(first)
    waited = rec.wait_begin(first, blocking=True)
    time.sleep(0.002)                                        # each op takes longer than its issue cost
    rec.wait_end(first, *waited)
    second = rec.issue("broadcast", "world", WORLD, 0, 8, "float32")
    rec.on_wire(second, rec.rows[second][-2] + 5e-6)        # a thread's stamp may land after the next op's
    rec.issued(second)
    rec.on_wire(first, rec.rows[first][-2] + 2e-6)
    waited = rec.wait_begin(second, blocking=True)
    time.sleep(0.002)
    rec.wait_end(second, *waited)
    part = rec.write_part(tmp_path)
    nodes, when = read_wire(part)
    assert nodes.tolist() == [first, second]                 # in node order
    cols = rec.columns()
    cost = _issue_cost(part, cols["t_start"], cols["t_end"], cols["kind"])
    # stamps are float64 seconds of a clock at 10^4-10^5 s since boot here: a few 1e-12 s apart at best
    assert cost[first] == pytest.approx(2e-6, abs=1e-9) and cost[second] == pytest.approx(5e-6, abs=1e-9)
    assert np.all(cost[cols["kind"] != COMM] == 0)
    assert read_wire(Recorder(1).write_part(tmp_path))[0].size == 0     # no op: nothing noted


def test_seq_counts_per_group_for_collectives():
    rec = Recorder(0)
    tp = (0, 1)
    seqs = []
    for op, name, ranks in [("allreduce", "world", WORLD), ("allgather", "tp", tp), ("broadcast", "world", WORLD),
                            ("allreduce", "tp", tp), ("barrier", "world", WORLD)]:
        idx = blocking(rec, op, name, ranks, 8)
        seqs.append((name, rec.rows[idx][6]))
    assert seqs == [("world", 0), ("tp", 0), ("world", 1), ("tp", 1), ("world", 2)]
    assert rec.tables()["group_order"] == ["world", "tp"]


def test_seq_counts_per_group_src_dst_tag_for_p2p():
    rec = Recorder(0)
    ids = [
        send(rec, 1, 8, tag=0, ranks=WORLD),   # (0,1,0) #0
        send(rec, 1, 8, tag=0, ranks=WORLD),   # (0,1,0) #1
        send(rec, 1, 8, tag=5, ranks=WORLD),   # (0,1,5) #0
        send(rec, 2, 8, tag=0, ranks=WORLD),   # (0,2,0) #0
        recv(rec, 1, 8, tag=0, ranks=WORLD),   # (1,0,0) #0: the other direction counts separately
        send(rec, 1, 8, tag=0, group="pp", ranks=(0, 1)),   # other group #0
        send(rec, 1, 8, tag=0, ranks=WORLD),   # (0,1,0) #2
    ]
    assert [rec.rows[i][6] for i in ids] == [0, 1, 0, 0, 0, 0, 2]
    assert [rec.rows[i][3] for i in ids] == [1, 1, 1, 2, 1, 1, 1]   # peer
    assert [rec.rows[i][7] for i in ids] == [0, 0, 5, 0, 0, 0, 0]   # tag
    # p2p traffic does not advance the group's collective count
    idx = blocking(rec, "allreduce", "world", WORLD, 8)
    assert rec.rows[idx][6] == 0


def test_annotate_without_sink_is_a_shared_noop(no_sink):
    a = prism_core.annotate("fwd")
    b = prism_core.annotate("bwd", mb=1, chunk=2)
    assert a is b is annotations._NOOP
    with a as value:
        assert value is None
    with prism_core.annotate("x"):
        with prism_core.annotate("y"):
            pass


def test_annotate_with_sink_records(no_sink):
    rec = Recorder(0)
    annotations.set_sink(rec)
    try:
        with prism_core.annotate("fwd", mb=2, chunk=1):
            blocking(rec, "allreduce", "world", WORLD, 8)
        with pytest.raises(KeyError):
            with prism_core.annotate("bwd"):
                raise KeyError("boom")
    finally:
        annotations.set_sink(None)
    assert rec._stack == []                 # the failing block still popped
    cols = rec.columns()
    labels = rec.tables()["labels"]
    got = [(int(k), labels[l], int(m), int(c)) for k, l, m, c in
           zip(cols["kind"], cols["label"], cols["mb"], cols["chunk"])]
    assert got == [
        (COMPUTE, "", -1, -1),
        (COMPUTE, "fwd", 2, 1),
        (COMM, "fwd", 2, 1),
        (COMPUTE, "fwd", 2, 1),
        (COMPUTE, "", -1, -1),
        (COMPUTE, "bwd", -1, -1),
        (COMPUTE, "", -1, -1),
    ]
    assert prism_core.annotate("after") is annotations._NOOP


class _ScriptedDelay:
    """Stands in for the thread's run delay: the test sets how long it has waited so far."""

    def __init__(self):
        self.ns = 0

    def read(self) -> int:
        return self.ns


def test_waits_for_the_core_are_noted_per_compute_node_and_not_within_ops(tmp_path):
    rec = Recorder(0)
    rec._delay, rec._delay_mark = _ScriptedDelay(), 0
    rec._own, rec._own_mark = _ScriptedDelay(), 0
    rec._helper, rec._helper_mark = _ScriptedDelay(), 0
    rec._delay.ns = 30_000_000                   # waited 30 ms within the first compute node
    rec._own.ns = 12_000_000                     # the rank's other threads ran 12 ms of it
    rec._helper.ns = 15_000_000                  # and the assistant 15
    idx = rec.issue("allreduce", "world", WORLD, -1, 64, "float32")
    rec._delay.ns = 40_000_000                   # 10 ms within the issue call: the op's, not compute's
    rec._own.ns, rec._helper.ns = 20_000_000, 40_000_000
    rec.issued(idx)
    inline, began = rec.wait_begin(idx, blocking=True)
    rec._delay.ns = 45_000_000                   # 5 ms within the wait
    rec.wait_end(idx, inline, began)
    rec.push("fwd", 0, 0)                        # a compute node without any wait: nothing noted
    rec._delay.ns = 65_000_000                   # 20 ms within the labelled compute
    rec._own.ns = 21_000_000                     # 1 ms of other threads' within it
    rec._helper.ns = 44_000_000                  # 4 ms of the assistant's
    rec.pop()
    assert rec.queued == [(0, 30_000_000, 12_000_000, 15_000_000), (3, 20_000_000, 1_000_000, 4_000_000)]
    assert [rec.rows[n][0] for n, *_ in rec.queued] == [COMPUTE, COMPUTE]
    with np.load(rec.write_part(tmp_path)) as part:
        assert part["queued_node"].tolist() == [0, 3]
        assert part["queued_s"] == pytest.approx([0.03, 0.02])
        assert part["queued_own_s"] == pytest.approx([0.012, 0.001])
        assert part["queued_helper_s"] == pytest.approx([0.015, 0.004])


def test_a_recorder_without_the_figure_notes_nothing(tmp_path):
    rec = Recorder(0)
    rec._delay = None
    blocking(rec, "allreduce", "world", WORLD, 64)
    assert rec.queued == []
    with np.load(rec.write_part(tmp_path)) as part:
        assert len(part["queued_node"]) == 0


def test_each_compute_node_notes_the_cpu_time_its_thread_ran_and_none_of_the_ops(tmp_path, monkeypatch):
    clock = {"ns": 0}
    monkeypatch.setattr(recorder_module, "_thread_cpu", lambda: clock["ns"])
    rec = Recorder(0)
    rec._delay = None
    clock["ns"] = 7_000_000                      # 7 ms of CPU within the first compute node
    idx = rec.issue("allreduce", "world", WORLD, -1, 64, "float32")
    clock["ns"] = 9_000_000                      # 2 ms within the issue call: the op's
    rec.issued(idx)
    inline, began = rec.wait_begin(idx, blocking=True)
    clock["ns"] = 10_000_000                     # 1 ms within the wait
    rec.wait_end(idx, inline, began)
    clock["ns"] = 13_000_000                     # 3 ms within the compute after it
    rec.push("fwd", 0, 0)
    rec.pop()                                    # an empty labelled node: none
    assert [rec.rows[n][0] for n, _ in rec.oncpu] == [COMPUTE] * len(rec.oncpu)
    with np.load(rec.write_part(tmp_path)) as part:
        by_node = dict(zip(part["oncpu_node"].tolist(), part["oncpu_s"].tolist()))
    assert by_node[0] == pytest.approx(0.007)
    assert sorted(by_node.values())[-2:] == pytest.approx([0.003, 0.007])
    assert sum(by_node.values()) == pytest.approx(0.010)      # the op's and the wait's 3 ms are in none
