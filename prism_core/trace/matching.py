"""Which nodes of a PrismTrace are the same communication op on different ranks.

Collectives match by (group, seq); point-to-point ops by (group, src, dst, tag, seq). `match_ops`
numbers every op once (vectorised: keys packed into integers and sorted), so replay and
calibration can gather per-op facts (arrival times, members) with array operations.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from prism_core.trace.schema import COMM, OP_CODE
from prism_core.trace.store import Trace

_SEND, _RECV = OP_CODE["send"], OP_CODE["recv"]


@dataclass
class OpMatch:
    op_id: np.ndarray        # per node: the op it takes part in (comm nodes), -1 otherwise
    n_ops: int
    order: np.ndarray        # comm node indices sorted by op id
    bounds: np.ndarray       # order[bounds[i]:bounds[i+1]] are op i's nodes
    members: np.ndarray      # per op: how many nodes take part


def node_ranks(trace: Trace) -> np.ndarray:
    return np.repeat(np.arange(trace.world_size, dtype=np.int64), np.diff(trace.offsets))


def match_ops(trace: Trace) -> OpMatch:
    c = trace.columns
    n = len(c["kind"])
    comm = np.nonzero(c["kind"] == COMM)[0]
    op = c["op"][comm]
    rank = node_ranks(trace)[comm]
    peer = c["peer"][comm].astype(np.int64)
    group = c["group"][comm].astype(np.int64)
    seq = c["seq"][comm].astype(np.int64)
    p2p = (op == _SEND) | (op == _RECV)
    src = np.where(op == _RECV, peer, rank)
    dst = np.where(op == _SEND, peer, rank)
    _, tag = np.unique(c["tag"][comm], return_inverse=True)
    tag = tag.astype(np.int64)
    # key 1: kind of matching and who; key 2: which call
    who = np.where(p2p, (group << 40) | (src << 20) | dst, group << 40) | (p2p.astype(np.int64) << 62)
    call = np.where(p2p, (tag << 40) | seq, seq)
    order = np.lexsort((call, who))
    w, k = who[order], call[order]
    starts = np.ones(len(order), dtype=bool)
    starts[1:] = (w[1:] != w[:-1]) | (k[1:] != k[:-1])
    ids_sorted = np.cumsum(starts) - 1
    op_id = np.full(n, -1, dtype=np.int64)
    op_id[comm[order]] = ids_sorted
    bounds = np.append(np.nonzero(starts)[0], len(order))
    return OpMatch(op_id=op_id, n_ops=int(starts.sum()), order=comm[order], bounds=bounds,
                   members=np.diff(bounds))
