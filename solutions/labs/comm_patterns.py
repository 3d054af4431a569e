"""Waiting for communication, or not; and who carries the traffic: a server, or everyone.

    torchrun --standalone --nproc-per-node 2 solutions/labs/comm_patterns.py async
        # blocking vs async_op=True, isend/irecv
    torchrun --standalone --nproc-per-node 4 solutions/labs/comm_patterns.py ps
        # parameter server vs all_reduce

(Activate the course's environment first: source .venv/bin/activate.) Rank 0 prints a table
and, with --log-json, writes one JSON record per measurement: every rank's timeline (async)
or the time and the bytes each rank sent and received (ps).
"""
import argparse
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from dpcourse.lab import world
from dpcourse.lab.metrics import JsonLog


def say(*parts):
    if dist.get_rank() == 0:  # DDP: one rank talks
        print(*parts, flush=True)


def common_clock(device):
    """A start time that every rank shares: rank 0's wall clock, broadcast (one machine, one
    clock)."""
    start = torch.tensor([time.time()], dtype=torch.float64, device=device)
    dist.broadcast(start, src=0)  # DDP: rank 0's clock reading, to every rank
    return start.item()


def gathered(obj):
    """``obj`` from every rank, as a list on rank 0 (None elsewhere)."""
    # DDP: a slot per rank, on rank 0 only
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)  # DDP: every rank's obj, into rank 0's list
    return out


# ---------------------------------------------------------------- async: waiting or not
def compute(a, repeats):
    """Stand-in for the work a rank could do meanwhile (the backward of earlier layers)."""
    for _ in range(repeats):
        a = torch.tanh(a @ a)
    return a


def calibrate(x, a, device, tries=5):
    """How many compute repeats take about as long as one blocking all_reduce of x (rank 0 decides).

    The fastest of a few tries estimates each cost: slower tries are other programs' noise.
    """
    def fastest(fn, together=False):
        times = []
        for _ in range(tries):
            if together:
                # DDP: else a blocking all_reduce also times the wait for the other rank
                dist.barrier()
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    dist.all_reduce(x)  # DDP: warm up the connections and the allocator
    compute(a, 2)
    # DDP: how long one blocking all_reduce takes
    comm = fastest(lambda: dist.all_reduce(x), together=True)
    one = fastest(lambda: compute(a, 4)) / 4
    repeats = torch.tensor([max(1, round(comm / one))], device=device)
    dist.broadcast(repeats, src=0)  # DDP: every rank computes the same amount
    return int(repeats.item())


def timeline(mode, x, a, repeats, device):
    """One run of ``mode``; this rank's segments (what, start ms, end ms) on the common clock."""
    rank = dist.get_rank()  # DDP: who am I?
    peer = 1 if rank == 0 else 0  # point to point: rank 0 ↔ rank 1 (others only compute)
    dist.barrier()  # DDP: everyone starts together
    t0 = common_clock(device)

    def now():
        return (time.time() - t0) * 1000

    seg = []
    s = now()
    if mode == "blocking all_reduce":
        dist.all_reduce(x)  # DDP: returns when the sum is in x
        seg.append(("communicate", s, now()))
        s = now()
        compute(a, repeats)
        seg.append(("compute", s, now()))
    elif mode == "async all_reduce":
        work = dist.all_reduce(x, async_op=True)  # DDP: returns a work handle at once
        seg.append(("start", s, now()))
        s = now()
        compute(a, repeats)  # DDP: meanwhile: don't read or write x until wait()
        seg.append(("compute", s, now()))
        s = now()
        work.wait()  # DDP: now x holds the sum
        seg.append(("wait", s, now()))
    elif mode == "blocking send/recv":
        if rank < 2:
            (dist.send if rank == 0 else dist.recv)(x, peer)  # DDP: blocks until delivered
            seg.append(("communicate", s, now()))
            s = now()
        compute(a, repeats)
        seg.append(("compute", s, now()))
    elif mode == "isend/irecv":
        work = None
        if rank < 2:
            work = (dist.isend if rank == 0 else dist.irecv)(x, peer)  # DDP: returns at once
            seg.append(("start", s, now()))
            s = now()
        compute(a, repeats)
        seg.append(("compute", s, now()))
        s = now()
        if work is not None:
            work.wait()  # DDP: the message has left (isend) or arrived (irecv)
            seg.append(("wait", s, now()))
    return seg


def async_demo(args, env, log):
    rank, world_size = dist.get_rank(), dist.get_world_size()  # DDP: who am I, how many are we?
    x = torch.randn(args.mib * 2**20 // 4, device=env.device)  # float32: 4 bytes per value
    a = torch.randn(args.matrix, args.matrix, device=env.device) / args.matrix ** 0.5
    repeats = calibrate(x, a, env.device)
    say(f"{args.mib} MiB float32 per message on {world_size} ranks; "
        f"compute = {repeats} × tanh(A @ A), A {args.matrix}×{args.matrix}, "
        f"about as long as one all_reduce; median of {args.repeats} runs")
    say(f"{'':20} {'total ms':>9}   (total: the slowest rank's; then rank 0's timeline, ms)")
    for mode in ("blocking all_reduce", "async all_reduce", "blocking send/recv", "isend/irecv"):
        runs = []
        for _ in range(args.repeats):
            segments = gathered(timeline(mode, x, a, repeats, env.device))
            if rank == 0:
                runs.append((max(s[2] for rank_segs in segments for s in rank_segs), segments))
        if rank == 0:
            runs.sort(key=lambda r: r[0])
            total, segments = runs[len(runs) // 2]  # the median run, with its timeline
            steps = ", ".join(f"{what} {end - start:.1f}" for what, start, end in segments[0])
            print(f"{mode:20} {total:9.1f}   {steps}", flush=True)
            log.write("async", mode=mode, total_ms=round(total, 3), mib=args.mib, repeats=repeats,
                      totals_ms=[round(r[0], 3) for r in runs],
                      segments=[[[w, round(s, 3), round(e, 3)] for w, s, e in segs]
                                for segs in segments])


# ---------------------------------------------------------------- parameter server vs all_reduce
def parameter_server(grad, counter):
    """Rank 0 is the server: it receives every worker's gradient, sums, and sends the sum back.

    (A real server keeps the weights, applies the update and sends the new weights: the same
    messages.) Everything goes through rank 0: its link carries 2·(P−1) messages per step.
    """
    # DDP: rank 0 is the server, the others its workers
    rank, world_size = dist.get_rank(), dist.get_world_size()
    nbytes = grad.numel() * grad.element_size()
    if rank == 0:
        total, incoming = grad.clone(), torch.empty_like(grad)
        for src in range(1, world_size):
            dist.recv(incoming, src=src)  # DDP: push: worker → server
            total += incoming
            counter["received"] += nbytes
        for dst in range(1, world_size):
            dist.send(total, dst=dst)  # DDP: pull: server → worker
            counter["sent"] += nbytes
        grad.copy_(total)
    else:
        dist.send(grad, dst=0)  # DDP: push: my gradient, to the server
        dist.recv(grad, src=0)  # DDP: pull: the sum, back from it
        counter["sent"] += nbytes
        counter["received"] += nbytes


def ps_demo(args, env, log):
    rank, world_size = dist.get_rank(), dist.get_world_size()  # DDP: who am I, how many are we?
    say(f"summing a gradient over {world_size} ranks, median of {args.repeats} runs (ms)")
    say(f"{'values':>10} {'MiB':>8} {'server':>9} {'all_reduce':>11}   "
        f"{'MiB in+out: server':>18} {'a worker':>9}")
    for n in args.sizes:
        gen = torch.Generator().manual_seed(rank)
        grad = torch.randn(n, generator=gen).to(env.device)  # DDP: each rank's own gradient
        times, results = {}, {}
        for name in ("server", "all_reduce"):
            counter = {"sent": 0, "received": 0}
            runs = []
            for i in range(args.repeats + 1):  # the first run warms up, not timed
                g = grad.clone()
                dist.barrier()  # DDP: start together
                start = time.perf_counter()
                if name == "server":
                    parameter_server(g, counter)
                else:
                    dist.all_reduce(g)  # DDP: decentralised: every rank sends and receives
                if i:
                    runs.append((time.perf_counter() - start) * 1000)
            times[name], results[name] = statistics.median(runs), g
            if name == "server":
                traffic = gathered({k: v / (args.repeats + 1) for k, v in counter.items()})
        diff = (results["server"] - results["all_reduce"]).abs().max().item()
        # DDP: the slowest rank decides how long a step takes
        slowest = torch.tensor([times["server"], times["all_reduce"]], device=env.device)
        # DDP: each time, the slowest rank's, on every rank
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        if rank == 0:
            mib = n * 4 / 2**20
            per_rank = [(t["sent"] + t["received"]) / 2**20 for t in traffic]
            print(f"{n:>10} {mib:8.3f} {slowest[0].item():9.2f} {slowest[1].item():11.2f}   "
                  f"{per_rank[0]:18.2f} {per_rank[1]:9.2f}", flush=True)
            log.write("ps", values=n, mib=mib, server_ms=slowest[0].item(),
                      all_reduce_ms=slowest[1].item(),
                      sent_mib=[t["sent"] / 2**20 for t in traffic],
                      received_mib=[t["received"] / 2**20 for t in traffic], max_abs_diff=diff)


# ---------------------------------------------------------------- set-up and main
def setup(args):
    # DDP: rank and world size from torchrun, srun or mpirun; MASTER_ADDR/PORT set and checked.
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
    if dist.get_world_size() < 2:  # DDP: send/recv and a server need a second rank
        world.stop(env, "this lab needs at least 2 ranks: "
                   "torchrun --standalone --nproc-per-node 2 ...")
    # DDP: rank 0 logs
    log = JsonLog(args.log_json if env.rank == 0 else None, world_size=env.world_size)
    (async_demo if args.part == "async" else ps_demo)(args, env, log)
    cleanup()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("part", choices=["async", "ps"])
    parser.add_argument("--mib", type=int, default=8, help="async: message size in MiB")
    parser.add_argument("--matrix", type=int, default=256,
                        help="async: compute is tanh(A @ A), A this square")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 16384, 262144, 4194304],
                        help="ps: gradient sizes, in float32 values")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed runs per measurement (median)")
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl", "auto"],
                        help="gloo on CPU tensors (default); nccl needs one GPU per rank")
    parser.add_argument("--timeout", type=float, default=60, help="seconds a collective may wait")
    parser.add_argument("--log-json", default=None, help="rank 0 writes JSON lines here")
    main(parser.parse_args())
