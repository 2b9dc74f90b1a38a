"""Checks that a PrismTrace holds together across ranks (DESIGN.md §4).

A collective must appear on every member of its group with the same op at the same sequence
number (and the same size and dtype where the op requires it); every send must meet a recv
with the same (group, src, dst, tag, seq) and size; within a rank, waits follow the op they
wait for, each async op is waited once, and steps and start times do not go backwards.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from prism_core.trace.schema import COMM, OP_CODE, OPS, P2P_OPS, WAIT
from prism_core.trace.store import Trace, TraceError

# ops whose per-rank byte count must agree (others are uneven by nature: alltoall, scatter roots...)
EQUAL_BYTES_OPS = frozenset(OP_CODE[n] for n in ("allreduce", "allreduce_coalesced", "broadcast", "allgather",
                                                 "all_gather_single", "reduce_scatter_single", "reduce", "scatter",
                                                 "gather", "barrier"))
MAX_REPORTED = 20


def problems(trace: Trace) -> list[str]:
    out: list[str] = []
    out += _program_order(trace)
    comm = _comm_frame(trace)
    out += _collectives(trace, comm[~comm.op.isin(P2P_OPS)])
    out += _p2p(comm[comm.op.isin(P2P_OPS)])
    out += _splits(trace)
    return out


def _splits(trace: Trace) -> list[str]:
    """An uneven all-to-all names one split per group member, in whole rows of its bytes."""
    c = trace.columns
    out = []
    table = [[int(x) for x in t.split(",")] if t else [] for t in trace.splits]
    uneven = (c["splits"] > 0) & (c["op"] == OP_CODE["all_to_all_single"]) & (c["kind"] == COMM)
    for i in np.nonzero(uneven)[0][:100_000]:
        s = table[c["splits"][i]]
        members = len(trace.groups[c["group"][i]])
        rank = int(np.searchsorted(trace.offsets, i, side="right") - 1)
        if len(s) != members or min(s) < 0 or (sum(s) and c["bytes"][i] % sum(s)) or (not sum(s) and c["bytes"][i]):
            out.append(f"rank {rank} node {i - int(trace.offsets[rank])}: all_to_all_single splits {s} do not fit "
                       f"its group of {members} and {int(c['bytes'][i])} B")
            if len(out) >= MAX_REPORTED:
                break
    return out


def validate(trace: Trace) -> None:
    found = problems(trace)
    if found:
        more = f" (and {len(found) - MAX_REPORTED} more)" if len(found) > MAX_REPORTED else ""
        raise TraceError("invalid trace: " + "; ".join(found[:MAX_REPORTED]) + more)


def _rank_column(trace: Trace) -> np.ndarray:
    return np.repeat(np.arange(trace.world_size), np.diff(trace.offsets))


def _comm_frame(trace: Trace) -> pd.DataFrame:
    c = trace.columns
    mask = c["kind"] == COMM
    return pd.DataFrame({"rank": _rank_column(trace)[mask], "op": c["op"][mask], "group": c["group"][mask],
                         "peer": c["peer"][mask], "bytes": c["bytes"][mask], "dtype": c["dtype"][mask],
                         "seq": c["seq"][mask], "tag": c["tag"][mask]})


def _collectives(trace: Trace, df: pd.DataFrame) -> list[str]:
    out = []
    sizes = np.array([len(g) for g in trace.groups] or [0])
    stats = df.groupby(["group", "seq"]).agg(n=("rank", "size"), ranks=("rank", "nunique"), ops=("op", "nunique"),
                                             op=("op", "first"), bmin=("bytes", "min"), bmax=("bytes", "max"),
                                             ndtypes=("dtype", "nunique"))
    stats = stats.reset_index()
    bad_count = stats[(stats.n != sizes[stats.group]) | (stats.ranks != stats.n)]
    for row in bad_count.itertuples():
        members = trace.groups[row.group]
        have = set(df[(df.group == row.group) & (df.seq == row.seq)]["rank"])
        missing = sorted(set(members) - have)
        out.append(f"collective #{row.seq} of group {list(members)} ({OPS[row.op]}) is missing on ranks {missing}"
                   if missing else f"collective #{row.seq} of group {list(members)} appears twice on a rank")
    for row in stats[stats.ops > 1].itertuples():
        sub = df[(df.group == row.group) & (df.seq == row.seq)]
        calls = ", ".join(f"rank {r}: {OPS[o]}" for r, o in zip(sub["rank"], sub.op))
        out.append(f"collective #{row.seq} of group {list(trace.groups[row.group])} mismatched ({calls})")
    size_bad = stats[(stats.ops == 1) & stats.op.isin(EQUAL_BYTES_OPS) & ((stats.bmin != stats.bmax) | (stats.ndtypes > 1))]
    for row in size_bad.itertuples():
        sub = df[(df.group == row.group) & (df.seq == row.seq)]
        sizes_txt = ", ".join(f"rank {r}: {b} B" for r, b in zip(sub["rank"], sub["bytes"]))
        out.append(f"{OPS[row.op]} #{row.seq} of group {list(trace.groups[row.group])} disagrees in size ({sizes_txt})")
    return out


def _p2p(df: pd.DataFrame) -> list[str]:
    send = df[df.op == OP_CODE["send"]].rename(columns={"rank": "src", "peer": "dst"})
    recv = df[df.op == OP_CODE["recv"]].rename(columns={"rank": "dst", "peer": "src"})
    keys = ["group", "src", "dst", "tag", "seq"]
    merged = send.merge(recv, on=keys, how="outer", suffixes=("_s", "_r"), indicator="matched")
    out = []
    for row in merged[merged.matched != "both"].itertuples():   # (itertuples renames a "_merge" field)
        side = "send" if row.matched == "left_only" else "recv"
        other = "recv" if side == "send" else "send"
        out.append(f"{side} #{row.seq} from rank {row.src} to rank {row.dst} (tag {row.tag}) has no matching {other}")
    both = merged[(merged.matched == "both") & (merged.bytes_s != merged.bytes_r)]
    for row in both.itertuples():
        out.append(f"send #{row.seq} from rank {row.src} to rank {row.dst} carries {row.bytes_s} B "
                   f"but the recv expects {row.bytes_r} B")
    return out


def _program_order(trace: Trace) -> list[str]:
    out = []
    c = trace.columns
    for rank in range(trace.world_size):
        s = trace.rank_slice(rank)
        kind, step, t0, ref = c["kind"][s], c["step"][s], c["t_start"][s], c["ref"][s]
        if len(step) and np.any(np.diff(step) < 0):
            out.append(f"rank {rank}: iteration numbers go backwards at node {int(np.argmax(np.diff(step) < 0)) + 1}")
        finite = t0[np.isfinite(t0)]
        if len(finite) and np.any(np.diff(finite) < -1e-9):
            out.append(f"rank {rank}: node start times go backwards")
        waits = np.nonzero(kind == WAIT)[0]
        refs = ref[waits]
        bad = (refs < 0) | (refs >= waits)
        if np.any(bad):
            out.append(f"rank {rank}: wait node {int(waits[bad][0])} refers to node {int(refs[bad][0])}, "
                       "not an earlier op")
            continue
        if np.any(kind[refs] != COMM) if len(refs) else False:
            out.append(f"rank {rank}: a wait node refers to a node that is not a communication op")
        asyncs = np.nonzero((kind == COMM) & (c["async_"][s] == 1))[0]
        if len(np.unique(refs)) != len(refs) or set(refs.tolist()) != set(asyncs.tolist()):
            out.append(f"rank {rank}: async ops and their waits do not pair up one to one")
    return out
