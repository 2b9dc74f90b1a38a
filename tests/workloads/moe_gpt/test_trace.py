"""moe_gpt under `prism record`: valid traces, the 1F1B pattern in labels, reproducible structure and memory."""

from __future__ import annotations

from pathlib import Path

import pytest

from prism_core.config import load_config
from prism_core.record import record
from prism_core.trace import load_trace, problems, rank_hashes, structural_diff
from prism_core.trace.schema import COMPUTE
from prism_core.topology import Topology
from prism_core.workloads.moe_gpt.schedule import pipeline_order

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
LAYOUTS = {
    "tp2-pp2": ["job.world_size=4", "parallel.tp=2", "parallel.pp=2", "parallel.microbatches=4"],
    "dp2-ep2": ["job.world_size=4", "parallel.pp=2", "parallel.dp=2", "parallel.ep=2", "parallel.microbatches=4"],
}


def _labelled_steps(trace, rank: int, step: int) -> list[tuple[str, int, int]]:
    """The fwd/bwd compute of one step as (F|B, chunk, mb), consecutive repeats collapsed."""
    c = trace.rank(rank)
    out = []
    for kind, label, mb, chunk, st in zip(c["kind"], c["label"], c["mb"], c["chunk"], c["step"]):
        name = trace.labels[label]
        if kind == COMPUTE and st == step and name in ("fwd", "bwd"):
            item = ("F" if name == "fwd" else "B", int(chunk), int(mb))
            if not out or out[-1] != item:
                out.append(item)
    return out


@pytest.fixture(scope="module", params=list(LAYOUTS))
def two_runs(request, tmp_path_factory):
    overrides = LAYOUTS[request.param] + ["job.iterations=3", "job.warmup=1"]
    cfg = load_config(CONFIGS / "tiny_moe_w2_pp2.yaml", overrides)
    runs = []
    for i in range(2):
        out = tmp_path_factory.mktemp(f"{request.param}-{i}")
        runs.append((record(cfg, out, echo=False), load_trace(out / "trace.zarr")))
    return cfg, runs


@pytest.mark.timeout(300)
def test_trace_is_valid(two_runs):
    _, runs = two_runs
    for _, trace in runs:
        assert trace.world_size == 4
        assert problems(trace) == []


@pytest.mark.timeout(300)
def test_trace_shows_1f1b_with_labelled_microbatches(two_runs):
    cfg, runs = two_runs
    trace = runs[0][1]
    topo = Topology.from_config(cfg)
    for rank in range(4):
        pp_rank = topo.coord(rank).pp
        expected = [(s.kind, s.chunk, s.mb) for s in pipeline_order(topo.pp, 1, cfg.parallel.microbatches, pp_rank)]
        assert _labelled_steps(trace, rank, step=1) == expected, f"rank {rank} (stage {pp_rank})"
    # stage 0 warms up with pp-1 forwards, the last stage alternates from the start
    assert [k for k, _, _ in _labelled_steps(trace, 0, 1)][:3] == ["F", "F", "B"]
    assert [k for k, _, _ in _labelled_steps(trace, 3, 1)][:3] == ["F", "B", "F"]


@pytest.mark.timeout(300)
def test_structure_and_peak_memory_repeat_exactly(two_runs):
    _, ((doc_a, trace_a), (doc_b, trace_b)) = two_runs
    assert rank_hashes(trace_a) == rank_hashes(trace_b)
    assert structural_diff(trace_a, trace_b) is None
    peaks_a = {r: m["peak_memory_bytes"] for r, m in doc_a["ranks"].items()}
    peaks_b = {r: m["peak_memory_bytes"] for r, m in doc_b["ranks"].items()}
    assert all(isinstance(p, int) and p > 0 for p in peaks_a.values())
    assert peaks_a == peaks_b
