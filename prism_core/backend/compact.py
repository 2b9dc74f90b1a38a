"""Gloo groups of only the members that exist, for groups pruned to a rank of interest's neighbours.

In an emulation (or a slice) a pruned group keeps on the wire only its sandbox ranks and the
virtual ranks next to them in its rings and trees (paper §6.3). Made as c10d makes it, its gloo
group would still have every member: gloo's TCP context builds one pair object per member, about
1.4 KiB each even when lazily connected, so the replay assistant, which makes one such group for
each virtual member it keeps, grew by some 4 KiB per rank of the job (65 MiB at W=16,384 with
three of them; bench/MEASURED.md, item 52's scale run). Here the group's gloo layer has only the
members that exist, at compact ranks 0..k-1 in group order, and the prism backend's
point-to-point links map group positions onto them; the group the program sees keeps its rank
and size.

The replay assistant knows from the graph which members exist. Before it makes any group it
publishes, for each group holding a sandbox rank that it prunes, the positions kept (`publish`),
then a ready mark; a sandbox rank making a group reads them (`existing_positions`): none
published, the group is whole. A group the graph names is published under its c10d name, the
name under which both sides' gloo layers meet, so a group the program makes but never uses
(absent from the graph) cannot take another's place. A DP-expanded group, whose c10d name the
graph cannot know, goes by its rank set and how many groups of that set the program made
before it (`rank_set_key`), which each side knows without the other.
"""

from __future__ import annotations

import datetime
import hashlib
from collections.abc import Iterable, Sequence

MEMBERS_PREFIX = "prism/members"
READY_KEY = f"{MEMBERS_PREFIX}/ready"


def rank_set_key(prefix: str, ranks: Iterable[int], nth: int) -> str:
    """`prefix` + the nth group of this rank set (a hash keeps store keys short)."""
    ranks = sorted(ranks)
    members = hashlib.sha1(",".join(map(str, ranks)).encode()).hexdigest()
    return f"{prefix}/{len(ranks)}/{members}/{nth}"


def members_key(ranks: Iterable[int], nth: int) -> str:
    """Where the kept positions of a group known only by its rank set (DP-expanded) are said."""
    return rank_set_key(MEMBERS_PREFIX, ranks, nth)


def named_members_key(name: str) -> str:
    """Where the kept positions of the group c10d names `name` are said."""
    return f"{MEMBERS_PREFIX}/name/{name}"


def publish(store, groups: Iterable[tuple[str | None, Sequence[int], int, Sequence[int]]]) -> int:
    """For each (c10d name, or None where the graph does not know it; global ranks; nth group of
    that rank set; positions kept) with some position left out, say which positions exist; then
    the ready mark. Returns how many groups were published compact."""
    published = 0
    for name, ranks, nth, positions in groups:
        if len(positions) < len(ranks):
            key = named_members_key(name) if name is not None else members_key(ranks, nth)
            store.set(key, ",".join(map(str, sorted(positions))))
            published += 1
    store.set(READY_KEY, str(published))
    return published


def existing_positions(store, name: str, ranks: Sequence[int], nth: int,
                       timeout: datetime.timedelta) -> list[int] | None:
    """The positions of group `name` (its global `ranks`, the `nth` of that rank set the program
    made) that exist, once the assistant has said; None: all of them."""
    try:
        store.wait([READY_KEY], timeout)
    except RuntimeError as err:      # c10d's DistStoreError: say who was waited for
        raise TimeoutError(f"group {name!r} of {len(ranks)} ranks: the replay assistant did not say which of its "
                           f"members exist within {timeout} (it says so once it has loaded the graph; did it "
                           f"start?): {err}") from err
    for key in (named_members_key(name), members_key(ranks, nth)):
        if store.check([key]):
            return [int(p) for p in store.get(key).decode().split(",")]
    return None


def layer(store, position: int, kept: Sequence[int], timeout: datetime.timedelta) -> CompactGloo:
    """The gloo layer of the member at group `position` of a pruned group whose existing
    positions are `kept`, made on `store` (lazily connected where the process asks for it)."""
    import torch.distributed as dist

    from prism_core.backend.transport_threads import make_gloo_group

    kept = list(kept)
    if position not in kept:
        raise ValueError(f"position {position} is not among the {len(kept)} positions the replay assistant "
                         f"keeps of this group ({kept[:8]}...): the graph and the program disagree on the group")
    gloo = make_gloo_group(lambda: dist.ProcessGroupGloo(store, kept.index(position), len(kept), timeout))
    return CompactGloo(gloo, kept)


class PrunedGroupError(AttributeError):
    """A call a pruned group's gloo layer cannot serve (an AttributeError, so `hasattr` answers no)."""


class CompactGloo:
    """A gloo group over some positions of a larger group, answering point-to-point calls by the
    larger group's positions. Only send and recv exist: a pruned group's rings, trees and barrier
    token move over them, and any other of gloo's collectives would need every member."""

    def __init__(self, gloo, positions: Sequence[int]):
        self.gloo = gloo
        self.positions = tuple(positions)
        self._compact = {p: i for i, p in enumerate(self.positions)}

    def _at(self, position: int) -> int:
        try:
            return self._compact[position]
        except KeyError:
            raise ValueError(f"position {position} of a pruned group does not exist here (kept: "
                             f"{len(self.positions)} positions, {list(self.positions[:8])}...)") from None

    def send(self, tensors, dst: int, tag: int):
        return self.gloo.send(tensors, self._at(dst), tag)

    def recv(self, tensors, src: int, tag: int):
        return self.gloo.recv(tensors, self._at(src), tag)

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise PrunedGroupError(f"{name}: a pruned group's gloo layer holds only {len(self.positions)} of its "
                           "members, so it moves point-to-point only (rings, trees, the barrier token)")
