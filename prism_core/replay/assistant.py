"""The replay assistant: one process that hosts every virtual rank of a run (paper §6.1, §7).

Each virtual rank walks its graph from the bare (or calibrated) PrismTrace. Communication with
a sandbox rank is real: for every group that holds a sandbox rank, each virtual member owns a
gloo process group made on the same store keys as c10d makes the sandbox's, and issues the
op there with the tensors of `virtual_ops`. Communication among virtual ranks only is settled
in-process (a collective completes when every member has arrived, a send at once, a recv when
its send has arrived). The loop is event-driven: gloo completions arrive on a queue, so one
process serves thousands of virtual ranks while the sandbox ranks run their real program.

Mode "structure" (slice timing, Stage 2) runs compute nodes in zero time: the sandbox ranks
measure their own durations, and calibration repairs the timeline afterwards. The issue time
of every virtual node is written to `replay/arrivals.npy` so that a sandbox rank's transfer
time can exclude its wait for late peers.
"""

from __future__ import annotations

import argparse
import datetime
import os
import queue
import sys
import time
import traceback
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ENV_LAZY_GLOO = "TORCH_GLOO_LAZY_INIT"
ASSISTANT = "assistant"


class _Handle:
    """One op of one virtual rank: done once its outputs are in; ranks blocked on it wait here."""

    __slots__ = ("done", "waiters", "keep")

    def __init__(self):
        self.done = False
        self.waiters: list[int] = []
        self.keep = None


class _Local:
    __slots__ = ("arrived", "handles", "sent")

    def __init__(self):
        self.arrived = 0
        self.handles: list[_Handle] = []
        self.sent = False


def c10d_store(base, group_name: str):
    """The store c10d hands the prism backend for group `group_name`, with the backend's own prefix."""
    import torch.distributed as dist

    return dist.PrefixStore("prism_gloo/", dist.PrefixStore("cpu/", dist.PrefixStore(
        f"{group_name}/", dist.PrefixStore("default_pg", base))))


class Assistant:
    def __init__(self, trace, sandbox: set[int], cache_root: Path | None, timeout_s: float):
        from prism_core.replay.virtual_ops import Inputs
        from prism_core.trace.matching import match_ops

        self.trace = trace
        self.sandbox = set(sandbox)
        self.virtual = [r for r in range(trace.world_size) if r not in self.sandbox]
        self.timeout_s = timeout_s
        self.match = match_ops(trace)
        self.inputs = Inputs(cache_root, range(trace.world_size))
        self.arrivals = np.full(len(trace.columns["kind"]), np.nan)
        self.real_groups = {g for g, members in enumerate(trace.groups) if self.sandbox & set(members)}
        self.pgs: dict[tuple[int, int], object] = {}
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="p2p-wait")
        self.local: dict[int, _Local] = {}

    # -- set-up -----------------------------------------------------------------------------
    def connect(self, base_store) -> None:
        """A gloo group per virtual member of every group holding a sandbox rank (lazily connected)."""
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=self.timeout_s)
        for g in sorted(self.real_groups):
            members = self.trace.groups[g]
            store = c10d_store(base_store, self.trace.group_names[g])
            for position, rank in enumerate(members):
                if rank not in self.sandbox:
                    self.pgs[(rank, g)] = dist.ProcessGroupGloo(store, position, len(members), timeout)

    # -- the loop ---------------------------------------------------------------------------
    def run(self) -> None:
        from prism_core.trace.schema import COMM, COMPUTE

        c = self.trace.columns
        kind, async_, ref = c["kind"], c["async_"], c["ref"]
        pos = {r: int(self.trace.offsets[r]) for r in self.virtual}
        end = {r: int(self.trace.offsets[r + 1]) for r in self.virtual}
        handles: dict[int, dict[int, _Handle]] = {r: {} for r in self.virtual}
        blocked: dict[int, tuple[int, str]] = {}
        ready = deque(self.virtual)
        remaining = len(self.virtual)
        deadline = time.monotonic() + self.timeout_s
        while remaining:
            while ready:
                r = ready.popleft()
                blocked.pop(r, None)
                base = int(self.trace.offsets[r])
                i = pos[r]
                while i < end[r]:
                    k = kind[i]
                    if k == COMPUTE:
                        i += 1
                        continue
                    if k == COMM:
                        h = self._issue(r, i)
                        if async_[i]:
                            handles[r][i - base] = h
                        elif not h.done:
                            h.waiters.append(r)
                            blocked[r] = (i, "in")
                            i += 1
                            break
                        i += 1
                        continue
                    h = handles[r].pop(int(ref[i]))   # a wait node
                    i += 1
                    if not h.done:
                        h.waiters.append(r)
                        blocked[r] = (base + int(ref[i - 1]), "waiting for")
                        break
                pos[r] = i
                if i >= end[r] and r not in blocked:
                    remaining -= 1
            if not remaining:
                break
            try:
                h = self.events.get(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() >= deadline:
                    raise TimeoutError(self._report(blocked)) from None
                continue
            while True:
                if isinstance(h, BaseException):
                    raise h
                self._finish(h, ready)
                try:
                    h = self.events.get_nowait()
                except queue.Empty:
                    break

    def _finish(self, h: _Handle, ready: deque) -> None:
        h.done = True
        h.keep = None
        ready.extend(h.waiters)
        h.waiters = []

    def _report(self, blocked: dict[int, tuple[int, str]]) -> str:
        from prism_core.trace.schema import OPS

        c = self.trace.columns
        lines = [f"virtual rank {r} blocked {how} {OPS[c['op'][i]]} #{c['seq'][i]} of group "
                 f"{list(self.trace.groups[c['group'][i]])}" for r, (i, how) in sorted(blocked.items())[:20]]
        return (f"replay did not finish within {self.timeout_s:g} s; " + ("; ".join(lines) or
                "no virtual rank is blocked"))

    # -- ops --------------------------------------------------------------------------------
    def _issue(self, rank: int, i: int) -> _Handle:
        from prism_core.trace.schema import OPS, P2P_OPS

        c = self.trace.columns
        self.arrivals[i] = time.perf_counter()
        h = _Handle()
        g = int(c["group"][i])
        op = int(c["op"][i])
        if g in self.real_groups and (op not in P2P_OPS or int(c["peer"][i]) in self.sandbox):
            self._issue_gloo(rank, i, h)
            return h
        entry = self.local.get(int(self.match.op_id[i]))
        if entry is None:
            entry = self.local[int(self.match.op_id[i])] = _Local()
        op_id = int(self.match.op_id[i])
        if OPS[op] == "send":              # in-process sends are buffered: done at once
            h.done = True
            if entry.handles:              # the recv came first
                self.events.put(entry.handles[0])
                del self.local[op_id]
            else:
                entry.sent = True
            return h
        if OPS[op] == "recv":
            if entry.sent:
                h.done = True
                del self.local[op_id]
            else:
                entry.handles.append(h)
            return h
        entry.arrived += 1
        entry.handles.append(h)
        if entry.arrived == self.match.members[op_id]:
            for member in entry.handles:
                member.done = True
                if member is not h:
                    self.events.put(member)
            del self.local[op_id]
        return h

    def _issue_gloo(self, rank: int, i: int, h: _Handle) -> None:
        import torch

        from prism_core.replay.virtual_ops import OpSpec, issue
        from prism_core.trace.schema import OPS, REDUCE_OPS, ROOTED_OPS

        c = self.trace.columns
        g = int(c["group"][i])
        members = self.trace.groups[g]
        kind = OPS[c["op"][i]]
        name = self.trace.group_names[g]
        peer = int(c["peer"][i])
        if kind in ("send", "recv"):
            src, dst = (rank, peer) if kind == "send" else (peer, rank)
            key = f"p/{name}/{src}/{dst}/{int(c['tag'][i])}/{int(c['seq'][i])}"
        else:
            key = f"c/{name}/{int(c['seq'][i])}"
        spec = OpSpec(kind=kind, key=key, group=tuple(members), me=members.index(rank), nbytes=int(c["bytes"][i]),
                      dtype=getattr(torch, self.trace.dtypes[c["dtype"][i]] or "float32"),
                      reduce=REDUCE_OPS[c["reduce"][i]],
                      root=members.index(peer) if c["op"][i] in ROOTED_OPS and peer >= 0 else None,
                      peer=members.index(peer) if kind in ("send", "recv") else None, tag=int(c["tag"][i]))
        works, keep = issue(self.pgs[(rank, g)], spec, rank, self.inputs)
        h.keep = (works, keep)
        if kind not in ("send", "recv") and len(works) == 1:
            try:
                works[0].get_future().then(lambda _f, h=h: self.events.put(h))
                return
            except RuntimeError:   # some gloo works have no future
                pass
        self.pool.submit(self._wait, works, h)

    def _wait(self, works, h: _Handle) -> None:
        try:
            for w in works:
                w.wait()
            self.events.put(h)
        except BaseException as err:  # noqa: BLE001 - reported on the loop's thread
            self.events.put(err)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.inputs.close()


def run_assistant(graph: Path, sandbox: list[int], result_dir: Path, cache: Path | None, timeout_s: float) -> None:
    """Connect to the job's store (torchrun environment), replay every virtual rank, write arrivals."""
    import torch
    import torch.distributed as dist

    from prism_core.trace import load_trace

    torch.set_num_threads(1)
    trace = load_trace(graph)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    assistant = Assistant(trace, set(sandbox), cache, timeout_s)
    try:
        assistant.connect(store)
        assistant.run()
    finally:
        assistant.close()
    out = result_dir / "replay"
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".arrivals.{os.getpid()}.npy"
    np.save(tmp, assistant.arrivals)
    os.replace(tmp, out / "arrivals.npy")


def main(argv: list[str] | None = None) -> None:
    from prism_core.launch.rank_main import _die_with_launcher
    from prism_core.runtime import write_json_atomic

    parser = argparse.ArgumentParser(prog="prism_core.replay.assistant")
    parser.add_argument("--graph", required=True, type=Path, help="trace.zarr to replay")
    parser.add_argument("--sandbox", required=True, help="comma-separated sandbox ranks")
    parser.add_argument("--result-dir", required=True, type=Path)
    parser.add_argument("--cache", type=Path, default=None, help="tensors.zarr of the collection, if any")
    parser.add_argument("--timeout", type=float, default=600.0)
    ns = parser.parse_args(argv)
    _die_with_launcher()
    os.environ[ENV_LAZY_GLOO] = "1"
    try:
        run_assistant(ns.graph, [int(r) for r in ns.sandbox.split(",") if r], ns.result_dir, ns.cache, ns.timeout)
    except BaseException:  # noqa: BLE001 - every failure is reported to the launcher the same way
        text = traceback.format_exc()
        sys.stderr.write(text)
        sys.stderr.flush()
        write_json_atomic(ns.result_dir / "errors" / f"{ASSISTANT}.json",
                          {"rank": ASSISTANT, "time": time.time(), "traceback": text})
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
