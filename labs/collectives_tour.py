"""The ten communication primitives of torch.distributed, each run once, before and after shown.

    torchrun --standalone --nproc-per-node 4 labs/collectives_tour.py
    torchrun --standalone --nproc-per-node 4 labs/collectives_tour.py --only all_to_all

(Activate the course's environment first: source .venv/bin/activate.) Rank r starts every
primitive from the same row of numbers, 10·r + j for position j (rank 2 of 4: 20 21 22 23),
so the tens digit of a number says which rank it came from. Rank 0 prints a rank × data table
before and after each primitive and, with --log-json, writes one JSON record per primitive.
"""
import argparse
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from dpcourse.lab import world
from dpcourse.lab.metrics import JsonLog


def row(rank, world_size, device):
    """What rank ``rank`` holds before each primitive: 10·rank + j, j = 0 … world_size − 1."""
    return torch.tensor([10.0 * rank + j for j in range(world_size)], device=device)


def values(t):
    return [round(v) for v in t.tolist()] if t is not None else None  # integers: exact in float32


# Each primitive: (this rank's data before, after), for this rank. None means "no buffer here"
# (scatter's list exists on the source only, gather's on the destination only).
def broadcast(rank, world_size, device):
    x = row(rank, world_size, device)
    before = values(x)
    dist.broadcast(x, src=0)  # DDP: rank 0's row overwrites x on every rank
    return before, values(x)


def scatter(rank, world_size, device):
    out = torch.empty(1, device=device)
    chunks = list(row(0, world_size, device).chunk(world_size)) if rank == 0 else None
    dist.scatter(out, chunks, src=0)  # DDP: chunk r of rank 0's list goes to rank r
    return (values(row(0, world_size, device)) if rank == 0 else None), values(out)


def gather(rank, world_size, device):
    mine = row(rank, world_size, device)[rank:rank + 1]  # one number per rank: 10·r + r
    out = [torch.empty(1, device=device) for _ in range(world_size)] if rank == 0 else None
    dist.gather(mine, out, dst=0)  # DDP: every rank's tensor lands in rank 0's list, in rank order
    return values(mine), (values(torch.cat(out)) if rank == 0 else None)


def reduce(rank, world_size, device):
    x = row(rank, world_size, device)
    before = values(x)
    dist.reduce(x, dst=0, op=dist.ReduceOp.SUM)  # DDP: the sum of all rows, on rank 0 only
    return before, (values(x) if rank == 0 else None)  # elsewhere x is undefined: don't read it


def all_reduce(rank, world_size, device):
    x = row(rank, world_size, device)
    before = values(x)
    dist.all_reduce(x, op=dist.ReduceOp.SUM)  # DDP: the sum of all rows, on every rank
    return before, values(x)


def all_gather(rank, world_size, device):
    mine = row(rank, world_size, device)[rank:rank + 1]
    out = [torch.empty(1, device=device) for _ in range(world_size)]
    dist.all_gather(out, mine)  # DDP: gather, with the result on every rank
    return values(mine), values(torch.cat(out))


def reduce_scatter(rank, world_size, device):
    x = row(rank, world_size, device)
    out = torch.empty(1, device=device)
    # DDP: chunk r summed over ranks → rank r
    dist.reduce_scatter(out, list(x.chunk(world_size)), op=dist.ReduceOp.SUM)
    return values(x), values(out)


def all_to_all(rank, world_size, device):
    x = row(rank, world_size, device)
    out = torch.empty(world_size, device=device)
    dist.all_to_all_single(out, x)  # DDP: chunk j of rank r → position r on rank j (a transpose)
    return values(x), values(out)


def send_recv(rank, world_size, device):
    """A ring shift: each rank sends its row to the next rank and receives the previous one's.

    Blocking send waits until the other side takes the message. If every rank sent first, all
    could wait for each other forever (a deadlock, for messages too big to buffer); so even
    ranks send first and odd ranks receive first. (isend/irecv avoid the question: notebook §3.)
    """
    x = row(rank, world_size, device)
    if world_size == 1:  # one process: nobody to send to (a rank cannot send to itself)
        return values(x), values(x)
    got = torch.empty_like(x)
    nxt, prev = (rank + 1) % world_size, (rank - 1) % world_size
    if rank % 2 == 0:
        dist.send(x, dst=nxt)  # DDP: point to point, to one rank
        dist.recv(got, src=prev)  # DDP: blocks until the message is here
    else:
        dist.recv(got, src=prev)  # DDP: odd ranks receive first: no deadlock
        dist.send(x, dst=nxt)  # DDP: then pass their own row on
    return values(x), values(got)


def barrier(rank, world_size, device, late_ms=40):
    """Rank r arrives r·late_ms late; nobody leaves the barrier before the last one has come.

    The times are on one clock for all ranks: the wall clock (the same on one machine), from
    a start that rank 0 picks and broadcasts.
    """
    start = torch.tensor([time.time()], dtype=torch.float64, device=device)
    dist.broadcast(start, src=0)  # DDP: every rank measures from rank 0's start
    start = start.item()
    time.sleep(max(0.0, start + rank * late_ms / 1000 - time.time()))
    arrived = time.time() - start
    dist.barrier()  # DDP: wait here until every rank has arrived
    left = time.time() - start
    return [round(arrived * 1000, 1)], [round(left * 1000, 1)]  # milliseconds


PRIMITIVES = {  # name: (function, what it does, the call, "move" or "reduce" (values summed))
    "broadcast": (broadcast, "rank 0's row to every rank", "dist.broadcast(x, src=0)", "move"),
    "scatter": (scatter, "chunk r of rank 0's list to rank r",
                "dist.scatter(out, chunks, src=0)", "move"),
    "gather": (gather, "one tensor from each rank, into a list on rank 0",
               "dist.gather(x, out, dst=0)", "move"),
    "reduce": (reduce, "the sum of all rows, on rank 0", "dist.reduce(x, dst=0)", "reduce"),
    "all_reduce": (all_reduce, "the sum of all rows, on every rank",
                   "dist.all_reduce(x)", "reduce"),
    "all_gather": (all_gather, "one tensor from each rank, to every rank",
                   "dist.all_gather(out, x)", "move"),
    "reduce_scatter": (reduce_scatter, "chunk r summed over the ranks, to rank r",
                       "dist.reduce_scatter(out, list(x.chunk(P)))", "reduce"),
    "all_to_all": (all_to_all, "chunk j of rank r to position r of rank j",
                   "dist.all_to_all_single(out, x)", "move"),
    "send_recv": (send_recv, "each row to the next rank (a ring shift)",
                  "dist.send(x, dst=r+1); dist.recv(got, src=r-1)", "move"),
    "barrier": (barrier, "nobody leaves before everyone has arrived", "dist.barrier()", "time"),
}


def table(before, after, labels=("before", "after")):
    """Rank × data, before | after, one line per rank; '—' where a rank has no buffer."""
    def cells(v):
        return ("   —" if v is None else
                "".join(f"{x:>4g}" if float(x).is_integer() else f"{x:>7.1f}" for x in v))
    left = max(len(labels[0]), *(len(cells(v)) for v in before)) + 3
    lines = [f"{'':8}{labels[0]:<{left}}{labels[1]}"]
    lines += [f"rank {r:<3}{cells(b):<{left}}{cells(a)}"
              for r, (b, a) in enumerate(zip(before, after))]
    return "\n".join(lines)


# ---------------------------------------------------------------- set-up and main
def setup(args):
    # DDP: rank and world size from torchrun, srun or mpirun; MASTER_ADDR/PORT set and checked.
    # gloo runs on CPU tensors; NCCL needs one GPU per rank.
    env = world.prepare(backend=args.backend, device="cpu" if args.backend == "gloo" else "auto")
    if env.device.type == "cuda":
        torch.cuda.set_device(env.device)  # DDP: one GPU per process, cuda:LOCAL_RANK
    dist.init_process_group(env.backend, rank=env.rank, world_size=env.world_size,  # DDP: join
                            timeout=timedelta(seconds=args.timeout))
    return env


def cleanup():
    dist.destroy_process_group()  # DDP: leave the process group so every rank exits cleanly.


def main(args):
    env = setup(args)
    rank, world_size = dist.get_rank(), dist.get_world_size()  # DDP: who am I, how many are we?
    log = JsonLog(args.log_json if rank == 0 else None, world_size=world_size,  # DDP: rank 0 logs
                  backend=env.backend)
    for name in args.only or PRIMITIVES:
        run, what, call, kind = PRIMITIVES[name]
        before, after = run(rank, world_size, env.device)
        # DDP: rank 0 collects every rank's view (with gather_object, itself a collective).
        views = [None] * world_size if rank == 0 else None
        # DDP: every rank's view, into rank 0's list
        dist.gather_object((before, after), views, dst=0)
        if rank == 0:  # DDP: one rank prints and logs
            before_all, after_all = [v[0] for v in views], [v[1] for v in views]
            labels = ("arrived (ms)", "left (ms)") if kind == "time" else ("before", "after")
            print(f"\n{name}: {what}   {call}\n{table(before_all, after_all, labels)}", flush=True)
            log.write("collective", op=name, what=what, call=call, kind=kind,
                      before=before_all, after=after_all)
    cleanup()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="+", choices=list(PRIMITIVES),
                        help="run only these primitives")
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl", "auto"],
                        help="gloo on CPU tensors (default); nccl needs one GPU per rank")
    parser.add_argument("--timeout", type=float, default=60, help="seconds a collective may wait")
    parser.add_argument("--log-json", default=None,
                        help="rank 0 writes one JSON line per primitive")
    main(parser.parse_args())
