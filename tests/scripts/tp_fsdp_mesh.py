"""2-D ("dp", "tp") = (2, 2) CPU device mesh: tensor parallel MLP + FSDP2 fully_shard (run with W=4).

TP via parallelize_module (Colwise/Rowwise) on "tp", fully_shard on "dp"; rank 0 prints the dp-averaged loss.
"""
import argparse
import json
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(16, 64)
        self.w2 = nn.Linear(64, 1)

    def forward(self, x):
        return self.w2(torch.tanh(self.w1(x)))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--losses-out", default=None)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    assert dist.get_world_size() == 4, "tp_fsdp_mesh.py expects exactly 4 ranks"
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()

    torch.manual_seed(0)  # identical full init on every rank before sharding
    model = MLP()
    parallelize_module(model, mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    gen = torch.Generator().manual_seed(1000 + dp_rank)  # different data per dp rank, same within tp
    x = torch.randn(64, 16, generator=gen)
    y = x[:, :1] * 0.5 - x[:, 1:2] + 0.1 * torch.randn(64, 1, generator=gen)

    losses = []
    for step in range(args.steps):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        avg = loss.detach().clone()
        dist.all_reduce(avg, group=mesh["dp"].get_group())
        losses.append((avg / 2).item())
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
