"""The pruned tree barrier: the assistant's side, played against sandbox ranks that follow the
backend's protocol, releases nobody before every rank arrived, and moves exactly the tokens the
full tree moves on each sandbox rank's links."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from prism_core.backend.pruned import _tree, subtree_of, tree_children, tree_parent
from prism_core.replay.tree_barrier import PrunedBarrier, barrier_shape


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


def _play(k: int, sandbox: set[int], seed: int):
    """Sandbox ranks run the backend's tree barrier; virtual members arrive in a random order."""
    rng = random.Random(seed)
    shape = barrier_shape(k, sandbox)
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
        assert arrived == set(range(k)), "released before every rank arrived"
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
        assert arrived == set(range(k)), "released before every rank arrived"
        for p, qs in shape.from_sandbox.items():
            for q in qs:
                sent.append((p, q, "down"))
                release_sandbox(q)

    barrier = PrunedBarrier(shape, send_up=send_up, release=release)
    order = list(range(k))
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
