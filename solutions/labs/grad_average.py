"""Gradient averaging in real processes: K shard gradients, averaged, against one whole batch.

    torchrun --standalone --nproc-per-node 2 solutions/labs/grad_average.py
        # the identity
    torchrun --standalone --nproc-per-node 3 solutions/labs/grad_average.py --case all
        # where it breaks
    python solutions/labs/grad_average.py
        # one process

Every rank builds the same course CNN (same seed) and draws the same global batch of --batch
FashionMNIST training images; rank k keeps its shard of m_k images, computes the gradient of
its shard's loss, and the ranks combine their gradients with all_reduce. Rank 0 also computes
the gradient of the whole batch in one piece, in one process (the reference), and prints, for
each case, the max relative error  max|g - g_ref| / max|g_ref|  over all parameters.

    --case average    equal shards, mean loss, all_reduce(SUM) / K: the identity  (exercise)
    --case float32    the same in float32: rounding, not a bug
    --case unequal    unequal shards (--shards): plain average vs weights m_k / n
    --case sum        reduction="sum" instead of "mean"
    --case batchnorm  BatchNorm: each rank's own batch statistics vs statistics of the global
                      batch (nn.SyncBatchNorm on GPUs; on the CPU the moments all-reduced by hand)
    --case dropout    dropout masks: the same seed on every rank, seed + rank, the global mask
    --case all        all of them, in this order

(Activate the course's environment first: source .venv/bin/activate.) With --log-json, rank 0
writes one JSON record per line printed.
"""
import argparse
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dpcourse.lab import world
from dpcourse.lab.data import InMemoryFashionMNIST
from dpcourse.lab.metrics import JsonLog
from dpcourse.lab.models import FashionCNN

CASES = ("average", "float32", "unequal", "sum", "batchnorm", "dropout")
TOLERANCE = 1e-6  # float64 rounding is ~1e-16; a real mistake is 1e-3 or more


# ---------------------------------------------------------------- the exercise
def average_gradients(model, loss, world_size):
    """Backpropagate this rank's loss, then leave in every .grad the average over the ranks."""
    ### BEGIN SOLUTION (hint: backpropagate loss; then each p.grad must become, on every rank, the mean of the K ranks' p.grad: one collective and one division per parameter)
    loss.backward()  # ∂lₖ/∂w: this rank's shard only
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)  # DDP: Σₖ ∂lₖ/∂w, in place, on every rank
        p.grad /= world_size  # DDP: (1/K)·Σₖ ∂lₖ/∂w
    ### END SOLUTION


# ---------------------------------------------------------------- BatchNorm over all ranks
class AllReduceSum(torch.autograd.Function):
    """dist.all_reduce(SUM) that autograd can go back through.

    y = Σ_r x_r on every rank, so ∂L/∂x_r = Σ_k ∂L_k/∂y_k: the backward is an all-reduce too.
    (torch.distributed.nn.functional.all_reduce is the same function; deprecated in torch 2.14.)
    """

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)  # DDP: the sum over the ranks
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)  # DDP: every rank's loss depends on my x through the sum
        return grad


class HandSyncBatchNorm(nn.BatchNorm2d):
    """BatchNorm2d that normalises with the mean and variance of the *global* batch.

    What nn.SyncBatchNorm does on GPUs, written out for the CPU: each rank sums x and x² per
    channel over its shard, one all-reduce adds them up over the ranks, and every rank
    normalises with the same moments. Backward goes through the same all-reduce.
    """

    def forward(self, x):
        if not self.training:
            return super().forward(x)  # evaluation uses the running statistics: nothing to sync
        c = x.shape[1]
        count = torch.full((1,), x.numel() / c, dtype=x.dtype, device=x.device)
        local = torch.cat([x.sum((0, 2, 3)), (x * x).sum((0, 2, 3)), count])
        total = AllReduceSum.apply(local)  # DDP: per-channel Σx, Σx² and the count, global
        n = total[-1]
        mean = total[:c] / n
        var = total[c:2 * c] / n - mean * mean  # biased, as BatchNorm normalises
        with torch.no_grad():  # running statistics as BatchNorm keeps them (unbiased variance)
            self.num_batches_tracked += 1
            self.running_mean.lerp_(mean, self.momentum)
            self.running_var.lerp_(var * n / (n - 1), self.momentum)
        shape = (1, c, 1, 1)
        x_hat = (x - mean.view(shape)) / torch.sqrt(var.view(shape) + self.eps)
        return x_hat * self.weight.view(shape) + self.bias.view(shape)


def sync_batchnorm(model, device):
    """Every BatchNorm of ``model`` with statistics over all ranks."""
    if device.type == "cuda":  # DDP: torch's own; it refuses CPU tensors
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    for name, module in model.named_children():
        if isinstance(module, nn.BatchNorm2d):
            synced = HandSyncBatchNorm(module.num_features, module.eps, module.momentum).to(
                module.weight.device, module.weight.dtype)
            synced.load_state_dict(module.state_dict())
            setattr(model, name, synced)  # DDP: the same weights, global statistics
        else:
            sync_batchnorm(module, device)
    return model


# ---------------------------------------------------------------- helpers
def flat_grad(model):
    """All parameter gradients as one vector."""
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def relative_error(g, reference):
    return ((g - reference).abs().max() / reference.abs().max()).item()


def ranks_max_diff(g):
    """How far this rank's vector is from rank 0's, worst rank (0.0: every rank holds the same)."""
    rank0 = g.clone()
    dist.broadcast(rank0, src=0)  # DDP: rank 0's copy, everywhere
    diff = (g - rank0).abs().max().reshape(1)
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)  # DDP: the worst rank decides
    return diff.item()


def shard_sizes(n, world_size, spec=None):
    """Equal shards, or the sizes of --shards; unequal by default: m_k ∝ k + 1."""
    if spec:
        sizes = [int(s) for s in spec.split(",")]
    else:
        weights = range(1, world_size + 1)
        sizes = [n * w // sum(weights) for w in weights]
        sizes[-1] += n - sum(sizes)
    return sizes


class Bench:
    """The common ground: model, data and shards of every case; rank 0's reference gradients."""

    def __init__(self, args, env, log):
        self.args, self.env, self.log = args, env, log
        self.rank, self.world = dist.get_rank(), dist.get_world_size()  # DDP: who am I, how many?
        with world.rank0_first():  # DDP: one download, not one per rank
            data = InMemoryFashionMNIST(args.data_root, train=True, device=env.device)
        g = torch.Generator().manual_seed(args.seed)  # the same global batch on every rank
        self.x, self.y = data[torch.randperm(len(data), generator=g)[:args.batch].to(env.device)]
        self.cache = {}  # reference gradients

    def model(self, norm="group", dtype=torch.float64):
        torch.manual_seed(self.args.seed)  # the same initial weights on every rank
        return FashionCNN(width=self.args.width, norm=norm).to(self.env.device, dtype)

    def rows(self, sizes):
        """This rank's rows of the global batch: contiguous blocks of sizes[k] images."""
        start = sum(sizes[:self.rank])  # DDP: my shard
        return slice(start, start + sizes[self.rank])

    def equal_sizes(self):
        n, k = self.args.batch, self.world
        if n % k:
            world.stop(self.env, f"--batch {n} does not split into {k} equal shards: "
                                 f"use a multiple of {k}, e.g. --batch {n - n % k}.")
        return [n // k] * k

    def reference(self, model, forward=None, reduction="mean", dtype=torch.float64):
        """The gradient of the whole batch in one process (rank 0 computes it, then sends it).

        Cases that rebuild the same model (same seed, norm, dtype) reuse it.
        """
        key = (model.config["norm"], dtype, reduction)
        if forward is None and key in self.cache:
            return self.cache[key]
        model.zero_grad()
        if self.rank == 0:  # DDP: the one-process gradient, on rank 0 only
            F.cross_entropy((forward or model)(self.x.to(dtype)), self.y,
                            reduction=reduction).backward()
            ref = flat_grad(model)
        else:
            ref = torch.empty(sum(p.numel() for p in model.parameters()), dtype=dtype,
                              device=self.env.device)
        dist.broadcast(ref, src=0)  # DDP: every rank learns it (they all report below)
        model.zero_grad()
        if forward is None:
            self.cache[key] = ref
        return ref

    def report(self, case, variant, g, ref, sizes, tolerance=TOLERANCE, **extra):
        err, spread = relative_error(g, ref), ranks_max_diff(g)
        holds = err <= tolerance and spread == 0.0
        if self.rank == 0:  # DDP: one rank prints and logs
            words = "holds" if holds else "broken" if spread == 0.0 else "ranks disagree"
            more = "".join(f", {k} {v:.3g}" for k, v in extra.items() if isinstance(v, float))
            print(f"{case:9}  {variant:45} max relative error {err:7.1e}{more}  → {words}",
                  flush=True)
        self.log.write("grad", case=case, variant=variant, shards=sizes, max_rel_error=err,
                       tolerance=tolerance, ranks_max_diff=spread, holds=holds, **extra)


# ---------------------------------------------------------------- the cases
def case_average(b, dtype=torch.float64, name="average"):
    """Equal shards, mean loss, all_reduce(SUM)/K: the gradient of the whole batch."""
    model, sizes = b.model(dtype=dtype), b.equal_sizes()
    ref = b.reference(model, dtype=dtype)
    mine = b.rows(sizes)
    loss = F.cross_entropy(model(b.x[mine].to(dtype)), b.y[mine])  # my shard's mean loss
    average_gradients(model, loss, b.world)
    # float32 keeps ~7 digits, and a ReLU or max-pool may tip the other way: 1e-4 is its limit
    b.report(name, f"{dtype}".replace("torch.", "") + ", equal shards, all_reduce(SUM)/K",
             flat_grad(model), ref, sizes, tolerance=TOLERANCE if dtype == torch.float64 else 1e-4)


def case_unequal(b):
    """Shards of m_k images: the mean of shard means is not the mean of the batch."""
    n = b.args.batch
    sizes = shard_sizes(n, b.world, b.args.shards)
    if len(sizes) != b.world or sum(sizes) != n or min(sizes) < 1:
        world.stop(b.env, f"--shards {b.args.shards}: give {b.world} positive sizes "
                   f"adding up to --batch {n}.")
    mine = b.rows(sizes)
    for weighted in (False, True):
        model = b.model()
        ref = b.reference(model)
        loss = F.cross_entropy(model(b.x[mine].double()), b.y[mine])
        if weighted:
            loss.backward()
            for p in model.parameters():
                p.grad *= sizes[b.rank] / n  # DDP: my share of the batch, m_k / n
                dist.all_reduce(p.grad)  # DDP: Σₖ (m_k/n)·∂lₖ/∂w
            variant = "weighted by m_k/n, then all_reduce(SUM)"
        else:
            average_gradients(model, loss, b.world)
            variant = "plain average (1/K)"
        b.report("unequal", variant, flat_grad(model), ref, sizes)


def case_sum(b):
    """reduction='sum': each rank's loss is a sum, so the average is n/K times too large."""
    sizes = b.equal_sizes()
    mine = b.rows(sizes)
    model = b.model()
    ref = b.reference(model)  # the mean-loss gradient, as in every other case
    loss = F.cross_entropy(model(b.x[mine].double()), b.y[mine], reduction="sum")
    average_gradients(model, loss, b.world)
    g = flat_grad(model)
    b.report("sum", "sum loss, all_reduce(SUM)/K  vs  mean loss", g, ref, sizes,
             ratio=(g.norm() / ref.norm()).item())
    ref_sum = b.reference(model, reduction="sum")
    F.cross_entropy(model(b.x[mine].double()), b.y[mine], reduction="sum").backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)  # DDP: a sum of sums is the sum over the batch
    b.report("sum", "sum loss, all_reduce(SUM)  vs  sum loss", flat_grad(model), ref_sum, sizes)


def case_batchnorm(b):
    """BatchNorm normalises with its batch's statistics: on K ranks, each rank's own shard."""
    sizes = b.equal_sizes()
    mine = b.rows(sizes)
    if b.env.device.type == "cpu":  # torch's own SyncBatchNorm, tried on the CPU
        try:
            nn.SyncBatchNorm.convert_sync_batchnorm(b.model(norm="batch"))(b.x[mine].double())
        except ValueError as err:
            if b.rank == 0:  # DDP: one rank talks
                print(f"batchnorm  nn.SyncBatchNorm on the CPU → ValueError: {err}", flush=True)
    for synced in (False, True):
        model = b.model(norm="batch")
        ref = b.reference(model)  # one process: the statistics of the whole batch
        if synced:
            model = sync_batchnorm(model, b.env.device)
        loss = F.cross_entropy(model(b.x[mine].double()), b.y[mine])
        average_gradients(model, loss, b.world)
        kind = ("nn.SyncBatchNorm" if b.env.device.type == "cuda" else "moments all-reduced") \
            if synced else "per-rank statistics"
        b.report("batchnorm", f"BatchNorm, {kind}", flat_grad(model), ref, sizes)


def case_dropout(b, p=0.5):
    """Dropout before the last layer; which mask does each rank draw?"""
    sizes = b.equal_sizes()
    mine = b.rows(sizes)
    model = b.model()
    body, head = nn.Sequential(*list(model)[:-1]), model[-1]  # features → dropout → last layer
    width = head.in_features

    def draw(rows, seed):
        """A dropout mask, scaled by 1/(1-p), as nn.Dropout draws it: from a seeded generator."""
        g = torch.Generator().manual_seed(seed)
        return torch.bernoulli(torch.full((rows, width), 1 - p, dtype=torch.float64),
                               generator=g) / (1 - p)

    global_mask = draw(b.args.batch, b.args.seed)  # the mask one process draws for the whole batch
    ref = b.reference(model, forward=lambda x: head(body(x) * global_mask.to(x.device)))
    masks = {  # what rank k multiplies its shard's features with
        "same seed on every rank": draw(sizes[b.rank], b.args.seed),
        "seed + rank": draw(sizes[b.rank], b.args.seed + b.rank),  # DDP: a stream per rank
        "the global batch's mask, my rows": global_mask[mine],  # DDP: = one process
    }
    for variant, mask in masks.items():
        mask = mask.to(b.env.device)
        loss = F.cross_entropy(head(body(b.x[mine].double()) * mask), b.y[mine])
        average_gradients(model, loss, b.world)
        everyone = [torch.empty_like(mask) for _ in range(b.world)]
        dist.all_gather(everyone, mask)  # DDP: every rank's mask, to compare them
        same = [(everyone[0] == m).double().mean().item() for m in everyone[1:]]
        agree = {"masks_agree": sum(same) / len(same)} if same else {}  # rank 0 vs the others
        b.report("dropout", f"dropout {p:g}, {variant}", flat_grad(model), ref, sizes, **agree)
        model.zero_grad()


# ---------------------------------------------------------------- set-up and main
def setup(args):
    # DDP: rank and world size from torchrun, srun or mpirun; MASTER_ADDR/PORT set and checked.
    env = world.prepare(backend=args.backend, device=args.device)
    if env.device.type == "cuda":
        torch.cuda.set_device(env.device)  # DDP: one GPU per process, cuda:LOCAL_RANK
    dist.init_process_group(env.backend, rank=env.rank, world_size=env.world_size,  # DDP: join
                            timeout=timedelta(seconds=args.timeout))  # DDP: no endless waits
    return env


def cleanup():
    dist.destroy_process_group()  # DDP: leave the process group so every rank exits cleanly.


def main(args):
    env = setup(args)
    rank, world_size = dist.get_rank(), dist.get_world_size()  # DDP: who am I, how many are we?
    log = JsonLog(args.log_json if rank == 0 else None, world_size=world_size,  # DDP: rank 0 logs
                  global_batch=args.batch)
    bench = Bench(args, env, log)
    if rank == 0:  # DDP: one rank talks
        print(f"{world_size} rank(s), global batch {args.batch} FashionMNIST images, "
              f"{env.backend} on {env.device}", flush=True)
    cases = CASES if "all" in args.case else args.case
    run = {"average": case_average, "float32": lambda b: case_average(b, torch.float32, "float32"),
           "unequal": case_unequal, "sum": case_sum, "batchnorm": case_batchnorm,
           "dropout": case_dropout}
    try:
        for case in cases:
            run[case](bench)
    except NotImplementedError as err:  # the learner's copy: every rank meets the stub
        if rank == 0:
            print(f"average_gradients is not done yet — NotImplementedError: {err}", flush=True)
        raise SystemExit(1)
    cleanup()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--case", nargs="+", default=["average"], choices=[*CASES, "all"],
                        metavar="CASE",
                        help=f"what to compare, one or more of {', '.join(CASES)}, "
                             "or all (default: average)")
    parser.add_argument("--batch", type=int, default=240,
                        help="global batch, split over the ranks (default 240)")
    parser.add_argument("--shards", default=None,
                        help="--case unequal: comma-separated shard sizes, one per rank "
                             "(default ∝ rank + 1)")
    parser.add_argument("--width", type=int, default=16, help="channels of the CNN's first layer")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-root", default=None, help="where FashionMNIST is (default: data/)")
    parser.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--timeout", type=float, default=60, help="seconds a collective may wait")
    parser.add_argument("--log-json", default=None, help="rank 0 writes JSON lines here")
    main(parser.parse_args())
