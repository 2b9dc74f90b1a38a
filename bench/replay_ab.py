"""Two checkouts' emulations of the same kept calibrations, taking turns: whether a change to the
replay moved the emulated iteration time, apart from the machine's drift.

An emulation's error against `prism record` moves with this machine by several percent from one
run to the next (bench/MEASURED.md items 57-58: a pair's second record up to 36% from its first),
so two fidelity runs hours apart cannot tell a change in the replay from the machine. Here each
kept pair of `bench/fidelity.py --turns ... --keep KEEP` is emulated again, each rank of interest
once with checkout A's code and once with B's, on the pair's own graph and the calibrated
timeline its kept emulations replayed (`kept.replayed_timeline`: the second pass's after
`--emulate-second`) and with the settings they ran with; the launches of a
round (each rank, each checkout) take turns (bench/turns.py), their stopped time taken out. A
pair's emulated figure is the mean over its ranks of each one's median step, as fidelity.py takes
it, and B's over A's is the change's effect with the machine's drift shared by both. A and B are
git checkouts, each with its own `.venv` (`make install`); each launch runs that checkout's own
`bench/fidelity.py --launch emulate`, as the fidelity runs did.

    .venv/bin/python bench/replay_ab.py KEEP --a DIR --b DIR [--configs pp2,tp2] [--pairs 4]
        [--rounds 1] [--turns 0.3]

Printed per pair and round: A's and B's emulated figures and B / A - 1, each launch's order in
the turns alternating from round to round; then per config the median of B / A - 1 over its
rounds and a 90% interval bootstrapped over them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fidelity import _rank_figure as figure    # a run's rank's median step after the warm-up
from kept import chosen_pairs, replayed_timeline, warmup_steps
from turns import take_turns, unstop_run


@dataclass(frozen=True)
class Checkout:
    name: str          # "A" or "B"
    root: Path
    commit: str

    @property
    def python(self) -> Path:
        return self.root / ".venv" / "bin" / "python"


def checkout(name: str, root: Path) -> Checkout:
    """A checkout to emulate with; SystemExit naming what is missing (its fidelity.py, its .venv)."""
    root = root.resolve()
    if not (root / "bench" / "fidelity.py").is_file():
        raise SystemExit(f"--{name.lower()} {root}: no bench/fidelity.py there (a PrismLLM checkout?)")
    if not (root / ".venv" / "bin" / "python").is_file():
        raise SystemExit(f"--{name.lower()} {root}: no .venv (run `make install` there)")
    commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, timeout=30).stdout.strip() or "?"
    return Checkout(name, root, commit)


def emulate_cmd(co: Checkout, config: str, run: Path, graph: Path, timeline: Path, rank: int, kept: dict) -> list[str]:
    """`co`'s own fidelity.py launching one emulation of `rank`, with the settings of the kept
    emulation `kept` (its config.json)."""
    job, em = kept["job"], kept["emulation"]
    return [str(co.python), str(co.root / "bench" / "fidelity.py"), "--launch", "emulate", str(run), str(graph),
            str(timeline), str(rank), "--config", config, "--steps", str(job["iterations"]),
            "--sandbox", str(em["sandbox"]), "--neighbours", em["neighbours"], "--no-join-late",
            "--virtual-spans", em["virtual_spans"],
            # not for "loaded": a checkout from before the option has no `--pace-reference`, and a
            # later one reads the loaded spans on the one-pass timelines such emulations replayed
            *(["--pace-reference", em["pace_reference"]] if em.get("pace_reference", "loaded") != "loaded" else [])]


def interval(effects: list[float], draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A 90% bootstrap interval of the median of `effects` (each B / A - 1), resampling them."""
    rng = np.random.default_rng(seed)
    a = np.asarray(effects)
    medians = np.median(a[rng.integers(0, len(a), size=(draws, len(a)))], axis=1)
    return float(np.quantile(medians, 0.05)), float(np.quantile(medians, 0.95))


def one_round(pair: Path, config: str, graph: Path, sides: tuple[Checkout, Checkout], out: Path, turn_s: float,
              timeout_s: float) -> dict[str, float]:
    """Every rank of interest of `pair` emulated by each checkout (in `sides`' order in the turns);
    each checkout's figure for the pair."""
    ranks = sorted(int(p.name.split("_")[1]) for p in pair.glob("emulate_*") if p.name.count("_") == 1)
    if not ranks:
        raise SystemExit(f"{pair}: no kept emulation (emulate_<rank>) to take the settings from")
    kept = json.loads((pair / f"emulate_{ranks[0]}" / "config.json").read_text())
    warmup = warmup_steps(pair / f"emulate_{ranks[0]}")
    launches = [(co, r, out / f"{co.name}_{r}") for co in sides for r in ranks]
    cmds = [emulate_cmd(co, config, run, graph, replayed_timeline(pair), r, kept)
            for co, r, run in launches]
    (out / "logs").mkdir(parents=True, exist_ok=True)
    # each in its own checkout: before `launch/child_python.py` a child's `python -m` imported the
    # prism_core of its working directory, so both sides' ranks ran the checkout replay_ab ran in
    stops = take_turns(cmds, turn_s, timeout_s, [out / "logs" / f"{run.name}.log" for _, _, run in launches],
                       cwds=[co.root for co, _, _ in launches])
    for (_, _, run), s in zip(launches, stops):
        unstop_run(run, s)
    return {co.name: statistics.mean(figure(run, r, warmup) for c, r, run in launches if c is co) for co in sides}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("keep", type=Path, help="a `bench/fidelity.py --turns ... --keep` directory")
    parser.add_argument("--a", type=Path, required=True, help="checkout A (the reference), with its .venv")
    parser.add_argument("--b", type=Path, required=True, help="checkout B (the change), with its .venv")
    parser.add_argument("--configs", default=None, help="short names, e.g. pp2,tp2 (default: all kept)")
    parser.add_argument("--pairs", type=int, default=4, help="kept pairs per config, the first ones")
    parser.add_argument("--rounds", type=int, default=1, help="rounds per pair, A and B's order alternating")
    parser.add_argument("--turns", type=float, default=0.3, help="turn length, s")
    parser.add_argument("--timeout", type=float, default=1800.0, help="per round, s")
    args = parser.parse_args()
    if not args.keep.is_dir():
        raise SystemExit(f"{args.keep}: not a directory")
    a, b = checkout("A", args.a), checkout("B", args.b)
    pairs = chosen_pairs(args.keep, args.configs, args.pairs)
    print(f"A = {a.root} ({a.commit}), B = {b.root} ({b.commit}); turns of {args.turns:g} s", flush=True)
    effects: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="prism-replay-ab-") as tmp:
        n = 0
        for config, found in pairs.items():
            for pair, graph, _ in found:
                for k in range(args.rounds):
                    sides = (a, b) if n % 2 == 0 else (b, a)
                    n += 1
                    got = one_round(pair, config, graph, sides, Path(tmp) / f"{config}_{pair.name}_{k}", args.turns,
                                    args.timeout)
                    effect = got["B"] / got["A"] - 1
                    effects.setdefault(config, []).append(effect)
                    print(f"{config} {pair.name} round {k + 1} ({sides[0].name} first): A {got['A']:.4f} s  "
                          f"B {got['B']:.4f} s  B/A {100 * effect:+.2f}%", flush=True)
    print(f"\n{'config':8} {'rounds':>6} {'B/A median':>11} {'90% interval':>16}")
    for config, got in effects.items():
        lo, hi = interval(got)
        print(f"{config:8} {len(got):>6} {100 * statistics.median(got):>+10.2f}% "
              f"{f'[{100 * lo:+.1f}, {100 * hi:+.1f}]':>16}")
    print("B/A: a pair's emulated figure (the mean over its ranks of each one's median step) by checkout B over "
          "checkout A's, their launches taking turns on the same graph and calibrated timeline; an interval that "
          "holds 0 cannot tell the change from none")


if __name__ == "__main__":
    main()
