"""solutions/labs/fashion_ddp.py as the requeue test runs it, under slurm/cpu.sbatch (LAB=this file).

A run cannot end by itself until the job has been requeued $OPEN_RUNS times (SLURM_RESTART_COUNT):
only the test's requeue or signal stops it, whenever it comes, so the test waits for no clock. The
run after that trains 10 steps past its checkpoint and finishes."""
import os
import runpy
import sys
from pathlib import Path

import torch

LAB = Path(__file__).resolve().parents[2] / "solutions" / "labs" / "fashion_ddp.py"
args = sys.argv[1:]
if int(os.environ.get("SLURM_RESTART_COUNT", "0")) < int(os.environ["OPEN_RUNS"]):
    args += ["--epochs", "1000", "--max-steps", "100000000"]
else:
    last = Path(args[args.index("--checkpoint-dir") + 1]) / "last.pt"
    step = torch.load(last, weights_only=True)["progress"]["step"]
    args += ["--max-steps", str(step + 10)]
sys.argv = [str(LAB), *args]
runpy.run_path(str(LAB), run_name="__main__")
