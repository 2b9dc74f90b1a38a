"""`prism record`: exact peak memory, and a device capacity that runs out exactly where the peak says."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prism_core.config import ConfigError, load_config
from prism_core.record import check_fits, record

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
STEPS = ["job.iterations=3", "job.warmup=0"]


@pytest.mark.timeout(300)
def test_capacity_at_the_measured_peak_fits_and_one_byte_less_runs_out(tmp_path):
    base = load_config(CONFIGS / "tiny_moe_w2_dp2.yaml", STEPS)
    doc = record(base, tmp_path / "free", echo=False)
    peak = max(r["peak_memory_bytes"] for r in doc["ranks"].values())
    assert peak > 0

    fits = record(load_config(CONFIGS / "tiny_moe_w2_dp2.yaml", STEPS + [f"job.device_memory_bytes={peak}"]),
                  tmp_path / "fits", echo=False)
    assert "oom" not in fits and not any(r["oom"] for r in fits["ranks"].values())
    assert {r: m["peak_memory_bytes"] for r, m in fits["ranks"].items()} == \
        {r: m["peak_memory_bytes"] for r, m in doc["ranks"].items()}

    short = record(load_config(CONFIGS / "tiny_moe_w2_dp2.yaml", STEPS + [f"job.device_memory_bytes={peak - 1}"]),
                   tmp_path / "short", echo=False)
    worst = [r for r, m in doc["ranks"].items() if m["peak_memory_bytes"] == peak]
    assert short["oom"]["ranks"] and set(map(str, short["oom"]["ranks"])) <= set(doc["ranks"])
    assert any(str(r) in worst for r in short["oom"]["ranks"])
    assert "out of memory" in short["oom"]["message"]
    written = json.loads((tmp_path / "short" / "metrics.json").read_text())
    assert written["oom"] == short["oom"]
    oom_rank = written["ranks"][str(short["oom"]["ranks"][0])]
    assert oom_rank["oom"] is True and oom_rank["oom_step"] == short["oom"]["step"]


def test_a_world_too_large_for_this_machine_is_refused():
    with pytest.raises(ConfigError, match="job.world_size: recording 100000 ranks"):
        check_fits(100_000)
