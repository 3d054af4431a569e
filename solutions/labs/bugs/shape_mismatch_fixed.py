"""Bug hunt: rank 0 collects the test images that the model got wrong, from every rank.

    torchrun --standalone --nproc-per-node 2 solutions/labs/bugs/shape_mismatch_fixed.py

The model is a nearest-class-mean classifier built from the training images (the same on
every rank). Rank r tests images r, r+K, r+2K, ... and keeps the indices of those it got wrong;
rank 0 gathers them all, to print the accuracy and the classes most often confused.
Lines there because of distribution: `# DDP:`.
"""
import argparse
from datetime import timedelta

import torch
import torch.distributed as dist

from dpcourse.lab import world
from dpcourse.lab.data import CLASSES, load_fashion_mnist
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
    shard = list(range(rank, len(labels), world_size))  # DDP: images r, r+K, r+2K, ...
    predicted = torch.cdist(images[shard].flatten(1).float() / 255, means).argmin(1)
    wrong = torch.tensor(shard)[predicted != labels[shard]]  # the test images this rank got wrong
    print(f"rank {rank} got {len(wrong):,} of its {len(shard):,} images wrong", flush=True)

    ### BEGIN SOLUTION (hint: the ranks got different numbers of images wrong, and all_gather needs one shape on every rank: pad, gather, then cut)
    size = torch.tensor([len(wrong)])
    sizes = [torch.zeros_like(size) for _ in range(world_size)]
    dist.all_gather(sizes, size)  # DDP: how many indices each rank holds
    longest = max(s.item() for s in sizes)
    padded = torch.cat([wrong, wrong.new_zeros(longest - len(wrong))])  # DDP: one shape everywhere
    gathered = [torch.zeros_like(padded) for _ in range(world_size)]
    dist.all_gather(gathered, padded)  # DDP: every rank's indices
    gathered = [g[:s.item()] for g, s in zip(gathered, sizes)]  # DDP: the padding cut off again
    ### END SOLUTION

    if rank == 0:  # DDP: one rank reports
        every = torch.cat(gathered).sort().values  # every misclassified test image, from all ranks
        guess = torch.cdist(images[every].flatten(1).float() / 255, means).argmin(1)
        confused = torch.zeros(10, 10, dtype=torch.long).index_put_(
            (labels[every], guess), torch.tensor(1), accumulate=True)
        worst = divmod(confused.argmax().item(), 10)
        accuracy = 1 - len(every) / len(labels)
        print(f"{len(every):,} of {len(labels):,} test images wrong: accuracy {accuracy:.4f}; "
              f"most confused: {CLASSES[worst[0]]} taken for {CLASSES[worst[1]]} "
              f"{confused.max().item()} times", flush=True)
        JsonLog(args.log_json).write("done", world_size=world_size, test_accuracy=accuracy,
                                     wrong=len(every), correct=len(labels) - len(every),
                                     distinct=len(set(every.tolist())),
                                     gathered=[len(g) for g in gathered])
    cleanup()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data-root", default=None)
    parser.add_argument("--timeout", type=float, default=30, help="seconds a collective may wait")
    parser.add_argument("--log-json", default=None, help="rank 0 writes JSON lines here")
    main(parser.parse_args())
