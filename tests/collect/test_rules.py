"""Rules-mode collection: ranks alone against a fake world, one DP replica expanded, rules from the config."""

from __future__ import annotations

from pathlib import Path

import pytest

from prism_core.cache import CacheError
from prism_core.collect import CollectError, collect_context_switch, collect_rules
from prism_core.config import config_from_dict, load_config
from prism_core.record import RecordOptions, record
from prism_core.trace import TraceError, load_trace, structural_diff

from tests.jobs import assert_nothing_left, make_job

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
W4 = ["job.world_size=4", "parallel.dp=2", "parallel.microbatches=4", "job.iterations=3"]


def _equals_record(cfg, tmp_path):
    collected = collect_rules(cfg, tmp_path / "rules", slots=2)
    record(cfg, tmp_path / "record", options=RecordOptions(memory=False, echo=False))
    assert structural_diff(load_trace(tmp_path / "record" / "trace.zarr"), collected.trace) is None
    return collected


@pytest.mark.timeout(300)
def test_one_replica_with_rules_equals_the_real_run(tmp_path):
    cfg = load_config(CONFIGS / "tiny_moe_w2_pp2.yaml", W4)
    collected = _equals_record(cfg, tmp_path)
    assert collected.switches == 2          # ranks run: one per (tp, pp), not all four


@pytest.mark.timeout(300)
def test_tp_with_balanced_routing_equals_the_real_run(tmp_path):
    cfg = load_config(CONFIGS / "tiny_moe_w2_pp2.yaml",
                      W4[:1] + ["parallel.pp=1", "parallel.tp=2", "parallel.dp=2", "parallel.ep=2",
                                "parallel.microbatches=2", "job.iterations=3", "model.moe_router=balanced"])
    _equals_record(cfg, tmp_path)


@pytest.mark.timeout(300)
def test_value_dependent_sizes_without_a_rule_are_reported(tmp_path):
    # learned routing on filler values: TP peers route differently, so the sizes of the expert
    # all-reduce (tokens received through EP) disagree between them
    cfg = load_config(CONFIGS / "tiny_moe_w2_pp2.yaml",
                      W4[:1] + ["parallel.pp=1", "parallel.tp=2", "parallel.dp=2", "parallel.ep=2",
                                "parallel.microbatches=2", "job.iterations=3"])
    with pytest.raises(TraceError, match="disagrees in size"):
        collect_rules(cfg, tmp_path, slots=2)


# slow: the two-rank case below keeps the cached all-to-alls in the fast path
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_learned_routing_from_the_tensor_cache_equals_the_real_run(tmp_path):
    # the same job, its value-dependent sizes answered from an earlier collection's tensor cache;
    # every rank collected, since each DP replica routes its own data
    overrides = W4[:1] + ["parallel.pp=1", "parallel.tp=2", "parallel.dp=2", "parallel.ep=2",
                          "parallel.microbatches=2", "job.iterations=3"]
    cfg = load_config(CONFIGS / "tiny_moe_w2_pp2.yaml", overrides)
    collect_context_switch(cfg, tmp_path / "cs", slots=2)
    cached = load_config(CONFIGS / "tiny_moe_w2_pp2.yaml", overrides + [
        "emulation.collect_mode=rules", "emulation.dp_dedup=false",
        f"emulation.tensor_cache={tmp_path / 'cs' / 'tensors.zarr'}"])
    _equals_record(cached, tmp_path)
    # dedup would rename replica 0's routing onto replica 1: a graph that is valid but not this job's
    deduped = load_config(CONFIGS / "tiny_moe_w2_pp2.yaml", overrides + [
        "emulation.collect_mode=rules", f"emulation.tensor_cache={tmp_path / 'cs' / 'tensors.zarr'}"])
    record_trace = load_trace(tmp_path / "record" / "trace.zarr")
    assert structural_diff(record_trace, collect_rules(deduped, tmp_path / "dedup", slots=2).trace) is not None


@pytest.mark.timeout(300)
def test_learned_all_to_alls_of_two_ranks_from_the_tensor_cache_equal_the_real_run(tmp_path):
    # ep2 with learned routing: the all-to-alls' uneven splits follow each rank's data; the rules
    # answer them from the cache (each rank collected: dedup would rename one replica's routing)
    overrides = ["job.iterations=3"]
    cfg = load_config(CONFIGS / "tiny_moe_w2_ep2.yaml", overrides)
    collect_context_switch(cfg, tmp_path / "cs", slots=2)
    cached = load_config(CONFIGS / "tiny_moe_w2_ep2.yaml", overrides + [
        "emulation.collect_mode=rules", "emulation.dp_dedup=false",
        f"emulation.tensor_cache={tmp_path / 'cs' / 'tensors.zarr'}"])
    collected = _equals_record(cached, tmp_path)
    splits = collected.trace.columns["splits"]
    assert (splits > 0).any()


@pytest.mark.timeout(300)
def test_pipelining_script_with_the_tensor_cache_equals_the_real_run(tmp_path):
    # torch.distributed.pipelining sends its shape metadata with send_object_list: no rule can
    # guess it, the cache holds it
    job = {"program": str(SCRIPTS / "pipeline_1f1b.py"), "world_size": 2, "iterations": 3, "warmup": 1,
           "args": ["--steps", "3"]}
    plain = config_from_dict({"name": "pp", "job": job})
    with pytest.raises(CollectError, match="rank"):
        collect_rules(plain, tmp_path / "no_cache", slots=2)
    collect_context_switch(plain, tmp_path / "cs", slots=1)
    cfg = config_from_dict({"name": "pp", "job": job, "emulation": {
        "collect_mode": "rules", "tensor_cache": str(tmp_path / "cs" / "tensors.zarr")}})
    _equals_record(cfg, tmp_path)


def test_a_tensor_cache_that_is_not_one_is_refused(tmp_path):
    cfg = load_config(CONFIGS / "tiny_moe_w2_pp2.yaml", ["emulation.collect_mode=rules",
                                                         f"emulation.tensor_cache={tmp_path}"])
    with pytest.raises(CacheError, match="is not a tensor cache"):
        collect_rules(cfg, tmp_path / "out", slots=2)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_moe_w16_rules_with_dp_dedup_equals_the_real_run(tmp_path):
    # balanced routing: rules alone, one DP replica; learned routing (the config's): every rank,
    # alone, with the tensor cache of a context-switching collection
    cfg = load_config(CONFIGS / "moe_w16.yaml", ["job.iterations=3", "model.moe_router=balanced"])
    _equals_record(cfg, tmp_path / "balanced")
    learned = load_config(CONFIGS / "moe_w16.yaml", ["job.iterations=3"])
    collect_context_switch(learned, tmp_path / "cs", slots=2)
    cached = load_config(CONFIGS / "moe_w16.yaml", ["job.iterations=3", "emulation.collect_mode=rules",
                                                    "emulation.dp_dedup=false",
                                                    f"emulation.tensor_cache={tmp_path / 'cs' / 'tensors.zarr'}"])
    _equals_record(cached, tmp_path / "learned")


RULE_MODULE = '''
import torch

def magic_flag(op):
    if op.kind == "broadcast" and op.outputs and op.outputs[0].numel() == 1 and op.root != op.group_rank:
        return [torch.tensor([7.0])]
    return None
'''

FLAG_SCRIPT = """
    dist.init_process_group("gloo")
    flag = torch.tensor([7.0]) if dist.get_rank() == 0 else torch.zeros(1)
    dist.broadcast(flag, 0)
    if flag.item() != 7.0:
        raise ValueError(f"rank {dist.get_rank()} got flag {flag.item()}")
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        dist.all_reduce(torch.ones(2))
        model(torch.ones(2)).sum().backward()
        opt.step()
"""


@pytest.mark.timeout(120)
def test_a_rule_named_in_the_config_answers_and_its_absence_is_reported(tmp_path, monkeypatch):
    (tmp_path / "my_rules.py").write_text(RULE_MODULE)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    config, script = make_job(tmp_path, FLAG_SCRIPT, name="flag")
    with pytest.raises(CollectError, match="rank 1 got flag 0.0"):
        collect_rules(load_config(config), tmp_path / "without", slots=2)
    assert_nothing_left(tmp_path, script)
    cfg = load_config(config, ["emulation.rules=my_rules:magic_flag"])
    collected = collect_rules(cfg, tmp_path / "with", slots=2)
    assert collected.trace.world_size == 2
    assert_nothing_left(tmp_path, script)
