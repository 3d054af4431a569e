"""Two ranks ask for FashionMNIST in an empty data root at the same time (tests/test_data.py)."""
import sys

import torch.distributed as dist

from dpcourse.lab import world
from dpcourse.lab.data import load_fashion_mnist, raw_dir

env = world.setup(backend="gloo")
root = sys.argv[1]
already = raw_dir(root).exists()
images, labels = load_fashion_mnist(root)
if env.rank == 0 and not already:
    print("staged by rank 0", flush=True)
dist.barrier()
print(f"OK {len(labels)}", flush=True)
world.cleanup()
