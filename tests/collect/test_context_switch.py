"""Context-switching collection: the bare graph equals the real run's structure; failures are named."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from prism_core.collect import CollectError, collect_context_switch
from prism_core.config import config_from_dict, load_config
from prism_core.record import RecordOptions, record
from prism_core.trace import load_trace, rank_hashes, structural_diff

from tests.jobs import assert_nothing_left, make_job

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def _same_structure_as_record(cfg, tmp_path: Path, slots: int):
    collected = collect_context_switch(cfg, tmp_path / "collect", slots=slots)
    record(cfg, tmp_path / "record", options=RecordOptions(memory=False, echo=False))
    real = load_trace(tmp_path / "record" / "trace.zarr")
    assert structural_diff(real, collected.trace) is None
    assert rank_hashes(real) == rank_hashes(load_trace(collected.path))
    return collected


@pytest.mark.timeout(300)
@pytest.mark.parametrize("slots", [1, pytest.param(2, marks=pytest.mark.slow)])   # K=1 switches the most
def test_moe_w4_dp2_ep2_bare_graph_equals_real_run(tmp_path, slots):
    cfg = load_config(CONFIGS / "tiny_moe_w2_pp2.yaml", ["job.world_size=4", "parallel.dp=2", "parallel.ep=2",
                                                         "parallel.microbatches=4", "job.iterations=3"])
    collected = _same_structure_as_record(cfg, tmp_path, slots)
    assert collected.switches > 0


@pytest.mark.timeout(300)
@pytest.mark.parametrize("script,world,slots", [("pipeline_1f1b", 2, 1), ("tp_fsdp_mesh", 4, 2)])
def test_torch_api_script_bare_graph_equals_real_run(tmp_path, script, world, slots):
    cfg = config_from_dict({"name": script, "job": {"program": str(SCRIPTS / f"{script}.py"), "world_size": world,
                                                    "iterations": 3, "warmup": 1, "args": ["--steps", "3"]}})
    _same_structure_as_record(cfg, tmp_path, slots=slots)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_moe_w16_on_two_slots_equals_real_run(tmp_path):
    cfg = load_config(CONFIGS / "moe_w16.yaml", ["job.iterations=3"])
    _same_structure_as_record(cfg, tmp_path, slots=2)


@pytest.mark.timeout(120)
def test_mismatched_collectives_are_named(tmp_path):
    config, script = make_job(tmp_path, """
        dist.init_process_group("gloo")
        x = torch.ones(8)
        dist.all_reduce(x)
        if dist.get_rank() == 0:
            dist.all_reduce(x)
        else:
            dist.broadcast(x, 0)
    """)
    start = time.monotonic()
    with pytest.raises(CollectError, match="mismatched collectives") as info:
        collect_context_switch(load_config(config), tmp_path / "out", slots=1)
    assert time.monotonic() - start < 30
    assert "broadcast" in str(info.value) and "allreduce" in str(info.value)
    assert_nothing_left(tmp_path, script)


@pytest.mark.timeout(120)
def test_deadlock_names_the_blocked_ranks_and_ops(tmp_path):
    config, script = make_job(tmp_path, """
        dist.init_process_group("gloo")
        x = torch.ones(4)
        dist.recv(x, src=1 - dist.get_rank())   # both ranks receive first: nobody can send
    """)
    with pytest.raises(CollectError, match="deadlocked") as info:
        collect_context_switch(load_config(config), tmp_path / "out", slots=2)
    message = str(info.value)
    assert "rank 0 waits in send" in message and "rank 1 waits in send" in message
    assert_nothing_left(tmp_path, script)


@pytest.mark.timeout(120)
def test_a_failing_rank_is_reported_with_its_traceback(tmp_path):
    config, script = make_job(tmp_path, """
        dist.init_process_group("gloo")
        dist.barrier()
        if dist.get_rank() == 1:
            raise ValueError("collect boom")
        dist.barrier()
    """)
    with pytest.raises(CollectError, match="rank 1 failed") as info:
        collect_context_switch(load_config(config), tmp_path / "out", slots=1)
    assert "ValueError: collect boom" in str(info.value)
    assert_nothing_left(tmp_path, script)


@pytest.mark.timeout(300)
def test_every_rank_communication_inputs_land_in_the_tensor_cache(tmp_path):
    from prism_core.cache import TensorCacheReader

    cfg = load_config(CONFIGS / "tiny_moe_w2_pp2.yaml", ["job.iterations=3"])
    collect_context_switch(cfg, tmp_path, slots=1)
    sent = {}
    for rank in range(2):
        with TensorCacheReader(tmp_path / "tensors.zarr", rank) as reader:
            keys = reader.keys()
            assert keys, f"rank {rank} cached nothing"
            sent[rank] = {k: reader.get(k) for k in keys if k.startswith("p/")}
    # stage 0 sends activations to stage 1, stage 1 sends gradients back: both sides cached
    assert any(k.split("/")[2:4] == ["0", "1"] for k in sent[0])
    assert any(k.split("/")[2:4] == ["1", "0"] for k in sent[1])
    assert all(t.dtype == torch.float32 and t.numel() > 0 for t in sent[0].values())


@pytest.mark.timeout(120)
def test_k_slots_hold_from_the_first_line_of_the_program(tmp_path):
    # work before init_process_group (imports, model building) is also limited to K ranks at once
    config, script = make_job(tmp_path, f"""
        (Path({str(tmp_path)!r}) / f"start_{{os.environ['RANK']}}").write_text(str(time.time()))
        time.sleep(1.0)
        dist.init_process_group("gloo")
        dist.barrier()
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            model(torch.ones(2)).sum().backward()
            opt.step()
    """)
    collect_context_switch(load_config(config), tmp_path / "out", slots=1)
    starts = sorted(float((tmp_path / f"start_{r}").read_text()) for r in range(2))
    assert starts[1] - starts[0] >= 0.9, starts
    assert_nothing_left(tmp_path, script)
