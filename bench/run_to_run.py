"""How far two `prism record` runs of one config differ: one after the other, and taking turns.

The floor under any fidelity figure of bench/fidelity.py: two runs of the same job can be told
apart from each other only down to this. Per round, two records one after the other, then two
taking turns of `--turns` seconds (bench/turns.py, their stopped time taken out); printed: each
pair's figures (mean over ranks of each rank's median step) and the second's difference from
the first, then the median and largest difference of each way.

    .venv/bin/python bench/run_to_run.py [--config pp2] [--rounds 3] [--steps 60] [--turns 0.3]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fidelity import _figure, _load, launch_cmd  # noqa: E402
from turns import take_turns, unstop_run  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="pp2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--turns", type=float, default=0.3)
    args = parser.parse_args()
    cfg = _load(args.config, args.steps, 1)
    world, warmup = cfg.job.world_size, cfg.job.warmup

    def cmd(out: Path) -> list[str]:
        return launch_cmd(["record", str(out)], args.config, args.steps, 1, "co_run")

    diffs: dict[str, list[float]] = {"one after the other": [], f"taking turns of {args.turns:g} s": []}
    with tempfile.TemporaryDirectory(prefix="prism-run-to-run-") as tmp:
        for k in range(args.rounds):
            root = Path(tmp) / str(k)
            seq = [root / "seq_a", root / "seq_b"]
            for out in seq:
                subprocess.run(cmd(out), check=True, timeout=cfg.job.timeout_s, stdout=subprocess.DEVNULL,
                               start_new_session=True)
            turn = [root / "turn_a", root / "turn_b"]
            stops = take_turns([cmd(out) for out in turn], args.turns, 2 * cfg.job.timeout_s,
                               [root / "turn_a.log", root / "turn_b.log"])
            for out, s in zip(turn, stops):
                unstop_run(out, s)
            for (how, runs) in zip(diffs, (seq, turn)):
                a, b = (_figure(r, world, warmup) for r in runs)
                diffs[how].append(b / a - 1)
                print(f"{cfg.name} round {k + 1}/{args.rounds}, {how}: {a:.4f} s and {b:.4f} s ({100 * (b / a - 1):+.2f}%)",
                      flush=True)
    print(f"\n{cfg.name}, {args.steps} steps per run ({args.steps - warmup} measured), {args.rounds} rounds")
    print(f"{'how':<28} {'median |difference|':>20} {'largest':>9}")
    for how, d in diffs.items():
        print(f"{how:<28} {100 * statistics.median(abs(x) for x in d):19.2f}% {100 * max(abs(x) for x in d):8.2f}%")


if __name__ == "__main__":
    main()
