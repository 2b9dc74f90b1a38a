"""Two-stage pipeline-parallel MLP with torch.distributed.pipelining, Schedule1F1B (run with W=2).

4 microbatches per step; the loss lives on the last stage, so rank 1 prints/writes the losses.
"""
import argparse
import json
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

N_MICRO = 4


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--losses-out", default=None)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 2, "pipeline_1f1b.py expects exactly 2 ranks"

    torch.manual_seed(0)  # build the full model identically on every rank, keep one half
    full = nn.Sequential(
        nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),  # stage 0
        nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1),  # stage 1
    )
    part = full[:4] if rank == 0 else full[4:]
    stage = PipelineStage(part, stage_index=rank, num_stages=world, device=torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=N_MICRO, loss_fn=nn.functional.mse_loss)
    opt = torch.optim.SGD(part.parameters(), lr=0.1)

    gen = torch.Generator().manual_seed(1000)  # same full batch on both ranks
    x = torch.randn(64, 16, generator=gen)
    y = x[:, :1] * 0.5 - x[:, 1:2] + 0.1 * torch.randn(64, 1, generator=gen)

    last = rank == world - 1
    losses = []
    for step in range(args.steps):
        opt.zero_grad()
        if rank == 0:
            schedule.step(x)
        else:
            mb_losses = []
            schedule.step(target=y, losses=mb_losses)
            losses.append(torch.stack(mb_losses).mean().item())
            print(f"loss {step} {losses[-1]!r}", flush=True)
        opt.step()

    if last and args.losses_out:
        with open(args.losses_out, "w") as f:
            json.dump(losses, f)
    # Same teardown guard as ddp.py / tp_fsdp_mesh.py: let gloo's worker threads release their
    # last ops (which may need the GIL) before the interpreter exits (torch 2.13 abort-at-exit race).
    time.sleep(0.2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
