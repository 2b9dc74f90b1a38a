"""moe_w16 emulated with ranks 0 and 15 real: each one's peak memory equals `prism record`'s to the
byte, and with a device capacity the real run cannot meet, the emulation runs out at the same rank
and step; hosting only their neighbours (`emulation.virtual_ranks: neighbours`), too, and they train
bit for bit as beside every virtual rank. (The real 16-rank run is contended on 2 cores: only memory
is compared.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prism_core.calibrate.stage import time_and_calibrate
from prism_core.collect.stage import collect
from prism_core.config import load_config
from prism_core.emulate.stage import emulate
from prism_core.record import RecordOptions, record

from tests.jobs import assert_no_rank_processes

CONFIGS = Path(__file__).resolve().parents[2] / "configs"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def test_moe_w16_memory_and_oom_equal_the_real_run(tmp_path):
    cfg = load_config(CONFIGS / "moe_w16.yaml", ["job.iterations=3", "emulation.virtual_ranks=all"])
    roi = sorted(cfg.emulation.ranks_of_interest)
    real = record(cfg, tmp_path / "record", options=RecordOptions(echo=False))
    graph = collect(cfg, tmp_path / "collect")
    predicted = time_and_calibrate(cfg, graph.trace, graph.directory, tmp_path / "timing", tmp_path / "calibrate")
    timeline = tmp_path / "calibrate" / "timeline.npz"
    doc = emulate(cfg, graph.directory, timeline, tmp_path / "emulate", predicted)
    assert doc["mode"] == "emulated" and sorted(map(int, doc["ranks"])) == roi
    for r in map(str, roi):
        assert doc["ranks"][r]["peak_memory_bytes"] == real["ranks"][r]["peak_memory_bytes"]
    assert doc["emulation"]["groups_instantiated"] < doc["emulation"]["groups_in_job"]
    near = cfg.model_copy(update={"emulation": cfg.emulation.model_copy(update={"virtual_ranks": "neighbours"})})
    doc_near = emulate(near, graph.directory, timeline, tmp_path / "emulate_near", predicted)
    assert doc_near["emulation"]["virtual_ranks"] < doc["emulation"]["virtual_ranks"] == 14
    assert load_config(CONFIGS / "moe_w16.yaml").emulation.virtual_ranks == "neighbours"     # the default
    # every input folded into a compensated chunk was read ahead, the absent ranks' too
    assert json.loads((tmp_path / "emulate_near" / "replay" / "stats.json").read_text())["inputs_read_on_demand"] == 0
    for r in map(str, roi):
        assert doc_near["ranks"][r]["peak_memory_bytes"] == real["ranks"][r]["peak_memory_bytes"]
        losses = [json.loads((tmp_path / d / "results" / f"{r}.json").read_text())["scalars"].get("loss")
                  for d in ("emulate", "emulate_near")]
        assert losses[0] == losses[1]
    # a capacity between the two ranks of interest's peaks: only the larger one runs out
    peaks = {r: real["ranks"][str(r)]["peak_memory_bytes"] for r in roi}
    big, small = max(peaks, key=peaks.get), min(peaks, key=peaks.get)
    assert peaks[big] > peaks[small]
    capacity = (peaks[big] + peaks[small]) // 2
    bounded = cfg.model_copy(update={"job": cfg.job.model_copy(update={"device_memory_bytes": capacity})})
    real_oom = record(bounded, tmp_path / "record_oom", options=RecordOptions(echo=False))
    assert "oom" in real_oom and small not in real_oom["oom"]["ranks"]
    # the step at which `big` passes the capacity in the real run: its first step whose peak does
    # (the bounded real run stops at whichever rank runs out first, maybe another one)
    step_peaks = json.loads((tmp_path / "record" / "results" / f"{big}.json").read_text())["step_peaks"]
    first_over = next(k for k, p in enumerate(step_peaks) if p is not None and p > capacity)
    if big in real_oom["oom"]["ranks"]:
        assert real_oom["ranks"][str(big)]["oom_step"] == first_over
    for name, run in (("emulate_oom", bounded), ("emulate_near_oom", bounded.model_copy(
            update={"emulation": near.emulation}))):
        emulated_oom = emulate(run, graph.directory, timeline, tmp_path / name, predicted)
        assert emulated_oom["oom"]["ranks"] == [big], name
        assert emulated_oom["ranks"][str(big)]["oom_step"] == first_over, name
    assert_no_rank_processes()
