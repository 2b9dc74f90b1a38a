"""PrismTrace schema (DESIGN.md §4): one row per node, columns of fixed meaning, tables of names.

Per rank, nodes are in program order. Kinds: a compute node spans the time between two
communication points (issue, wait, annotation boundary, iteration end); a comm node is one
communication op from its issue to its completion; a wait node is the later `wait()` of an op
that was issued asynchronously (its `ref` is the comm node's index within the rank). A comm op
waited on right after its issue has no wait node (`async_` = 0).
Synchronisation edges are implied: collectives match by (group, seq), p2p by
(group, src, dst, tag, seq).
"""

from __future__ import annotations

import numpy as np

SCHEMA_VERSION = 4          # 4: the group and step-peak tables as arrays (trace/store.py)
READS = (3, 4)              # schema versions a store of which is read

COMPUTE, COMM, WAIT = 0, 1, 2
KINDS = ("compute", "comm", "wait")

OPS = ("", "allreduce", "allreduce_coalesced", "broadcast", "allgather", "all_gather_single", "reduce_scatter",
       "reduce_scatter_single", "all_to_all_single", "alltoall", "send", "recv", "barrier", "scatter", "gather",
       "reduce")
OP_CODE = {name: i for i, name in enumerate(OPS)}
REDUCE_OPS = ("", "sum", "avg", "product", "max", "min", "band", "bor", "bxor")
REDUCE_CODE = {name: i for i, name in enumerate(REDUCE_OPS)}
P2P_OPS = frozenset({OP_CODE["send"], OP_CODE["recv"]})
# ops whose root is recorded in `peer` (global rank)
ROOTED_OPS = frozenset({OP_CODE[n] for n in ("broadcast", "scatter", "gather", "reduce")})

# column name -> numpy dtype; structural columns first, timing last
COLUMNS: dict[str, np.dtype] = {
    "kind": np.dtype(np.int8),
    "op": np.dtype(np.int8),
    "group": np.dtype(np.int32),     # index into the job's group table, -1 for compute
    "peer": np.dtype(np.int32),      # global rank: p2p peer or collective root, -1 otherwise
    "bytes": np.dtype(np.int64),
    "dtype": np.dtype(np.int16),     # index into the dtype table
    "seq": np.dtype(np.int64),       # per group (collectives) or per (group, src, dst, tag) (p2p)
    "tag": np.dtype(np.int32),
    "async_": np.dtype(np.int8),     # comm: 1 when waited later through a wait node
    "ref": np.dtype(np.int64),       # wait: index of its comm node within the rank
    "label": np.dtype(np.int16),     # index into the label table ("" when unlabelled)
    "mb": np.dtype(np.int32),
    "chunk": np.dtype(np.int32),
    "step": np.dtype(np.int32),
    "reduce": np.dtype(np.int8),     # index into REDUCE_OPS for reductions, 0 otherwise
    "splits": np.dtype(np.int32),    # all_to_all_single: index into the splits table (rows this rank sends to
                                     # each member, "3,0,5"); a coalesced all-gather / reduce-scatter: its
                                     # inputs' element counts; 0 ("") for an even split and other ops
    "t_start": np.dtype(np.float64),
    "t_end": np.dtype(np.float64),
}
STRUCTURAL_COLUMNS = tuple(c for c in COLUMNS if not c.startswith("t_"))
TIMING_COLUMNS = ("t_start", "t_end")
