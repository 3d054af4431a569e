"""Who am I: this process's rank, local rank and world size, read from the launcher that started it.

torchrun (RANK, LOCAL_RANK, WORLD_SIZE, ...), srun (SLURM_PROCID, SLURM_LOCALID,
SLURM_STEP_NUM_TASKS, ...), mpirun (OMPI_COMM_WORLD_*), horovodrun (HOROVOD_*), or none (one
process). Only reads variables: it starts nothing and talks to nobody (dpcourse.lab.world does, with
what it finds here).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    # torchrun | env (RANK and WORLD_SIZE exported by hand) | horovodrun | slurm | mpi | none
    launcher: str = "none"
    backend: str | None = None
    device: torch.device = torch.device("cpu")

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

def _tasks_per_node(spec: str, node_id: int) -> int:
    """Expand Slurm's '2(x3),1' task list and return the count on node ``node_id``."""
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            return 1
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts[node_id] if node_id < len(counts) else counts[-1]

def env_info(environ: os._Environ | dict | None = None) -> DistEnv:
    """Read rank, local rank and world size from the variables of the launcher that started us.

    Order: torchrun (or RANK and WORLD_SIZE exported by hand: "env") → horovodrun (gloo) →
    ``mpirun`` → an ``srun`` job step → one process. torchrun is told from a hand-made launch by
    TORCHELASTIC_RUN_ID, which torchrun always sets: a hand-made launch gets the address check and
    the roll call that srun's and mpirun's get, since no launcher watches its ranks. The innermost
    launcher wins: torchrun runs inside srun steps, and ``mpirun`` inside an sbatch job or an srun
    step starts its ranks through Slurm's helper steps, whose SLURM_* variables describe mpirun's
    daemons, not the MPI ranks. The batch script of an sbatch job has SLURM_PROCID but no
    SLURM_STEP_ID: that is one process.
    """
    e = os.environ if environ is None else environ
    if "RANK" in e and "WORLD_SIZE" in e:
        world = int(e["WORLD_SIZE"])
        return DistEnv(int(e["RANK"]), int(e.get("LOCAL_RANK", 0)), world,
                       int(e.get("LOCAL_WORLD_SIZE", world)),
                       "torchrun" if "TORCHELASTIC_RUN_ID" in e else "env")
    if "HOROVOD_RANK" in e and "HOROVOD_SIZE" in e:  # horovodrun --gloo (with MPI: OMPI_* below)
        world = int(e["HOROVOD_SIZE"])
        return DistEnv(int(e["HOROVOD_RANK"]), int(e.get("HOROVOD_LOCAL_RANK", 0)), world,
                       int(e.get("HOROVOD_LOCAL_SIZE", world)), "horovodrun")
    if "OMPI_COMM_WORLD_RANK" in e:
        world = int(e["OMPI_COMM_WORLD_SIZE"])
        return DistEnv(int(e["OMPI_COMM_WORLD_RANK"]), int(e.get("OMPI_COMM_WORLD_LOCAL_RANK", 0)),
                       world, int(e.get("OMPI_COMM_WORLD_LOCAL_SIZE", world)), "mpi")
    if "SLURM_PROCID" in e and "SLURM_STEP_ID" in e:
        world = int(e.get("SLURM_STEP_NUM_TASKS", e.get("SLURM_NTASKS", 1)))
        local_world = _tasks_per_node(e.get("SLURM_STEP_TASKS_PER_NODE", str(world)),
                                      int(e.get("SLURM_NODEID", 0)))
        return DistEnv(int(e["SLURM_PROCID"]), int(e.get("SLURM_LOCALID", 0)), world,
                       local_world, "slurm")
    return DistEnv()

def job_token(environ: os._Environ | dict | None = None) -> str:
    """A name for this launch that every rank of it shares and a concurrent launch does not."""
    e = os.environ if environ is None else environ
    launcher = env_info(e).launcher
    if launcher == "mpi":  # Open MPI 4 names its job; PMIx-based launchers name a namespace
        return "mpi-" + e.get("OMPI_MCA_ess_base_jobid", e.get("PMIX_NAMESPACE", "0"))
    if launcher == "slurm":
        return f"slurm-{e.get('SLURM_JOB_ID', '0')}.{e.get('SLURM_STEP_ID', '0')}"
    if launcher == "env":  # every rank was given the same world size and port by hand
        return f"env-{e.get('WORLD_SIZE')}-{e.get('MASTER_PORT', '')}"
    return launcher
