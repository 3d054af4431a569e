"""Every rank raises a ValueError (tests/test_dist.py): the same on every rank (argv[1] "same",
each naming its rank: the same up to its numbers), or one of its own ("own"); rank 0 raises its
own argv[2] seconds later than the others."""
import sys
import time

import torch.distributed as dist

from dpcourse.lab import world

env = world.prepare(backend="gloo", device="cpu")  # srun's variables read; the excepthook in place
dist.init_process_group("gloo", rank=env.rank, world_size=env.world_size)
if env.rank == 0:
    time.sleep(float(sys.argv[2]))
raise ValueError(f"rank {env.rank}: shapes [8] and [4] differ" if sys.argv[1] == "same"
                 else ["one problem", "another problem"][env.rank])
