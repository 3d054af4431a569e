"""Bug hunt: the test accuracy that rank 0 prints.

    torchrun --standalone --nproc-per-node 2 labs/bugs/rank0_accuracy_fixed.py
    python labs/bugs/rank0_accuracy_fixed.py           # one process, for comparison

The model is a nearest-class-mean classifier built from the training images (the same on
every rank, and quick). Each rank evaluates its share of the 10,000 test images; rank 0
prints the accuracy and the number of images behind it. Lines there because of distribution:
`# DDP:`.
"""
import argparse
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

from dpcourse.lab import world
from dpcourse.lab.data import load_fashion_mnist
from dpcourse.lab.metrics import JsonLog


def setup(args):
    # DDP: rank and world size from the launcher
    env = world.prepare(backend="gloo", device="cpu")
    dist.init_process_group(env.backend, rank=env.rank, world_size=env.world_size,  # DDP: join
                            timeout=timedelta(seconds=args.timeout))


def cleanup():
    dist.destroy_process_group()  # DDP: leave the group so every rank exits cleanly


def class_means(root):
    """The model: the mean training image of each class (the same on every rank)."""
    images, labels = load_fashion_mnist(root, train=True)
    images = images.flatten(1).float() / 255
    return torch.stack([images[labels == c].mean(0) for c in range(10)])


def main(args):
    setup(args)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    means = class_means(args.data_root)
    images, labels = load_fashion_mnist(args.data_root, train=False)
    shard = list(DistributedSampler(range(len(labels)),
                                    shuffle=False))  # DDP: this rank's test images
    predicted = torch.cdist(images[shard].flatten(1).float() / 255, means).argmin(1)
    correct, count = (predicted == labels[shard]).sum().item(), len(shard)

    # YOUR CODE HERE
    # Hint: rank 0 must print the accuracy over every rank's images: add up two numbers
    #       over all ranks
    raise NotImplementedError("Exercise: see the hint above")
    if rank == 0:  # DDP: one rank reports
        print(f"test accuracy {correct / count:.4f}: {int(correct):,} right of "
              f"{int(count):,} images ({world_size} process(es))", flush=True)
        JsonLog(args.log_json).write("done", world_size=world_size, test_accuracy=correct / count,
                                     correct=int(correct), test_images=int(count))
    cleanup()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data-root", default=None)
    parser.add_argument("--timeout", type=float, default=30, help="seconds a collective may wait")
    parser.add_argument("--log-json", default=None, help="rank 0 writes JSON lines here")
    main(parser.parse_args())
