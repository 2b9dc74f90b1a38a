"""Structural hash and diff: timing and name-table order do not count, structure does."""

from __future__ import annotations

import copy

import numpy as np

from prism_core.trace import load_trace, rank_hashes, structural_diff, write_trace
from prism_core.trace.schema import COMM
from prism_core.trace.structure import describe

from ._build import merged, reference_job


def _permute_tables(trace):
    """The same trace with its group, label and dtype tables reversed (columns renumbered)."""
    t = copy.deepcopy(trace)
    for table, col in (("groups", "group"), ("labels", "label"), ("dtypes", "dtype")):
        n = len(getattr(t, table))
        perm = np.arange(n)[::-1]            # old id -> new id
        values = t.columns[col]
        t.columns[col] = np.where(values >= 0, perm[np.maximum(values, 0)], values).astype(values.dtype)
        setattr(t, table, list(reversed(getattr(t, table))))
    t.group_names = list(reversed(t.group_names))
    return t


def _first_comm(trace, rank, op_index=0):
    s = trace.rank_slice(rank)
    return int(np.nonzero(trace.columns["kind"][s] == COMM)[0][op_index])


def test_hash_ignores_timing(tmp_path):
    a = merged(tmp_path, reference_job(4), "a")
    b = merged(tmp_path, reference_job(4), "b")
    assert not np.array_equal(a.columns["t_start"], b.columns["t_start"])
    b.columns["t_start"] = b.columns["t_start"] + 100.0
    b.columns["t_end"] = b.columns["t_end"] * 3.0
    assert rank_hashes(a) == rank_hashes(b)
    assert structural_diff(a, b) is None
    hashes = rank_hashes(a)
    assert len(hashes) == 4 and all(isinstance(h, str) and len(h) == 16 for h in hashes)
    assert hashes[0] != hashes[2]    # different programs on different ranks


def test_hash_ignores_group_registration_order(tmp_path):
    a = merged(tmp_path, reference_job(4), "a")
    b = merged(tmp_path, reference_job(4, preregister={0: ["pair0", "world"], 2: ["world", "pair2"],
                                                       3: ["world"]}), "b")
    assert a.groups != b.groups                       # the tables really differ
    assert sorted(a.groups) == sorted(b.groups)
    assert not np.array_equal(a.columns["group"], b.columns["group"])
    assert rank_hashes(a) == rank_hashes(b)
    assert structural_diff(a, b) is None


def test_hash_ignores_table_order(tmp_path):
    a = merged(tmp_path, reference_job(3))
    b = _permute_tables(a)
    assert a.labels != b.labels and a.dtypes != b.dtypes and a.groups != b.groups
    assert rank_hashes(a) == rank_hashes(b)
    assert structural_diff(a, b) is None


def test_hash_survives_the_store(tmp_path):
    a = merged(tmp_path, reference_job(3))
    assert rank_hashes(load_trace(write_trace(a, tmp_path / "t.zarr"))) == rank_hashes(a)


def test_bytes_change_the_hash(tmp_path):
    a = merged(tmp_path, reference_job(4, nbytes=4096), "a")
    b = merged(tmp_path, reference_job(4, nbytes=8192), "b")
    assert all(x != y for x, y in zip(rank_hashes(a), rank_hashes(b)))
    # one node of one rank
    c = copy.deepcopy(a)
    c.columns["bytes"][c.rank_slice(2).start + _first_comm(c, 2)] += 1
    ha, hc = rank_hashes(a), rank_hashes(c)
    assert [x == y for x, y in zip(ha, hc)] == [True, True, False, True]


def test_other_structural_changes_change_the_hash(tmp_path):
    a = merged(tmp_path, reference_job(2))
    for column, delta in (("seq", 1), ("peer", 1), ("step", 1), ("mb", 1), ("op", 1), ("tag", 1)):
        c = copy.deepcopy(a)
        c.columns[column][a.rank_slice(1).start + _first_comm(c, 1)] += delta
        assert rank_hashes(c)[1] != rank_hashes(a)[1], column
        assert rank_hashes(c)[0] == rank_hashes(a)[0], column


def test_diff_names_rank_node_and_both_ops(tmp_path):
    a = merged(tmp_path, reference_job(4, nbytes=4096), "a")
    b = copy.deepcopy(a)
    i = _first_comm(b, 2, 1)                            # rank 2's second op: the broadcast
    b.columns["bytes"][b.rank_slice(2).start + i] = 999
    diff = structural_diff(a, b)
    da, db = describe(a, 2, i), describe(b, 2, i)
    assert da.startswith("broadcast(") and "256 B int64" in da and "999 B int64" in db
    assert diff == f"rank 2 node {i} differs in bytes: {da} vs {db}"
    assert structural_diff(a, b, ranks=[0, 1, 3]) is None


def test_diff_names_the_group_by_its_ranks(tmp_path):
    a = merged(tmp_path, reference_job(4), "a")
    b = copy.deepcopy(a)
    i = _first_comm(b, 3, 0)                            # rank 3's allgather on [2, 3]
    b.columns["group"][b.rank_slice(3).start + i] = b.groups.index((0, 1, 2, 3))
    diff = structural_diff(a, b)
    assert diff.startswith(f"rank 3 node {i} differs in group: allgather(group [2, 3]")
    assert "vs allgather(group [0, 1, 2, 3]" in diff


def test_diff_reports_different_node_counts(tmp_path):
    recs = reference_job(3)
    recs[1].push("extra", 0, 0)
    recs[1].pop()
    a = merged(tmp_path, reference_job(3), "a")
    b = merged(tmp_path, recs, "b")
    n = a.num_nodes(1)
    assert b.num_nodes(1) == n + 2
    diff = structural_diff(a, b)
    assert diff == f"rank 1: {n} vs {n + 2} nodes; the first extra node is extra(mb=0, chunk=0, step=2)"
    assert structural_diff(b, a) == f"rank 1: {n + 2} vs {n} nodes; the first extra node is " \
                                    "extra(mb=0, chunk=0, step=2)"
    assert rank_hashes(a)[1] != rank_hashes(b)[1]
    assert rank_hashes(a)[0] == rank_hashes(b)[0]


def test_diff_reports_world_size(tmp_path):
    a = merged(tmp_path, reference_job(2), "a")
    b = merged(tmp_path, reference_job(3), "b")
    assert structural_diff(a, b) == "world sizes differ: 2 vs 3"
