"""Whether the turns' length moves the emulated error: kept pairs' emulations and a record of their
job taking turns of each length in turn.

`bench/fidelity.py --turns 0.3` compares an emulation with a record of its job taking turns of
0.3 s on the machine (bench/turns.py), and takes each launch's stopped time out of it; what stays
is the cost of caches left cold after each stop, taken to be alike for every launch. A record
runs two ranks at once, each with its model and its data, and an emulation one rank beside its
assistant, so the refill after a stop need not cost them alike. Here each kept pair of
`fidelity.py --turns ... --keep KEEP` runs again, a record of its job and one emulation per
rank on the pair's own graph and the calibrated timeline its emulations replayed (with their
settings), taking turns of each length of `--lengths` in turn (their order alternating from
round to round). Per length: the emulated error against that round's record (pair-wise, the
mean over the ranks of each one's median step, as fidelity.py takes it), and s, each emulated
rank's compute per step over the record's same rank. An error that moves towards 0 with longer turns
is the turns' own, not the emulation's.

    .venv/bin/python bench/turn_length.py KEEP [--configs ep2,tp2] [--pairs 2] [--rounds 1]
        [--lengths 0.3,1.5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from emulated_pace import _part, compute_per_step
from fidelity import _rank_figure as figure
from fidelity import launch_cmd
from kept import chosen_pairs, replayed_timeline, warmup_steps
from replay_ab import emulate_cmd, interval
from turns import graph_progress, take_turns, unstop_run

ROOT = Path(__file__).resolve().parents[1]


class Here:
    """This checkout, as replay_ab's `emulate_cmd` takes one."""
    root = ROOT
    python = Path(sys.executable)


def one_round(pair: Path, config: str, graph: Path, nodes: dict[int, int], turn_s: float, out: Path,
              timeout_s: float) -> dict:
    """A record of the pair's job and one emulation per kept rank of interest, taking turns of
    `turn_s`, kept level as fidelity.py keeps them (`nodes`: each rank's graph nodes); the emulated
    error against that record and each rank's s."""
    ranks = sorted(int(p.name.split("_")[1]) for p in pair.glob("emulate_*") if p.name.count("_") == 1)
    if not ranks:
        raise SystemExit(f"{pair}: no kept emulation (emulate_<rank>) to take the settings from")
    kept = json.loads((pair / f"emulate_{ranks[0]}" / "config.json").read_text())
    warmup = warmup_steps(pair / f"emulate_{ranks[0]}")
    world = int(kept["job"]["world_size"])
    record = out / "record"
    cmds = [launch_cmd(["record", str(record)], config, int(kept["job"]["iterations"]),
                       int(kept["emulation"]["sandbox"]), kept["emulation"]["neighbours"])]
    runs = [record] + [out / f"emulate_{r}" for r in ranks]
    cmds += [emulate_cmd(Here, config, out / f"emulate_{r}", graph, replayed_timeline(pair),
                         r, kept) for r in ranks]
    (out / "logs").mkdir(parents=True, exist_ok=True)
    progress = [graph_progress([(record, list(range(world)))], nodes)]
    progress += [graph_progress([(out / f"emulate_{r}", [r])], nodes) for r in ranks]
    stops = take_turns(cmds, turn_s, timeout_s, [out / "logs" / f"{run.name}.log" for run in runs], progress=progress)
    for run, s in zip(runs, stops):
        unstop_run(run, s)
    real = statistics.mean(figure(record, r, warmup) for r in range(world))
    emulated = statistics.mean(figure(out / f"emulate_{r}", r, warmup) for r in ranks)
    s = [compute_per_step(**_part(out / f"emulate_{r}", r), warmup=warmup)
         / compute_per_step(**_part(record, r), warmup=warmup) for r in ranks]
    return {"error": emulated / real - 1, "s": statistics.mean(s), "real": real}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("keep", type=Path, help="a `bench/fidelity.py --turns ... --keep` directory")
    parser.add_argument("--configs", default=None, help="short names, e.g. ep2,tp2 (default: all kept)")
    parser.add_argument("--pairs", type=int, default=2, help="kept pairs per config, the first ones")
    parser.add_argument("--rounds", type=int, default=1, help="rounds per pair, the lengths' order alternating")
    parser.add_argument("--lengths", default="0.3,1.5", help="turn lengths, s, comma-separated")
    parser.add_argument("--timeout", type=float, default=1800.0, help="per round and length, s")
    args = parser.parse_args()
    lengths = [float(x) for x in args.lengths.split(",")]
    if not args.keep.is_dir():
        raise SystemExit(f"{args.keep}: not a directory")
    if len(lengths) < 2 or min(lengths) <= 0:
        raise SystemExit("--lengths: two or more turn lengths, each > 0")
    pairs = chosen_pairs(args.keep, args.configs, args.pairs)
    got: dict[tuple[str, float], list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="prism-turn-length-") as tmp:
        n = 0
        for config, found in pairs.items():
            for pair, graph, trace in found:
                nodes = {r: trace.num_nodes(r) for r in range(trace.world_size)}
                for k in range(args.rounds):
                    order = lengths if n % 2 == 0 else lengths[::-1]
                    n += 1
                    for t in order:
                        out = Path(tmp) / f"{config}_{pair.name}_{k}_{t:g}"
                        row = one_round(pair, config, graph, nodes, t, out, args.timeout)
                        got.setdefault((config, t), []).append(row)
                        print(f"{config} {pair.name} round {k + 1} turns {t:g} s: record {row['real']:.4f} s  "
                              f"emulated {100 * row['error']:+.2f}%  s {row['s']:.3f}", flush=True)
    print(f"\n{'config':8} {'turns (s)':>9} {'rounds':>6} {'emulated error':>15} {'90% interval':>16} {'s':>6}")
    for (config, t), rows in got.items():
        errors = [r["error"] for r in rows]
        lo, hi = interval(errors)
        print(f"{config:8} {t:>9g} {len(rows):>6} {100 * statistics.median(errors):>+14.2f}% "
              f"{f'[{100 * lo:+.1f}, {100 * hi:+.1f}]':>16} {statistics.median(r['s'] for r in rows):6.3f}")
    print("emulated error: the emulations' figure (the mean over the ranks of each one's median step) over the "
          "record's that took turns with them (median over rounds); s: an emulated rank's compute per step over the "
          "record's same rank (mean over the ranks, median over rounds)")


if __name__ == "__main__":
    main()
