"""What a process group and DistributedDataParallel do for you, one short demonstration at a time.

    torchrun --standalone --nproc-per-node 2 labs/ddp_tour.py init
        # env://, tcp://, file://
    torchrun --standalone --nproc-per-node 2 labs/ddp_tour.py ddp
        # broadcast, no_sync, unused

(Activate the course's environment first: source .venv/bin/activate.) Rank 0 prints; with
--log-json it also writes one JSON record per demonstration.
"""
import argparse
import contextlib
import os
import tempfile
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from dpcourse.lab import world
from dpcourse.lab.metrics import JsonLog
from dpcourse.lab.rendezvous import free_port

# DDP: how long the group's meeting, and each collective, waits for every rank: a rank that cannot
# reach the others fails within a minute, not after gloo's default 30 minutes
TIMEOUT = timedelta(seconds=60)


def say(*parts):
    if dist.get_rank() == 0:  # DDP: one rank talks
        print(*parts, flush=True)


def check_group():
    """Every rank adds rank + 1: the group works if the sum is 1 + 2 + ... + world size."""
    t = torch.tensor([dist.get_rank() + 1.0])  # DDP: rank + 1, different on every rank
    dist.all_reduce(t)  # DDP: the sum over the ranks, in t on every rank
    return t.item()


def init_methods(env, log):
    """The same group, started three ways. All need rank and world size; they differ in how
    the ranks find each other: env:// reads MASTER_ADDR/MASTER_PORT, tcp:// names rank 0's
    address and a port in a URL, file:// meets in a file every rank can see."""
    rank, world = env.rank, env.world_size
    start = time.perf_counter()
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world,  # DDP: join
                            timeout=TIMEOUT)
    took = time.perf_counter() - start
    say(f"env://  rank 0 of {world}: all_reduce(rank + 1) = {check_group():g}, set-up {took:.2f} s")
    log.write("init", method="env", sum=check_group(), setup_s=took)
    # Rank 0 picks a port and a file name for the next two and tells the others (a broadcast).
    choice = [free_port("0.0.0.0"),
              os.path.join(tempfile.gettempdir(), f"dpcourse-rdzv-{os.getpid()}")]
    dist.broadcast_object_list(choice, src=0)  # DDP: rank 0's port and file name, to every rank
    port, path = choice
    dist.destroy_process_group()  # DDP: leave the env:// group: the next two meet anew
    # DDP: torchrun's ranks meet in its agent's store; this new address is served by rank 0 itself
    # (PyTorch before 2.14 would otherwise make every rank a client of it, and wait: seen with 2.11)
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"

    for method, url in (("tcp", f"tcp://{os.environ['MASTER_ADDR']}:{port}"), ("file", f"file://{path}")):
        start = time.perf_counter()
        dist.init_process_group("gloo", init_method=url, rank=rank, world_size=world,  # DDP: join
                                timeout=TIMEOUT)
        took = time.perf_counter() - start
        total = check_group()
        say(f"{method}://  rank 0 of {world}: all_reduce(rank + 1) = {total:g}, "
            f"set-up {took:.2f} s   ({url})")
        log.write("init", method=method, sum=total, setup_s=took)
        dist.barrier()  # DDP: nobody leaves before every rank has arrived
        dist.destroy_process_group()  # DDP: leave this group, before the next one or the exit
    if rank == 0:
        with contextlib.suppress(FileNotFoundError):  # the file store may have removed it
            os.remove(path)


def small_net(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def gathered(value):
    """``value`` (a float) from every rank, as a list, on every rank."""
    out = [None] * dist.get_world_size()  # DDP: a slot per rank
    dist.all_gather_object(out, value)  # DDP: every rank's value, on every rank
    return out


def broadcast_at_wrap(log):
    """Ranks may build different initial weights; DDP's constructor copies rank 0's to all."""
    net = small_net(seed=dist.get_rank())  # DDP: a different seed on every rank, on purpose
    before = gathered(round(net[0].weight[0, 0].item(), 4))
    model = DDP(net)  # DDP: broadcasts rank 0's parameters and buffers
    after = gathered(round(model.module[0].weight[0, 0].item(), 4))
    say(f"first weight on each rank, before DDP(): {before}   after: {after}")
    log.write("broadcast", before=before, after=after)


def count_allreduces(model):
    """Wrap DDP's communication in a counter: one call per gradient bucket sent."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    calls = {"n": 0}

    def hook(state, bucket):
        calls["n"] += 1
        return allreduce_hook(state, bucket)

    model.register_comm_hook(None, hook)
    return calls


def accumulate_with_no_sync(log, micro=8, accum=4):
    """Gradient accumulation: `accum` micro-batches per step, one all-reduce at the last.

    Global batch = micro-batch × accumulation steps × world size. Each micro-batch's loss is
    divided by `accum`, so the accumulated gradient is the mean over the global batch.
    """
    rank, world = dist.get_rank(), dist.get_world_size()  # DDP: who am I, how many are we?
    g = torch.Generator().manual_seed(0)  # the same global batch on every rank
    x, y = (torch.randn(micro * accum * world, 8, generator=g),
            torch.randint(0, 4, (micro * accum * world,), generator=g))
    reference = small_net(seed=0)  # one process, the whole global batch at once
    F.cross_entropy(reference(x), y).backward()

    for use_no_sync in (True, False):
        model = DDP(small_net(seed=0))  # DDP: a fresh wrap, its all-reduces counted
        calls = count_allreduces(model)
        mine = torch.arange(rank, len(x), world)  # DDP: my shard of the global batch
        for i, part in enumerate(mine.split(micro)):
            last = i == accum - 1
            if use_no_sync and not last:
                with model.no_sync():  # DDP: accumulate locally, no communication
                    (F.cross_entropy(model(x[part]), y[part]) / accum).backward()
            else:
                # DDP: all-reduce here
                (F.cross_entropy(model(x[part]), y[part]) / accum).backward()
        diff = max((p.grad - r.grad).abs().max().item()
                   for p, r in zip(model.parameters(), reference.parameters()))
        label = "with no_sync" if use_no_sync else "without    "
        say(f"{label}: {calls['n']} all-reduce call(s) for {accum} micro-batches of {micro} "
            f"on {world} ranks (global batch {micro * accum * world}); "
            f"max |grad - one-process grad| = {diff:.1e}")
        log.write("no_sync", no_sync=use_no_sync, allreduces=calls["n"], max_grad_diff=diff,
                  global_batch=micro * accum * world)


class TwoHeads(nn.Module):
    """A model whose second head is not used in forward: its parameters never get a gradient."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.used, self.unused = nn.Linear(8, 16), nn.Linear(16, 4), nn.Linear(16, 4)

    def forward(self, x):
        return self.used(torch.relu(self.body(x)))


def unused_parameters(log):
    """DDP waits for every parameter's gradient before a bucket is sent. A parameter that
    forward never used never gets one: the next iteration then fails, unless DDP is told to
    look for such parameters after each forward (find_unused_parameters=True, which costs a
    walk over the autograd graph every step)."""
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    for find in (False, True):
        # DDP: without, then with, the unused-parameter search
        model = DDP(TwoHeads(), find_unused_parameters=find)
        try:
            for _ in range(2):
                F.cross_entropy(model(x), y).backward()
            outcome = "2 steps ran"
        except RuntimeError as err:
            outcome = "RuntimeError: " + str(err).strip().splitlines()[0][:90] + " ..."
        say(f"find_unused_parameters={find!s:5}: {outcome}")
        log.write("unused", find_unused_parameters=find, ok=outcome == "2 steps ran")


def main(args):
    env = world.prepare(backend="gloo", device="cpu")  # DDP: rank, world size, address, port
    # DDP: rank 0 logs
    log = JsonLog(args.log_json if env.rank == 0 else None, world_size=env.world_size)
    if args.part == "init":
        init_methods(env, log)
        return
    dist.init_process_group("gloo", rank=env.rank, world_size=env.world_size,  # DDP: join the group
                            timeout=TIMEOUT)
    # we show it on purpose
    warnings.filterwarnings("ignore", message=".*find_unused_parameters=True.*")
    broadcast_at_wrap(log)
    accumulate_with_no_sync(log)
    unused_parameters(log)
    dist.destroy_process_group()  # DDP: leave the group so every rank exits cleanly


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("part", choices=["init", "ddp"])
    parser.add_argument("--log-json", default=None, help="rank 0 writes JSON lines here")
    main(parser.parse_args())
