"""Rank side of rules-mode collection: a transport with gloo's method names that answers every op
locally, so a rank runs alone while believing it is in a W-rank world: from the config's tensor
rules, then from the tensor cache of an earlier collection if one is given (`cached.py`), then
from the workload's rules, then filler (`rules.py`).
"""

from __future__ import annotations

import os
from pathlib import Path

from collections import defaultdict

import torch
import torch.distributed as dist

from prism_core.collect.cached import CachedPeers
from prism_core.backend.reduce_ops import reduce_name as _reduce_name
from prism_core.collect.rules import OpView, answer, check_answer, load_rules

ENV_RULES = "PRISM_RULES"           # comma-separated module:function names (the config's, then the workload's)
ENV_USER_RULES = "PRISM_USER_RULES"  # how many of them come first, ahead of the cache
ENV_CACHE_OUT = "PRISM_CACHE_OUT"    # tensors.zarr that receives each collected rank's communication inputs
KEEP_BYTES = 1 << 30                 # per collected rank, at most


class LocalWork(dist.Work):
    def __init__(self, result):
        super().__init__()
        self._result = result

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self):
        fut = torch.futures.Future()
        fut.set_result(self._result)
        return fut


class RulesTransport:
    _rules = None
    _writer = None   # this rank's TensorCacheWriter: what it sent, for the replay of virtual ranks
    _kept = 0        # bytes it holds

    @classmethod
    def rules(cls):
        if cls._rules is None:
            names = [n for n in os.environ.get(ENV_RULES, "").split(",") if n]
            cls._rules = load_rules(names)
        return cls._rules

    @classmethod
    def user_rule_count(cls) -> int:
        return int(os.environ.get(ENV_USER_RULES, "0"))

    @classmethod
    def start_process(cls) -> None:
        if os.environ.get(ENV_CACHE_OUT):
            from prism_core.cache import TensorCacheWriter

            cls._writer = TensorCacheWriter(Path(os.environ[ENV_CACHE_OUT]), int(os.environ["RANK"]))

    @classmethod
    def finish_process(cls) -> None:
        if cls._writer is not None:
            cls._writer.close()
            cls._writer = None

    def _keep(self, key: str, inputs, splits: list[int] | None = None) -> None:
        """What this rank sent in the op, under the key context switching uses (rebuilt by replay).

        Held in memory until the rank ends, up to KEEP_BYTES: past that, replay sends zeros of the
        recorded size for the rest (sizes stay exact; the graph records them)."""
        if self._writer is None:
            return
        size = sum(t.numel() * t.element_size() for t in inputs)
        if RulesTransport._kept + size > KEEP_BYTES:
            return
        RulesTransport._kept += size
        for j, t in enumerate(inputs):
            self._writer.put(f"{key}/{j}", t.detach())
        if splits:
            self._writer.put(f"{key}/splits", torch.tensor(splits, dtype=torch.int64))

    def __init__(self, group_name: str, global_ranks: tuple[int, ...], group_rank: int):
        self.group, self.ranks, self.me = group_name, tuple(global_ranks), group_rank
        self._seq = 0   # call number on this group, as the recorder and the coordinator count
        self._cache_seq: dict[tuple, int] = defaultdict(int)   # op keys as context switching writes them
        self.world = int(os.environ["WORLD_SIZE"])
        self.rank = int(os.environ["RANK"])

    def _cache_key(self, kind: str, peer: int | None, tag: int) -> str:
        if kind == "send":
            seq = self._cache_seq[(self.me, peer, tag)]
            self._cache_seq[(self.me, peer, tag)] = seq + 1
            return f"p/{self.group}/{self.rank}/{self.ranks[peer]}/{tag}/{seq}"
        if kind != "recv":
            seq = self._cache_seq[()]
            self._cache_seq[()] = seq + 1
            return f"c/{self.group}/{seq}"
        seq = self._cache_seq[(peer, self.me, tag)]
        self._cache_seq[(peer, self.me, tag)] = seq + 1
        return f"p/{self.group}/{self.ranks[peer]}/{self.rank}/{tag}/{seq}"

    @torch.no_grad()
    def _op(self, kind: str, inputs, outputs, root: int | None = None, meta: dict | None = None,
            peer: int | None = None, tag: int = 0) -> LocalWork:
        seq = self._seq
        self._seq += 1
        key = self._cache_key(kind, peer, tag)
        if kind not in ("recv", "barrier"):
            self._keep(key, inputs, (meta or {}).get("in_splits"))
        view = OpView(rank=self.rank, world_size=self.world, kind=kind, group=self.ranks, group_rank=self.me,
                      seq=seq, inputs=list(inputs), outputs=list(outputs), root=root)
        rules = self.rules()
        first = self.user_rule_count()
        values = answer(view, rules[:first], fallback=None)
        if values is None:
            values = self._from_cache(view, key, dict(meta or {}, **({"root": root} if root is not None else {})),
                                      peer)
        if values is None:
            values = answer(view, rules[first:])
        for buf, value in zip(outputs, values):
            buf.copy_(value.reshape(buf.shape))
        return LocalWork(outputs)

    def _from_cache(self, view: OpView, key: str, meta: dict, peer: int | None) -> list[torch.Tensor] | None:
        cache = CachedPeers.from_env()
        if cache is None:
            return None
        if view.kind == "recv":
            values = cache.inputs(self.ranks[peer], key)   # what the sender passed
        else:
            values = cache.collective(view.kind, key, self.ranks, self.me, view.inputs, meta)
        if values is not None:
            check_answer(view, values, f"the tensor cache at {cache.root} (op {key})")
        return values

    def allreduce(self, tensors, opts):
        return self._op("allreduce", tensors, tensors, meta={"reduce": _reduce_name(opts.reduceOp)})

    def allreduce_coalesced(self, tensors, opts):
        return self._op("allreduce_coalesced", tensors, tensors, meta={"reduce": _reduce_name(opts.reduceOp)})

    def broadcast(self, tensors, opts):
        mine = tensors if self.me == opts.rootRank else []
        return self._op("broadcast", mine, tensors, root=opts.rootRank)

    def allgather(self, output_lists, inputs, opts):
        return self._op("allgather", inputs, [t for per_input in output_lists for t in per_input])

    def _allgather_base(self, output, input, opts):
        return self._op("all_gather_single", [input], [output])

    def reduce_scatter(self, outputs, input_lists, opts):
        if len(outputs) != 1:
            raise NotImplementedError("prism collect: reduce_scatter with several output tensors")
        return self._op("reduce_scatter", list(input_lists[0]), outputs, meta={"reduce": _reduce_name(opts.reduceOp)})

    def _reduce_scatter_base(self, output, input, opts):
        return self._op("reduce_scatter_single", [input], [output], meta={"reduce": _reduce_name(opts.reduceOp)})

    def alltoall_base(self, output, input, output_splits, input_splits, opts):
        rows = input.shape[0] if input.dim() else 0
        if input_splits and sum(input_splits) != rows:
            raise RuntimeError(f"all_to_all_single on rank {self.rank}: input splits {list(input_splits)} do not add "
                               f"up to the {rows} rows sent")
        return self._op("all_to_all_single", [input], [output], meta={"in_splits": list(input_splits)})

    def alltoall(self, outputs, inputs, opts):
        return self._op("alltoall", inputs, outputs)

    def barrier(self, opts):
        return self._op("barrier", [], [])

    def scatter(self, outputs, input_lists, opts):
        mine = input_lists[0] if self.me == opts.rootRank else []
        return self._op("scatter", mine, outputs, root=opts.rootRank)

    def gather(self, output_lists, inputs, opts):
        outs = output_lists[0] if self.me == opts.rootRank else []
        return self._op("gather", inputs, outs, root=opts.rootRank)

    def reduce(self, tensors, opts):
        return self._op("reduce", tensors, tensors, root=opts.rootRank, meta={"reduce": _reduce_name(opts.reduceOp)})

    def send(self, tensors, dst, tag):
        self._keep(self._cache_key("send", dst, tag), tensors)
        return LocalWork(tensors)

    def recv(self, tensors, src, tag):
        return self._op("recv", [], tensors, peer=src, tag=tag)
