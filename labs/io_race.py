"""Every rank fetches the same data file at once, and how "rank 0 first" fixes it.

    torchrun --standalone --nproc-per-node 3 labs/io_race.py --dest /tmp/race \
        --mode naive --arrive 0,0,0.15
    torchrun --standalone --nproc-per-node 3 labs/io_race.py --dest /tmp/fixed \
        --mode rank0
    srun --ntasks 3 python labs/io_race.py --dest /shared/scratch/race --mode rank0

(Activate the course's environment first: source .venv/bin/activate.)

Each rank runs the code that every training script starts with: "if the data file is not
there yet, download it; then read it". The download is simulated (FashionMNIST's test images,
7.8 MB, copied from the staged data at --mb-per-s after a short connection delay), so the lab
runs offline, but the file is written the way ``urllib.request.urlretrieve`` writes it: straight
into its final name, chunk by chunk.

``--mode naive``: every rank runs that code at once. Ranks that arrive together all download
(the traffic is multiplied by the number of ranks, and they write the same file at the same
time); a rank that arrives a little later finds the file already *there* and reads it while it
is still being written.
``--mode rank0``: rank 0 runs it first while the others wait (``dpcourse.lab.world.rank0_first``);
then the others run it, find the finished file, and download nothing.

Every rank then checks the SHA-256 of what it read against the official one. Rank 0 gathers
every rank's outcome, prints a table and writes it to --log-json. Every line that exists
because of distribution is marked `# DDP:`.
"""
import argparse
import hashlib
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from dpcourse.lab import world
from dpcourse.lab.data import FILES, ensure_fashion_mnist
from dpcourse.lab.metrics import JsonLog

NAME = "t10k-images-idx3-ubyte"  # the file every rank wants
SIZE, SHA256 = FILES[NAME]
CHUNK = 64 * 1024


def setup(args):
    # DDP: rank and world size from torchrun, srun or mpirun; MASTER_ADDR/PORT set and checked.
    env = world.prepare(backend="gloo", device="cpu")  # files and flags: the CPU is enough
    dist.init_process_group(env.backend, rank=env.rank, world_size=env.world_size,  # DDP: join
                            timeout=timedelta(seconds=args.timeout))
    return env


def cleanup():
    dist.destroy_process_group()  # DDP: leave the group so every rank exits cleanly


def download(source, dest, args):
    """A stand-in for an HTTP download: connect, then write the bytes into ``dest`` as they come."""
    time.sleep(args.connect_s)  # the request's round trip, before the first byte arrives
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(source, "rb") as src, open(dest, "wb") as out:  # the final name, at once
        while chunk := src.read(CHUNK):
            out.write(chunk)
            out.flush()  # what a reader on this or another node can see so far
            time.sleep(len(chunk) / (args.mb_per_s * 1e6))


def fetch_if_missing(source, dest, args):
    """The usual first lines of a training script. True when this call downloaded."""
    if dest.exists():
        return False
    download(source, dest, args)
    return True


def fetch_rank0_first(source, dest, args):
    """The same code, run by rank 0 first while the other ranks wait; True when this rank
    downloaded."""
    # YOUR CODE HERE
    # Hint: run fetch_if_missing(source, dest, args) on rank 0 first while the others
    #       wait (dpcourse.lab.world has a context manager for it: world here), then on
    #       the others
    raise NotImplementedError("Exercise: see the hint above")
    return downloaded


def read_and_verify(dest):
    """(bytes read, None if they are the official file, else what is wrong)."""
    try:
        data = dest.read_bytes()
    except FileNotFoundError:
        return 0, "missing"
    if len(data) != SIZE:
        return len(data), f"truncated ({len(data) / 1e6:.1f} of {SIZE / 1e6:.1f} MB)"
    if hashlib.sha256(data).hexdigest() != SHA256:
        return len(data), "corrupt (wrong SHA-256)"
    return len(data), None


def main(args):
    setup(args)
    rank, world_size = dist.get_rank(), dist.get_world_size()  # DDP: who am I, how many are we?
    source = ensure_fashion_mnist(args.data_root) / NAME  # the "server" (the staged, verified copy)
    dest = Path(args.dest) / NAME  # one folder that every rank sees: shared by the whole job
    delays = [float(s) for s in args.arrive.split(",")] if args.arrive else []
    arrive = delays[rank] if rank < len(delays) else 0.0

    dist.barrier()  # DDP: line up, so that the arrival times below are the only difference
    start = time.perf_counter()
    time.sleep(arrive)  # ranks never start at exactly the same moment: another node, a busy disk
    # naive: every rank at once
    fetch = fetch_if_missing if args.mode == "naive" else fetch_rank0_first
    downloaded = fetch(source, dest, args)
    read, problem = read_and_verify(dest)
    outcome = {"rank": rank, "arrived_s": arrive, "downloaded": downloaded,
               "read_mb": round(read / 1e6, 2), "ok": problem is None, "problem": problem,
               "done_s": round(time.perf_counter() - start, 3)}
    outcomes = [None] * world_size
    # DDP: every rank's outcome, so rank 0 can report them
    dist.all_gather_object(outcomes, outcome)

    if rank == 0:  # DDP: one rank reports and logs
        downloads = sum(o["downloaded"] for o in outcomes)
        broken = [o["rank"] for o in outcomes if not o["ok"]]
        print(f"mode {args.mode}: {world_size} ranks fetch {NAME} ({SIZE / 1e6:.1f} MB) "
              "into one shared folder")
        print("rank  arrives  downloaded  read      file")
        for o in outcomes:
            print(f"{o['rank']:>4}  {o['arrived_s']:5.2f} s  "
                  f"{'yes' if o['downloaded'] else 'no':10}  "
                  f"{o['read_mb']:4.1f} MB   {o['problem'] or 'ok'}")
        print(f"{downloads} download{'s' * (downloads != 1)} "
              f"({downloads * SIZE / 1e6:.1f} MB fetched); "
              + (f"rank{'s' * (len(broken) > 1)} {', '.join(map(str, broken))} read a broken file"
                 if broken else "every rank read the official file"), flush=True)
        JsonLog(args.log_json, world_size=world_size).write(
            "fetch", mode=args.mode, downloads=downloads,
            fetched_mb=round(downloads * SIZE / 1e6, 2), broken=broken, ranks=outcomes)
    cleanup()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dest", required=True, help="the shared folder every rank downloads into")
    p.add_argument("--mode", default="rank0", choices=["naive", "rank0"])
    p.add_argument("--arrive", default="",
                   help="seconds each rank starts late, by rank: e.g. 0,0,0.15")
    p.add_argument("--mb-per-s", type=float, default=20.0, help="the simulated network's speed")
    p.add_argument("--connect-s", type=float, default=0.05,
                   help="the simulated request's round trip")
    p.add_argument("--data-root", default=None,
                   help="FashionMNIST folder (default: $DPCOURSE_DATA or data/)")
    p.add_argument("--log-json", default=None, help="rank 0 writes one JSON object per line here")
    p.add_argument("--timeout", type=float, default=60,
                   help="seconds a collective may wait for a peer")
    return p.parse_args(argv)


if __name__ == "__main__":
    main(parse_args())
