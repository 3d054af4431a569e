"""The ring all-reduce, written out: reduce-scatter, then all-gather, over send/recv only.

    torchrun --standalone --nproc-per-node 3 labs/ring_allreduce.py --check  # right?
    torchrun --standalone --nproc-per-node 3 labs/ring_allreduce.py --show   # watch it
    python labs/ring_allreduce.py --check                                    # one process

Every rank cuts its vector into P chunks (their sizes differ by at most one element).

    reduce-scatter  P − 1 steps: each rank sends one chunk to its right neighbour and adds the
                    chunk that arrives from its left neighbour into its own copy of that chunk.
                    Afterwards rank r holds the sum over all ranks of chunk (r + 1) mod P.
    all-gather      P − 1 more steps: the finished chunks travel round the ring, each received
                    straight into its place, until every rank has every chunk.

Each rank sends 2(P − 1) messages of M/P bytes: 2(P − 1)/P · M in all, whatever P is.
``dpcourse.lab.allreduce.ring`` is the same algorithm (the course's reference). --check compares
this file's ring with ``dist.all_reduce`` for awkward lengths (1 element, fewer elements than
ranks, lengths that P does not divide) in float32 and float64; --show prints what every rank
holds after each step, on a small vector whose digits say which ranks' numbers are in it.

(Activate the course's environment first: source .venv/bin/activate.)
"""
import argparse
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
    # DDP: a lost message ends the run
    dist.init_process_group(env.backend, rank=env.rank, world_size=env.world_size,  # DDP: join
                            timeout=timedelta(seconds=args.timeout))
    return env


def cleanup():
    dist.destroy_process_group()  # DDP: leave the process group so every rank exits cleanly.


def exchange(send, dst, recv, src):
    """Send ``send`` to rank ``dst`` while receiving ``recv`` from rank ``src``.

    Both are posted before either is waited for: if every rank did a blocking send first, each
    would wait for a neighbour that is itself still sending, and the ring could stall. They go
    as one batch: NCCL (GPUs) needs the send and the receive grouped, or each waits for the other.
    """
    works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, recv, src),  # DDP: both directions
                                    dist.P2POp(dist.isend, send, dst)])  # DDP: at once
    for work in works:
        work.wait()  # DDP: the chunk has left, and the incoming one is in ``recv``


def reduce_scatter(chunks, rank, world_size, on_step=None):
    """After it, ``chunks[(rank + 1) % world_size]`` holds that chunk's sum over all ranks.

    ``chunks`` are views into this rank's vector (``tensor_split``): writing into them writes
    into the vector. ``buffer`` has room for the largest chunk; receive into
    ``buffer[:size]``, never straight into a chunk you still need.
    """
    right, left = (rank + 1) % world_size, (rank - 1) % world_size  # DDP: my neighbours
    buffer = torch.empty_like(chunks[0])  # tensor_split puts the larger chunks first
    for step in range(world_size - 1):
        # YOUR CODE HERE
        # Hint: at each step send one chunk to the right and add the chunk that arrives
        #       from the left into your own copy of it, with
        #       exchange(send, right, incoming, left) and incoming = buffer[:that
        #       chunk's size];
        #       which chunk moves at which step: see the --show table in the notebook
        raise NotImplementedError("Exercise: see the hint above")
        if on_step:
            on_step("reduce-scatter", step)


def all_gather(chunks, rank, world_size, on_step=None):
    """Rank r starts with the finished chunk (r + 1) mod P; after P − 1 steps every rank has all."""
    right, left = (rank + 1) % world_size, (rank - 1) % world_size  # DDP: my neighbours
    for step in range(world_size - 1):
        send = chunks[(rank + 1 - step) % world_size]  # a finished chunk
        recv = chunks[(rank - step) % world_size]  # the finished chunk the left neighbour has
        exchange(send, right, recv, left)  # DDP: received straight into its place
        if on_step:
            on_step("all-gather", step)


def ring_all_reduce(tensor, on_step=None, reference=False):
    """Sum ``tensor`` in place over all ranks, like ``dist.all_reduce(tensor)``.

    ``reference``: the course library's reduce-scatter and all-gather instead of this file's.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()  # DDP: who am I, how many are we?
    if world_size == 1:
        return
    flat = tensor.view(-1)  # a contiguous tensor's 1-D view: the chunks write into ``tensor``
    chunks = flat.tensor_split(world_size)  # P views, sizes differ by at most one
    if reference:
        from dpcourse.lab.allreduce import ring_all_gather, ring_reduce_scatter
        ring_reduce_scatter(chunks, rank, world_size, on_step)
        ring_all_gather(chunks, rank, world_size, on_step)
        return
    reduce_scatter(chunks, rank, world_size, on_step)
    all_gather(chunks, rank, world_size, on_step)


# ---------------------------------------------------------------- --check
def check(args, env, log):
    """The ring against dist.all_reduce: awkward lengths, float32 and float64."""
    rank, world_size = dist.get_rank(), dist.get_world_size()  # DDP: who am I, how many are we?
    lengths = sorted({1, 2, world_size - 1 or 1, world_size + 1, 7, 1000, 1001, 65537,
                      *args.lengths})
    failures = 0
    for dtype in (torch.float32, torch.float64):
        for n in lengths:
            g = torch.Generator().manual_seed(1000 * rank + n)  # different numbers on every rank
            mine = torch.randn(n, generator=g, dtype=dtype).to(env.device)
            expected = mine.clone()
            dist.all_reduce(expected)  # DDP: the reference: torch's own all-reduce
            ours = mine.clone()
            chunks = ours.tensor_split(world_size)
            reduce_scatter(chunks, rank, world_size)
            done = (rank + 1) % world_size
            # reduce-scatter alone: the chunk this rank finishes must already be the full sum
            scattered_ok = torch.allclose(chunks[done], expected.tensor_split(world_size)[done],
                                          rtol=1e-6, atol=1e-6 * world_size)
            all_gather(chunks, rank, world_size)
            ok = torch.allclose(ours, expected, rtol=1e-6, atol=1e-6 * world_size)
            flags = torch.tensor([int(ok), int(scattered_ok)], device=env.device)
            dist.all_reduce(flags, op=dist.ReduceOp.MIN)  # DDP: right only if right on every rank
            ok, scattered_ok = bool(flags[0]), bool(flags[1])
            err = (ours - expected).abs().max().item()
            failures += not ok
            name = str(dtype).removeprefix("torch.")
            log.write("case", n=n, dtype=name, ok=ok, reduce_scatter_ok=scattered_ok,
                      max_abs_err=err)
            if rank == 0 and not ok:  # DDP: one rank reports
                why = ("" if scattered_ok else
                       ": after reduce-scatter, a rank's finished chunk is not the sum")
                print(f"WRONG: {n} elements, {name}: max |ring − all_reduce| = {err:.3g}{why}",
                      flush=True)
    cases = 2 * len(lengths)
    if rank == 0:
        verdict = "ok" if not failures else "WRONG"
        print(f"{world_size} ranks: {cases - failures} of {cases} cases equal dist.all_reduce "
              f"(lengths {', '.join(map(str, lengths))}; float32, float64): {verdict}", flush=True)
    log.write("summary", cases=cases, failures=failures, ok=not failures)
    return not failures


# ---------------------------------------------------------------- --show
def show(args, env, log):
    """Rank r holds 10^r · (1, 2, 3, …): a digit of a sum tells which ranks' numbers are in it."""
    # DDP: rank r holds 10^r · (1, 2, …), P chunks
    rank, world_size = dist.get_rank(), dist.get_world_size()
    n = args.per_chunk * world_size
    tensor = (10.0 ** rank) * torch.arange(1, n + 1, dtype=torch.float64, device=env.device)

    def snapshot(phase, step):
        states = [None] * world_size
        dist.all_gather_object(states, tensor.tolist())  # DDP: every rank's vector, to print it
        log.write("state", phase=phase, step=step, values=states)
        if rank == 0:  # DDP: one rank prints
            print(f"{phase} {'' if step is None else f'step {step}'}".strip() + ":", flush=True)
            for r, values in enumerate(states):
                cut = [values[c.start:c.stop] for c in _slices(n, world_size)]
                text = " | ".join(" ".join(f"{v:>{world_size}g}" for v in part) for part in cut)
                print(f"  rank {r}: | {text} |", flush=True)

    snapshot("start", None)
    ring_all_reduce(tensor, on_step=snapshot, reference=args.reference)
    return True


def _slices(n, parts):
    """The index ranges of ``tensor_split(parts)`` of n elements."""
    bounds, start = [], 0
    for p in range(parts):
        size = n // parts + (p < n % parts)
        bounds.append(slice(start, start + size))
        start += size
    return bounds


def main(args):
    env = setup(args)
    log = JsonLog(args.log_json if dist.get_rank() == 0 else None,  # DDP: rank 0 logs
                  world_size=dist.get_world_size())
    ok = show(args, env, log) if args.show else check(args, env, log)
    cleanup()
    if not ok:
        raise SystemExit(1)  # DDP: every rank knows the verdict, so every rank exits non-zero


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="compare with dist.all_reduce (the default)")
    parser.add_argument("--show", action="store_true",
                        help="print every rank's vector after each step")
    parser.add_argument("--reference", action="store_true",
                        help="--show: the course library's ring (dpcourse.lab.allreduce), "
                             "not this file's")
    parser.add_argument("--per-chunk", type=int, default=2, help="--show: elements per chunk")
    parser.add_argument("--lengths", type=int, nargs="*", default=[], help="--check: more lengths")
    parser.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl", "mpi"])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--timeout", type=float, default=30,
                        help="seconds a send or receive may wait")
    parser.add_argument("--log-json", default=None, help="rank 0 writes JSON lines here")
    main(parser.parse_args())
