"""The pruned tree barrier: the assistant's side, played against sandbox ranks that follow the
backend's protocol, releases nobody before every rank arrived, and moves exactly the tokens the
full tree moves on each sandbox rank's links."""

from __future__ import annotations

import json
import random
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from prism_core.backend.pruned import _tree, subtree_of, tree_children, tree_parent
from prism_core.collect.stage import collect
from prism_core.config import config_from_dict
from prism_core.replay.slices import run_with_assistant
from prism_core.replay.tree_barrier import PrunedBarrier, barrier_shape

from tests.jobs import assert_no_rank_processes


@given(st.integers(1, 200), st.data())
def test_closed_form_tree_equals_the_tree_of_the_collectives(k, data):
    root = data.draw(st.integers(0, k - 1))
    parent, children = _tree(k, root)
    for p in range(k):
        assert tree_parent(p, k, root) == parent.get(p)
        assert tree_children(p, k, root) == children[p]
        below, stack = set(), [p]
        while stack:
            n = stack.pop()
            below.add(n)
            stack.extend(children[n])
        assert set(subtree_of(p, k, root)) == below


def _play(k: int, sandbox: set[int], seed: int, absent: frozenset[int] = frozenset()):
    """Sandbox ranks run the backend's tree barrier; virtual members arrive in a random order, but
    for `absent` ones, which a replay hosting the sandbox ranks' neighbours only does not run."""
    rng = random.Random(seed)
    shape = barrier_shape(k, sandbox, (lambda p: p not in absent) if absent else None)
    everyone = set(range(k)) - absent
    sent = []                        # (from, to, "up" | "down")
    arrived: set[int] = set()
    got_up = {q: set() for q in sandbox}      # sandbox rank -> children whose token it has
    released: set[int] = set()
    state = {}

    def sandbox_progress():
        changed = True
        while changed:
            changed = False
            for q in sorted(sandbox):
                if q not in arrived or ("up", q) in state:
                    continue
                if set(tree_children(q, k)) <= got_up[q]:
                    state[("up", q)] = True
                    changed = True
                    p = tree_parent(q, k)
                    if p is None:
                        release_sandbox(q)
                    else:
                        sent.append((q, p, "up"))
                        if p in sandbox:
                            got_up[p].add(q)
                        else:
                            barrier.ready(q)

    def release_sandbox(q):
        assert arrived == everyone, "released before every rank arrived"
        released.add(q)
        for c in tree_children(q, k):
            sent.append((q, c, "down"))
            if c in sandbox:
                release_sandbox(c)
            else:
                barrier.settle()

    def send_up(c, q):
        sent.append((c, q, "up"))
        got_up[q].add(c)

    def release():
        assert arrived == everyone, "released before every rank arrived"
        for p, qs in shape.from_sandbox.items():
            for q in qs:
                sent.append((p, q, "down"))
                release_sandbox(q)

    barrier = PrunedBarrier(shape, send_up=send_up, release=release)
    order = sorted(everyone)
    rng.shuffle(order)
    for m in order:
        arrived.add(m)
        if m not in sandbox:
            barrier.ready(m)
        sandbox_progress()
    return shape, sent, released, barrier


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 64), st.data())
def test_pruned_barrier_releases_after_all_and_moves_the_full_trees_tokens(k, data):
    sandbox = set(data.draw(st.lists(st.integers(0, k - 1), min_size=1, max_size=6)))
    shape, sent, released, barrier = _play(k, sandbox, data.draw(st.integers(0, 1 << 30)))
    assert released == sandbox and (barrier.released or sandbox == set(range(k)))
    # on every link of a sandbox rank, one token up and one down: what the full tree sends there
    for q in sandbox:
        links = [(a, b, d) for a, b, d in sent if q in (a, b)]
        expected = {(c, q, "up") for c in tree_children(q, k)} | {(q, c, "down") for c in tree_children(q, k)}
        p = tree_parent(q, k)
        if p is not None:
            expected |= {(q, p, "up"), (p, q, "down")}
        assert sorted(links) == sorted(expected)
    # and nobody else is on the wire: every token has a sandbox rank at one end
    assert all(a in sandbox or b in sandbox for a, b, _ in sent)
    assert shape.neighbours == {p for q in sandbox for p in [tree_parent(q, k), *tree_children(q, k)]
                                if p is not None and p not in sandbox}


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 64), st.data())
def test_pruned_barrier_waits_only_for_the_members_replayed(k, data):
    # emulation.virtual_ranks=neighbours: only the tree neighbours (and any other virtual ranks the
    # replay hosts) arrive; the barrier releases once they all have, moving the same tokens
    sandbox = set(data.draw(st.lists(st.integers(0, k - 1), min_size=1, max_size=6)))
    neighbours = barrier_shape(k, sandbox).neighbours
    others = sorted(set(range(k)) - sandbox - neighbours)
    absent = frozenset(data.draw(st.lists(st.sampled_from(others), unique=True)) if others else [])
    shape, sent, released, barrier = _play(k, sandbox, data.draw(st.integers(0, 1 << 30)), absent)
    assert released == sandbox and (barrier.released or sandbox == set(range(k)))
    full = _play(k, sandbox, 0)[1]
    assert sorted(sent) == sorted(full)


SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "scripts" / "bootstrap_barrier.py"


def test_sandbox_ranks_pass_a_barrier_and_trees_with_only_their_tree_neighbours(tmp_path, monkeypatch):
    # W=6, TORCH_DIST_INIT_BARRIER=1: c10d's store barrier at init waits for all 6 ranks, the tree
    # barrier needs the neighbours. Sandbox {1}: virtual root 0 releases, virtual child 3 and 4
    # take rank 1's release token (the assistant must stay until they have it). Sandbox {0, 5}:
    # the root is real, and rank 5 hangs under virtual rank 2.
    monkeypatch.setenv("TORCH_DIST_INIT_BARRIER", "1")
    cfg = config_from_dict({"name": "barrier", "job": {"program": str(SCRIPT), "world_size": 6, "iterations": 1,
                                                       "warmup": 0, "timeout_s": 120},
                            "emulation": {"collect_mode": "rules", "sandbox": 2}})
    graph = collect(cfg, tmp_path / "collect")
    for sandbox, neighbours in (([1], {0, 3, 4}), ([0, 5], {1, 2})):
        out = tmp_path / "-".join(map(str, sandbox))
        run_with_assistant(cfg, graph.directory, sandbox, out)
        stats = json.loads((out / "replay" / "stats.json").read_text())
        assert stats["gloo_groups"] == len(neighbours) and stats["virtual_ranks"] == 6 - len(sandbox)
        # the world group's gloo layer: the sandbox ranks and their tree neighbours, not all 6
        assert stats["compact_groups"] == 1
        assert stats["gloo_members"] == len(neighbours) * (len(neighbours) + len(sandbox))
        for r in sandbox:
            line = json.loads((out / "logs" / f"rank_{r}.log").read_text().strip().splitlines()[-1])
            assert line["world_size"] == 6 and line["broadcast_ok"]      # the tree broadcast from rank 0
    # hosting the neighbours only: sandbox {0, 5} replays ranks 1 and 2, and reads only their rows
    out = tmp_path / "near"
    run_with_assistant(cfg, graph.directory, [0, 5], out, virtual_ranks="neighbours")
    stats = json.loads((out / "replay" / "stats.json").read_text())
    assert stats["virtual_ranks"] == 2 and stats["virtual_ranks_in_job"] == 4 and stats["nodes"] == 2 * 7
    for r in (0, 5):
        line = json.loads((out / "logs" / f"rank_{r}.log").read_text().strip().splitlines()[-1])
        assert line["world_size"] == 6 and line["broadcast_ok"]
    assert_no_rank_processes()
