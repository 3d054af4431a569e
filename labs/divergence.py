"""Silent divergence caught: every few steps the ranks compare fingerprints of their weights.

    torchrun --standalone --nproc-per-node 2 labs/divergence.py                # no fault
    torchrun --standalone --nproc-per-node 2 labs/divergence.py --fault skip-step
    torchrun --standalone --nproc-per-node 2 labs/divergence.py --fault inf-loss
    torchrun --standalone --nproc-per-node 2 labs/divergence.py --fault buffer
    torchrun --standalone --nproc-per-node 2 labs/divergence.py --fault dropout-seed
    torchrun --standalone --nproc-per-node 2 labs/divergence.py --bench   # its cost

(Activate the course's environment first: source .venv/bin/activate.)

DDP keeps the replicas equal only because every rank starts from rank 0's weights and applies the
same averaged gradients: a rank that applies anything else drifts away, and nothing complains.
The course CNN (with dropout before its classifier) trains with a GradScaler on FashionMNIST, each
rank on its own batches. The check: each rank sums the bytes of each of its parameters and buffers
read as 64-bit integers (exact and order-free: a changed bit changes the sum, a thread count or a
reduction order does not), all-gathers these fingerprints, and every rank compares them. Parameters
that differ stop the run on every rank, in one line naming the step, the ranks and the first
tensor; buffers that differ are reported, not stopped on.

    skip-step     rank --fault-rank skips one optimizer step: the GradScaler's own skip, of
                  torch.amp.GradScaler, set off by an inf planted in that rank's gradient after
                  the all-reduce (a bit flip, or code of that rank between backward and step)
    inf-loss      the same inf in that rank's loss, before the all-reduce: it reaches every rank,
                  every rank's scaler skips the same step, and the replicas stay equal
    buffer        BatchNorm instead of GroupNorm, and DDP(forward_sync_buffers=False), formerly
                  broadcast_buffers=False: each rank's running statistics follow its own
                  batches. Expected, not a fault of the weights
    dropout-seed  the same dropout stream on every rank: rank r's example i gets the same mask
                  as rank s's example i (correlated masks); by default each rank has its own
                  stream, as one process with the whole batch would. The weights stay equal
                  either way: the check cannot see it, and rank 0 prints how alike the masks are

--bench times one check against one training step, for the course CNN and a 10M-parameter MLP.
Lines there because of distribution: `# DDP:`.
"""
import argparse
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from dpcourse.lab import world
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


def cnn(norm="group", dropout=0.5):
    """The course CNN with dropout before its classifier."""
    layers = list(FashionCNN(norm=norm))
    return nn.Sequential(*layers[:-1], nn.Dropout(dropout), layers[-1])


def mlp(width=2048):
    """784 -> 2048 -> 2048 -> 2048 -> 10: 10.0M parameters."""
    return nn.Sequential(nn.Flatten(), nn.Linear(784, width), nn.ReLU(), nn.Linear(width, width),
                         nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))


def fingerprint(tensors):
    """One int64 per tensor: its bytes read as 64-bit integers and summed. Integer sums wrap
    around and are exact: one changed bit changes the sum, and no reduction order does."""
    sums = []
    for t in tensors:
        raw = t.detach().reshape(-1).view(torch.uint8)
        whole = raw.numel() // 8 * 8  # the bytes that make whole 64-bit words; then the rest
        sums.append(raw[:whole].view(torch.int64).sum() + raw[whole:].sum(dtype=torch.int64))
    return torch.stack(sums)


def compare(module, step, env, log, step_ms=None):
    """Every rank's fingerprints, gathered and compared: where the parameters differ, rank 0 logs
    it (with this check's ms, and ``step_ms``, a training step's so far) and every rank stops;
    returns the names of the buffers that differ."""
    tick = time.perf_counter()
    params, buffers = dict(module.named_parameters()), dict(module.named_buffers())
    names = [*params, *buffers]
    mine = fingerprint([*params.values(), *buffers.values()])
    everyone = [torch.empty_like(mine) for _ in range(env.world_size)]
    dist.all_gather(everyone, mine)  # DDP: every rank's fingerprints, on every rank
    differs = torch.stack(everyone) != everyone[0]  # [rank, tensor]: unlike rank 0's
    bad = differs[:, :len(params)]
    if bad.any():
        first = names[int(bad.any(0).nonzero()[0])]
        ranks = bad.any(1).nonzero().flatten().tolist()
        log.write("diverged", step=step, ranks=ranks, first=first,
                  tensors_differ=int(bad.any(0).sum()), tensors=len(params),
                  check_ms=round(1000 * (time.perf_counter() - tick), 3), step_ms=step_ms)
        world.stop(env, f"the replicas have diverged by step {step}: the parameters of rank(s) "
                        f"{ranks} differ from rank 0's, first in {first} ({int(bad.any(0).sum())} "
                        f"of {len(params)} parameter tensors differ)")
    return [n for n, d in zip(names[len(params):], differs[:, len(params):].any(0)) if d]


def watch_dropout(dropout):
    """The first forward's dropout mask (kept or dropped) where its input was not zero."""
    first = {}

    def hook(module, inputs, output):
        if not first:
            first["kept"], first["known"] = output != 0, inputs[0] != 0
    dropout.register_forward_hook(hook)
    return first


def masks_agree(first, world_size):
    """Of the positions every rank knows, the fraction where rank r's mask equals rank 0's
    (the mean over ranks r > 0; None on one process)."""
    pair = torch.stack([first["kept"], first["known"]]).to(torch.uint8)
    everyone = [torch.empty_like(pair) for _ in range(world_size)]
    dist.all_gather(everyone, pair)  # DDP: every rank's first mask
    known = torch.stack([p[1] for p in everyone]).all(0).bool()
    same = [(p[0] == everyone[0][0])[known].float().mean().item() for p in everyone[1:]]
    return round(sum(same) / len(same), 4) if same else None


def train(args, env, log):
    rank, world_size, dev = env.rank, env.world_size, env.device
    train_set = InMemoryFashionMNIST(args.data_root, train=True, device=dev)
    torch.manual_seed(args.seed)
    module = cnn("batch" if args.fault == "buffer" else "group").to(dev)
    # DDP: with forward_sync_buffers=False each rank keeps its own BatchNorm statistics
    model = DDP(module, device_ids=[dev] if dev.type == "cuda" else None,
                forward_sync_buffers=args.fault != "buffer")
    first_mask = watch_dropout(module[-2])
    # DDP: dropout's stream: the same on every rank (dropout-seed), or one of its own per rank
    torch.manual_seed(args.seed if args.fault == "dropout-seed" else args.seed + 1 + rank)
    batches = torch.Generator(device=dev).manual_seed(1000 * args.seed + rank)  # DDP: own data
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    scaler = torch.amp.GradScaler(dev.type)
    fault_rank = args.fault_rank % world_size
    skipped, buffers, spent, checks, start = 0, [], 0.0, 0, time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = train_set[torch.randint(len(train_set), (args.batch_size,), generator=batches,
                                       device=dev)]
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        planted = step == args.fault_step and rank == fault_rank
        if planted and args.fault == "inf-loss":
            loss = loss * float("inf")  # before the all-reduce: every rank's gradient gets it
        scaler.scale(loss).backward()  # DDP: gradients averaged over the ranks in here
        if planted and args.fault == "skip-step":
            next(model.parameters()).grad.view(-1)[0] = float("inf")  # after it: this rank only
        scale = scaler.get_scale()
        scaler.step(opt)  # skipped where this rank's gradients hold an inf or a nan
        scaler.update()
        skipped += scaler.get_scale() < scale
        if step == 1:
            agree = masks_agree(first_mask, world_size)
        if step % args.check_every == 0 or step == args.steps:
            tick = time.perf_counter()
            so_far = round(1000 * (tick - start - spent) / step, 2)  # ms a training step, so far
            buffers = compare(module, step, env, log, step_ms=so_far)
            spent, checks = spent + time.perf_counter() - tick, checks + 1
    seconds = time.perf_counter() - start
    skips = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(world_size)]
    # DDP: how many steps each rank's scaler skipped
    dist.all_gather(skips, torch.tensor([skipped], device=dev))
    return {"fault": args.fault, "steps": args.steps, "checks": checks,
            "skipped_per_rank": [int(s) for s in skips], "buffers_differ": buffers,
            "masks_agree": agree, "ms_per_step": round(1000 * (seconds - spent) / args.steps, 2),
            "ms_per_check": round(1000 * spent / checks, 3)}


def timed(work, repeats, device):
    """Median milliseconds of work(), after two calls to warm up; every rank starts together."""
    times = []
    for _ in range(repeats + 2):
        dist.barrier()  # DDP: every rank starts the timed call together
        tick = time.perf_counter()
        work()
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the GPU's work done, not only queued
        times.append(1000 * (time.perf_counter() - tick))
    return statistics.median(times[2:])


def bench(args, env, log):
    """One check against one training step, for the course CNN and a 10M-parameter MLP."""
    dev = env.device
    for name, module in (("course CNN", cnn()), ("MLP", mlp())):
        torch.manual_seed(args.seed)
        module = module.to(dev)
        model = DDP(module, device_ids=[dev] if dev.type == "cuda" else None)  # DDP: as trained
        opt = torch.optim.SGD(model.parameters(), lr=args.lr)
        x = torch.randn(args.batch_size, 1, 28, 28, device=dev)
        y = torch.randint(10, (args.batch_size,), device=dev)

        def step():
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()  # DDP: gradients averaged in here
            opt.step()
        step_ms = timed(step, args.repeats, dev)
        check_ms = timed(lambda: compare(module, 0, env, log), args.repeats, dev)
        params = sum(p.numel() for p in module.parameters())
        if env.rank == 0:  # DDP: one rank prints
            print(f"{name}: {params:,} parameters, step {step_ms:.2f} ms, check {check_ms:.3f} ms "
                  f"({100 * check_ms / step_ms:.2f} % of a step)", flush=True)
        log.write("bench", model=name, parameters=params, step_ms=round(step_ms, 3),
                  check_ms=round(check_ms, 4), batch_size=args.batch_size)


def main(args):
    env = setup(args)
    rank, world_size = dist.get_rank(), dist.get_world_size()  # DDP: who am I, how many are we?
    log = JsonLog(args.log_json if rank == 0 else None,  # DDP: rank 0 logs
                  world_size=world_size, check_every=args.check_every)
    if args.bench:
        bench(args, env, log)
        cleanup()
        return
    result = train(args, env, log)
    if rank == 0:  # DDP: one rank reports
        print(", ".join(f"{k} {v}" for k, v in result.items()), flush=True)
        if result["buffers_differ"]:
            print(f"buffers differ between the ranks ({', '.join(result['buffers_differ'])}): "
                  "each rank's BatchNorm updates its running statistics from its own batch in "
                  "every forward. DDP's forward_sync_buffers=True (the default) copies rank 0's "
                  "to every rank at the start of the next forward; False never does, so each "
                  "rank evaluates with its own. Not a divergence of the weights.", flush=True)
    log.write("done", **result)
    cleanup()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fault", default="none",
                        choices=["none", "skip-step", "inf-loss", "buffer", "dropout-seed"])
    parser.add_argument("--check-every", type=int, default=10, help="steps between two checks")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--fault-step", type=int, default=25, help="the step the fault hits")
    parser.add_argument("--fault-rank", type=int, default=-1, help="the rank it hits (-1: last)")
    parser.add_argument("--batch-size", type=int, default=64, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bench", action="store_true", help="time a check against a step")
    parser.add_argument("--repeats", type=int, default=10, help="--bench: timed calls of each")
    parser.add_argument("--data-root", default=None)
    parser.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl", "mpi"])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--timeout", type=float, default=60, help="seconds a collective may wait")
    parser.add_argument("--log-json", default=None, help="rank 0 writes JSON lines here")
    main(parser.parse_args())
