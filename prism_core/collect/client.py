"""Rank side of context-switching collection: a transport with gloo's method names that hands every
op to the coordinator instead of to peers.

Issuing an op sends its inputs and returns at once (the rank keeps computing, as after an async
issue); `wait()` tells the coordinator the rank is blocked — releasing its slot if the op is not
complete — and returns when the coordinator sends the outputs and lets the rank run again.
A future is completed by waiting, so callback-style users (DDP hooks) see the result.
"""

from __future__ import annotations

import os
import socket
from collections import defaultdict

import torch
import torch.distributed as dist

from prism_core.backend.reduce_ops import reduce_name as _reduce_name
from prism_core.collect import protocol

ENV_SOCKET = "PRISM_COLLECT_SOCKET"
class Connection:
    """This rank's single connection to the coordinator (opened once per process)."""

    _instance: Connection | None = None

    def __init__(self, path: str, rank: int):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self.rank = rank
        self.next_id = 0
        protocol.send(self.sock, {"type": "hello", "rank": rank})
        header, _ = protocol.recv(self.sock)   # the first grant: run until the first blocking wait
        assert header["type"] == "go", header

    @classmethod
    def get(cls) -> Connection:
        if cls._instance is None:
            cls._instance = cls(os.environ[ENV_SOCKET], int(os.environ["RANK"]))
        return cls._instance

    def issue(self, header: dict, tensors: list[torch.Tensor]) -> int:
        op_id = self.next_id
        self.next_id += 1
        protocol.send(self.sock, dict(header, type="issue", id=op_id), tensors)
        return op_id

    def wait(self, op_id: int) -> list[torch.Tensor]:
        protocol.send(self.sock, {"type": "wait", "id": op_id})
        header, tensors = protocol.recv(self.sock)
        if header["type"] == "abort":
            raise RuntimeError(f"collection stopped by the coordinator: {header['reason']}")
        assert header["type"] == "done" and header["id"] == op_id, header
        return tensors

    def finish(self) -> None:
        protocol.send(self.sock, {"type": "finish"})


class CollectWork(dist.Work):
    def __init__(self, conn: Connection, op_id: int, apply):
        super().__init__()
        self._conn, self._id, self._apply = conn, op_id, apply
        self._done = False
        self._result = None

    def wait(self, timeout=None) -> bool:
        if not self._done:
            self._result = self._apply(self._conn.wait(self._id))
            self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done

    def get_future(self):
        self.wait()
        fut = torch.futures.Future()
        fut.set_result(self._result)
        return fut


@torch.no_grad()
def _copy(dst: list[torch.Tensor], src: list[torch.Tensor]) -> list[torch.Tensor]:
    # like a backend writing into the buffers it was given (they may be leaves that require grad)
    for d, s in zip(dst, src):
        d.copy_(s.reshape(d.shape))
    return dst


class CoordinatorTransport:
    """Stands where ProcessGroupGloo stands in a recording run; one per process group."""

    @staticmethod
    def start_process() -> None:
        Connection.get()   # hello, then block until the coordinator grants a slot

    @staticmethod
    def finish_process() -> None:
        Connection.get().finish()

    def __init__(self, group_name: str, global_ranks: tuple[int, ...], group_rank: int):
        self.conn = Connection.get()
        self.group, self.ranks, self.me = group_name, list(global_ranks), group_rank
        self._seq: dict[tuple, int] = defaultdict(int)

    def _collective(self, kind: str, tensors, meta: dict, apply) -> CollectWork:
        seq = self._seq[()]
        self._seq[()] = seq + 1
        header = {"kind": kind, "key": f"c/{self.group}/{seq}", "group": self.group, "ranks": self.ranks,
                  "group_rank": self.me, "meta": meta}
        return CollectWork(self.conn, self.conn.issue(header, list(tensors)), apply)

    def _p2p(self, kind: str, tensors, peer: int, tag: int, apply) -> CollectWork:
        src, dst = (self.me, peer) if kind == "send" else (peer, self.me)
        seq = self._seq[(src, dst, tag)]
        self._seq[(src, dst, tag)] = seq + 1
        header = {"kind": kind, "key": f"p/{self.group}/{self.ranks[src]}/{self.ranks[dst]}/{tag}/{seq}",
                  "group": self.group, "ranks": [self.ranks[src], self.ranks[dst]],
                  "group_rank": 0 if kind == "send" else 1, "meta": {}}
        return CollectWork(self.conn, self.conn.issue(header, list(tensors) if kind == "send" else []), apply)

    # -- collectives, under ProcessGroupGloo's names -------------------------------------------
    def allreduce(self, tensors, opts):
        return self._collective("allreduce", tensors, {"reduce": _reduce_name(opts.reduceOp)},
                                lambda out: _copy(tensors, out))

    def allreduce_coalesced(self, tensors, opts):
        return self._collective("allreduce_coalesced", tensors, {"reduce": _reduce_name(opts.reduceOp)},
                                lambda out: _copy(tensors, out))

    def broadcast(self, tensors, opts):
        mine = tensors if self.me == opts.rootRank else []
        return self._collective("broadcast", mine, {"root": opts.rootRank}, lambda out: _copy(tensors, out))

    def allgather(self, output_lists, inputs, opts):
        flat = [t for per_input in output_lists for t in per_input]
        return self._collective("allgather", inputs, {}, lambda out: (_copy(flat, out), output_lists)[1])

    def _allgather_base(self, output, input, opts):
        return self._collective("all_gather_single", [input], {}, lambda out: _copy([output], out))

    def reduce_scatter(self, outputs, input_lists, opts):
        if len(outputs) != 1:
            raise NotImplementedError("prism collect: reduce_scatter with several output tensors")
        return self._collective("reduce_scatter", list(input_lists[0]), {"reduce": _reduce_name(opts.reduceOp)},
                                lambda out: _copy(outputs, out))

    def _reduce_scatter_base(self, output, input, opts):
        return self._collective("reduce_scatter_single", [input], {"reduce": _reduce_name(opts.reduceOp)},
                                lambda out: _copy([output], out))

    def alltoall_base(self, output, input, output_splits, input_splits, opts):
        return self._collective("all_to_all_single", [input], {"in_splits": list(input_splits)},
                                lambda out: _copy([output], out))

    def alltoall(self, outputs, inputs, opts):
        return self._collective("alltoall", inputs, {}, lambda out: _copy(outputs, out))

    def barrier(self, opts):
        return self._collective("barrier", [], {}, lambda out: out)

    def scatter(self, outputs, input_lists, opts):
        mine = input_lists[0] if self.me == opts.rootRank else []
        return self._collective("scatter", mine, {"root": opts.rootRank}, lambda out: _copy(outputs, out))

    def gather(self, output_lists, inputs, opts):
        def apply(out):
            if self.me == opts.rootRank:
                _copy(output_lists[0], out)
            return output_lists
        return self._collective("gather", inputs, {"root": opts.rootRank}, apply)

    def reduce(self, tensors, opts):
        def apply(out):
            if self.me == opts.rootRank:
                _copy(tensors, out)
            return tensors
        return self._collective("reduce", tensors, {"root": opts.rootRank, "reduce": _reduce_name(opts.reduceOp)}, apply)

    def send(self, tensors, dst, tag):
        return self._p2p("send", tensors, dst, tag, lambda out: tensors)

    def recv(self, tensors, src, tag):
        return self._p2p("recv", tensors, src, tag, lambda out: _copy(tensors, out))
