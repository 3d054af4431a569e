"""Bug hunt: every rank starts with "download the data if it is not there".

    torchrun --standalone --nproc-per-node 2 labs/bugs/download_race_fixed.py \
        --dest /tmp/race

The download is simulated so the lab runs offline: FashionMNIST's test images (7.8 MB) are
copied from the staged data at --mb-per-s, straight into the final file name, chunk by chunk,
as urllib and torchvision write a download. Rank 1 arrives --late-s after rank 0 (another node,
a busy disk). Each rank then checks what it read against the official SHA-256, and rank 0
reports the downloads and the bytes each rank read. Lines there because of distribution: `# DDP:`.
"""
import argparse
import hashlib
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from dpcourse.lab import world
from dpcourse.lab.data import FILES, ensure_fashion_mnist
from dpcourse.lab.metrics import JsonLog

NAME = "t10k-images-idx3-ubyte"
SIZE, SHA256 = FILES[NAME]


def setup(args):
    # DDP: rank and world size from the launcher
    env = world.prepare(backend="gloo", device="cpu")
    dist.init_process_group(env.backend, rank=env.rank, world_size=env.world_size,  # DDP: join
                            timeout=timedelta(seconds=args.timeout))


def cleanup():
    dist.destroy_process_group()  # DDP: leave the group so every rank exits cleanly


def download_if_missing(source: Path, dest: Path, mb_per_s: float) -> bool:
    """What torchvision's download=True does: nothing if the file is there; True if it
    downloaded."""
    if dest.exists():
        return False
    time.sleep(0.05)  # the request's round trip
    with open(source, "rb") as src, open(dest, "wb") as out:  # the final name, at once
        while chunk := src.read(256 * 1024):
            out.write(chunk)
            out.flush()
            time.sleep(len(chunk) / (mb_per_s * 1e6))
    return True


def main(args):
    setup(args)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    source = ensure_fashion_mnist(args.data_root) / NAME  # the "server"
    dest = Path(args.dest) / NAME  # a folder every rank of the job sees
    dest.parent.mkdir(parents=True, exist_ok=True)
    dist.barrier()  # DDP: start together, so that --late-s is the only difference
    time.sleep(args.late_s if rank > 0 else 0.0)

    # YOUR CODE HERE
    # Hint: rank 0 downloads while the others wait at a barrier;
    #       then every rank reads
    raise NotImplementedError("Exercise: see the hint above")
    data = dest.read_bytes()
    ok = len(data) == SIZE and hashlib.sha256(data).hexdigest() == SHA256

    counts = torch.tensor([int(downloaded), int(not ok)])
    dist.all_reduce(counts)  # DDP: downloads and bad reads, summed over the ranks
    sizes = [None] * world_size
    dist.all_gather_object(sizes, len(data))  # DDP: what each rank read, for rank 0's report
    if rank == 0:  # DDP: one rank reports
        downloads, bad = counts.tolist()
        print(f"{downloads} download(s) of one {SIZE / 1e6:.1f} MB file; " +
              "; ".join(f"rank {r} read {n / 1e6:.1f} MB" for r, n in enumerate(sizes)) +
              f"; {bad} rank(s) read a damaged file", flush=True)
        JsonLog(args.log_json).write("done", world_size=world_size, downloads=downloads,
                                     bad_reads=bad, bytes_read=sizes)
    cleanup()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dest", required=True,
                        help="the shared folder to download into (start it empty)")
    parser.add_argument("--data-root", default=None,
                        help="where the staged FashionMNIST is (the 'server')")
    parser.add_argument("--mb-per-s", type=float, default=40.0, help="the simulated download speed")
    parser.add_argument("--late-s", type=float, default=0.1,
                        help="how much later the other ranks arrive")
    parser.add_argument("--timeout", type=float, default=30, help="seconds a collective may wait")
    parser.add_argument("--log-json", default=None, help="rank 0 writes JSON lines here")
    main(parser.parse_args())
