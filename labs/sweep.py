"""Several runs of fashion_study.py in ONE torchrun launch, one after the other.

    torchrun --standalone --nproc-per-node 2 labs/sweep.py \\
        "--batch-size 32 --time-budget 3 --log-json b32.jsonl" \\
        "--batch-size 512 --time-budget 3 --log-json b512.jsonl"

Each argument is one run's options, exactly as fashion_study.py takes them; the run above is
`torchrun ... fashion_study.py --batch-size 32 --time-budget 3 --log-json b32.jsonl`, and so on.
Starting Python, importing torch and starting the workers cost seconds per launch on a small
machine, more than a short run; here they are paid once. Each run is still fashion_study.main()
from start to end: its own process group, data, model, optimiser and log (notebooks 07 and 08).
Under torchrun only (or as one plain process).
"""
import os
import shlex
import sys
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the fashion_study.py beside this file
import fashion_study
from dpcourse.lab.rendezvous import free_port


def fresh_rendezvous(run, agent):
    """Run ``run`` (from 1 on) meets on a new port that rank 0 picks and announces in torchrun's
    store.

    A new process group with the same name as the last one would read that group's addresses,
    still in torchrun's store, and dial its closed sockets ("Connection reset by peer").
    """
    # DDP: a client of torchrun's own store, where rank 0 posts this run's port
    store = dist.TCPStore(*agent, is_master=False, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    key = f"sweep/run{run}/port"
    if os.environ["RANK"] == "0":
        store.set(key, str(free_port("0.0.0.0")))
    store.wait([key])
    os.environ["MASTER_PORT"] = store.get(key).decode()  # DDP: env:// meets there
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"  # DDP: rank 0 serves the new store itself


def main(runs):
    agent = (os.environ.get("MASTER_ADDR"), int(os.environ.get("MASTER_PORT", 0)))
    for run, options in enumerate(runs):
        if run and "TORCHELASTIC_RUN_ID" in os.environ:
            fresh_rendezvous(run, agent)
        # DDP: joins, trains, leaves the group
        fashion_study.main(fashion_study.parse_args(shlex.split(options)))


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        sys.exit(__doc__)
    if (("SLURM_STEP_ID" in os.environ or "OMPI_COMM_WORLD_SIZE" in os.environ)
            and "TORCHELASTIC_RUN_ID" not in os.environ):
        sys.exit("sweep.py runs under torchrun (or as one process); "
                 "under srun or mpirun, launch fashion_study.py once per run.")
    main(sys.argv[1:])
