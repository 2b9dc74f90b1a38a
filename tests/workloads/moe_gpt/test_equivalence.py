"""Every parallel layout of moe_gpt computes the single-rank run's losses, and the loss falls."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prism_core.config import PrismConfig, load_config
from prism_core.record import record

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
STEPS = ["job.iterations=3", "job.warmup=1"]


def _losses(cfg: PrismConfig, out: Path) -> list[float]:
    record(cfg, out, echo=False)
    last = json.loads((out / "results" / f"{cfg.job.world_size - 1}.json").read_text())
    return last["scalars"]["loss"]


# single-rank losses by the reference's config (less its name): pp2, dp2, ep2 and the W=4 layout
# without SGD all come down to the same single-rank run
_REFERENCES: dict[str, list[float]] = {}


def _reference_losses(cfg: PrismConfig, out: Path) -> list[float]:
    key = json.dumps(cfg.model_dump(mode="json", exclude={"name"}), sort_keys=True)
    if key not in _REFERENCES:
        _REFERENCES[key] = _losses(cfg, out)
    return _REFERENCES[key]


def _single_rank(cfg: PrismConfig) -> list[str]:
    """Overrides that run the same global batch on one rank."""
    p = cfg.parallel
    return ["job.world_size=1", "parallel.tp=1", "parallel.pp=1", "parallel.vpp=1", "parallel.dp=1",
            "parallel.ep=1", f"parallel.microbatches={p.microbatches * p.dp}", "parallel.distributed_optimizer=false"]


CASES = {
    "pp2": ("tiny_moe_w2_pp2.yaml", []),
    "dp2": ("tiny_moe_w2_dp2.yaml", []),
    "tp2": ("tiny_moe_w2_tp2.yaml", []),
    "ep2": ("tiny_moe_w2_ep2.yaml", []),
    # (Adam; the same layout with SGD below is the fast path)
    "w4-pp2-vpp2-dp2-ep2-distopt": ("tiny_moe_w2_pp2.yaml", [
        "job.world_size=4", "parallel.dp=2", "parallel.ep=2", "parallel.vpp=2", "parallel.microbatches=4",
        "parallel.distributed_optimizer=true"]),
    "pp2-tied-recompute-no-overlap-naive": ("tiny_moe_w2_pp2.yaml", [
        "model.tie_embeddings=true", "model.recompute=true", "parallel.overlap_p2p=false", "model.attention=naive"]),
    # SGD: any error in gradient scale (DP averaging, expert-DP, TP or embedding sums) changes the losses
    "sgd-w4-pp2-vpp2-dp2-ep2-distopt-tied": ("tiny_moe_w2_pp2.yaml", [
        "job.world_size=4", "parallel.dp=2", "parallel.ep=2", "parallel.vpp=2", "parallel.microbatches=4",
        "parallel.distributed_optimizer=true", "model.tie_embeddings=true", "model.optimizer=sgd", "model.lr=2.0"]),
    "sgd-tp2": ("tiny_moe_w2_tp2.yaml", ["model.optimizer=sgd", "model.lr=2.0"]),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c == "w4-pp2-vpp2-dp2-ep2-distopt"
                                  else c for c in CASES])
def test_first_losses_equal_single_rank_run(case, tmp_path):
    config, overrides = CASES[case]
    cfg = load_config(CONFIGS / config, overrides + STEPS)
    parallel = _losses(cfg, tmp_path / "parallel")
    reference = _reference_losses(load_config(CONFIGS / config, overrides + STEPS + _single_rank(cfg)),
                                  tmp_path / "single")
    assert len(parallel) == len(reference) == 3
    for step, (a, b) in enumerate(zip(parallel, reference)):
        assert a == pytest.approx(b, rel=1e-5), f"step {step}: {case} loss {a} vs single-rank {b}"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_all_four_parallelisms_at_once_equal_single_rank(tmp_path):
    overrides = ["job.world_size=8", "parallel.tp=2", "parallel.dp=2", "parallel.ep=2", "parallel.vpp=2",
                 "parallel.microbatches=4", "parallel.distributed_optimizer=true"] + STEPS
    cfg = load_config(CONFIGS / "tiny_moe_w2_pp2.yaml", overrides)
    parallel = _losses(cfg, tmp_path / "parallel")
    reference = _losses(load_config(CONFIGS / "tiny_moe_w2_pp2.yaml", overrides + _single_rank(cfg)),
                        tmp_path / "single")
    assert parallel == pytest.approx(reference, rel=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_moe_w16_records_every_rank(tmp_path):
    cfg = load_config(CONFIGS / "moe_w16.yaml", ["job.iterations=3"])
    document = record(cfg, tmp_path, echo=False)
    assert document["mode"] == "real" and document["world_size"] == 16
    assert sorted(map(int, document["ranks"])) == list(range(16))
    for rank in document["ranks"].values():
        assert len(rank["step_times_s"]) == 2 and rank["iteration_time_s"] > 0


@pytest.mark.timeout(300)
def test_loss_falls_over_20_steps(tmp_path):
    cfg = load_config(CONFIGS / "tiny_moe_w2_dp2.yaml", ["job.iterations=20", "job.warmup=1"])
    losses = _losses(cfg, tmp_path)
    assert len(losses) == 20
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < first - 0.5, f"loss did not fall: {losses}"
