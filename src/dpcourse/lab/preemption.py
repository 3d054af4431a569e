"""The end of a job's time, announced: a signal that asks a training run to save and stop.

On Slurm, `#SBATCH --signal=B:USR1@120` has Slurm send SIGUSR1 to the batch shell 120 s before the
job's --time. The templates' shell (slurm/env.sh, ``run_training``) then has Slurm send SIGTERM to
every task of the training step (`scancel --signal=TERM JOB.STEP`), and a torchrun passes it on to
its workers. Outside Slurm, or under torchrun alone, a plain SIGTERM stops a run the same way. Under
srun it does not: srun passes its own SIGTERM on to the tasks as SIGKILL.

A handler may run at any point of a step, and each rank gets the signal at its own moment. So the
handler only notes it; the lab asks at the end of each step whether any rank has one (one
all_reduce, in the lab, marked ``# DDP:``), and every rank stops after the same step. Rank 0 then
writes the checkpoint once, atomically (a temporary file, then renamed): a kill while it writes
leaves the last complete checkpoint as it was.

    caught = preemption.catch()          # at the start of main(), before the data and the model
    ...
    flags = torch.tensor([float(caught.number)])   # the signal's number, 0 if none
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)   # DDP: one rank signalled = all stop here
    caught.number = int(flags.item())              # every rank now knows which signal it was
"""
from __future__ import annotations

import signal

SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class Caught:
    """The first of ``SIGNALS`` this process received: ``number`` (0 if none) and ``signal`` (its
    name, e.g. 'SIGUSR1', or None). A lab sets ``number`` to what the ranks agreed on, so that
    rank 0 can name a signal that only another rank received."""

    def __init__(self) -> None:
        self.number = 0

    @property
    def signal(self) -> str | None:
        return signal.Signals(self.number).name if self.number else None

    def _note(self, signum, frame) -> None:
        # The first one counts. A second (Slurm signals a torchrun's workers, and the torchrun
        # passes its own on) changes nothing: the run still stops after this step. What ends a hung
        # rank is the SIGKILL that Slurm and torchrun send when their grace period is over.
        self.number = self.number or signum

    def __repr__(self) -> str:
        return f"Caught({self.signal!r})"


def catch(signals=SIGNALS) -> Caught:
    """Note SIGUSR1 and SIGTERM instead of dying at once; returns what
    ``Caught.signal`` will say."""
    caught = Caught()
    for sig in signals:
        signal.signal(sig, caught._note)
    return caught


def ignore_in_worker(worker_id: int = 0) -> None:
    """A DataLoader's ``worker_init_fn``: Slurm signals every process of a step, DataLoader workers
    included, and a worker that dies of it takes the step down with it before rank 0 can save."""
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def stopped_message(caught: Caught, step: int, saved: str | None) -> str:
    """Rank 0's one line when a signal stopped the run; ``saved``: the --checkpoint-dir."""
    why = {"SIGUSR1": "the job's time-limit warning (SIGUSR1)",
           "SIGTERM": "SIGTERM (time limit, scancel or preemption)"}
    where = (f"checkpoint of step {step} in {saved}/: --resume auto goes on from there" if saved
             else "nothing was saved (no --checkpoint-dir): a new run starts from step 0")
    return f"stopped after step {step} by {why.get(caught.signal, caught.signal)}; {where}"
