"""bench/fidelity.py: the step noise of a run's figure; the turns' launches sharing the preload; the
emulations' second ways of reading the pace."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from fidelity import (_load, _other_against, _other_reference, _other_spans, _other_steps, _share_preload,  # noqa: E402
                      _step_noise, _timed_and_streamed, launch_cmd)

from prism_core.config import EmulationConfig  # noqa: E402

from prism_core.replay.virtual_ops import ENV_PRELOAD  # noqa: E402


def _run(tmp: Path, steps: list[list[float]]) -> Path:
    (tmp / "results").mkdir(parents=True)
    for r, times in enumerate(steps):
        (tmp / "results" / f"{r}.json").write_text(json.dumps({"step_times_s": times}))
    return tmp


def test_steady_steps_have_no_step_noise(tmp_path: Path):
    assert _step_noise(_run(tmp_path, [[9.0] * 3 + [0.25] * 30, [9.0] * 3 + [0.25] * 30]), 2, 3) == 0.0


def test_step_noise_is_the_figures_spread_and_shrinks_with_more_steps(tmp_path: Path):
    rng = np.random.default_rng(1)
    short = list(0.25 * (1 + 0.12 * rng.standard_normal(27)))
    long = list(0.25 * (1 + 0.12 * rng.standard_normal(27 * 9)))
    # both ranks step together (the same steps drawn for both), as a synchronised job's do
    a = _step_noise(_run(tmp_path / "a", [[1.0] * 3 + short, [1.0] * 3 + short]), 2, 3)
    b = _step_noise(_run(tmp_path / "b", [[1.0] * 3 + long, [1.0] * 3 + long]), 2, 3)
    # a median of n draws of 12% noise: about 1.25 * 12% / sqrt(n)
    assert 0.015 < a < 0.045
    assert 0.005 < b < 0.015
    assert b < a / 2


def test_more_assistants_at_once_than_cores_share_half_the_memory(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    monkeypatch.setenv(ENV_PRELOAD, "1")      # the variable as it was is put back after the test
    monkeypatch.delenv(ENV_PRELOAD)
    slices = [["slice", "OUT", "GRAPH", "0", "0"], ["slice", "OUT", "GRAPH", "1", "0"]]
    _share_preload([["record", "OUT"], *slices])                       # two assistants on two cores
    assert ENV_PRELOAD not in os.environ
    co_run = ["co-run", "GRAPH", "A", "0", "B", "1"]
    _share_preload([["record", "OUT"], *slices, co_run])                # four: each takes an eighth
    share = int(os.environ[ENV_PRELOAD])
    with open("/proc/meminfo") as f:
        free = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    assert share >= 1 << 30 and (share == 1 << 30 or abs(share - free / 8) < 0.1 * free / 8)
    _share_preload([["record", "OUT"]])                                 # fits again: the variable goes
    assert ENV_PRELOAD not in os.environ


def test_a_timed_run_whose_assistant_streamed_is_flagged(tmp_path: Path):
    def run(name: str, stats: dict | None) -> Path:
        d = tmp_path / name
        (d / "replay").mkdir(parents=True)
        if stats is not None:
            (d / "replay" / "stats.json").write_text(json.dumps(stats))
        return d

    assert _timed_and_streamed(run("emulate_0", {"timed": True, "inputs_streamed": True}))
    assert not _timed_and_streamed(run("emulate_1", {"timed": True, "inputs_streamed": False}))
    assert not _timed_and_streamed(run("slice_0", {"timed": False, "inputs_streamed": True}))   # structure only
    assert not _timed_and_streamed(run("record", None))                                          # no assistant


def test_the_other_pace_reading_is_item_35s_way_against_the_default():
    default = EmulationConfig()
    assert (default.pace_reference, default.pace_steps) == ("timed", 10)
    assert _other_reference(default) == ("loaded", 1) and _other_steps(default) == 1
    former = default.model_copy(update={"pace_reference": "loaded", "pace_steps": 1})
    assert _other_reference(former) == ("alone", 10) and _other_steps(former) == 10
    assert _other_against(default) == "loaded" and _other_against(former) == "alone"
    assert _other_against(default.model_copy(update={"pace_reference": "alone"})) == "loaded"


def test_virtual_ranks_paired_with_sandbox_ranks_are_matched_by_default_and_the_other_way_is_paired():
    default = EmulationConfig()
    assert default.virtual_spans == "matched"
    assert _other_spans(default) == "paired"
    assert _other_spans(default.model_copy(update={"virtual_spans": "paired"})) == "timed"
    assert _other_spans(default.model_copy(update={"virtual_spans": "steady"})) == "timed"
    assert _other_spans(default.model_copy(update={"virtual_spans": "timed"})) == "paired"
    assert _other_spans(default.model_copy(update={"virtual_spans": "matched"})) == "paired"


def test_the_emulations_spans_set_on_the_command_line_reach_each_launch():
    cmd = launch_cmd(["record", "out"], "tiny_moe_w2_pp2", 10, 1, "co_run", virtual_spans="matched")
    at = cmd.index("--virtual-spans")
    assert cmd[at + 1] == "matched"
    assert "--virtual-spans" not in launch_cmd(["record", "out"], "tiny_moe_w2_pp2", 10, 1, "co_run")
    assert _load("pp2", 10, 1, virtual_spans="matched").emulation.virtual_spans == "matched"
    assert _load("pp2", 10, 1).emulation.virtual_spans == EmulationConfig().virtual_spans


def test_the_emulations_pace_reference_set_on_the_command_line_reaches_each_launch():
    cmd = launch_cmd(["record", "out"], "tiny_moe_w2_pp2", 10, 1, "co_run", pace_reference="alone")
    assert cmd[cmd.index("--pace-reference") + 1] == "alone"
    assert "--pace-reference" not in launch_cmd(["record", "out"], "tiny_moe_w2_pp2", 10, 1, "co_run")
    assert _load("pp2", 10, 1, pace_reference="alone").emulation.pace_reference == "alone"
    assert _load("pp2", 10, 1).emulation.pace_reference == EmulationConfig().pace_reference
