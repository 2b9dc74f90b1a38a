"""Some nodes' rows of a calibrated timeline, read where they lie in the file: the same values as
reading it whole, and an error naming the file for a timeline of another graph."""

from __future__ import annotations

import numpy as np
import pytest

from prism_core.calibrate.timeline_rows import read_rows, runs

PER_NODE = ("span", "transfer", "kind")


def _timeline(path, n: int, compressed: bool = False):
    rng = np.random.default_rng(3)
    arrays = {"span": rng.random(n), "transfer": rng.random(n), "kind": rng.integers(0, 3, n).astype(np.int8),
              "offsets": np.array([0, n // 3, n], dtype=np.int64), "timed_pass": np.bool_(True)}
    (np.savez_compressed if compressed else np.savez)(path, **arrays)
    return arrays


def test_runs_of_consecutive_nodes():
    assert runs(np.array([0, 1, 2, 7, 9, 10])) == [(0, 3), (7, 8), (9, 11)]
    assert runs(np.zeros(0, np.int64)) == []


@pytest.mark.parametrize("compressed", [False, True])
def test_the_rows_read_are_those_of_the_whole_file(tmp_path, compressed):
    n = 1000
    path = tmp_path / "timeline.npz"
    whole = _timeline(path, n, compressed)
    nodes = np.concatenate([np.arange(0, 5), np.arange(400, 480), [999]])
    got = read_rows(path, nodes, n, (*PER_NODE, "absent"), whole=("timed_pass",))
    assert set(got) == {*PER_NODE, "timed_pass"}        # only what was asked for, of what the file holds
    for name in PER_NODE:
        assert got[name].dtype == whole[name].dtype and np.array_equal(got[name], whole[name][nodes]), name
    assert bool(got["timed_pass"])
    assert len(read_rows(path, nodes[:0], n, PER_NODE)["span"]) == 0


@pytest.mark.parametrize("compressed", [False, True])
def test_a_timeline_of_another_graph_is_refused_naming_the_file(tmp_path, compressed):
    path = tmp_path / "timeline.npz"
    _timeline(path, 1000, compressed)
    # even where the graph's hosted nodes are as many as the timeline's nodes
    with pytest.raises(ValueError, match="span.npy holds \\(1000,\\) values, not one per node of a 2000-node graph"):
        read_rows(path, np.arange(1000), 2000, ("span",))
    with pytest.raises(ValueError, match=str(path)):
        read_rows(path, np.arange(3), 999, ("span",))
    (tmp_path / "torn.npz").write_bytes(path.read_bytes()[:100])
    with pytest.raises(ValueError, match=str(tmp_path / "torn.npz")):
        read_rows(tmp_path / "torn.npz", np.arange(3), 1000, ("span",))
