"""Bug hunt: train, then report the test accuracy.

    torchrun --standalone --nproc-per-node 2 solutions/labs/bugs/skipped_collective.py \
        --timeout 5

A linear classifier on FashionMNIST, wrapped in DDP, trains for --steps steps; then the test
accuracy is measured on all 10,000 images (each rank tests its share, the counts are summed)
and rank 0 prints it. Every collective waits at most --timeout seconds.
Lines there because of distribution: `# DDP:`.
"""
import argparse
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from dpcourse.lab import world
from dpcourse.lab.data import InMemoryFashionMNIST
from dpcourse.lab.metrics import JsonLog


def setup(args):
    # DDP: rank and world size from the launcher
    env = world.prepare(backend="gloo", device="cpu")
    dist.init_process_group(env.backend, rank=env.rank, world_size=env.world_size,  # DDP: join
                            timeout=timedelta(seconds=args.timeout))


def cleanup():
    dist.destroy_process_group()  # DDP: leave the group so every rank exits cleanly


def evaluate(model, test, rank, world_size):
    """Accuracy on the whole test set: each rank tests its share, then the counts are summed."""
    x, y = test[torch.arange(rank, len(test), world_size)]  # DDP: images r, r+K, r+2K, ...
    with torch.no_grad():
        totals = torch.tensor([(model(x.flatten(1)).argmax(1) == y).sum().item(), len(y)],
                              dtype=torch.float64)
    dist.all_reduce(totals)  # DDP: correct answers and images, summed over the ranks
    return (totals[0] / totals[1]).item()


def main(args):
    setup(args)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    start = time.perf_counter()
    train, test = (InMemoryFashionMNIST(args.data_root, train=True),
                   InMemoryFashionMNIST(args.data_root, train=False))
    torch.manual_seed(0)
    # DDP: gradients averaged over the ranks in backward()
    model = DDP(torch.nn.Linear(28 * 28, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(args.steps):
        x, y = train[torch.randint(len(train), (64,))]
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x.flatten(1)), y).backward()
        opt.step()

    if rank == 0:  # DDP: only rank 0 prints the accuracy, so only rank 0 measures it
        accuracy = evaluate(model, test, rank, world_size)
        print(f"test accuracy {accuracy:.4f} after {args.steps} steps", flush=True)
    dist.barrier()  # DDP: every rank finishes together
    if rank == 0:  # DDP: one rank reports
        print(f"done in {time.perf_counter() - start:.1f} s", flush=True)
        JsonLog(args.log_json).write("done", world_size=world_size, test_accuracy=accuracy,
                                     seconds=time.perf_counter() - start)
    cleanup()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data-root", default=None)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--timeout", type=float, default=30, help="seconds a collective may wait")
    parser.add_argument("--log-json", default=None, help="rank 0 writes JSON lines here")
    main(parser.parse_args())
