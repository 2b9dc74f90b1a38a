"""Structural identity of traces: a hash per rank that ignores timing, and a diff naming the first difference.

Each node is reduced to its structural fields with names in place of table indices (a group
by its global ranks, labels and dtypes by their text), so two traces compare equal however
their name tables were ordered.
"""

from __future__ import annotations

import hashlib

import numpy as np

from prism_core.trace.schema import KINDS, OPS, STRUCTURAL_COLUMNS
from prism_core.trace.store import Trace


def _h64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


def _lookup(values: list[str]) -> np.ndarray:
    return np.array([_h64(v) for v in values] or [0], dtype=np.int64)


def canonical(trace: Trace, rank: int) -> np.ndarray:
    """[nodes, fields] int64 matrix of rank's structure, comparable across traces."""
    cols = trace.rank(rank)
    groups = _lookup([",".join(map(str, g)) for g in trace.groups])
    labels, dtypes, splits = _lookup(trace.labels), _lookup(trace.dtypes), _lookup(trace.splits)
    out = []
    for name in STRUCTURAL_COLUMNS:
        col = cols[name].astype(np.int64)
        if name == "group":
            col = np.where(col >= 0, groups[np.maximum(col, 0)], -1)
        elif name == "label":
            col = labels[col]
        elif name == "dtype":
            col = dtypes[col]
        elif name == "splits":
            col = splits[col]
        out.append(col)
    return np.stack(out, axis=1) if out else np.empty((0, 0), dtype=np.int64)


def rank_hashes(trace: Trace) -> list[str]:
    return [hashlib.sha256(canonical(trace, r).tobytes()).hexdigest()[:16] for r in range(trace.world_size)]


def describe(trace: Trace, rank: int, index: int) -> str:
    c = {k: v[trace.rank_slice(rank)][index] for k, v in trace.columns.items()}
    kind = KINDS[int(c["kind"])]
    if kind == "compute":
        label = trace.labels[int(c["label"])] or "compute"
        return f"{label}(mb={int(c['mb'])}, chunk={int(c['chunk'])}, step={int(c['step'])})"
    op = OPS[int(c["op"])]
    group = list(trace.groups[int(c["group"])])
    if kind == "wait":
        return f"wait({op} on {group}, node {int(c['ref'])})"
    peer = f", peer {int(c['peer'])}" if int(c["peer"]) >= 0 else ""
    if int(c["splits"]):
        peer += f", splits [{trace.splits[int(c['splits'])]}]"
    return (f"{op}(group {group}{peer}, seq {int(c['seq'])}, {int(c['bytes'])} B "
            f"{trace.dtypes[int(c['dtype'])]}, step {int(c['step'])})")


def structural_diff(a: Trace, b: Trace, ranks: list[int] | None = None) -> str | None:
    """None when structurally identical; otherwise a sentence naming the first differing node."""
    if a.world_size != b.world_size:
        return f"world sizes differ: {a.world_size} vs {b.world_size}"
    for rank in ranks if ranks is not None else range(a.world_size):
        ca, cb = canonical(a, rank), canonical(b, rank)
        n = min(len(ca), len(cb))
        rows = np.nonzero((ca[:n] != cb[:n]).any(axis=1))[0]
        if len(rows):
            i = int(rows[0])
            fields = [STRUCTURAL_COLUMNS[j] for j in np.nonzero(ca[i] != cb[i])[0]]
            return (f"rank {rank} node {i} differs in {', '.join(fields)}: "
                    f"{describe(a, rank, i)} vs {describe(b, rank, i)}")
        if len(ca) != len(cb):
            longer, trace = (ca, a) if len(ca) > len(cb) else (cb, b)
            return (f"rank {rank}: {len(ca)} vs {len(cb)} nodes; the first extra node is "
                    f"{describe(trace, rank, n)}")
    return None
