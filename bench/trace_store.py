"""The trace store at scale: writing and reading the W=8,192 graph of `bench/calibrate_scale.py`
(moe_w1024's layout with DP widened to 256, collected with rules and DP dedup, expanded to every
rank; 11.3 million nodes), whole and for a few ranks.

    .venv/bin/python bench/trace_store.py [--dp 256] [--ranks 0,1,4096,8191]

Printed: the graph's nodes and groups; the time to write the store, its size on disk and its
files; the time to load it whole, and the time and the peak memory it takes to load only the
given ranks' rows with the replay's columns, in a fresh process (VmHWM less the resident memory
before the load: what a replay hosting those ranks pays for reading them). Each read runs three
times; the table gives the median. Run it against another checkout of `prism_core` with
`PYTHONPATH=<checkout>` to compare store layouts on the same graph.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "moe_w1024.yaml"

# in a fresh process: resident memory before and the high-water mark after loading some ranks' rows
PART_LOAD = """
import json, sys, time
from pathlib import Path
from prism_core.replay.assistant import REPLAY_COLUMNS
from prism_core.trace import load_trace

def status(key):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024

before = status("VmRSS:")
t0 = time.perf_counter()
part = load_trace(Path(sys.argv[1]), REPLAY_COLUMNS, ranks=json.loads(sys.argv[2]))
wall = time.perf_counter() - t0
print(json.dumps({"wall_s": wall, "grew": status("VmHWM:") - before, "nodes": len(part.columns["kind"])}))
"""


def main() -> None:
    from prism_core.collect import collect_rules
    from prism_core.config import load_config
    from prism_core.trace import load_trace, write_trace

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, default=256)
    parser.add_argument("--ranks", default=None, help="comma-separated ranks to load alone (default 0,1,W/2,W-1)")
    args = parser.parse_args()
    world = 4 * 8 * args.dp
    ranks = [int(r) for r in args.ranks.split(",")] if args.ranks else [0, 1, world // 2, world - 1]
    cfg = load_config(CONFIG, [f"job.world_size={world}", f"parallel.dp={args.dp}", "job.iterations=3",
                               "job.warmup=1", f"name=moe_w{world}"])
    import prism_core
    print(f"prism_core from {Path(prism_core.__file__).parent}", flush=True)
    with tempfile.TemporaryDirectory(prefix="prism-store-") as tmp:
        tmp = Path(tmp)
        trace = collect_rules(cfg, tmp / "collect", slots=2).trace
        nodes = int(trace.offsets[-1])
        print(f"W={world}: {nodes:,} nodes, {len(trace.groups):,} groups", flush=True)
        t0 = time.perf_counter()
        path = write_trace(trace, tmp / "trace.zarr")
        t_write = time.perf_counter() - t0
        del trace
        files = [f for f in path.rglob("*") if f.is_file()]
        size = sum(f.stat().st_size for f in files)
        whole = []
        for _ in range(3):
            t0 = time.perf_counter()
            load_trace(path)
            whole.append(time.perf_counter() - t0)
        env = dict(os.environ)
        parts = [json.loads(subprocess.run([sys.executable, "-c", PART_LOAD, str(path), json.dumps(ranks)],
                                           check=True, capture_output=True, text=True, env=env, timeout=600).stdout)
                 for _ in range(3)]
    print(f"\n{'write (s)':>10} {'on disk (MiB)':>14} {'files':>6} {'load whole (s)':>15} "
          f"{'load ' + str(len(ranks)) + ' ranks (s)':>18} {'their nodes':>12} {'peak growth (MiB)':>18}")
    print(f"{t_write:>10.2f} {size / 2**20:>14.1f} {len(files):>6} {statistics.median(whole):>15.2f} "
          f"{statistics.median(p['wall_s'] for p in parts):>18.3f} {parts[0]['nodes']:>12,} "
          f"{statistics.median(p['grew'] for p in parts) / 2**20:>18.1f}")
    print(f"ranks loaded alone: {ranks}; load whole: all columns, median of 3; the ranks: the replay's columns, "
          "in a fresh process each (3), peak growth = VmHWM less VmRSS before the load")


if __name__ == "__main__":
    main()
