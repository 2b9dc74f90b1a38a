"""The `moe_gpt` training loop, run in each rank process by the launcher (`builtin:moe_gpt`)."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from prism_core import runtime
from prism_core.annotations import annotate
from prism_core.topology import Topology
from prism_core.workloads.moe_gpt import parallel_state
from prism_core.workloads.moe_gpt.data import DataPath
from prism_core.workloads.moe_gpt.model import ModelChunk
from prism_core.workloads.moe_gpt.optimizer import MegatronOptimizer
from prism_core.workloads.moe_gpt.schedule import PipelineExecutor


def main(cfg) -> None:
    torch.manual_seed(cfg.job.seed)
    timeout = datetime.timedelta(seconds=cfg.job.timeout_s)
    dist.init_process_group("gloo", timeout=timeout)
    topo = Topology.from_config(cfg)
    if dist.get_world_size() != topo.world_size:
        raise RuntimeError(f"launched with WORLD_SIZE={dist.get_world_size()} but the config's layout needs "
                           f"{topo.world_size} ranks")
    rank = dist.get_rank()
    state = parallel_state.build(topo, rank, cfg.parallel.vpp, timeout)
    data = DataPath(cfg, state)
    data.broadcast_status()

    m, par = cfg.model, cfg.parallel
    chunks = [ModelChunk(cfg, state, c, aux_scale=m.moe_aux_loss_coeff / par.microbatches)
              for c in range(par.vpp)]
    params = [p for chunk in chunks for p in chunk.parameters()]
    optimizer = MegatronOptimizer(params, state, m.lr, distributed=par.distributed_optimizer, kind=m.optimizer)
    executor = PipelineExecutor(state, chunks, (m.micro_batch_size, m.seq_length, m.hidden_size),
                                par.microbatches, overlap=par.overlap_p2p)
    last_stage = state.coord.pp == topo.pp - 1
    reporter = rank == topo.world_size - 1
    rt = runtime.current()

    for step in range(cfg.job.iterations):
        runtime.iteration_start()
        optimizer.zero_grad()
        losses = executor.run(lambda mb: data.batch(step, mb))
        with annotate("optim"):
            optimizer.step()
        if last_stage:
            loss = torch.tensor(sum(losses) / len(losses), dtype=torch.float64)
            if state.group("dp") is not None:
                dist.all_reduce(loss, group=state.group("dp"))
            loss = float(loss) / topo.dp
            runtime.log_scalar("loss", loss)
            if reporter:
                took = f" {rt.step_times()[-1]:.3f}s" if rt is not None and rt.step_times() else ""
                print(f"step {step + 1}/{cfg.job.iterations} loss {loss:.6f}{took}", flush=True)
    dist.barrier()
    dist.destroy_process_group()

