"""Bug hunt: does each epoch see the data in a new order?

    torchrun --standalone --nproc-per-node 2 solutions/labs/bugs/no_set_epoch_fixed.py

A DataLoader with a DistributedSampler over 16 numbered examples: each rank prints the
examples it gets in each epoch, and rank 0 counts the epochs that repeat epoch 0's order.
Every line that exists because of distribution is marked `# DDP:`.
"""
import argparse
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from dpcourse.lab import world
from dpcourse.lab.metrics import JsonLog


def setup(args):
    # DDP: rank and world size from the launcher
    env = world.prepare(backend="gloo", device="cpu")
    dist.init_process_group(env.backend, rank=env.rank, world_size=env.world_size,  # DDP: join
                            timeout=timedelta(seconds=args.timeout))


def cleanup():
    dist.destroy_process_group()  # DDP: leave the group so every rank exits cleanly


def main(args):
    setup(args)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    dataset = TensorDataset(torch.arange(args.examples))  # example i is the number i
    sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed)  # DDP: this rank's share
    loader = DataLoader(dataset, batch_size=4, sampler=sampler)

    orders = []
    for epoch in range(args.epochs):
        ### BEGIN SOLUTION (hint: one line, before the loader is read: the sampler must know which epoch this is)
        sampler.set_epoch(epoch)  # DDP: a new shuffle each epoch, the same on every rank
        ### END SOLUTION
        order = torch.cat([x for (x,) in loader]).tolist()
        orders.append(order)
        print(f"epoch {epoch}: rank {rank} gets {order}", flush=True)

    everyone = [None] * world_size
    dist.all_gather_object(everyone, orders)  # DDP: rank 0 collects every rank's orders
    if rank == 0:  # DDP: one rank reports
        repeats = sum(orders[e] == orders[0] for e in range(1, args.epochs))
        print(f"{repeats} of the {args.epochs - 1} later epochs repeat epoch 0's order on rank 0",
              flush=True)
        JsonLog(args.log_json).write("done", world_size=world_size, orders=everyone,
                                     repeats=repeats)
    cleanup()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--examples", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=30, help="seconds a collective may wait")
    parser.add_argument("--log-json", default=None, help="rank 0 writes JSON lines here")
    main(parser.parse_args())
