"""What bench/scale.py emulates: join the job, pass one barrier, take a broadcast from rank 0 and
all-reduce one number (both trees over the world group), then say how long each took."""

import json
import os
import time

import torch
import torch.distributed as dist

start = time.perf_counter()
dist.init_process_group("gloo")
joined = time.perf_counter()
dist.barrier()
done = time.perf_counter()
data = torch.full((256,), float(dist.get_rank()))
dist.broadcast(data, src=0)
one = torch.ones(1)
dist.all_reduce(one)
trees = time.perf_counter()
print(json.dumps({"rank": dist.get_rank(), "world_size": dist.get_world_size(), "init_s": joined - start,
                  "barrier_s": done - joined, "trees_s": trees - done, "broadcast_ok": bool((data == 0).all()),
                  "pid": os.getpid()}), flush=True)
