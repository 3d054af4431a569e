"""rank 0 enters the block first; the others only after it left (tests/test_dist.py)."""
import sys
import time

import torch.distributed as dist

from dpcourse.lab import world

env = world.setup(backend="gloo")
with world.rank0_first():
    if env.rank == 0:
        time.sleep(1.0)  # rank 1 would overtake here without the wait
    with open(sys.argv[1], "a") as f:
        f.write(f"{env.rank}\n")
dist.barrier()
world.cleanup()
