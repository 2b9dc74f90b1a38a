"""What a virtual rank passes to gloo for one op of its graph: tensors of the right structure and size.

A virtual rank has no program, only its graph node: op, group, byte count, dtype. Where the
tensor cache of a context-switching collection holds the rank's inputs for the op (same key
as the collection wrote), they are sent as they were, so a sandbox rank receives the values the
real peer would have sent (and sizes that depend on values, such as MoE all-to-all splits,
agree). Otherwise zeros of the recorded size are sent. Output buffers are allocated to the
sizes the peers will deliver and dropped after completion.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import torch
import torch._C._distributed_c10d as c10d
import torch.distributed as dist

from prism_core.backend.reduce_ops import BY_NAME
from prism_core.cache import TensorCacheReader


class ReplayError(RuntimeError):
    pass


@dataclass
class OpSpec:
    kind: str
    key: str                 # the op's key in the tensor cache
    group: tuple[int, ...]   # global ranks
    me: int                  # this rank's position in the group
    nbytes: int
    dtype: torch.dtype
    reduce: str              # "" for non-reductions
    root: int | None = None  # group position of the root (rooted ops)
    peer: int | None = None  # group position of the p2p peer
    tag: int = 0
    # all_to_all_single split unevenly: rows each member sends to each member, from the graph
    member_splits: list[list[int]] | None = None
    row_bytes: int = 0


ENV_PRELOAD = "PRISM_PRELOAD_BYTES"


def _preload_bound() -> int:
    """Cached inputs held in memory at once, at most: `PRISM_PRELOAD_BYTES` where set, else half
    the memory available when the assistant starts shared among the machine's cores, within
    1-32 GiB. Assistants that run at once each take theirs, and there are at most about as many
    as cores (a co-run's members, Dask's slices), so together they stay within half of it. More at
    once than cores (bench/fidelity.py's turns: six here) set the variable: six that took a
    quarter each, 2.9 GB apiece for ep2 at 90 steps, had the kernel kill the bench for memory."""
    if os.environ.get(ENV_PRELOAD):
        return int(os.environ[ENV_PRELOAD])
    return int(min(max(memory_available() // (2 * (os.cpu_count() or 1)), 1 << 30), 32 << 30))


def memory_available() -> int:
    """The machine's available memory in bytes (`MemAvailable`; 8 GiB where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return 8 << 30


PRELOAD_BYTES = _preload_bound()
AHEAD_STEPS = 2           # streamed: steps read ahead of the latest step a replay has asked for
BEHIND_STEPS = 2          # streamed: steps kept behind it, for virtual ranks that lag


class Inputs:
    """Cached inputs of every rank that has a cache group (None where the cache has no answer).

    `preload` reads the tensors a replay will send before it starts, so that no virtual rank reads
    the store on the way to a transfer: read on demand, a 128 KiB entry took 3.7 ms here (a 1 MiB
    chunk decoded for it), and a tp2 plain slice of 90 steps (2.5 GB of inputs, two entries an
    all-reduce) ran 0.396 s a step against 0.266 with everything preloaded. Beyond PRELOAD_BYTES
    it reads the first steps and a thread streams the rest, step by step, a few steps ahead of
    the latest step asked for, dropping steps left behind: memory stays bounded, but the reading
    shares the assistant's core with the replay (the same slice, streamed: 0.356 s a step). An
    entry dropped or not yet streamed is read on demand.
    """

    def __init__(self, cache_root, ranks):
        self._readers: dict[int, TensorCacheReader] = {}
        self._held: dict[tuple[int, str], list[torch.Tensor]] = {}
        self._lock = threading.Condition()
        self._step_of: dict[tuple[int, str], int] = {}
        self._held_at: dict[int, list[tuple[int, str]]] = {}     # streamed: step -> entries held
        self._held_bytes = 0
        self._seen = -1                  # the latest step asked for
        self._closed = False
        self._thread: threading.Thread | None = None
        self.streamed = False
        self.on_demand = 0               # entries read from the store when asked for
        if cache_root is not None:
            for r in ranks:
                if (cache_root / "ranks" / str(r)).is_dir():
                    self._readers[r] = TensorCacheReader(cache_root, r)

    def _parts(self, rank: int, key: str) -> list[str]:
        reader, out, i = self._readers[rank], [], 0
        while f"{key}/{i}" in reader:
            out.append(f"{key}/{i}")
            i += 1
        return out

    def preload(self, wanted: list[tuple[int, str, int]]) -> int:
        """`wanted`: (rank, key, step) of every input the replay will read. Returns the bytes held
        when it returns (the rest, if any, streams)."""
        by_step: dict[int, dict[int, dict[str, list[str]]]] = {}
        total = 0
        for rank, key, step in wanted:
            if rank not in self._readers or (rank, key) in self._step_of:
                continue
            names = self._parts(rank, key)
            if not names:
                continue
            self._step_of[(rank, key)] = int(step)
            by_step.setdefault(int(step), {}).setdefault(rank, {})[key] = names
            total += sum(self._readers[rank].nbytes(n) for n in names)
        steps = sorted(by_step)
        if total <= PRELOAD_BYTES:            # all of it, one read per rank
            merged: dict[int, dict[str, list[str]]] = {}
            for step in steps:
                for rank, parts in by_step[step].items():
                    merged.setdefault(rank, {}).update(parts)
            self._load(merged)
            self._step_of.clear()             # held for the whole replay
            return self._held_bytes
        self.streamed = True
        for step in steps[:AHEAD_STEPS + 1]:
            self._held_at[step] = self._load(by_step[step])
        rest = [(step, by_step[step]) for step in steps[AHEAD_STEPS + 1:]]
        self._thread = threading.Thread(target=self._stream, args=(rest,), name="inputs-stream", daemon=True)
        self._thread.start()
        return self._held_bytes

    def _load(self, parts_of: dict[int, dict[str, list[str]]]) -> list[tuple[int, str]]:
        """Read these entries (rank -> key -> parts), one read per rank; hold them."""
        out = []
        for rank, parts in parts_of.items():
            loaded = self._readers[rank].get_many([n for ns in parts.values() for n in ns])
            with self._lock:
                for key, ns in parts.items():
                    self._held[(rank, key)] = [loaded[n] for n in ns]
                    self._held_bytes += _nbytes(self._held[(rank, key)])
                    out.append((rank, key))
        return out

    def _stream(self, rest: list[tuple[int, dict[int, dict[str, list[str]]]]]) -> None:
        for step, parts_of in rest:
            with self._lock:
                while not self._closed and (step > self._seen + AHEAD_STEPS or self._held_bytes > PRELOAD_BYTES):
                    self._lock.wait(0.5)
                if self._closed:
                    return
            try:
                held = self._load(parts_of)
            except Exception:  # noqa: BLE001 - the entries are read on demand, which reports it
                return
            with self._lock:
                self._held_at[step] = held

    def _drop_behind(self) -> None:
        """(Lock held.) Drop streamed steps left more than BEHIND_STEPS behind."""
        for step in [s for s in self._held_at if s < self._seen - BEHIND_STEPS]:
            for entry in self._held_at.pop(step):
                tensors = self._held.pop(entry, None)
                if tensors is not None:
                    self._held_bytes -= _nbytes(tensors)
        self._lock.notify_all()

    def _read(self, rank: int, key: str) -> list[torch.Tensor] | None:
        reader = self._readers.get(rank)
        if reader is None or f"{key}/0" not in reader:
            return None
        return [reader.get(n) for n in self._parts(rank, key)]

    def has(self, rank: int) -> bool:
        """The cache holds what `rank` sent (it was collected)."""
        return rank in self._readers

    def get(self, rank: int, key: str) -> list[torch.Tensor] | None:
        with self._lock:
            held = self._held.get((rank, key))   # kept: DP-expanded ranks share their replica's entries
            step = self._step_of.get((rank, key))
            if step is not None and step > self._seen:
                self._seen = step
                self._drop_behind()
        if held is None:
            held = self._read(rank, key)
            self.on_demand += held is not None
        tensors = held
        return None if tensors is None else [t.clone() for t in tensors]

    def shape(self, rank: int, key: str) -> tuple[int, ...] | None:
        reader = self._readers.get(rank)
        if reader is None or key not in reader:
            return None
        return reader.shape(key)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
        for reader in self._readers.values():
            reader.close()


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _zeros(nbytes: int, dtype: torch.dtype) -> torch.Tensor:
    size = torch.tensor([], dtype=dtype).element_size()
    if nbytes % size:
        raise ReplayError(f"{nbytes} B is not a whole number of {dtype} elements")
    return torch.zeros(nbytes // size, dtype=dtype)


@dataclass
class Prepared:
    """What an op needs from the cache, read before the transfer starts."""
    cached: list[torch.Tensor] | None
    in_splits: list[int]
    out_splits: list[int]
    shapes: list[tuple[int, ...] | None]    # alltoall: what each member sends here; recv: the sender's


def prepare(op: OpSpec, rank: int, inputs: Inputs) -> Prepared:
    cached = inputs.get(rank, op.key) if op.kind not in ("recv", "barrier") else None
    in_splits, out_splits, shapes = [], [], []
    if op.kind == "all_to_all_single" and op.member_splits:
        in_splits = op.member_splits[op.me]
        out_splits = [theirs[op.me] for theirs in op.member_splits]
    elif op.kind == "alltoall":
        shapes = [inputs.shape(member, f"{op.key}/{op.me}") for member in op.group]
    elif op.kind == "recv":
        shapes = [inputs.shape(op.group[op.peer], f"{op.key}/0")]
    return Prepared(cached, in_splits, out_splits, shapes)


def issue(pg: dist.ProcessGroup, op: OpSpec, prepared: Prepared) -> tuple[list, list]:
    """Start `op` on this virtual member's gloo group; returns (works, tensors to keep alive)."""
    n = len(op.group)
    cached = prepared.cached
    flat = cached[0] if cached and len(cached) == 1 else None
    ins = cached if cached else [_zeros(op.nbytes, op.dtype)]
    k = op.kind
    if k in ("allreduce", "allreduce_coalesced", "reduce"):
        if k == "allreduce_coalesced":
            o = c10d.AllreduceCoalescedOptions()
        else:
            o = c10d.AllreduceOptions() if k == "allreduce" else c10d.ReduceOptions()
        o.reduceOp = BY_NAME[op.reduce or "sum"]
        if k == "reduce":
            o.rootRank = op.root
            return [pg.reduce(ins, o)], ins
        return [pg.allreduce(ins, o) if k == "allreduce" else pg.allreduce_coalesced(ins, o)], ins
    if k == "broadcast":
        o = c10d.BroadcastOptions()
        o.rootRank = op.root
        return [pg.broadcast(ins, o)], ins
    if k == "allgather":
        outs = [[torch.empty_like(t) for _ in range(n)] for t in ins]
        return [pg.allgather(outs, ins, c10d.AllgatherOptions())], [ins, outs]
    if k == "all_gather_single":
        src = flat if flat is not None else torch.cat([t.reshape(-1) for t in ins])
        out = torch.empty(n * src.numel(), dtype=src.dtype)
        return [pg._allgather_base(out, src.reshape(-1), c10d.AllgatherOptions())], [src, out]
    if k == "reduce_scatter":
        chunks = cached if cached and len(cached) == n else list(_zeros(op.nbytes, op.dtype).chunk(n))
        out = [torch.empty_like(chunks[op.me])]
        o = c10d.ReduceScatterOptions()
        o.reduceOp = BY_NAME[op.reduce or "sum"]
        return [pg.reduce_scatter(out, [chunks], o)], [chunks, out]
    if k == "reduce_scatter_single":
        src = ins[0].reshape(-1)
        out = torch.empty(src.numel() // n, dtype=src.dtype)
        o = c10d.ReduceScatterOptions()
        o.reduceOp = BY_NAME[op.reduce or "sum"]
        return [pg._reduce_scatter_base(out, src, o)], [src, out]
    if k == "all_to_all_single":
        src = ins[0]
        in_splits, out_splits = prepared.in_splits, prepared.out_splits
        if op.row_bytes and not cached:    # zeros of the recorded size, in the program's rows
            src = src.reshape(-1, op.row_bytes // src.element_size())
        rows = sum(out_splits) if out_splits else (src.shape[0] if src.dim() else src.numel())
        out = torch.empty((rows, *src.shape[1:]), dtype=src.dtype)
        return [pg.alltoall_base(out, src, out_splits, in_splits, c10d.AllToAllOptions())], [src, out]
    if k == "alltoall":
        chunks = cached if cached and len(cached) == n else list(_zeros(op.nbytes, op.dtype).chunk(n))
        outs = [torch.empty(shape if shape is not None else chunks[g].shape, dtype=chunks[g].dtype)
                for g, shape in enumerate(prepared.shapes)]
        return [pg.alltoall(outs, chunks, c10d.AllToAllOptions())], [chunks, outs]
    if k == "scatter":
        o = c10d.ScatterOptions()
        o.rootRank = op.root
        out = [_zeros(op.nbytes, op.dtype)]
        if op.me == op.root:
            chunks = cached if cached and len(cached) == n else [torch.zeros_like(out[0]) for _ in range(n)]
            return [pg.scatter(out, [chunks], o)], [chunks, out]
        return [pg.scatter(out, [], o)], [out]
    if k == "gather":
        o = c10d.GatherOptions()
        o.rootRank = op.root
        outs = [[torch.empty_like(ins[0]) for _ in range(n)]] if op.me == op.root else []
        return [pg.gather(outs, ins, o)], [ins, outs]
    if k == "send":
        return [pg.send(ins, op.peer, op.tag)], ins
    if k == "recv":
        shape = prepared.shapes[0]
        buf = torch.empty(shape, dtype=op.dtype) if shape is not None else _zeros(op.nbytes, op.dtype)
        return [pg.recv([buf], op.peer, op.tag)], [buf]
    raise ReplayError(f"the replayer cannot issue {k}")
