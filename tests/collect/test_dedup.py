"""DP dedup: the renaming respects every group kind, and one replica expanded equals the real run."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prism_core.collect.dedup import expand_replica_with_groups, rank_map, replica_source
from prism_core.config import load_config
from prism_core.record import RecordOptions, record
from prism_core.topology import GROUP_KINDS, Topology
from prism_core.trace import load_trace, problems, structural_diff

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@st.composite
def topologies(draw):
    tp, pp = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    ep = draw(st.integers(1, 3))
    dp = ep * draw(st.integers(1, 3))
    return Topology(tp=tp, pp=pp, dp=dp, ep=ep)


@settings(max_examples=60, deadline=None)
@given(topologies(), st.data())
def test_rank_map_is_a_permutation_that_maps_groups_onto_groups(topo, data):
    replica = data.draw(st.integers(0, topo.dp - 1))
    image = rank_map(topo, replica)
    assert sorted(image.tolist()) == list(range(topo.world_size))
    assert set(int(image[r]) for r in topo.replica_ranks(0)) == set(topo.replica_ranks(replica))
    for kind in GROUP_KINDS:
        groups = {frozenset(g) for g in topo.groups(kind)}
        assert {frozenset(int(image[r]) for r in g) for g in groups} == groups, kind


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", [
    ["job.world_size=4", "parallel.dp=2", "parallel.microbatches=4"],                       # pp2 x dp2
    ["job.world_size=4", "parallel.pp=1", "parallel.tp=2", "parallel.dp=2", "parallel.microbatches=2"],  # tp2 x dp2
])
def test_one_replica_expanded_equals_the_real_run(tmp_path, layout):
    cfg = load_config(CONFIGS / "tiny_moe_w2_pp2.yaml", layout + ["job.iterations=3"])
    record(cfg, tmp_path, options=RecordOptions(memory=False, echo=False))
    real = load_trace(tmp_path / "trace.zarr")
    topo = Topology.from_config(cfg)
    expanded, group_source = expand_replica_with_groups(real, topo)
    assert problems(expanded) == []
    assert structural_diff(real, expanded) is None
    # every copied node's group copies the group of its source rank's node at the same place, the
    # one whose cache entry it replays (a replay that holds only some ranks' rows finds it by this)
    source = replica_source(topo)
    copied = 0
    for t in range(topo.world_size):
        mine = expanded.columns["group"][expanded.rank_slice(t)]
        theirs = real.columns["group"][real.rank_slice(int(source[t]))]
        on = mine >= 0
        assert np.array_equal(group_source[mine[on]], theirs[on]), t
        copied += int(on.sum()) if source[t] != t else 0
    assert copied > 0
