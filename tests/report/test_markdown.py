"""The markdown report names every rank of interest with its emulated and predicted figures, OOMs,
the whole job's spread and what the emulation instantiated."""

from __future__ import annotations

from prism_core.config import config_from_dict
from prism_core.report.markdown import render_report, write_report


def _cfg():
    return config_from_dict({"name": "r", "job": {"program": "builtin:moe_gpt", "world_size": 4, "iterations": 3,
                                                  "warmup": 1, "device_memory_bytes": 1000},
                             "parallel": {"pp": 4, "microbatches": 4},
                             "emulation": {"ranks_of_interest": [0, 3]}})


def test_report_holds_the_key_figures(tmp_path):
    emulated = {"mode": "emulated", "world_size": 4, "ranks": {
        "0": {"iteration_time_s": 0.110, "step_times_s": [0.11], "peak_memory_bytes": 900, "oom": False},
        "3": {"iteration_time_s": None, "step_times_s": [], "peak_memory_bytes": 1000, "oom": True, "oom_step": 1}},
        "oom": {"ranks": [3], "step": 1, "message": "torch.OutOfMemoryError: over capacity"},
        "emulation": {"virtual_ranks": 2, "groups_in_job": 9, "groups_instantiated": 3, "gloo_groups": 4,
                      "nodes": 1234, "wall_s": 2.0, "cpu_s": 0.5,
                      "follow_pace": {"ranks": [0, 3], "off": None, "updates": 9, "median": 1.04}}}
    predicted = {"mode": "predicted", "world_size": 4, "ranks": {
        str(r): {"iteration_time_s": t, "uncalibrated_iteration_time_s": 0.09} for r, t in
        enumerate([0.100, 0.120, 0.105, 0.115])}}
    text = render_report(_cfg(), emulated, predicted, {"bare graph": "g/"})
    assert "| 0 | 110.00 ms | 100.00 ms | +10.00% | 900 B" in text
    assert "| 3 | – | 115.00 ms | – | 1,000 B" in text and "yes (step 1)" in text
    assert "rank(s) [3] at step 1" in text and "over capacity" in text
    assert "median 110.00 ms, min 100.00 ms, max 120.00 ms" in text
    assert "slowest ranks: 1 (120.00 ms), 3 (115.00 ms)" in text
    assert "3 of the job's 9 instantiated" in text and "virtual ranks: 2" in text
    assert "followed the pace of ranks [0, 3]: median 1.04" in text
    path = write_report(tmp_path / "out" / "report.md", text)
    assert path.read_text() == text and not list(path.parent.glob(".*"))
    # hosting only the ranks of interest's neighbours (emulation.virtual_ranks), it says of how many
    emulated["emulation"].update(hosted="neighbours", virtual_ranks_in_job=2)
    emulated["emulation"]["virtual_ranks"] = 1
    text = render_report(_cfg(), emulated, predicted, {"bare graph": "g/"})
    assert "virtual ranks: 1 replayed (the ranks of interest's neighbours) of the job's 2, 1,234 nodes" in text
