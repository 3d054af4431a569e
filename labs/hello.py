"""Hello, distributed world: every rank says who it is, then all ranks agree on one number.

    torchrun --standalone --nproc-per-node 2 solutions/labs/hello.py
    srun --ntasks 2 python solutions/labs/hello.py          # inside a Slurm allocation
    python solutions/labs/hello.py                          # one process, no launcher
"""
import argparse
import os
import socket

import torch
import torch.distributed as dist

from dpcourse import dist as ddp_env
from dpcourse.metrics import JsonLog


def setup(args):
    # DDP: read rank/world size from the launcher, pick gloo (CPU) or NCCL (GPU), join the group.
    return ddp_env.setup(backend=args.backend, device=args.device)


def cleanup():
    ddp_env.cleanup()  # DDP: leave the process group so every rank exits cleanly.


def main(args):
    env = setup(args)
    rank, world_size = dist.get_rank(), dist.get_world_size()  # DDP: who am I, how many are we?
    print(f"hello from rank {rank} of {world_size} (local rank {env.local_rank}) on "
          f"{socket.gethostname()}, pid {os.getpid()}, backend {env.backend}, device {env.device}",
          flush=True)

    # DDP: each rank holds its own number; all_reduce sums them in place on every rank.
    value = torch.tensor([float(rank + 1)], device=env.device)
    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    expected = world_size * (world_size + 1) / 2

    if rank == 0:  # DDP: one rank prints the result and writes the log.
        print(f"all_reduce(rank + 1) = {value.item():g} on every rank "
              f"(1 + 2 + ... + {world_size} = {expected:g})", flush=True)
    log = JsonLog(args.log_json if rank == 0 else None, world_size=world_size)  # DDP: rank 0 logs
    log.write("hello", backend=env.backend, launcher=env.launcher, all_reduce=value.item())
    cleanup()
    if value.item() != expected:
        raise SystemExit(f"rank {rank}: all_reduce gave {value.item()}, expected {expected}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl", "mpi"])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--log-json", default=None, help="rank 0 writes JSON lines here")
    main(parser.parse_args())
