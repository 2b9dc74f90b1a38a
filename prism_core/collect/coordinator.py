"""The collection coordinator: W logical ranks, at most K running, collectives run on the CPU.

Every rank process talks to the coordinator over one Unix socket. A rank runs only while it
holds one of the K slots; it gives the slot back when it waits for an op that is not complete
(or finishes). When every participant of an op has issued it, the executor computes the
outputs and the waiting members become ready. Free slots go to ready ranks by the paper's
Algorithm 1: finished and not-ready ranks are skipped, and among the rest the rank that the
most incomplete ops are waiting for goes first. If no rank runs and none is ready while some
are unfinished, collection is deadlocked: the error names every blocked rank, its op and the
members the op still misses.
"""

from __future__ import annotations

import selectors
import socket
import time
from dataclasses import dataclass, field

import torch

from prism_core.collect import executor, protocol


class CollectError(RuntimeError):
    pass


@dataclass
class _Op:
    kind: str
    ranks: list[int]                      # global ranks, group order
    arrived: dict[int, tuple[dict, list]] = field(default_factory=dict)   # group rank -> (meta, inputs)
    outputs: dict[int, list] | None = None

    def describe(self, key: str) -> str:
        seq = key.rsplit("/", 1)[-1]
        missing = [self.ranks[g] for g in range(len(self.ranks)) if g not in self.arrived]
        return f"{self.kind} #{seq} of group {self.ranks} (not yet issued by ranks {missing})"


@dataclass
class _Rank:
    sock: socket.socket
    state: str = "new"        # new | running | blocked | ready | finished
    waiting: tuple[str, int] | None = None   # (op key, op id) it waits for
    issued: dict[int, str] = field(default_factory=dict)  # op id -> key


class Coordinator:
    def __init__(self, path: str, world_size: int, slots: int, on_progress=None, cache_root=None):
        self.path, self.world, self.slots = path, world_size, slots
        self.cache_root = cache_root      # where each rank's communication inputs are kept (tensors.zarr)
        self._writers: dict = {}
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(path)
        self.server.listen(world_size)
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.server, selectors.EVENT_READ)
        self.ranks: dict[int, _Rank] = {}
        self.ops: dict[str, _Op] = {}
        self.running = 0
        self.switches = 0   # slot grants after the first: how often a rank was swapped in
        self.on_progress = on_progress

    # -- bookkeeping ---------------------------------------------------------------------------
    def _complete(self, key: str, op: _Op) -> None:
        group_ranks = sorted(op.arrived)
        metas = [op.arrived[g][0] for g in group_ranks]
        inputs = [op.arrived[g][1] for g in group_ranks]
        if op.kind in ("send", "recv"):
            outs = [[], inputs[0]]   # group rank 0 sends, 1 receives
        else:
            outs = executor.run(op.kind, metas, inputs)
        op.outputs = dict(enumerate(outs))
        op.arrived = dict.fromkeys(op.arrived)   # inputs are no longer needed
        for g, global_rank in enumerate(op.ranks):
            r = self.ranks.get(global_rank)
            if r is not None and r.state == "blocked" and r.waiting and r.waiting[0] == key:
                r.state = "ready"

    def _pending(self, rank: int) -> int:
        """How many incomplete ops wait for this rank (Algorithm 1's priority)."""
        n = 0
        for op in self.ops.values():
            if op.outputs is None and op.arrived and rank in op.ranks and op.ranks.index(rank) not in op.arrived:
                n += 1
        return n

    def _grant(self, rank: int) -> None:
        r = self.ranks[rank]
        if r.state == "new":
            protocol.send(r.sock, {"type": "go"})
        else:
            key, op_id = r.waiting
            self._reply(rank, key, op_id)
            self.switches += 1
        r.state, r.waiting = "running", None
        self.running += 1

    def _reply(self, rank: int, key: str, op_id: int) -> None:
        op = self.ops[key]
        g = op.ranks.index(rank) if op.kind not in ("send", "recv") else (0 if op.ranks[0] == rank else 1)
        outs = op.outputs.pop(g, [])
        protocol.send(self.ranks[rank].sock, {"type": "done", "id": op_id}, outs)
        if not op.outputs:
            del self.ops[key]   # every member has its outputs

    def _schedule(self) -> None:
        while self.running < self.slots:
            ready = [r for r, st in self.ranks.items() if st.state in ("new", "ready")]
            if not ready:
                return
            best = max(ready, key=lambda r: (self._pending(r), -r))
            self._grant(best)

    def status(self) -> str:
        """Who runs, who waits in what, who never connected: for a timeout message."""
        lines = []
        missing = sorted(set(range(self.world)) - set(self.ranks))
        if missing:
            lines.append(f"ranks that never reached their first process group: {missing}")
        running = sorted(r for r, st in self.ranks.items() if st.state == "running")
        if running:
            lines.append(f"ranks running (holding a slot, outside communication): {running}")
        for rank, r in sorted(self.ranks.items()):
            if r.state == "blocked":
                lines.append(f"rank {rank} waits in {self.ops[r.waiting[0]].describe(r.waiting[0])}")
        return "\n".join(lines)

    def _deadlock(self) -> CollectError:
        lines = []
        for rank, r in sorted(self.ranks.items()):
            if r.state == "blocked":
                key = r.waiting[0]
                lines.append(f"rank {rank} waits in {self.ops[key].describe(key)}")
        return CollectError("collection deadlocked: no rank can run.\n" + "\n".join(lines))

    # -- messages --------------------------------------------------------------------------------
    def _handle(self, rank: int, header: dict, tensors: list) -> None:
        r = self.ranks[rank]
        kind = header["type"]
        if kind == "issue":
            key = header["key"]
            op = self.ops.get(key)
            if op is None:
                op = self.ops[key] = _Op(kind=header["kind"] if header["kind"] not in ("send", "recv") else "send",
                                         ranks=header["ranks"])
            elif op.kind != header["kind"] and not {op.kind, header["kind"]} <= {"send", "recv"}:
                raise CollectError(f"mismatched collectives: rank {rank} issued {header['kind']} as call "
                                   f"{key.rsplit('/', 1)[-1]} of group {header['ranks']}, where rank "
                                   f"{op.ranks[min(op.arrived)]} issued {op.kind}")
            op.arrived[header["group_rank"]] = (header["meta"], tensors)
            r.issued[header["id"]] = key
            if self.cache_root is not None and tensors:
                writer = self._writers.get(rank)
                if writer is None:
                    from prism_core.cache import TensorCacheWriter

                    writer = self._writers[rank] = TensorCacheWriter(self.cache_root, rank)
                for i, t in enumerate(tensors):
                    writer.put(f"{key}/{i}", t)
                if header["meta"].get("in_splits"):   # rules mode rebuilds a peer's all-to-all from these
                    writer.put(f"{key}/splits", torch.tensor(header["meta"]["in_splits"], dtype=torch.int64))
            if len(op.arrived) == len(op.ranks):
                self._complete(key, op)
        elif kind == "wait":
            key = r.issued.pop(header["id"], None)
            op = self.ops.get(key) if key is not None else None
            if op is None:
                raise CollectError(f"rank {rank} waits for op {header['id']} ({key}), which it never issued or "
                                   "already collected")
            if op.outputs is not None:
                self._reply(rank, key, header["id"])      # complete: the rank keeps its slot
            else:
                r.state, r.waiting = "blocked", (key, header["id"])
                self.running -= 1
        elif kind == "finish":
            r.state = "finished"
            self.running -= 1
        else:
            raise CollectError(f"rank {rank} sent an unknown message {kind!r}")

    def serve(self, timeout_s: float, alive) -> None:
        """Run until every rank finished. `alive()` is checked so a crashed rank stops collection."""
        deadline = time.monotonic() + timeout_s
        pending: dict[socket.socket, None] = {}
        while True:
            if self.ranks and all(r.state == "finished" for r in self.ranks.values()) and len(self.ranks) == self.world:
                return
            for key_obj, _ in self.sel.select(timeout=0.2):
                sock = key_obj.fileobj
                if sock is self.server:
                    conn, _ = self.server.accept()
                    pending[conn] = None
                    self.sel.register(conn, selectors.EVENT_READ, data=None)
                    continue
                try:
                    header, tensors = protocol.recv(sock)
                except ConnectionError:
                    self.sel.unregister(sock)
                    rank = key_obj.data
                    if rank is not None and self.ranks[rank].state != "finished":
                        raise CollectError(f"rank {rank} disconnected before finishing") from None
                    continue
                if header["type"] == "hello":
                    rank = header["rank"]
                    self.ranks[rank] = _Rank(sock=sock)
                    self.sel.modify(sock, selectors.EVENT_READ, data=rank)
                    pending.pop(sock, None)
                else:
                    self._handle(key_obj.data, header, tensors)
            if len(self.ranks) == self.world:
                self._schedule()
                if self.running == 0 and not any(r.state in ("new", "ready") for r in self.ranks.values()) \
                        and not all(r.state == "finished" for r in self.ranks.values()):
                    raise self._deadlock()
            if self.on_progress:
                self.on_progress(self)
            alive()
            if time.monotonic() > deadline:
                raise CollectError(f"collection timed out after {timeout_s:g} s (job.timeout_s)\n{self.status()}")

    def write_cache(self) -> None:
        """Store every rank's communication inputs (call once collection has succeeded)."""
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()

    def abort(self, reason: str) -> None:
        for r in self.ranks.values():
            try:
                protocol.send(r.sock, {"type": "abort", "reason": reason})
            except OSError:
                pass

    def close(self) -> None:
        for r in self.ranks.values():
            r.sock.close()
        self.sel.close()
        self.server.close()
