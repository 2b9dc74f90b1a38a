"""What bench/scale.py emulates: join the job and pass one barrier, then say how long that took."""

import json
import os
import time

import torch.distributed as dist

start = time.perf_counter()
dist.init_process_group("gloo")
joined = time.perf_counter()
dist.barrier()
done = time.perf_counter()
print(json.dumps({"rank": dist.get_rank(), "world_size": dist.get_world_size(), "init_s": joined - start,
                  "barrier_s": done - joined, "pid": os.getpid()}), flush=True)
