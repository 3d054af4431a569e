"""Which collectives does this backend run here, on the CPU and on the GPU? Try each and see.

    torchrun --standalone --nproc-per-node 2 solutions/labs/probe_collectives.py --backend gloo

Rank 0 prints one line per (device, collective) and writes them to --log-json.
"""
import argparse
from datetime import timedelta

import torch
import torch.distributed as dist

from dpcourse.lab import world
from dpcourse.lab.metrics import JsonLog


def collectives(rank, world_size, device):
    """Each entry: name -> a function that runs that collective once and checks its result."""
    def t(value):
        return torch.full((4,), float(value), device=device)

    def send_recv():
        x = t(rank)
        if rank == 0:
            dist.send(t(7), dst=1)  # DDP: point-to-point, rank 0 → rank 1
        elif rank == 1:
            dist.recv(x, src=0)  # DDP: rank 1 takes rank 0's 7s
            assert x[0] == 7
        dist.barrier()  # DDP: the others wait for the pair

    def broadcast():
        x = t(rank)
        dist.broadcast(x, src=0)  # DDP: rank 0's tensor to every rank
        assert x[0] == 0

    def all_reduce():
        x = t(rank + 1)
        dist.all_reduce(x)  # DDP: the sum of every rank's x, on every rank
        assert x[0] == world_size * (world_size + 1) / 2

    def reduce():
        x = t(1)
        dist.reduce(x, dst=0)  # DDP: the sum, on rank 0 only
        assert rank != 0 or x[0] == world_size

    def all_gather():
        out = [t(-1) for _ in range(world_size)]
        dist.all_gather(out, t(rank))  # DDP: every rank's tensor, to every rank
        assert [o[0].item() for o in out] == list(range(world_size))

    def gather():
        out = [t(-1) for _ in range(world_size)] if rank == 0 else None
        dist.gather(t(rank), out, dst=0)  # DDP: every rank's tensor, into rank 0's list
        assert rank != 0 or [o[0].item() for o in out] == list(range(world_size))

    def scatter():
        x = t(-1)
        # DDP: rank 0's t(r) to rank r
        dist.scatter(x, [t(r) for r in range(world_size)] if rank == 0 else None, src=0)
        assert x[0] == rank

    def reduce_scatter():
        x = t(-1)
        # DDP: t(r) summed over the ranks, to rank r
        dist.reduce_scatter(x, [t(r) for r in range(world_size)])
        assert x[0] == rank * world_size

    def all_to_all():
        out = [t(-1) for _ in range(world_size)]
        # DDP: one tensor from every rank to every rank
        dist.all_to_all(out, [t(rank) for _ in range(world_size)])
        assert [o[0].item() for o in out] == list(range(world_size))

    def barrier():
        dist.barrier()  # DDP: nobody leaves before every rank has arrived

    return {f.__name__: f for f in (send_recv, broadcast, all_reduce, reduce, all_gather, gather,
                                    scatter, reduce_scatter, all_to_all, barrier)}


def setup(args):
    # DDP: rank and world size from torchrun, srun or mpirun; MASTER_ADDR/PORT set and checked.
    # gloo runs on CPU tensors; NCCL needs one GPU per rank.
    env = world.prepare(backend=args.backend, device="cpu" if args.backend == "gloo" else "auto")
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
    log = JsonLog(args.log_json if rank == 0 else None, backend=env.backend, world_size=world_size)
    devices = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
    for device_type in devices:
        device = (env.device if device_type == "cuda" and env.device.type == "cuda"
                  else torch.device(device_type))
        for name, run in collectives(rank, world_size, device).items():
            try:
                run()
                ok, why = True, ""
            except (RuntimeError, AssertionError, ValueError) as err:
                ok, why = False, (str(err).strip().splitlines() or ["wrong result"])[0][:100]
            if rank == 0:
                print(f"{env.backend:5} {device_type:4} {name:15} {'yes' if ok else 'no  ' + why}",
                      flush=True)
            log.write("probe", device=device_type, op=name, ok=ok, error=why)
    cleanup()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl", "mpi"])
    parser.add_argument("--timeout", type=float, default=60, help="seconds a collective may wait")
    parser.add_argument("--log-json", default=None, help="rank 0 writes one JSON line per probe")
    main(parser.parse_args())
