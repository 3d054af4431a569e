"""DiLoCo over a slow link: each worker takes H steps of AdamW alone, then the workers average
where they went (one all-reduce) and an outer Nesterov step moves the shared weights; against
DDP, which all-reduces every step.

    torchrun --standalone --nproc-per-node 2 labs/diloco.py --link wan --mode ddp
    torchrun --standalone --nproc-per-node 2 labs/diloco.py --link wan --inner-steps 20
    torchrun --standalone --nproc-per-node 2 labs/diloco.py --link wan --inner-steps 50

(Activate the course's environment first: source .venv/bin/activate.)

The course CNN trains --steps steps of AdamW on FashionMNIST, --batch-size per worker, every
collective paying the link --link names (dpcourse/lab/links.py). In --mode ddp the gradients
are all-reduced at every step (DDP, its comm hook paying the link). In --mode diloco
(Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of Language Models",
arXiv 2311.08105) each worker keeps the shared weights of the last outer step and, every
--inner-steps steps (H):

    pseudo-gradient = shared weights − this worker's weights     (where the H steps went, reversed)
    all-reduce it, divide by the workers                          (one message per H steps)
    outer step: SGD with Nesterov momentum on the shared weights  (--outer-lr, --outer-momentum)
    every worker goes on from the new shared weights

The outer step's defaults are the paper's: an outer learning rate of 0.7 and Nesterov momentum
of 0.9, a choice that "is very robust, and it is adopted for all our experiments". The paper's
language models take H = 500 inner steps of AdamW at 4e-4; this small CNN, a few hundred steps
in all, takes H = 20 by default and AdamW at 2e-3 (the course's choice). With H = 1, an outer
lr of 1, no momentum and SGD inside, this is DDP (notebook 15's matrix holds it). The shared
weights are the parameters only: the course CNN's GroupNorm keeps no buffers; a model with
BatchNorm would have its running statistics averaged too, or they drift apart unseen.

Rank 0 logs (--log-json) at every outer step (every H steps in --mode ddp): the step, the
seconds since the start and rank 0's own training loss over those steps (it needs no message);
at the end ("done"): the test accuracy on 10,000 images, the messages and bytes each
rank sent, the seconds the link added and the largest weight difference between the workers.
Lines there because of distribution: `# DDP:` (`# DiLoCo:` where the method is the reason);
because of the slow network: `# LINK:`.
"""
import argparse
import itertools
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils import parameters_to_vector, vector_to_parameters
from torch.utils.data import BatchSampler, DistributedSampler

from dpcourse.lab import links, training, world
from dpcourse.lab.data import InMemoryFashionMNIST
from dpcourse.lab.metrics import JsonLog
from dpcourse.lab.models import FashionCNN


def setup(args):
    # DDP: rank and world size from torchrun, srun or mpirun; MASTER_ADDR/PORT set and checked.
    env = world.prepare(backend=args.backend, device=args.device)
    if env.device.type == "cuda":
        torch.cuda.set_device(env.device)  # DDP: one GPU per process, cuda:LOCAL_RANK
    dist.init_process_group(env.backend, rank=env.rank, world_size=env.world_size,  # DDP: join
                            timeout=timedelta(seconds=args.timeout))
    return env


def cleanup():
    dist.destroy_process_group()  # DDP: leave the process group so every rank exits cleanly.


class Outer:
    """DiLoCo's outer loop: the shared weights (a copy of the model's, as one vector), the outer
    optimizer on them, and the step that brings the workers together."""

    def __init__(self, model, lr, momentum, link):
        self.model, self.link = model, link
        self.shared = parameters_to_vector(model.parameters()).detach().clone()
        self.shared.requires_grad_(True)
        self.opt = torch.optim.SGD([self.shared], lr=lr, momentum=momentum,
                                   nesterov=momentum > 0)

    def step(self):
        """Average the workers' pseudo-gradients, step the shared weights, go on from them."""
        now = parameters_to_vector(self.model.parameters()).detach()
        # YOUR CODE HERE
        # Hint: the pseudo-gradient points like a gradient: from where the H steps went
        #       back to where they started, the shared weights
        raise NotImplementedError("Exercise: see the hint above")
        dist.all_reduce(delta)  # DiLoCo: summed over the workers: one message per H steps ...
        delta /= dist.get_world_size()  # DiLoCo: ... and averaged
        self.link.wait("all_reduce", delta)  # LINK: the one message pays the link
        self.shared.grad = delta
        self.opt.step()  # the outer step: SGD with Nesterov momentum on the shared weights
        with torch.no_grad():  # DiLoCo: every worker goes on from the new shared weights
            vector_to_parameters(self.shared.detach().clone(), self.model.parameters())


def evaluate(model, test_set, link, rank, world_size):
    """Accuracy on the test set, each rank testing images r, r+K, ...: each image once."""
    x, y = test_set[torch.arange(rank, len(test_set), world_size, device=test_set.labels.device)]
    with torch.no_grad():
        totals = torch.tensor([(model(x).argmax(1) == y).sum().item(), len(y)],
                              dtype=torch.float64, device=y.device)
    dist.all_reduce(totals)  # DDP: correct answers and images, summed over the ranks
    link.wait("all_reduce", totals)  # LINK: an explicit collective pays the link too
    return (totals[0] / totals[1]).item()


def main(args):
    env = setup(args)
    rank, world_size = dist.get_rank(), dist.get_world_size()  # DDP: who am I, how many are we?
    dev = env.device
    link = links.EmulatedLink(links.link(args.link), world_size)  # LINK: the network to pay
    if args.link != "none" and dev.type == "cuda":  # the link waits on CPU ranks' futures
        world.stop(env, "--link emulates a network for CPU ranks (gloo): add --device cpu, "
                        "or leave --link out")
    train_set = InMemoryFashionMNIST(args.data_root, train=True, device=dev, first=args.images)
    test_set = InMemoryFashionMNIST(args.data_root, train=False, device=dev)
    sampler = DistributedSampler(train_set, world_size, rank, seed=args.seed,  # DDP: my shard
                                 drop_last=True)
    torch.manual_seed(args.seed)  # the same initial weights on every worker
    model = FashionCNN(args.width).to(dev)
    every = args.inner_steps  # steps between log records (and, in DiLoCo, between messages)
    if args.mode == "ddp":
        model = DDP(model, device_ids=[dev] if dev.type == "cuda" else None)  # DDP: the wrap
        model.register_comm_hook(None, link.hook())  # LINK: each bucket pays the link
        outer = None
    else:
        outer = Outer(model, args.outer_lr, args.outer_momentum, link)  # DiLoCo: shared weights
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)

    def batches():  # this rank's batches, epoch after epoch
        for epoch in itertools.count():
            sampler.set_epoch(epoch)  # DDP: a new order each epoch, the same on every rank
            for idx in BatchSampler(sampler, args.batch_size, drop_last=True):
                yield torch.as_tensor(idx, device=dev)

    log = JsonLog(args.log_json if rank == 0 else None, world_size=world_size)  # DDP: rank 0
    losses, start = [], time.perf_counter()
    for step, idx in enumerate(itertools.islice(batches(), args.steps), start=1):
        x, y = train_set[idx]
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()  # DDP: in --mode ddp, gradients averaged here; in DiLoCo, nothing sent
        opt.step()
        losses.append(loss.item())
        if step % every == 0 or step == args.steps:
            if outer is not None:
                outer.step()  # DiLoCo: every H steps, the workers meet
            log.write("outer", step=step, elapsed_s=round(time.perf_counter() - start, 4),
                      train_loss=round(statistics.mean(losses), 4))
            losses = []
    seconds = time.perf_counter() - start
    net = model.module if args.mode == "ddp" else model
    accuracy = evaluate(net, test_set, link, rank, world_size)
    spread = training.replicas_max_diff(  # DDP: the largest |worker's weight - rank 0's|
        net, training.broadcast_from_rank0, training.max_over_ranks)
    messages = args.steps if args.mode == "ddp" else -(-args.steps // every)
    result = {"mode": args.mode, "link": args.link, "inner_steps": every, "seconds": seconds,
              "ms_per_step": round(1000 * seconds / args.steps, 2), "messages": messages,
              "bytes_sent": dict(link.bytes), "link_added_s": round(link.added, 3),
              "test_accuracy": round(accuracy, 4), "replicas_max_diff": spread}
    if rank == 0:  # DDP: one rank reports
        print(", ".join(f"{k} {v}" for k, v in result.items()), flush=True)
    log.write("done", steps=args.steps, batch_size=args.batch_size, **result)
    cleanup()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", default="diloco", choices=["diloco", "ddp"])
    parser.add_argument("--link", default="none", choices=["none", *links.PRESETS],
                        help="the emulated link every collective pays (none: this machine's)")
    parser.add_argument("--inner-steps", type=int, default=20,
                        help="H: steps alone between outer steps (--mode ddp: between logs)")
    parser.add_argument("--outer-lr", type=float, default=0.7)
    parser.add_argument("--outer-momentum", type=float, default=0.9, help="Nesterov's")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--images", type=int, default=60000, help="the first N training images")
    parser.add_argument("--batch-size", type=int, default=64, help="per worker")
    parser.add_argument("--width", type=int, default=16, help="the CNN's channels")
    parser.add_argument("--lr", type=float, default=2e-3, help="AdamW's, inside")
    parser.add_argument("--weight-decay", type=float, default=0.01, help="AdamW's")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-root", default=None)
    parser.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl", "mpi"])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--timeout", type=float, default=60, help="seconds a collective may wait")
    parser.add_argument("--log-json", default=None, help="rank 0 writes JSON lines here")
    main(parser.parse_args())
