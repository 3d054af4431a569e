"""Bug hunt: rank 0 writes a file that every rank then reads.

    torchrun --standalone --nproc-per-node 2 solutions/labs/bugs/no_barrier_fixed.py \
        --dir /tmp/stats

Rank 0 computes the training images' mean and standard deviation (what the inputs are
normalised with) and writes them to <dir>/stats.json; every rank then reads that file. A rank
that finds no file falls back to 0.5 and 0.5, as much real code does. Each rank prints the
statistics it will normalise with. Lines there because of distribution: `# DDP:`.
"""
import argparse
import json
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from dpcourse.lab import world
from dpcourse.lab.data import ensure_fashion_mnist, read_idx
from dpcourse.lab.metrics import JsonLog

FALLBACK = {"mean": 0.5, "std": 0.5}


def setup(args):
    # DDP: rank and world size from the launcher
    env = world.prepare(backend="gloo", device="cpu")
    dist.init_process_group(env.backend, rank=env.rank, world_size=env.world_size,  # DDP: join
                            timeout=timedelta(seconds=args.timeout))


def cleanup():
    dist.destroy_process_group()  # DDP: leave the group so every rank exits cleanly


def main(args):
    setup(args)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    raw = ensure_fashion_mnist(args.data_root)  # staged and verified (every rank calls it)
    path = Path(args.dir) / "stats.json"
    dist.barrier()  # DDP: start together, so that the times below compare
    start = time.perf_counter()
    if rank == 0:  # DDP: one rank computes and writes
        images = read_idx(raw / "train-images-idx3-ubyte").float() / 255
        time.sleep(args.slow_s)  # a busy file system, a bigger data set
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"mean": images.mean().item(), "std": images.std().item(),
                                    "written_s": round(time.perf_counter() - start, 3)}))
    ### BEGIN SOLUTION (hint: one line: no rank may read the file before rank 0 has written it)
    dist.barrier()  # DDP: every rank waits here until rank 0 has written the file
    ### END SOLUTION
    read_s = round(time.perf_counter() - start, 3)
    try:
        stats, source = json.loads(path.read_text()), "read from stats.json"
    except (FileNotFoundError, ValueError):  # not there yet, or half-written
        stats, source = FALLBACK, "stats.json not there: the fallback"
    print(f"rank {rank} normalises with mean {stats['mean']:.4f}, std {stats['std']:.4f} "
          f"({source}, after {read_s:.2f} s)", flush=True)
    stats = {**stats, "read_s": read_s}

    everyone = [None] * world_size
    dist.all_gather_object(everyone, stats)  # DDP: rank 0 collects what each rank uses
    if rank == 0:  # DDP: one rank reports
        agree = all((s["mean"], s["std"]) == (everyone[0]["mean"], everyone[0]["std"])
                    for s in everyone)
        print(f"the {world_size} ranks normalise {'alike' if agree else 'DIFFERENTLY'}", flush=True)
        JsonLog(args.log_json).write("done", world_size=world_size, stats=everyone, agree=agree)
    cleanup()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", required=True, help="a folder every rank sees (start it empty)")
    parser.add_argument("--data-root", default=None)
    parser.add_argument("--slow-s", type=float, default=0.0,
                        help="extra seconds rank 0 takes to write the file")
    parser.add_argument("--timeout", type=float, default=30, help="seconds a collective may wait")
    parser.add_argument("--log-json", default=None, help="rank 0 writes JSON lines here")
    main(parser.parse_args())
