"""The report's plots: which ranks are drawn, memory samples of one step, PNGs written."""

from __future__ import annotations

import numpy as np

from prism_core.report import plots


def test_sampled_ranks_put_the_ranks_of_interest_first_and_spread_the_rest():
    ranks = plots.sample_ranks(64, [63, 0], others=4)
    assert ranks[:2] == [0, 63] and len(ranks) == 6 and len(set(ranks)) == 6
    assert plots.sample_ranks(2, [1]) == [1, 0]


def test_memory_samples_cover_one_step_from_its_start(tmp_path):
    part = tmp_path / "0.npz"
    steps = np.array([0, 0, 1, 1, 1, 2])
    t_start = np.array([0.0, 1.0, 2.0, 3.0, 4.0, 5.0])
    np.savez(part, step=steps, t_start=t_start, t_end=t_start + 0.5,
             live_node=np.array([0, 2, 4, 5]), live_bytes=np.array([10, 20, 40, 5]))
    t, b = plots.memory_samples(part, 1)
    assert np.allclose(t, [0.5, 2.5]) and b.tolist() == [20.0, 40.0]
    assert plots.memory_samples(part, 7) is None
    np.savez(tmp_path / "old.npz", step=steps, t_start=t_start, t_end=t_start)   # a part without samples
    assert plots.memory_samples(tmp_path / "old.npz", 1) is None


def test_history_and_memory_plots_are_written(tmp_path):
    points = [(1, {"ranks": {"0": {"iteration_time_s": 0.1, "peak_memory_bytes": 2 << 20}}}),
              (2, {"ranks": {"0": {"iteration_time_s": 0.12, "peak_memory_bytes": 2 << 20},
                             "3": {"iteration_time_s": None, "peak_memory_bytes": None}}})]
    assert plots.history(points, tmp_path / "h.png").read_bytes()[:4] == b"\x89PNG"
    samples = {0: (np.array([0.0, 0.01]), np.array([1e6, 2e6]))}
    assert plots.memory(samples, tmp_path / "m.png").read_bytes()[:4] == b"\x89PNG"
    assert not list(tmp_path.glob(".*"))
