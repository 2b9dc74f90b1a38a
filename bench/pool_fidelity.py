"""Pool the pairs of several `bench/fidelity.py` runs of the same prediction code: per W=2 config,
the median pair-wise error of the prediction, of the uncalibrated ablation, of the prediction with
the real run's compute spans (the communication and the calibration alone) and of the emulations
with and without following the sandbox rank's pace, each with a bootstrap interval over the pairs.

One run of five pairs on this machine moves a config's median by a few points from the run before
(bench/MEASURED.md, items 28-31): the pairs of runs of the same code pooled pin it better than any one run.
The logs this reads are the bench's printed output, kept in `bench/logs/`.

    .venv/bin/python bench/pool_fidelity.py bench/logs/fidelity_item28.log=not-following bench/logs/fidelity_item30.log ...
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

PAIR = re.compile(r"^(?P<config>\S+) pair (?P<i>\d+)/\d+: real (?P<real>[\d.]+) s  predicted (?P<pred>[\d.]+) s "
                  r"\([^)]*\)  emulated (?P<emu>[\d.na]+) s \((?P<emu_err>[+-][\d.]+|[+-]?nan)% against its own "
                  r"record .*?with the real compute (?P<realc>[\d.]+) s .*?uncalibrated (?P<uncal>[\d.]+) s")
PACE = re.compile(r"^(?P<config>\S+): emulated as configured [^(]*\(pairs (?P<default>[^)]*)\), "
                  r"(?P<way>with|without) following the sandbox rank's pace [^(]*\(pairs (?P<other>[^)]*)\)")
# the header of a run that printed how its emulations ran as configured (bench/fidelity.py PACED_HEADER)
PACED = re.compile(r"emulations as configured (?P<way>following|not following) the sandbox rank's pace")
SEED = 0
# a log named LOG=following or LOG=not-following: how its emulations ran as configured, for runs
# whose header did not say (before item 33)
WAYS = {"following": "following the pace", "not-following": "not following"}


def parse(log: Path, way: str | None = None) -> dict[str, dict[str, list[float]]]:
    """config -> column -> its pairs' errors (fractions) in one bench log. `way`: the column of the
    emulations as configured ("following the pace" or "not following") where the log does not say."""
    out: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    paced: set[str] = set()
    for line in log.read_text().splitlines():
        if m := PACED.search(line):
            said = WAYS[m["way"].replace(" ", "-")]
            if way is not None and way != said:
                raise SystemExit(f"{log}: its header says the emulations ran {said!r}, not {way!r}")
            way = said
        if m := PAIR.match(line):
            real, cols = float(m["real"]), out[m["config"]]
            cols["predicted"].append(float(m["pred"]) / real - 1)
            cols["uncalibrated"].append(float(m["uncal"]) / real - 1)
            cols["with the real compute"].append(float(m["realc"]) / real - 1)
            if m["emu_err"] not in ("nan", "+nan", "-nan"):
                cols["emulated as configured"].append(float(m["emu_err"]) / 100)
        elif m := PACE.match(line):
            default = [float(x) / 100 for x in m["default"].split(",")]
            other = [float(x) / 100 for x in m["other"].split(",")]
            following, not_following = (default, other) if m["way"] == "without" else (other, default)
            out[m["config"]]["following the pace"] = following
            out[m["config"]]["not following"] = not_following
            paced.add(m["config"])
    for config in paced:    # the as-configured column is one of the two above
        out[config].pop("emulated as configured", None)
    if way is not None:
        for config, cols in out.items():
            if config not in paced and "emulated as configured" in cols:
                cols[way] = cols.pop("emulated as configured")
    if not out:
        raise SystemExit(f"{log}: no pairs of bench/fidelity.py found")
    return out


def interval(errors: list[float], draws: int = 10_000) -> tuple[float, float]:
    """90% bootstrap interval of the median over the pairs."""
    rng = np.random.default_rng(SEED)
    x = np.asarray(errors)
    medians = np.median(rng.choice(x, size=(draws, len(x)), replace=True), axis=1)
    return float(np.quantile(medians, 0.05)), float(np.quantile(medians, 0.95))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("logs", nargs="+", help="bench/fidelity.py outputs of the same prediction code; LOG=following "
                    "or LOG=not-following says how a log's emulations ran as configured where it does not say")
    args = ap.parse_args(argv)
    pooled: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for item in args.logs:
        log, _, way = item.partition("=")
        if way and way not in WAYS:
            ap.error(f"{item}: the way after '=' is one of {', '.join(WAYS)}")
        for config, cols in parse(Path(log), WAYS.get(way)).items():
            for col, errors in cols.items():
                pooled[config][col].extend(errors)
    columns = ["predicted", "uncalibrated", "with the real compute", "following the pace", "not following", "emulated as configured"]
    columns = [c for c in columns if any(pooled[k].get(c) for k in pooled)]
    print(f"pooled over {len(args.logs)} run(s): median pair-wise error [90% bootstrap interval] (pairs)")
    print(f"{'config':<18}" + "".join(f"{c:>32}" for c in columns))
    for config in sorted(pooled):
        cells = []
        for col in columns:
            errors = pooled[config].get(col, [])
            if not errors:
                cells.append(f"{'-':>32}")
                continue
            lo, hi = interval(errors)
            cells.append(f"{100 * statistics.median(errors):+7.2f}% [{100 * lo:+5.1f}, {100 * hi:+5.1f}] ({len(errors):>2})"
                         .rjust(32))
        print(f"{config:<18}" + "".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
