"""Make an unmodified program's process groups land on the prism backend.

`install()` registers the "prism" backend with c10d and wraps c10d's single choke point for
creating process groups (`_new_process_group_helper`, used by `init_process_group`, `new_group`
and device meshes), so that whatever backend the program asks for — "gloo", "nccl" on a CPU
run, or none — the group is a PrismProcessGroup (`get_backend()` then answers "prism").
"""

from __future__ import annotations

import os

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from prism_core.backend.compact import existing_positions, layer, rank_set_key
from prism_core.backend.process_group import PrismProcessGroup, gloo_store
from prism_core.trace.recorder import Recorder

BACKEND_NAME = "prism"
ENV_PUBLISH_GROUPS = "PRISM_PUBLISH_GROUPS"   # "1" in a sandbox rank: tell the replay assistant group names
ENV_SANDBOX = "PRISM_SANDBOX_RANKS"           # in a sandbox rank: the ranks that run for real (comma-separated)
_state: dict = {"installed": False, "recorder": None, "transport": None, "made": {}}


def group_name_key(ranks, nth: int) -> str:
    """Store key under which a sandbox rank publishes the c10d name of the nth group of this rank set."""
    return rank_set_key("prism/group_name", ranks, nth)


def _job_store(store):
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


def _nth(ranks: list[int]) -> int:
    """How many groups of this rank set the program made before this one."""
    made = _state["made"]
    nth = made.get(tuple(sorted(ranks)), 0)
    made[tuple(sorted(ranks))] = nth + 1
    return nth


def _create(opts, backend_options) -> PrismProcessGroup:
    ranks = list(opts.global_ranks_in_group) or list(range(opts.group_size))
    nth = _nth(ranks)
    if os.environ.get(ENV_PUBLISH_GROUPS) == "1":
        # c10d names groups by creation count; a graph built from one DP replica cannot know the
        # names of the other replicas' groups, so the ranks that run for real say them
        _job_store(opts.store).set(group_name_key(ranks, nth), opts.group_id)
    factory = _state["transport"]
    inner = factory(opts.group_id, tuple(ranks), opts.group_rank) if factory is not None else None
    if inner is None and os.environ.get(ENV_SANDBOX):     # the replay assistant says which members exist
        kept = existing_positions(_job_store(opts.store), opts.group_id, ranks, nth, opts.timeout)
        if kept is not None:
            inner = layer(gloo_store(opts.store), opts.group_rank, kept, opts.timeout)
    return PrismProcessGroup(opts.store, opts.group_rank, opts.group_size, opts.timeout, ranks, opts.group_id,
                             _state["recorder"], inner=inner)


def install(recorder: Recorder | None = None, transport=None) -> None:
    """Register the backend and route every new process group to it (idempotent).

    `transport(group_name, global_ranks, group_rank)` makes the object that moves the data, with
    ProcessGroupGloo's method names; None means a real ProcessGroupGloo.
    """
    _state["recorder"] = recorder
    _state["transport"] = transport
    if _state["installed"]:
        return
    if transport is not None:
        # Collection runs ranks K at a time (or alone): c10d's store-based barrier (with
        # TORCH_DIST_INIT_BARRIER=1) would wait for ranks that are not running. It adds nothing
        # to the graph, so collection skips it.
        c10d._store_based_barrier = lambda *args, **kwargs: None
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu"])
    original = c10d._new_process_group_helper

    def helper(group_size, group_rank, global_ranks_in_group, backend, *args, **kwargs):
        return original(group_size, group_rank, global_ranks_in_group, dist.Backend(BACKEND_NAME), *args, **kwargs)

    c10d._new_process_group_helper = helper
    if os.environ.get(ENV_SANDBOX):
        c10d._store_based_barrier = _virtual_bootstrap(c10d._store_based_barrier)
    _state["installed"] = True


def _virtual_bootstrap(original):
    """c10d's store-based barrier (init_process_group / new_group with TORCH_DIST_INIT_BARRIER=1)
    waits for every rank of the job to add itself. Virtual ranks never run that code, so the
    lowest sandbox rank of the group adds their count on their behalf before joining: the barrier
    completes when the ranks that do run have arrived, and the world size stays what it is."""
    sandbox = {int(r) for r in os.environ[ENV_SANDBOX].split(",") if r}

    def barrier(rank, store, group_name, rendezvous_count, timeout, *args, **kwargs):
        members = set(range(rendezvous_count))
        if rendezvous_count != dist.get_world_size():   # new_group(use_local_synchronization=True)
            try:
                pg = next(pg for pg, name in c10d._world.pg_names.items() if name == group_name)
                members = set(dist.get_process_group_ranks(pg))
            except (AttributeError, StopIteration, RuntimeError):
                pass
        real = sandbox & members
        if real and rank == min(real):
            store.add(f"{c10d.STORE_BASED_BARRIER_PREFIX}:{group_name}", rendezvous_count - len(real))
        return original(rank, store, group_name, rendezvous_count, timeout, *args, **kwargs)

    return barrier
