"""Hello, distributed world: every rank says who it is, then all ranks agree on one number.

    python solutions/labs/hello.py                                     # one process, no launcher
    torchrun --standalone --nproc-per-node 2 solutions/labs/hello.py   # two processes here
    srun --ntasks 2 python solutions/labs/hello.py                     # inside a Slurm allocation
    mpirun -np 2 python solutions/labs/hello.py                        # two Open MPI ranks

(Activate the course's environment first: source .venv/bin/activate.)
"""
import argparse
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from dpcourse.lab import world
from dpcourse.lab.metrics import JsonLog


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


def sum_formula(n):
    """'1', '1 + 2', '1 + 2 + 3', '1 + 2 + ... + n': the sum every rank's all_reduce computes."""
    terms = [str(k) for k in range(1, n + 1)]
    return " + ".join(terms if n <= 3 else ["1", "2", "...", str(n)])


def main(args):
    env = setup(args)
    rank, world_size = dist.get_rank(), dist.get_world_size()  # DDP: who am I, how many are we?
    print(f"hello from rank {rank} of {world_size} (local rank {env.local_rank}) on "
          f"{socket.gethostname()}, pid {os.getpid()}, backend {env.backend}, device {env.device}",
          flush=True)

    # DDP: each rank holds its own number; all_reduce sums them in place on every rank.
    value = torch.tensor([float(rank + 1)], device=env.device)
    dist.all_reduce(value, op=dist.ReduceOp.SUM)  # DDP: 1 + 2 + ... + P, in value on every rank
    expected = world_size * (world_size + 1) / 2

    if rank == 0:  # DDP: one rank prints the result and writes the log.
        print(f"all_reduce(rank + 1) = {value.item():g} on every rank "
              f"({sum_formula(world_size)} = {expected:g})", flush=True)
    log = JsonLog(args.log_json if rank == 0 else None, world_size=world_size)  # DDP: rank 0 logs
    log.write("hello", backend=env.backend, launcher=env.launcher, all_reduce=value.item())
    cleanup()
    if value.item() != expected:
        raise SystemExit(f"rank {rank}: all_reduce gave {value.item()}, expected {expected}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl", "mpi"])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--timeout", type=float, default=60, help="seconds a collective may wait")
    parser.add_argument("--log-json", default=None, help="rank 0 writes JSON lines here")
    main(parser.parse_args())
