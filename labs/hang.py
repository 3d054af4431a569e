"""A hang, found: which rank, which collective, which one in the sequence, and where each waits.

    torchrun --standalone --nproc-per-node 2 labs/hang.py --bug skip --trace-dir runs/hang
    python -m torch.distributed.flight_recorder.fr_trace runs/hang      # PyTorch's reader

    torchrun --standalone --nproc-per-node 2 labs/hang.py --bug evaluate-alone \
        --trace-dir runs/hang-eval
    torchrun --standalone --nproc-per-node 2 labs/hang.py --bug none --trace-dir runs/ok

Each rank fits a line to its share of synthetic data, averaging the gradients with an all_reduce
each step, then the test loss is measured on every rank's share and summed. --bug skip: rank 1
leaves one step out (a batch it could not use, say), so it makes one collective fewer;
--bug evaluate-alone: only rank 0 measures the test loss (it is the one that prints it), in an
all_reduce no other rank makes. A collective waits at most --timeout seconds; then every rank writes
PyTorch's flight recorder (its last TORCH_FR_BUFFER_SIZE collectives, each with its sequence number
and the Python stack that called it) to --trace-dir/rank_N, and ends with one line. The reader
matches the ranks' collectives by sequence number and names the first that disagrees, the line of
this file that called it, and as "Culprit" the rank whose collective differs from the first rank's:
rank 1 with both bugs, although the all_reduce too many in evaluate-alone is rank 0's.

A hang with a long timeout: every rank's Python stack while it waits, from a second terminal (as
root, or where ptrace is allowed), with py-spy (pip install py-spy): the launcher and its workers,

    py-spy dump --subprocesses --pid $(pgrep -of 'torchrun.*hang.py')

(Activate the course's environment first: source .venv/bin/activate.)
"""
import argparse
import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from dpcourse.lab import metrics, world
from dpcourse.lab.metrics import JsonLog

FEATURES, EXAMPLES, BATCH = 8, 4096, 64
SKIPPED_STEP = 3  # --bug skip: the step rank 1 leaves out


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


def line_data(seed, device):
    """(x, y) for training and for the test: y = x·w + noise, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(FEATURES, generator=g)
    x = torch.randn(2 * EXAMPLES, FEATURES, generator=g)
    y = x @ w + 0.1 * torch.randn(2 * EXAMPLES, generator=g)
    x, y = x.to(device), y.to(device)
    return (x[:EXAMPLES], y[:EXAMPLES]), (x[EXAMPLES:], y[EXAMPLES:])


def train_step(w, x, y, lr, world_size):
    """One step of SGD on this rank's batch, with the gradient averaged over the ranks."""
    w.grad = None
    ((x @ w - y) ** 2).mean().backward()
    dist.all_reduce(w.grad)  # DDP: the gradients summed over the ranks ...
    with torch.no_grad():
        w -= lr * w.grad / world_size  # DDP: ... and averaged: one step of the global batch


def evaluate(w, test, rank, world_size):
    """The mean squared error on the whole test set: each rank tests its share, sums added."""
    x, y = (t[rank::world_size] for t in test)  # DDP: examples r, r+K, r+2K, ...
    with torch.no_grad():
        totals = torch.tensor([((x @ w - y) ** 2).sum().item(), len(y)], dtype=torch.float64,
                              device=x.device)
    dist.all_reduce(totals)  # DDP: squared errors and examples, summed over the ranks
    return (totals[0] / totals[1]).item()


def main(args):
    # DDP: PyTorch's flight recorder keeps this process's last 2,000 collectives (set before the
    # group exists; gloo records too)
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
    if args.trace_dir:  # torchrun's SIGTERM, once another rank has failed, must not cut the dump
        signal.signal(signal.SIGTERM, lambda *_: None)  # DDP: this rank ends at its own timeout
    env = setup(args)
    rank, world_size = dist.get_rank(), dist.get_world_size()  # DDP: who am I, how many are we?
    (x, y), test = line_data(args.seed, env.device)
    x, y = x[rank::world_size], y[rank::world_size]  # DDP: this rank's share of the examples
    w = torch.zeros(FEATURES, device=env.device, requires_grad=True)
    start = time.perf_counter()
    try:
        for step in range(args.steps):
            if args.bug == "skip" and rank == 1 and step == SKIPPED_STEP:
                continue  # BUG: rank 1 leaves a step out, so one all_reduce fewer than rank 0's
            batch = slice(step * BATCH % len(y), step * BATCH % len(y) + BATCH)
            train_step(w, x[batch], y[batch], args.lr, world_size)
        dist.barrier()  # DDP: every rank has finished training before the clock stops
        seconds = time.perf_counter() - start
        if args.bug == "evaluate-alone":
            # BUG: only rank 0 prints the test loss, so only rank 0 measures it: its all_reduce
            # waits for rank 1, which has gone on to the barrier below
            test_loss = evaluate(w, test, rank, world_size) if rank == 0 else None  # DDP: rank 0
        else:
            test_loss = evaluate(w, test, rank, world_size)  # DDP: every rank tests its share
        dist.barrier()  # DDP: every rank finishes together
    finally:
        if args.trace_dir:  # DDP: every rank's recorder, also when a collective timed out
            metrics.write_flight_recorder(args.trace_dir, rank)

    if rank == 0:  # DDP: one rank reports
        print(f"test loss {test_loss:.4f} after {args.steps} steps, trained in {seconds:.2f} s",
              flush=True)
    log = JsonLog(args.log_json if rank == 0 else None, world_size=world_size)  # DDP: rank 0 logs
    log.write("done", bug=args.bug, steps=args.steps, test_loss=test_loss, seconds=seconds)
    cleanup()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bug", default="none", choices=["none", "skip", "evaluate-alone"])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=5, help="seconds a collective may wait")
    parser.add_argument("--trace-dir", default=None,
                        help="every rank writes its flight recorder here, as rank_<N>")
    # gloo on the CPU unless asked: the recorder and the timeouts as notebook 15 shows them, on a
    # GPU node too (NCCL's watchdog times out and dumps in its own way)
    parser.add_argument("--backend", default="gloo", choices=["auto", "gloo", "nccl", "mpi"])
    parser.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--log-json", default=None, help="rank 0 writes JSON lines here")
    main(parser.parse_args())
