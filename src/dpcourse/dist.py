"""Who am I, and the process group around me.

The same lab runs under ``torchrun`` (RANK, LOCAL_RANK, WORLD_SIZE, ...), under ``srun``
(SLURM_PROCID, SLURM_LOCALID, SLURM_STEP_NUM_TASKS, ...), under ``mpirun`` (OMPI_COMM_WORLD_*),
or as plain ``python lab.py`` (one process). ``setup()`` reads whichever is there, picks the
backend and device, and starts the process group; ``cleanup()`` ends it.
"""
from __future__ import annotations

import os
import re
import socket
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .errors import CourseError

DEFAULT_TIMEOUT_S = 300  # a collective that waits longer than this ends the run


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    launcher: str = "none"  # torchrun | slurm | mpi | none
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
    """Read rank, local rank and world size from the launcher's variables.

    Order: torchrun (it also runs inside srun jobs) → an ``srun`` job step → ``mpirun`` → one process.
    The batch script of an sbatch job has SLURM_PROCID but no SLURM_STEP_ID: that is one process.
    """
    e = os.environ if environ is None else environ
    if "RANK" in e and "WORLD_SIZE" in e:
        world = int(e["WORLD_SIZE"])
        return DistEnv(int(e["RANK"]), int(e.get("LOCAL_RANK", 0)), world,
                       int(e.get("LOCAL_WORLD_SIZE", world)), "torchrun")
    if "SLURM_PROCID" in e and "SLURM_STEP_ID" in e:
        world = int(e.get("SLURM_STEP_NUM_TASKS", e.get("SLURM_NTASKS", 1)))
        local_world = _tasks_per_node(e.get("SLURM_STEP_TASKS_PER_NODE", str(world)),
                                      int(e.get("SLURM_NODEID", 0)))
        return DistEnv(int(e["SLURM_PROCID"]), int(e.get("SLURM_LOCALID", 0)), world,
                       local_world, "slurm")
    if "OMPI_COMM_WORLD_RANK" in e:
        world = int(e["OMPI_COMM_WORLD_SIZE"])
        return DistEnv(int(e["OMPI_COMM_WORLD_RANK"]), int(e.get("OMPI_COMM_WORLD_LOCAL_RANK", 0)),
                       world, int(e.get("OMPI_COMM_WORLD_LOCAL_SIZE", world)), "mpi")
    return DistEnv()


# What PyTorch documents each backend to run, on CPU and on GPU tensors
# (docs/source/distributed.md, "Backends"); "?" means it depends on how MPI was built.
COLLECTIVES = ("send_recv", "broadcast", "all_reduce", "reduce", "all_gather", "gather",
               "scatter", "reduce_scatter", "all_to_all", "barrier")
DOCUMENTED = {  # backend -> {collective: (cpu, gpu)}
    "gloo": dict.fromkeys(COLLECTIVES, ("yes", "yes")) | {"send_recv": ("yes", "no"), "barrier": ("yes", "no")},
    "mpi": dict.fromkeys(COLLECTIVES, ("yes", "?")) | {"reduce_scatter": ("no", "no")},
    "nccl": dict.fromkeys(COLLECTIVES, ("no", "yes")),
}


def available_backends() -> dict[str, bool]:
    """Which backends this PyTorch build has compiled in."""
    return {"gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available(),
            "mpi": dist.is_mpi_available()}


def choose_backend(backend: str = "auto", device: str = "auto") -> str:
    """NCCL when we train on GPUs, gloo on the CPU; NCCL without a GPU is refused with a fix."""
    if backend not in ("auto", "gloo", "nccl", "mpi"):
        raise CourseError(f"Unknown backend {backend!r}: use auto, gloo or nccl.")
    cuda = torch.cuda.is_available() and device != "cpu"
    if backend == "auto":
        return "nccl" if cuda and dist.is_nccl_available() else "gloo"
    if backend == "nccl" and not cuda:
        why = "this process sees no GPU" if not torch.cuda.is_available() else "--device cpu was asked for"
        raise CourseError(
            f"NCCL needs a GPU, and {why}. On a CPU node use --backend gloo (or --backend auto); "
            "on a GPU node check `nvidia-smi` and that the job asked for GPUs (--gpus-per-node).")
    if backend == "mpi" and not dist.is_mpi_available():
        raise CourseError("This PyTorch build has no MPI backend: use --backend gloo or nccl.")
    return backend


def choose_device(backend: str, local_rank: int = 0, device: str = "auto") -> torch.device:
    """One GPU per process (cuda:LOCAL_RANK) with NCCL, or when asked; else the CPU."""
    if device == "cuda" and not torch.cuda.is_available():
        raise CourseError("--device cuda was asked for, but this process sees no GPU: use --device cpu.")
    if backend == "nccl" or (device == "cuda") or (device == "auto" and torch.cuda.is_available()):
        if torch.cuda.is_available():
            return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def setup(backend: str = "auto", device: str = "auto",
          timeout_s: float | None = None) -> DistEnv:
    """Start the process group and pick this rank's device.

    A plain ``python lab.py`` gets a one-process group on a free local port, so the DDP code
    path of a lab is the same with and without a launcher.
    """
    info = env_info()
    backend = choose_backend(backend, device)
    dev = choose_device(backend, info.local_rank, device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if info.launcher == "none":
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    elif info.local_world_size == info.world_size:  # srun/mpirun with every rank on this node
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    elif "MASTER_ADDR" not in os.environ:  # several nodes: rank 0's node must be named
        raise CourseError(
            f"Launched by {info.launcher} with {info.world_size} tasks but MASTER_ADDR is not set. "
            "Export it before the launch, e.g. in an sbatch script: "
            "export MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1)")
    os.environ.setdefault("MASTER_PORT", "29500")
    timeout = timedelta(seconds=timeout_s or float(os.environ.get("DPCOURSE_TIMEOUT_S", DEFAULT_TIMEOUT_S)))
    try:
        dist.init_process_group(backend, rank=info.rank, world_size=info.world_size,
                                timeout=timeout, device_id=dev if dev.type == "cuda" else None)
    except (RuntimeError, ValueError) as err:
        msg = str(err)
        if "EADDRINUSE" in msg or "address already in use" in msg.lower():
            raise CourseError(
                f"Port {os.environ['MASTER_PORT']} on {os.environ['MASTER_ADDR']} is already in use "
                "(another job, or a run that has not ended). Set MASTER_PORT to a free port, e.g. "
                "export MASTER_PORT=$(python -c 'from dpcourse.dist import free_port; print(free_port())'), "
                "or use torchrun --standalone, which picks one.") from None
        raise
    return DistEnv(info.rank, info.local_rank, info.world_size, info.local_world_size,
                   info.launcher, backend, dev)


def cleanup() -> None:
    """End the process group (safe to call when there is none)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _all_ok(ok: bool) -> bool:
    """Every rank says whether it is fine; all learn whether everyone is."""
    backend = dist.get_backend()
    dev = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    flag = torch.tensor([1 if ok else 0], device=dev)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


@contextmanager
def rank0_first():
    """Rank 0 runs the block first (download, unpack, cache); the others wait, then run it.

    If rank 0 fails, it raises its own error and the other ranks exit quietly with status 1,
    so the learner reads one message, not one traceback per rank. Without a process group
    this is a plain block.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        yield
        return
    if dist.get_rank() == 0:
        try:
            yield
        except BaseException:
            _all_ok(False)
            raise
        _all_ok(True)
    else:
        if not _all_ok(True):
            raise SystemExit(1)  # rank 0 has printed why
        yield
