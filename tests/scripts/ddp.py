"""Tiny MLP trained with DistributedDataParallel over gloo on CPU (run with W=2).

Each rank sees different (seeded) data; rank 0 prints `loss <step> <repr(loss)>` per step.
"""
import argparse
import json
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--losses-out", default=None)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()

    torch.manual_seed(0)  # identical init on every rank (DDP also broadcasts rank 0's)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)

    gen = torch.Generator().manual_seed(1000 + rank)  # different data per rank
    x = torch.randn(64, 16, generator=gen)
    y = x[:, :1] * 0.5 - x[:, 1:2] + 0.1 * torch.randn(64, 1, generator=gen)

    losses = []
    for step in range(args.steps):
        opt.zero_grad()
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if rank == 0:
            print(f"loss {step} {losses[-1]!r}", flush=True)

    if rank == 0 and args.losses_out:
        with open(args.losses_out, "w") as f:
            json.dump(losses, f)
    # torch 2.13 + gloo: a collective launched inside backward holds a Python object that a gloo
    # worker thread frees (needing the GIL) after the op completes; if the interpreter is already
    # exiting, the process aborts ("terminate called without an active exception"). Let it drain.
    time.sleep(0.2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
