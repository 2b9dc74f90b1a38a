"""Which virtual ranks a replay hosting the sandbox's neighbours runs, found from the sandbox ranks'
own nodes, and the graph it reads for them: those ranks' rows only."""

from __future__ import annotations

import numpy as np
import pytest

from prism_core.replay.hosted import load_for_replay, needed_positions, neighbour_ranks
from prism_core.replay.ring import ring_neighbours
from prism_core.replay.tree import tree_neighbours
from prism_core.trace import Trace, load_trace, write_trace
from prism_core.trace.schema import COLUMNS, COMM, COMPUTE, OP_CODE, REDUCE_CODE


def _graph(world: int, groups: list[tuple[int, ...]], ops: list[tuple]) -> Trace:
    """Every rank: a compute node, then each op of `ops` its group holds it in, each followed by a
    compute node. An op: (name, group index, bytes, root or p2p peers {rank: peer})."""
    rows: list[list[dict]] = [[] for _ in range(world)]
    seq: dict[tuple, int] = {}
    for r in range(world):
        rows[r].append({"kind": COMPUTE})
        for name, g, nbytes, extra in ops:
            if r not in groups[g]:
                continue
            if name in ("send", "recv"):
                if r not in extra:
                    continue
                peer = extra[r]
                key = (g, min(r, peer), max(r, peer))
            else:
                peer = extra if extra is not None else -1
                key = (g,)
            n = seq.get((r, *key), 0)
            seq[(r, *key)] = n + 1
            rows[r].append({"kind": COMM, "op": OP_CODE[name], "group": g, "peer": peer, "bytes": nbytes,
                            "dtype": 1, "seq": n, "reduce": REDUCE_CODE["sum"] if "reduce" in name else 0})
            rows[r].append({"kind": COMPUTE})
    flat = [row for rank in rows for row in rank]
    columns = {name: np.zeros(len(flat), dtype=dtype) for name, dtype in COLUMNS.items()}
    for name in ("group", "peer", "ref", "tag", "mb", "chunk"):
        columns[name][:] = -1
    for i, row in enumerate(flat):
        for name, value in row.items():
            columns[name][i] = value
    offsets = np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(np.int64)
    return Trace(world_size=world, columns=columns, offsets=offsets, groups=groups,
                 group_names=[str(g) for g in range(len(groups))], labels=[""], dtypes=["", "float32"],
                 step_peaks=[[100 + r] for r in range(world)])


def test_a_pruned_groups_needed_positions_are_its_algorithms_neighbours():
    sandbox = frozenset({0, 9})
    assert needed_positions(16, sandbox, False, False, True, (), ()) == set(range(16)) - sandbox
    assert needed_positions(16, sandbox, True, False, True, (), ()) == ring_neighbours(16, set(sandbox))
    assert needed_positions(16, sandbox, True, False, False, (3,), (12,)) == tree_neighbours(16, 3, set(sandbox)) | {12}
    assert needed_positions(16, sandbox, True, False, False, (), ()) == set()


def test_the_sandbox_ranks_neighbours_are_found_from_their_own_nodes(tmp_path):
    world = 16
    groups = [tuple(range(world)), tuple(range(0, world, 2)), tuple(range(1, world, 2)), (4, 5, 6, 7)]
    ops = [("allreduce", 0, 4 * 64, None),             # a ring over the world: 64 floats, 16 ranks
           ("allreduce", 1, 4 * 64, None),             # a ring over the even ranks
           ("allreduce", 2, 4 * 64, None),             # over the odd ranks: no sandbox rank, no neighbour
           ("broadcast", 0, 4 * 8, 0),                 # a tree from rank 0
           ("send", 3, 64, {4: 5}), ("recv", 3, 64, {5: 4})]
    trace = _graph(world, groups, ops)
    sandbox = {6, 10}
    mine = load_trace(write_trace(trace, tmp_path / "trace.zarr"), ranks=sandbox)
    expected = {5, 7, 9, 11}                                    # the world ring's
    expected |= {4, 8, 12}                                      # the even ranks' ring's
    expected |= tree_neighbours(world, 0, {6, 10})              # rank 0's broadcast tree's
    assert neighbour_ranks(mine, sandbox) == expected
    # a group whose ops the replay does not prune (an all-to-all) needs every member
    alltoall = _graph(world, groups, [*ops, ("all_to_all_single", 3, 64, None)])
    mine = load_trace(write_trace(alltoall, tmp_path / "a2a.zarr"), ranks=sandbox)
    assert neighbour_ranks(mine, sandbox) == expected | {4, 5, 7}


def test_a_replay_of_the_neighbours_reads_only_their_rows(tmp_path):
    world = 16
    trace = _graph(world, [tuple(range(world))], [("allreduce", 0, 4 * 64, None)])
    path = write_trace(trace, tmp_path / "trace.zarr")
    whole = load_for_replay(path, ["op", "group"], {3}, "all")
    assert whole.node_index is None and np.array_equal(whole.offsets, trace.offsets)
    near = load_for_replay(path, ["op", "group"], {3}, "neighbours")
    assert [r for r in range(world) if near.num_nodes(r)] == [2, 3, 4]
    assert near.world_size == world and near.groups == trace.groups
    for name in ("kind", "op", "group"):
        assert np.array_equal(near.columns[name], trace.columns[name][near.node_index]), name
    for r in (2, 3, 4):
        assert np.array_equal(near.node_index[near.rank_slice(r)], np.arange(trace.offsets[r], trace.offsets[r + 1]))
    assert near.step_peaks[3] == [103] and near.step_peaks[8] == []
    with pytest.raises(ValueError, match="virtual ranks 'some'"):
        load_for_replay(path, ["op"], {3}, "some")


@pytest.mark.parametrize("world", [2, 3])
def test_where_every_virtual_rank_is_a_neighbour_the_neighbours_replay_reads_the_whole_graph(tmp_path, world):
    trace = _graph(world, [tuple(range(world))], [("allreduce", 0, 4 * 64, None)])
    path = write_trace(trace, tmp_path / "trace.zarr")
    near = load_for_replay(path, ["op", "group"], {0}, "neighbours")
    assert near.node_index is None and np.array_equal(near.offsets, trace.offsets)
    assert np.array_equal(near.columns["op"], trace.columns["op"])
    # a fourth rank is no ring neighbour of rank 0's: then only the neighbours' rows
    four = write_trace(_graph(4, [tuple(range(4))], [("allreduce", 0, 4 * 64, None)]), tmp_path / "four.zarr")
    assert load_for_replay(four, ["op"], {0}, "neighbours").node_index is not None
