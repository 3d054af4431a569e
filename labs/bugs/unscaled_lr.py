"""Bug hunt: the same recipe on more processes.

    python labs/bugs/unscaled_lr.py                                    # 1 process
    torchrun --standalone --nproc-per-node 2 labs/bugs/unscaled_lr.py  # 2 processes

A linear classifier (softmax regression) on FashionMNIST, wrapped in DDP, trained for one
epoch with SGD. The recipe, --lr for --batch-size images per process, was tuned on one process.
Rank 0 prints the learning rate it used, the global batch and the test accuracy after the epoch.
Lines there because of distribution: `# DDP:`.
"""
import argparse
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


def main(args):
    setup(args)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    train, test = (InMemoryFashionMNIST(args.data_root, train=True),
                   InMemoryFashionMNIST(args.data_root, train=False))
    torch.manual_seed(args.seed)
    # DDP: gradients averaged over the ranks in backward()
    model = DDP(torch.nn.Linear(28 * 28, 10))
    global_batch = args.batch_size * world_size  # DDP: each step consumes a batch from every rank
    lr = args.lr
    opt = torch.optim.SGD(model.parameters(), lr=lr)

    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(args.seed))
    steps = len(train) // global_batch
    for step in range(steps):  # one epoch: every rank takes its own slice of each global batch
        # DDP: this rank's part
        idx = order[step * global_batch:(step + 1) * global_batch][rank::world_size]
        x, y = train[idx]
        loss = F.cross_entropy(model(x.flatten(1)), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    # every rank holds the same weights: rank 0 tests them on all 10,000 images
    with torch.no_grad():
        x, y = test[torch.arange(len(test))]
        accuracy = (model(x.flatten(1)).argmax(1) == y).float().mean().item()
    if rank == 0:  # DDP: one rank reports
        print(f"{world_size} process(es): global batch {global_batch}, lr {lr:g}, {steps} steps, "
              f"test accuracy {accuracy:.4f} after 1 epoch", flush=True)
        JsonLog(args.log_json).write("done", world_size=world_size, global_batch=global_batch,
                                     lr=lr, steps=steps, test_accuracy=accuracy)
    cleanup()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data-root", default=None)
    parser.add_argument("--batch-size", type=int, default=256, help="images per process and step")
    parser.add_argument("--lr", type=float, default=0.016,
                        help="tuned for one process at --batch-size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=30, help="seconds a collective may wait")
    parser.add_argument("--log-json", default=None, help="rank 0 writes JSON lines here")
    main(parser.parse_args())
