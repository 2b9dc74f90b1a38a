"""A pruned group's gloo layer holds only its kept members, answering by the group's positions."""

from __future__ import annotations

import datetime
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

from prism_core.backend.compact import (
    READY_KEY, CompactGloo, PrunedGroupError, existing_positions, layer, members_key, named_members_key, publish,
)
from prism_core.backend.install import group_name_key

TIMEOUT = datetime.timedelta(seconds=10)


def test_keys_name_a_rank_set_in_any_order_and_its_nth_group():
    assert members_key([3, 1, 2], 0) == members_key((1, 2, 3), 0) != members_key([1, 2, 3], 1)
    assert members_key([1, 2], 0) != members_key([1, 2, 3], 0)
    assert named_members_key("3") != named_members_key("4")
    assert group_name_key([1, 2, 3], 0).startswith("prism/group_name/3/")    # the names' keys, as before


def test_a_sandbox_rank_reads_the_positions_kept_and_none_for_a_whole_group():
    store = dist.HashStore()
    world, tp = list(range(16)), [4, 5]
    assert publish(store, [("0", world, 0, [0, 1, 7, 8, 9]), ("1", tp, 0, [0, 1]),
                           ("2", world, 1, list(range(16)))]) == 1
    assert existing_positions(store, "0", world, 0, TIMEOUT) == [0, 1, 7, 8, 9]
    assert existing_positions(store, "0", list(reversed(world)), 0, TIMEOUT) == [0, 1, 7, 8, 9]
    assert existing_positions(store, "1", tp, 0, TIMEOUT) is None            # nothing left out: whole
    assert existing_positions(store, "2", world, 1, TIMEOUT) is None         # the second group of the set
    assert store.get(READY_KEY) == b"1"


def test_a_named_group_is_found_by_its_name_and_an_expanded_one_by_its_rank_set():
    store = dist.HashStore()
    dp = [2, 6, 10, 14]
    publish(store, [("5", list(range(16)), 1, [0, 1, 15]), (None, dp, 0, [0, 1])])
    # the program made an unused group of the same rank set first ("4", absent from the graph):
    # its nth is off by one, but the name finds the group the graph holds, and the unused one is whole
    assert existing_positions(store, "5", list(range(16)), 2, TIMEOUT) == [0, 1, 15]
    assert existing_positions(store, "4", list(range(16)), 1, TIMEOUT) is None
    # a DP-expanded group: its c10d name is the program's own, its rank set and nth find it
    assert existing_positions(store, "9", dp, 0, TIMEOUT) == [0, 1]


def test_a_sandbox_rank_waits_for_the_assistant_to_say():
    with pytest.raises(TimeoutError, match="group '3' of 3 ranks: the replay assistant did not say"):
        existing_positions(dist.HashStore(), "3", [0, 1, 2], 0, datetime.timedelta(milliseconds=200))


def test_a_layer_refuses_a_position_the_assistant_does_not_keep():
    with pytest.raises(ValueError, match="position 4 is not among the 3 positions"):
        layer(dist.HashStore(), 4, [0, 1, 7], TIMEOUT)


def _compact_pair(positions: list[int]) -> list[CompactGloo]:
    """Two members of a larger group, at `positions`, each with a gloo layer of the two only."""
    store = dist.PrefixStore("compact/", dist.HashStore())

    def make(at: int) -> CompactGloo:
        return CompactGloo(dist.ProcessGroupGloo(store, at, 2, TIMEOUT), positions)
    with ThreadPoolExecutor(max_workers=2) as pool:      # gloo's constructor waits for its peer
        return list(pool.map(make, range(2)))


def test_sends_and_receives_go_by_the_larger_groups_positions():
    low, high = _compact_pair([3, 11])
    assert low.gloo.size() == high.gloo.size() == 2
    sent = torch.arange(6, dtype=torch.float32)
    got = torch.zeros(6)
    work = low.send([sent], 11, 7)
    high.recv([got], 3, 7).wait()
    work.wait()
    assert torch.equal(got, sent)
    back = torch.zeros(6)
    work = high.send([got * 2], 3, 8)
    low.recv([back], 11, 8).wait()
    work.wait()
    assert torch.equal(back, sent * 2)


def test_a_position_not_kept_and_gloos_own_collectives_are_refused():
    low, _ = _compact_pair([0, 5])
    with pytest.raises(ValueError, match="position 4 .* does not exist"):
        low.send([torch.zeros(1)], 4, 0)
    with pytest.raises(PrunedGroupError, match="allreduce: .* point-to-point only"):
        low.allreduce([torch.zeros(1)])
    assert not hasattr(low, "broadcast")
