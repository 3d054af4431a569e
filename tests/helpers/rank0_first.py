"""rank 0 enters the block first; the others only after it left (tests/test_dist.py)."""
import sys
import time

import torch.distributed as dist

from dpcourse import dist as ddp_env

env = ddp_env.setup(backend="gloo")
with ddp_env.rank0_first():
    if env.rank == 0:
        time.sleep(1.0)  # rank 1 would overtake here without the wait
    with open(sys.argv[1], "a") as f:
        f.write(f"{env.rank}\n")
dist.barrier()
ddp_env.cleanup()
