"""solutions/labs/fashion_ddp.py (or $OPEN_LAB, e.g. fashion_elastic.py, whose checkpoints are
distributed) as the requeue tests run it, under slurm/cpu.sbatch (LAB=this file).

A run cannot end by itself until the job has been requeued $OPEN_RUNS times (SLURM_RESTART_COUNT):
only the test's requeue or signal stops it, whenever it comes, so the test waits for no clock. The
first run after that sets the finish line, 10 steps past its checkpoint, and every later run keeps
it: a run stopped again on its way (a second warning) leaves the next one fewer steps, not a new 10.
An open-ended run pauses PAUSE_S before each step (a global forward pre-hook on the DDP model): it
only waits for Slurm, and at full speed its 2 cores of training took them from the tests that `make
test`'s other worker runs meanwhile. Nothing it tests depends on the speed of a step.
$NICE: the run's niceness, so that a test's other job, which only waits for its limit, leaves the
cores to this one's restarts."""
import os

os.nice(int(os.environ.get("NICE", "0")))  # before torch's import, which is most of a start's work

import runpy  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

PAUSE_S = 0.2
LAB = (Path(__file__).resolve().parents[2] / "solutions" / "labs"
       / os.environ.get("OPEN_LAB", "fashion_ddp.py"))
args = sys.argv[1:]
if int(os.environ.get("SLURM_RESTART_COUNT", "0")) < int(os.environ["OPEN_RUNS"]):
    args += ["--epochs", "1000", "--max-steps", "100000000"]

    def pause(module, inputs):
        # once per step: the model, not each of its layers
        if isinstance(module, DistributedDataParallel):
            time.sleep(PAUSE_S)

    torch.nn.modules.module.register_module_forward_pre_hook(pause)
else:
    runs = Path(args[args.index("--checkpoint-dir") + 1])
    # every rank reads the same checkpoint here: none is written before training
    finish = runs / "finish-at"
    if finish.exists():
        end = int(finish.read_text())
    elif (runs / "last.pt").exists():
        end = torch.load(runs / "last.pt", weights_only=True)["progress"]["step"] + 10
    else:  # a distributed checkpoint: the newest complete step-NNNNNNN/ folder
        end = int(sorted(runs.glob("step-*/.metadata"))[-1].parent.name[5:]) + 10
    if not finish.exists() and int(os.environ.get("SLURM_PROCID", "0")) == 0:
        (runs / "finish-at.tmp").write_text(str(end))
        (runs / "finish-at.tmp").rename(finish)
    args += ["--max-steps", str(end)]
sys.argv = [str(LAB), *args]
runpy.run_path(str(LAB), run_name="__main__")
