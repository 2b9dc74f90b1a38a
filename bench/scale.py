"""Virtual bootstrap at scale: S=2 ranks of interest join a W-rank job, pass one barrier, take a
broadcast and all-reduce one number, while the replay assistant stands in for the other W-2 ranks.

For each W the two sandbox ranks (0 and W/2) run `bench/scripts/bootstrap_barrier.py` unmodified,
with `TORCH_DIST_INIT_BARRIER=1` so that c10d's store-based barrier at `init_process_group` waits
for all W ranks (the lowest sandbox rank adds the virtual ranks' count); the barrier is the prism
backend's tree barrier, and the broadcast and one-number all-reduce the backend's trees, of which
only the sandbox ranks' tree neighbours exist. The job's graph (per rank: start-up, the barrier,
the broadcast, the all-reduce, the end) is written for W ranks; at W=4 it is first checked equal,
structurally, to the graph rules-mode collection records of the real script.

    .venv/bin/python bench/scale.py [--worlds 64,256,1024,4096,8192,16384] [--virtual-ranks all,neighbours]

Each W runs once per `emulation.virtual_ranks` mode: "all", the assistant replays every virtual
rank (and reads the whole graph); "neighbours", only the virtual ranks the sandbox ranks talk to
(replay/hosted.py), reading only their rows of the graph.

Printed per W: the launch's wall time (process start to exit, both ranks and the assistant), the
sandbox ranks' init, barrier and tree-collective times, the assistant's peak resident memory, its
gloo groups and their gloo layers' members all together (a pruned group's layer holds only the
members kept, `backend/compact.py`), and what its resident memory grew by in each phase (`replay/stats.json` ->
`rss_bytes`): loading the graph, setting up the replay, connecting its gloo groups, replaying;
it stops if a sandbox rank did not receive rank 0's broadcast.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from prism_core.collect.stage import collect
from prism_core.config import config_from_dict
from prism_core.replay.slices import run_with_assistant
from prism_core.trace import Trace, structural_diff, write_trace
from prism_core.trace.schema import COLUMNS, COMM, COMPUTE, OP_CODE, REDUCE_CODE

SCRIPT = Path(__file__).resolve().parent / "scripts" / "bootstrap_barrier.py"


def barrier_graph(world: int) -> Trace:
    """Per rank, on the world group (c10d's "0"), between compute nodes: the barrier (call 0), a
    broadcast of 256 floats from rank 0 (call 1), an all-reduce of one float (call 2)."""
    per_rank = 7
    n = per_rank * world
    columns = {name: np.zeros(n, dtype=dtype) for name, dtype in COLUMNS.items()}
    kind = np.tile(np.array([COMPUTE, COMM, COMPUTE, COMM, COMPUTE, COMM, COMPUTE], dtype=np.int8), world)
    comm = kind == COMM
    columns["kind"] = kind
    columns["op"][comm] = np.tile([OP_CODE[o] for o in ("barrier", "broadcast", "allreduce")], world)
    columns["seq"][comm] = np.tile([0, 1, 2], world)
    columns["bytes"][comm] = np.tile([0, 256 * 4, 4], world)
    columns["dtype"][comm] = np.tile([0, 1, 1], world)
    columns["reduce"][comm] = np.tile([0, 0, REDUCE_CODE["sum"]], world)
    columns["group"][:] = np.where(comm, 0, -1)
    columns["peer"][:] = -1
    columns["peer"][comm] = np.tile([-1, 0, -1], world)
    columns["ref"][:] = -1
    columns["tag"][:] = -1
    columns["mb"][:] = -1
    columns["chunk"][:] = -1
    columns["seq"][kind == COMPUTE] = -1
    columns["t_start"][:] = np.nan
    columns["t_end"][:] = np.nan
    return Trace(world_size=world, columns=columns, offsets=np.arange(0, n + 1, per_rank, dtype=np.int64),
                 groups=[tuple(range(world))], group_names=["0"], labels=[""], dtypes=["", "float32"],
                 step_peaks=[[] for _ in range(world)])


def _config(world: int) -> dict:
    return {"name": f"scale_{world}", "job": {"program": str(SCRIPT), "world_size": world, "iterations": 1,
                                              "warmup": 0, "timeout_s": 300},
            "emulation": {"sandbox": 2, "slots": 2, "collect_mode": "rules"}}


def check_graph(tmp: Path) -> None:
    collected = collect(config_from_dict(_config(4)), tmp / "collect").trace
    diff = structural_diff(barrier_graph(4), collected)
    if diff is not None:
        raise SystemExit(f"the bench's graph is not the script's: {diff}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="64,256,1024,4096,8192,16384")
    parser.add_argument("--virtual-ranks", default="all,neighbours",
                        help="comma-separated emulation.virtual_ranks modes to run each W with")
    args = parser.parse_args()
    modes = args.virtual_ranks.split(",")
    if not modes or set(modes) - {"all", "neighbours"}:
        parser.error("--virtual-ranks: all and/or neighbours")
    os.environ["TORCH_DIST_INIT_BARRIER"] = "1"     # collection skips it; the emulation must complete it
    rows = []
    with tempfile.TemporaryDirectory(prefix="prism-scale-") as tmp:
        tmp = Path(tmp)
        check_graph(tmp)
        print("graph checked against rules-mode collection of the script at W=4", flush=True)
        for world in (int(w) for w in args.worlds.split(",")):
            graph = tmp / f"w{world}"
            graph.mkdir()
            write_trace(barrier_graph(world), graph / "trace.zarr")
            sandbox = [0, world // 2]
            for mode in modes:
                out = tmp / f"run{world}_{mode}"
                start = time.perf_counter()
                run_with_assistant(config_from_dict(_config(world)), graph, sandbox, out, virtual_ranks=mode)
                wall = time.perf_counter() - start
                ranks = [json.loads((out / "logs" / f"rank_{r}.log").read_text().strip().splitlines()[-1])
                         for r in sandbox]
                stats = json.loads((out / "replay" / "stats.json").read_text())
                if not all(r["broadcast_ok"] for r in ranks):
                    raise SystemExit(f"W={world} ({mode}): a sandbox rank did not get rank 0's broadcast: {ranks}")
                rows.append((mode, world, wall, max(r["init_s"] for r in ranks), max(r["barrier_s"] for r in ranks),
                             max(r["trees_s"] for r in ranks), stats["max_rss_bytes"], stats["virtual_ranks"],
                             stats.get("gloo_members"), stats["wall_s"], _growth(stats.get("rss_bytes") or {})))
                print(f"W={world} ({mode}): {wall:.1f} s", flush=True)
    head = ("virtual ranks", "W", "wall (s)", "init (s)", "barrier (s)", "trees (s)", "assistant RSS", "replayed",
            "members", "assistant (s)")
    widths = (13, 6, 9, 9, 11, 9, 14, 8, 7, 13)
    growth_head = (("+graph", 6), ("+set-up", 7), ("+groups", 7), ("+replay", 7))
    print("\n" + " ".join(f"{h:>{w}}" for h, w in zip(head, widths)) + "   "
          + " ".join(f"{h:>{w}}" for h, w in growth_head) + " (MiB)")
    for mode, world, wall, init, barrier, trees, rss, replayed, members, assistant, growth in \
            sorted(rows, key=lambda row: (modes.index(row[0]), row[1])):
        cells = (mode, world, f"{wall:.2f}", f"{init:.3f}", f"{barrier:.3f}", f"{trees:.3f}", f"{rss / 2**20:.0f} MiB",
                 replayed, members if members is not None else "-", f"{assistant:.2f}")
        grown = (f"{g:.0f}" if g is not None else "-" for g in growth)
        print(" ".join(f"{c:>{w}}" for c, w in zip(cells, widths)) + "   "
              + " ".join(f"{g:>{w}}" for g, (_, w) in zip(grown, growth_head)))
    print("wall: launch to exit of both sandbox ranks and the assistant (Python and torch start-up included); "
          "init / barrier / trees (broadcast + all-reduce): inside the slower sandbox rank; replayed: virtual ranks the "
          "assistant replayed; members: of the assistant's "
          "gloo groups' gloo layers, all together; +graph / +set-up / +groups "
          "/ +replay: what the assistant's resident memory grew by loading the graph, setting up the replay, making "
          "its gloo groups (gloo's own state, per member of each group's gloo layer) and replaying")


def _growth(rss: dict) -> tuple[float | None, ...]:
    """MiB the assistant's resident memory grew by in each phase, from `stats.json` -> `rss_bytes`."""
    phases = ("started", "graph", "assistant", "connected", "replayed")
    return tuple((rss[b] - rss[a]) / 2**20 if rss.get(a) is not None and rss.get(b) is not None else None
                 for a, b in zip(phases, phases[1:]))


if __name__ == "__main__":
    main()
