"""Uneven inputs: ranks with different numbers of batches, and four ways to end the epoch.

    torchrun --standalone --nproc-per-node 2 labs/uneven_inputs.py --mode hang --timeout 5
    torchrun --standalone --nproc-per-node 2 labs/uneven_inputs.py --mode join
    torchrun --standalone --nproc-per-node 2 labs/uneven_inputs.py --mode pad
    torchrun --standalone --nproc-per-node 2 labs/uneven_inputs.py --mode drop
    torchrun --standalone --nproc-per-node 2 labs/uneven_inputs.py --mode join \
        --sync-loss plain --timeout 5    # a per-step all-reduce of the loss inside Join

(Activate the course's environment first: source .venv/bin/activate.)

The course CNN trains one epoch on the first --images FashionMNIST training images, stored as
--shards files of equal size, as a streaming (iterable) data set stores them. In `hang` and `join`
rank r reads files r, r+K, r+2K, ... and nothing else, without padding: with 7 files on 2 ranks,
rank 0 reads 4 and rank 1 reads 3, so rank 0 has 63 batches of 64 and rank 1 has 47.

    hang  the plain loop: rank 1 runs out and leaves; rank 0's next backward all-reduces its
          gradients with nobody, and waits until --timeout ends the run
    join  the same loop inside torch's `Join([model])` (the exercise): a rank out of batches
          answers the others' all-reduces with zero gradients until every rank is done, then
          DDP copies the last rank's weights to all. Its price: two one-number all-reduces in
          each forward (who still trains?), and a step that only some ranks take still divides
          the gradients' sum by K (divide_by_initial_world_size=True): a smaller step
    pad   DistributedSampler over all the images (a map-style data set: any rank reads any
          image), padded so every rank gets the same count: a few images twice
    drop  DistributedSampler with drop_last=True: the same count on every rank, a few images unseen

Rank 0 prints and logs (--log-json, event "done") the steps and images of each rank, the images
trained twice and never, the loop's seconds (slowest rank), the training loss (mean over every
example trained), the test accuracy on 10,000 images (split as the mode splits its data: `pad`
pads them too, as the clinic's padded_eval.py does) and the largest weight difference between
the replicas. The loss is summed on each rank and gathered once, after the loop. A collective
in every step is another matter: --sync-loss plain all-reduces the loss at each step, which Join
does not know of, so a rank that has joined answers it with one of Join's own collectives. The
ranks' collectives no longer pair up, and the run ends at --timeout, or at once where gloo sees
sizes that differ ("Received data size doesn't match expected size"). --sync-loss joinable makes
it a Joinable of its own (MeanLoss). Lines there because of distribution: `# DDP:`.
"""
import argparse
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

from dpcourse.lab import training, world
from dpcourse.lab.data import InMemoryFashionMNIST
from dpcourse.lab.metrics import JsonLog
from dpcourse.lab.models import FashionCNN


def setup(args):
    # DDP: rank and world size from torchrun, srun or mpirun; MASTER_ADDR/PORT set and checked.
    env = world.prepare(backend=args.backend, device=args.device)
    if env.device.type == "cuda":
        torch.cuda.set_device(env.device)  # DDP: one GPU per process, cuda:LOCAL_RANK
    # The group's timeout also bounds the wait for the other ranks to arrive, so a short
    # --timeout would fail a rank that starts late: a minute for that, then --timeout.
    dist.init_process_group(env.backend, rank=env.rank, world_size=env.world_size,  # DDP: join
                            timeout=timedelta(seconds=max(args.timeout, 60)))
    dist.set_timeout(timedelta(seconds=args.timeout))  # DDP: how long a collective may wait
    return env


def cleanup():
    dist.destroy_process_group()  # DDP: leave the process group so every rank exits cleanly.


def my_images(args, rank, world_size):
    """This rank's image indices for one epoch, shuffled."""
    if args.mode in ("pad", "drop"):
        # DDP: a map-style split: ceil(N/K) each, padded with repeats, or floor(N/K), the rest left
        return torch.tensor(list(DistributedSampler(range(args.images), world_size, rank,
                                                    seed=args.seed, drop_last=args.mode == "drop")))
    edges = [args.images * s // args.shards for s in range(args.shards + 1)]
    # DDP: a streaming split: files r, r+K, r+2K, ... and nothing else, no padding
    mine = torch.cat([torch.arange(edges[s], edges[s + 1])
                      for s in range(rank, args.shards, world_size)])
    order = torch.randperm(len(mine), generator=torch.Generator().manual_seed(args.seed + rank))
    return mine[order]


class MeanLoss(Joinable):
    """The loss averaged over the ranks at every step, written as a Joinable: inside Join, a rank
    out of batches answers each of its all-reduces with zeros (its join hook), so the mean is over
    the examples of the ranks still training. Join lists its Joinables in the order of their
    collectives in a step: the DDP model's (forward, backward) first, then this one's."""

    def __init__(self, device):
        super().__init__()
        self.device, self.last = device, None  # the last step's mean loss

    def __call__(self, loss, n):
        Join.notify_join_context(self)  # a no-op: DDP, the first Joinable, tells Join
        totals = torch.tensor([loss * n, n], dtype=torch.float64, device=self.device)
        dist.all_reduce(totals)  # DDP: loss and examples summed over the ranks
        self.last = (totals[0] / totals[1]).item()

    def join_hook(self, **kwargs):
        device = self.device

        class Shadow(JoinHook):
            def main_hook(self):  # on a rank out of batches, once per step of the others
                # DDP: the all-reduce the others make in __call__, with nothing to add
                dist.all_reduce(torch.zeros(2, dtype=torch.float64, device=device))
        return Shadow()

    @property
    def join_device(self):
        return self.device

    @property
    def join_process_group(self):
        return dist.group.WORLD  # DDP: the group its all-reduce uses


def train_loop(model, opt, train_set, batches, seen, args, meter=None):
    """One pass over this rank's batches: (steps, images, summed loss, seconds). With a meter,
    the loss is also averaged over the ranks at every step, as a training log would."""
    start, images, loss_sum = time.perf_counter(), 0, 0.0
    for idx in batches:
        x, y = train_set[idx]
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()  # DDP: gradients averaged over the ranks (an all-reduce) in here
        opt.step()
        images, loss_sum = images + len(y), loss_sum + loss.item() * len(y)
        seen.index_add_(0, idx, torch.ones_like(idx))
        if meter is not None:
            meter(loss.item(), len(y))
    return len(batches), images, loss_sum, time.perf_counter() - start


def train(model, opt, train_set, batches, seen, args, meter):
    """train_loop; in --mode join, inside the Join context manager."""
    if args.mode != "join":
        return train_loop(model, opt, train_set, batches, seen, args, meter)
    more = [meter] if args.sync_loss == "joinable" else []  # the per-step meter, as a Joinable
    # YOUR CODE HERE
    # Hint: run the same train_loop inside torch's Join context manager;
    #       its Joinables: the DDP-wrapped model first, then those in more, in the order
    #       of their collectives in a step
    raise NotImplementedError("Exercise: see the hint above")
    return done


def evaluate(model, test_set, rank, world_size, padded):
    """(accuracy, images counted) on the test set, each rank testing its share."""
    if padded:
        # DDP: the training split reused for testing: its repeats counted (as padded_eval.py)
        share = list(DistributedSampler(range(len(test_set)), world_size, rank, shuffle=False))
    else:
        share = range(rank, len(test_set), world_size)  # DDP: images r, r+K, ...: each once
    x, y = test_set[torch.tensor(list(share), device=test_set.labels.device)]
    with torch.no_grad():
        totals = torch.tensor([(model(x).argmax(1) == y).sum().item(), len(y)],
                              dtype=torch.float64, device=y.device)
    dist.all_reduce(totals)  # DDP: correct answers and images, summed over the ranks
    return (totals[0] / totals[1]).item(), int(totals[1])


def main(args):
    env = setup(args)
    rank, world_size = dist.get_rank(), dist.get_world_size()  # DDP: who am I, how many are we?
    dev = env.device
    train_set = InMemoryFashionMNIST(args.data_root, train=True, device=dev, first=args.images)
    test_set = InMemoryFashionMNIST(args.data_root, train=False, device=dev)
    mine = my_images(args, rank, world_size).to(dev)
    batches = list(mine.split(args.batch_size))
    counts = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(world_size)]
    # DDP: every rank learns how many batches each one has (only to print it)
    dist.all_gather(counts, torch.tensor([len(batches)], device=dev))
    if rank == 0:  # DDP: one rank prints
        counts = [int(c) for c in counts]
        print(f"--mode {args.mode}: batches per rank {counts}", flush=True)
        if args.mode == "hang" and min(counts) < max(counts):
            print(f"after step {min(counts)} a rank is out of batches; in step {min(counts) + 1} "
                  "the others all-reduce their gradients in backward, with nobody", flush=True)

    torch.manual_seed(args.seed)
    # DDP: rank 0's weights to every rank; gradients averaged in backward
    model = DDP(FashionCNN().to(dev), device_ids=[dev] if dev.type == "cuda" else None)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    seen = torch.zeros(args.images, dtype=torch.int64, device=dev)  # times each image was trained
    meter = None if args.sync_loss == "off" else MeanLoss(dev)
    steps, images, loss_sum, seconds = train(model, opt, train_set, batches, seen, args, meter)

    mine_row = torch.tensor([steps, images, loss_sum, seconds], dtype=torch.float64, device=dev)
    rows = [torch.zeros_like(mine_row) for _ in range(world_size)]
    dist.all_gather(rows, mine_row)  # DDP: each rank's steps, images, loss and seconds, to all
    dist.all_reduce(seen)  # DDP: how often each image was trained, over all ranks
    accuracy, test_images = evaluate(model.module, test_set, rank, world_size, args.mode == "pad")
    spread = training.replicas_max_diff(  # DDP: the largest |rank's weight - rank 0's|
        model.module, training.broadcast_from_rank0, training.max_over_ranks)
    rows = torch.stack(rows)
    result = {"mode": args.mode, "steps_per_rank": rows[:, 0].long().tolist(),
              "images_per_rank": rows[:, 1].long().tolist(),
              "duplicates": int((seen - 1).clamp(min=0).sum()), "unseen": int((seen == 0).sum()),
              "seconds": round(rows[:, 3].max().item(), 3),
              "ms_per_step": round(1000 * rows[:, 3].max().item() / rows[:, 0].max().item(), 2),
              "train_loss": round((rows[:, 2].sum() / rows[:, 1].sum()).item(), 4),
              "test_accuracy": round(accuracy, 4), "test_images": test_images,
              "replicas_max_diff": spread}
    if meter is not None:
        result["last_step_loss"] = round(meter.last, 4)  # over the ranks still training
    if rank == 0:  # DDP: one rank reports and logs
        print(", ".join(f"{k} {v}" for k, v in result.items()), flush=True)
    JsonLog(args.log_json if rank == 0 else None,  # DDP: rank 0 logs
            world_size=world_size).write("done", images=args.images, **result)
    cleanup()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", default="join", choices=["hang", "join", "pad", "drop"])
    parser.add_argument("--images", type=int, default=7001, help="the first N training images")
    parser.add_argument("--shards", type=int, default=7, help="files the images are stored in")
    parser.add_argument("--batch-size", type=int, default=64, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sync-loss", default="off", choices=["off", "plain", "joinable"],
                        help="all-reduce the loss at every step: plain, or as a Joinable")
    parser.add_argument("--data-root", default=None)
    parser.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl", "mpi"])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--timeout", type=float, default=60, help="seconds a collective may wait")
    parser.add_argument("--log-json", default=None, help="rank 0 writes JSON lines here")
    main(parser.parse_args())
