"""Property and pinned-example tests of prism_core.topology against a brute-force enumeration."""

from __future__ import annotations

from collections import defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prism_core.topology import GROUP_KINDS, Topology

SETTINGS = settings(max_examples=60, deadline=None)
KINDS = ("tp", "pp", "dp", "ep", "expert_dp")


@st.composite
def topologies(draw) -> Topology:
    tp = draw(st.integers(1, 6))
    pp = draw(st.integers(1, 6))
    dp = draw(st.integers(1, 6))
    ep = draw(st.sampled_from([e for e in range(1, dp + 1) if dp % e == 0]))
    return Topology(tp=tp, pp=pp, dp=dp, ep=ep)


def _coords(t: Topology, rank: int) -> dict[str, int]:
    """Coordinates found by searching, not by inverting the formula, so the test is independent of coord()."""
    for pp_i in range(t.pp):
        for dp_i in range(t.dp):
            for tp_i in range(t.tp):
                if tp_i + t.tp * (dp_i + t.dp * pp_i) == rank:
                    for edp_i in range(t.dp // t.ep):
                        for ep_i in range(t.ep):
                            if ep_i + t.ep * edp_i == dp_i:
                                return {"tp": tp_i, "dp": dp_i, "pp": pp_i, "ep": ep_i, "edp": edp_i}
    raise AssertionError(f"no coordinates for rank {rank}")


# kind -> (coordinates held fixed within a group, the coordinate that varies along it)
FIXED_AND_VARYING = {
    "tp": (("dp", "pp"), "tp"),
    "dp": (("tp", "pp"), "dp"),
    "pp": (("tp", "dp"), "pp"),
    "ep": (("tp", "edp", "pp"), "ep"),
    "expert_dp": (("tp", "ep", "pp"), "edp"),
}


def _brute_force(t: Topology, kind: str) -> set[frozenset[int]]:
    fixed, _ = FIXED_AND_VARYING[kind]
    buckets: dict[tuple[int, ...], set[int]] = defaultdict(set)
    for rank in range(t.tp * t.pp * t.dp):
        c = _coords(t, rank)
        buckets[tuple(c[f] for f in fixed)].add(rank)
    return {frozenset(b) for b in buckets.values()}


def _expected_size(t: Topology, kind: str) -> int:
    return {"tp": t.tp, "pp": t.pp, "dp": t.dp, "ep": t.ep, "expert_dp": t.dp // t.ep}[kind]


@SETTINGS
@given(topologies())
def test_each_kind_partitions_the_world(t: Topology) -> None:
    world = t.tp * t.pp * t.dp
    assert t.world_size == world
    for kind in KINDS:
        groups = t.groups(kind)
        size = _expected_size(t, kind)
        assert all(len(g) == size for g in groups), (kind, groups)
        flat = [r for g in groups for r in g]
        assert sorted(flat) == list(range(world)), kind  # each rank exactly once
        assert len(groups) == world // size


@SETTINGS
@given(topologies())
def test_groups_match_brute_force(t: Topology) -> None:
    for kind in KINDS:
        groups = t.groups(kind)
        assert {frozenset(g) for g in groups} == _brute_force(t, kind), kind
        _, varying = FIXED_AND_VARYING[kind]
        for g in groups:
            along = [_coords(t, r)[varying] for r in g]
            assert along == list(range(len(g))), (kind, g, along)


@SETTINGS
@given(topologies())
def test_embedding_groups(t: Topology) -> None:
    emb = t.groups("embedding")
    if t.pp == 1:
        assert emb == ()
        assert all(t.group_of("embedding", r) is None for r in range(t.world_size))
    else:
        assert list(emb) == [(g[0], g[-1]) for g in t.groups("pp")]
        for g in emb:
            assert _coords(t, g[0])["pp"] == 0 and _coords(t, g[1])["pp"] == t.pp - 1
        members = {r for g in emb for r in g}
        assert members == {r for r in range(t.world_size) if _coords(t, r)["pp"] in (0, t.pp - 1)}


@SETTINGS
@given(topologies())
def test_coord_and_rank_of_round_trip(t: Topology) -> None:
    for rank in range(t.world_size):
        c = t.coord(rank)
        expected = _coords(t, rank)
        assert c.rank == rank
        assert (c.tp, c.dp, c.pp, c.ep, c.edp) == tuple(expected[k] for k in ("tp", "dp", "pp", "ep", "edp"))
        assert t.rank_of(c.tp, c.dp, c.pp) == rank


@SETTINGS
@given(topologies())
def test_dp_equivalence_classes_and_replicas(t: Topology) -> None:
    classes = t.dp_equivalence_classes()
    assert classes == t.groups("dp")
    assert len(classes) == t.tp * t.pp
    seen: set[int] = set()
    for d in range(t.dp):
        replica = t.replica_ranks(d)
        assert len(replica) == t.tp * t.pp
        assert all(t.coord(r).dp == d for r in replica)
        for cls in classes:
            assert len(set(cls) & set(replica)) == 1, (d, cls, replica)
        seen |= set(replica)
    assert seen == set(range(t.world_size))
    assert t.replica_ranks() == t.replica_ranks(0)


@SETTINGS
@given(topologies(), st.data())
def test_group_of_returns_containing_group(t: Topology, data) -> None:
    rank = data.draw(st.integers(0, t.world_size - 1))
    for kind in KINDS:
        g = t.group_of(kind, rank)
        assert g is not None and rank in g and g in t.groups(kind), kind
    emb = t.group_of("embedding", rank)
    if emb is not None:
        assert rank in emb and emb in t.groups("embedding")


@pytest.mark.parametrize("tp, pp, dp, ep", [(1, 1, 4, 3), (2, 2, 6, 4), (1, 1, 1, 2)])
def test_ep_not_dividing_dp_rejected(tp: int, pp: int, dp: int, ep: int) -> None:
    with pytest.raises(ValueError, match="ep"):
        Topology(tp=tp, pp=pp, dp=dp, ep=ep)


@pytest.mark.parametrize("field", ["tp", "pp", "dp", "ep"])
@pytest.mark.parametrize("value", [0, -1])
def test_non_positive_sizes_rejected(field: str, value: int) -> None:
    kwargs = {"tp": 1, "pp": 1, "dp": 1, "ep": 1, field: value}
    with pytest.raises(ValueError, match=field):
        Topology(**kwargs)


@pytest.mark.parametrize("rank", [-1, 16, 100])
def test_rank_outside_world_rejected(rank: int) -> None:
    with pytest.raises(ValueError, match="outside"):
        Topology(tp=2, pp=2, dp=4, ep=2).coord(rank)


def test_unknown_group_kind_rejected() -> None:
    assert "embedding" in GROUP_KINDS
    with pytest.raises(ValueError, match="unknown group kind"):
        Topology(tp=1, pp=1, dp=1).groups("cp")


def test_pinned_tp2_pp2_dp4_ep2() -> None:
    t = Topology(tp=2, pp=2, dp=4, ep=2)
    assert t.world_size == 16 and t.edp == 2
    c = t.coord(5)  # 5 = 1 + 2·(2 + 4·0)
    assert (c.tp, c.dp, c.pp, c.ep, c.edp) == (1, 2, 0, 0, 1)
    assert t.group_of("tp", 5) == (4, 5)
    assert t.group_of("dp", 5) == (1, 3, 5, 7)
    assert t.group_of("pp", 5) == (5, 13)
    assert t.group_of("ep", 5) == (5, 7)
    assert t.group_of("expert_dp", 5) == (1, 5)
    assert t.group_of("embedding", 5) == (5, 13)
    assert set(t.groups("tp")) == {(0, 1), (2, 3), (4, 5), (6, 7), (8, 9), (10, 11), (12, 13), (14, 15)}
    assert set(t.groups("ep")) == {(0, 2), (1, 3), (4, 6), (5, 7), (8, 10), (9, 11), (12, 14), (13, 15)}
    assert set(t.groups("expert_dp")) == {(0, 4), (1, 5), (2, 6), (3, 7), (8, 12), (9, 13), (10, 14), (11, 15)}
    assert sorted(t.replica_ranks(3)) == [6, 7, 14, 15]


def test_pinned_tp1_pp4_dp2_ep1() -> None:
    t = Topology(tp=1, pp=4, dp=2)
    assert set(t.groups("pp")) == {(0, 2, 4, 6), (1, 3, 5, 7)}
    assert set(t.groups("embedding")) == {(0, 6), (1, 7)}
    assert t.group_of("embedding", 2) is None
    assert set(t.groups("ep")) == {(r,) for r in range(8)}
    assert set(t.groups("expert_dp")) == set(t.groups("dp")) == {(0, 1), (2, 3), (4, 5), (6, 7)}


def test_pinned_tp1_pp1_dp6_ep3() -> None:
    t = Topology(tp=1, pp=1, dp=6, ep=3)
    assert set(t.groups("ep")) == {(0, 1, 2), (3, 4, 5)}
    assert set(t.groups("expert_dp")) == {(0, 3), (1, 4), (2, 5)}
    assert t.groups("embedding") == ()
    assert t.coord(4).ep == 1 and t.coord(4).edp == 1
