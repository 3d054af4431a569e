"""Who am I, and the process group around me.

The same lab runs under ``torchrun`` (RANK, LOCAL_RANK, WORLD_SIZE, ...), under ``srun``
(SLURM_PROCID, SLURM_LOCALID, SLURM_STEP_NUM_TASKS, ...), under ``mpirun`` (OMPI_COMM_WORLD_*),
or as plain ``python lab.py`` (one process). A lab calls ``prepare()``, which reads whichever
is there, settles MASTER_ADDR/MASTER_PORT, checks them and gathers the ranks, and then calls
``dist.init_process_group`` itself::

    env = prepare(backend="auto", device="auto")
    dist.init_process_group(env.backend, rank=env.rank, world_size=env.world_size)

``setup()`` does both (for tests and helpers); ``cleanup()`` ends the group.

What the labs call lives here; the rendezvous (ports, the roll call, restarts) is
dpcourse.lab.rendezvous, the one-line explanations of failures dpcourse.lab.explain, and reading the
launcher's variables dpcourse.lab.whoami.
"""
from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

# torch 2.14: the first optimiser imports torch.distributed.nn, whose functions keep the default
# group alive if it exists by then; gloo's threads then outlive Python at exit and a rank can
# abort ("terminate called without an active exception"). Imported here, before any group.
import torch.distributed.nn

from dpcourse.lab import rendezvous
from dpcourse.lab.errors import CourseError
from dpcourse.lab.explain import explain_errors
from dpcourse.lab.whoami import DistEnv, env_info

# DistEnv, env_info, explain_errors: for the labs
__all__ = ["DistEnv", "env_info", "explain_errors", "prepare", "setup", "cleanup", "stop",
           "rank0_first", "bar_off", "placement", "gpu_roll_call", "why_no_gpu"]


DEFAULT_TIMEOUT_S = 300  # a collective that waits longer than this ends the run

# What PyTorch documents each backend to run, on CPU and on GPU tensors
# (docs/source/distributed.md, "Backends"); "?" means it depends on how MPI was built.
COLLECTIVES = ("send_recv", "broadcast", "all_reduce", "reduce", "all_gather", "gather",
               "scatter", "reduce_scatter", "all_to_all", "barrier")

DOCUMENTED = {  # backend -> {collective: (cpu, gpu)}
    "gloo": dict.fromkeys(COLLECTIVES, ("yes", "yes")) | {"send_recv": ("yes", "no"),
                                                          "barrier": ("yes", "no")},
    "mpi": dict.fromkeys(COLLECTIVES, ("yes", "?")) | {"reduce_scatter": ("no", "no")},
    "nccl": dict.fromkeys(COLLECTIVES, ("no", "yes")),
}

def available_backends() -> dict[str, bool]:
    """Which backends this PyTorch build has compiled in."""
    return {"gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available(),
            "mpi": dist.is_mpi_available()}

def job_gpus(environ=None) -> str | None:
    """The GPUs Slurm gave this job on this node ('0,1', or a count), or None outside a GPU job."""
    e = os.environ if environ is None else environ
    for name in ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS"):
        if e.get(name):
            return e[name]
    return e["SLURM_GPUS_ON_NODE"] if e.get("SLURM_GPUS_ON_NODE", "0") not in ("", "0") else None

def bound_one_each(launcher: str, environ=None, visible: int | None = None) -> bool:
    """Whether the launcher handed each process GPUs of its own. Under srun: --gpus-per-task, or a
    process that sees fewer GPUs than the job holds on its node (--gpu-bind). Slurm sets
    CUDA_VISIBLE_DEVICES for every task of a GPU job, bound or not, so that alone says nothing.
    Under mpirun: a site's CUDA_VISIBLE_DEVICES per rank. torchrun and horovodrun bind nothing."""
    e = os.environ if environ is None else environ
    if launcher == "slurm":
        on_node = e.get("SLURM_GPUS_ON_NODE", "")
        return bool(e.get("SLURM_GPUS_PER_TASK")) or (
            on_node.isdigit() and visible is not None and 0 < visible < int(on_node))
    return launcher == "mpi" and "CUDA_VISIBLE_DEVICES" in e

def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text)[:2])

def why_no_gpu(environ=None) -> str:
    """Why torch sees no GPU here, in one clause: the build, the driver, the vendor, or the job."""
    e = os.environ if environ is None else environ
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return f"this PyTorch ({torch.__version__}) is a CPU-only build: install the CUDA one"
    if shutil.which("nvidia-smi"):
        try:
            smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=20)
            said = smi.stdout + smi.stderr
        except (OSError, subprocess.SubprocessError) as err:
            said = str(err)
        driver = re.search(r"CUDA Version:\s*([\d.]+)", said)
        if (driver and torch.version.cuda
                and _version(driver.group(1)) < _version(torch.version.cuda)):
            version = re.search(r"Driver Version:\s*([\d.]+)", said)
            return (f"the NVIDIA driver{' ' + version.group(1) if version else ''} "
                    f"supports CUDA up to {driver.group(1)}, older than the CUDA "
                    f"{torch.version.cuda} this PyTorch was built for: load a newer driver "
                    f"(ask your admins), or install a PyTorch built for CUDA {driver.group(1)}")
        if not driver:
            return ("nvidia-smi finds no working GPU: "
                    + (said.strip().splitlines() or ["(no output)"])[-1])
    elif os.path.exists("/dev/kfd") or shutil.which("rocm-smi"):
        return ("this node's GPUs are AMD (ROCm) and this PyTorch is NVIDIA's CUDA build: "
                "use the ROCm build of PyTorch, or a partition with NVIDIA GPUs")
    if job_gpus(e) is None:
        if "SLURM_JOB_ID" in e:
            return ("the job asked Slurm for no GPU: "
                    "add #SBATCH --gpus-per-node=N (or --gpus-per-task=1)")
        # it listed GPUs (else we returned above), and CUDA finds none
        if shutil.which("nvidia-smi"):
            if e.get("CUDA_VISIBLE_DEVICES", "unset").strip() == "":
                return ("CUDA_VISIBLE_DEVICES is set and empty, which hides every GPU "
                        "nvidia-smi lists here: unset it, or name the GPUs by index from 0 "
                        "(CUDA_VISIBLE_DEVICES=0,1)")
            return (f"nvidia-smi lists GPUs here, but CUDA finds none (CUDA_VISIBLE_DEVICES="
                    f"{e.get('CUDA_VISIBLE_DEVICES', 'unset')}; "
                    f"this PyTorch's CUDA is {torch.version.cuda}): "
                    "compare with nvidia-smi, and ask your admins")
        return "there is no GPU on this machine"
    return (f"CUDA finds none of the GPUs Slurm gave the job ({job_gpus(e)}; CUDA_VISIBLE_DEVICES="
            f"{e.get('CUDA_VISIBLE_DEVICES', 'unset')}): check nvidia-smi on the node")

@dataclass(frozen=True)
class Placement:
    backend: str
    device: torch.device
    note: str | None = None  # one line to say: auto trains on the CPU although the job holds GPUs

def place(backend: str = "auto", device: str = "auto", local_rank: int = 0,
          local_world_size: int = 1, *, gpus: int, bound: bool = False, held: str | None = None,
          nccl: bool = True, why_none=lambda: "") -> Placement:
    """This process's backend and device, decided from what it sees (no side effects; the table in
    tests/test_dist.py goes through every case).

    gpus: the GPUs this process sees; bound: the launcher gave each process its own (then it
    takes its first, cuda:0); held: the GPUs the job holds on this node (None: no GPU job);
    why_none: why torch sees no GPU (called only when needed)."""
    if backend not in ("auto", "gloo", "nccl", "mpi"):
        raise CourseError(f"Unknown backend {backend!r}: use auto, gloo or nccl.")
    if gpus >= local_world_size and gpus > 0:
        gpu = local_rank  # all of the node's GPUs are visible to every process: one each
    elif gpus > 0 and bound:
        gpu = local_rank % gpus  # the launcher bound this process to its own (usually one: cuda:0)
    else:
        gpu = None
    sharing = gpus > 0 and gpu is None
    share = (f"this node runs {local_world_size} processes and has {gpus} GPU(s) they would "
             f"share. Start at most {gpus} per node (--nproc-per-node, --ntasks-per-node), or "
             "give each task its own (srun --gpus-per-task=1)")
    if device == "cuda" and gpu is None:
        raise CourseError(f"--device cuda needs one GPU per process: {share}." if sharing
                          else f"--device cuda, but this process sees no GPU: {why_none()}.")
    if backend == "nccl" and (gpu is None or device == "cpu"):
        if device == "cpu":
            raise CourseError("NCCL needs a GPU, and --device cpu was asked for: "
                              "use --backend gloo.")
        if sharing:
            raise CourseError(f"NCCL needs one GPU per process: {share}, or use --backend gloo.")
        raise CourseError(f"NCCL needs a GPU, and this process sees none: {why_none()}. "
                          "On a CPU node use --backend gloo (or --backend auto).")
    if backend == "mpi" and not dist.is_mpi_available():
        raise CourseError("This PyTorch build has no MPI backend: use --backend gloo or nccl.")
    on_gpu = gpu is not None and device != "cpu"
    chosen = ("nccl" if on_gpu and nccl else "gloo") if backend == "auto" else backend
    note = None
    if device == "auto" and not on_gpu and held is not None:
        why = share if sharing else why_none()
        note = (f"this job holds GPUs here ({held}), but {why}; training on the CPU with {chosen} "
                "(--device cuda makes this an error)")
    return Placement(chosen, torch.device("cuda", gpu) if on_gpu else torch.device("cpu"), note)

def placement(backend: str = "auto", device: str = "auto",
              info: DistEnv | None = None) -> Placement:
    """``place()`` for this process: what torch sees, the launcher's binding, Slurm's variables."""
    info = info or env_info()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return place(backend, device, info.local_rank, info.local_world_size, gpus=gpus,
                 bound=bound_one_each(info.launcher, visible=gpus), held=job_gpus(),
                 nccl=dist.is_nccl_available(), why_none=why_no_gpu)

def describe_gpus(rows: list[dict]) -> tuple[list[str], str | None]:
    """Rank 0's lines for ``gpu_roll_call`` (one per rank), and the problem when two ranks share a
    GPU."""
    lines = [f"rank {r['rank']:>3} on {r['node']}, local rank {r['local_rank']}: "
             f"{r['device']} = {r['name']} ({r['uuid']}), CUDA_VISIBLE_DEVICES={r['visible']}; "
             f"torch {r['torch']}, CUDA {r['cuda']}, driver {r['driver']}"
             for r in sorted(rows, key=lambda r: r["rank"])]
    seen: dict[tuple, list[int]] = {}
    for r in rows:
        seen.setdefault((r["node"], r["uuid"]), []).append(r["rank"])
    shared = [(node, uuid, ranks) for (node, uuid), ranks in seen.items() if len(ranks) > 1]
    if not shared:
        return lines, None
    node, uuid, ranks = shared[0]
    return lines, (f"ranks {rendezvous.ranks_text(sorted(ranks))} on {node} share one GPU "
                   f"({uuid}): each process needs its own. Ask Slurm for one per process "
                   "(--gpus-per-node equal to the processes per node, or srun "
                   "--gpus-per-task=1), or start fewer processes per node.")

def _driver(proc: str = "/proc/driver/nvidia/version") -> str:
    """The NVIDIA driver's version, e.g. 580.159.04: from the kernel module's file (no process
    started), else from nvidia-smi; "?" if neither says. torch has no call for it."""
    try:
        # "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  ...", or
        # "...Open Kernel Module for x86_64  580.159.04"
        with open(proc) as f:
            found = re.search(r"Kernel Module(?: for \S+)?\s+([\d.]+)", f.read())
        if found:
            return found.group(1)
    except OSError:
        pass
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        first = smi.stdout.split("\n", 1)[0].strip()
        return first if smi.returncode == 0 and re.fullmatch(r"[\d.]+", first) else "?"
    except (OSError, subprocess.SubprocessError):
        return "?"

def gpu_roll_call(env: DistEnv, gather=None) -> None:
    """In a GPU run, right after init_process_group: rank 0 prints one line per rank (node, local
    rank, the GPU it took with its name and UUID, torch, CUDA, driver), and two ranks on one GPU end
    the run with the fix. Nothing on the CPU. ``gather(obj)`` returns every rank's ``obj`` in rank
    order (default: torch.distributed's all_gather_object; Horovod: hvd.allgather_object)."""
    if env.device.type != "cuda":
        return
    props = torch.cuda.get_device_properties(env.device)
    mine = {"rank": env.rank, "node": socket.gethostname(), "local_rank": env.local_rank,
            "device": str(env.device), "name": props.name, "uuid": str(getattr(props, "uuid", "?")),
            "torch": torch.__version__, "cuda": torch.version.cuda, "driver": _driver(),
            "visible": os.environ.get("CUDA_VISIBLE_DEVICES", "unset")}
    if gather is None:
        everyone: list = [None] * env.world_size
        dist.all_gather_object(everyone, mine)
    else:
        everyone = list(gather(mine))
    lines, problem = describe_gpus(everyone)
    if env.rank == 0:
        print("\n".join(lines), flush=True)
    if problem:
        stop(env, problem)

def choose_backend(backend: str = "auto", device: str = "auto", local_world_size: int = 1) -> str:
    """The backend ``placement`` picks for local rank 0 of ``local_world_size``."""
    return placement(backend, device, DistEnv(local_world_size=local_world_size,
                                              launcher=env_info().launcher)).backend

def choose_device(backend: str, local_rank: int = 0, device: str = "auto",
                  local_world_size: int = 1) -> torch.device:
    """The device ``placement`` picks for ``local_rank`` of ``local_world_size`` with
    ``backend``."""
    info = DistEnv(local_rank=local_rank, local_world_size=local_world_size,
                   launcher=env_info().launcher)
    return placement(backend, device, info).device

def bar_off(rank: int = 0) -> bool | None:
    """tqdm's ``disable`` for a rank's progress bar (one process: rank 0's): off on every rank
    but 0, and off with $TQDM_DISABLE (an explicit argument would override it); None lets tqdm
    switch itself off when the output is not a terminal (CI, log files)."""
    return True if rank != 0 or os.environ.get("TQDM_DISABLE") else None

def stop(info: DistEnv, message: str, everyone: bool = False) -> NoReturn:
    """End this rank with ``message``: said by rank 0 (or by every rank), the others exit quietly.

    A problem every rank meets alike (a missing variable, a batch that does not divide) is said
    once, by rank 0; the others exit with status 1 without a word, a second later, so that a
    launcher that stops the job when one rank fails lets rank 0 speak first.
    """
    if everyone or info.rank == 0:
        raise CourseError(f"[rank {info.rank}] {message}")
    time.sleep(1.0)
    raise SystemExit(1)

def prepare(backend: str = "auto", device: str = "auto",
            rendezvous_timeout_s: float | None = None) -> DistEnv:
    """Everything ``dist.init_process_group`` needs, settled and checked, before a lab calls it.

    Reads rank and world size from the launcher (torchrun, srun, mpirun or none), picks the
    backend and this rank's device, sets MASTER_ADDR and MASTER_PORT when the launcher did
    not (one node: 127.0.0.1; Slurm and Open MPI: a port derived from the job id), checks
    that the address resolves, and under srun and mpirun (and with RANK and WORLD_SIZE exported by
    hand, where no launcher watches the ranks) makes every rank report to rank 0
    first, so a rank that never started is named within ``rendezvous_timeout_s`` (default
    60 s, or $DPCOURSE_RDZV_TIMEOUT_S). Each problem ends in one line saying what to do.
    """
    info = env_info()
    try:
        placed = placement(backend, device, info)
    except CourseError as err:  # every rank asked for the same thing: rank 0 says it
        stop(info, err.message)
    backend, dev = placed.backend, placed.device
    if placed.note and info.local_rank == 0:  # one line per node: the node's first process says it
        print(f"[rank {info.rank}] {placed.note}", file=sys.stderr, flush=True)
    if info.world_size > 1:
        explain_errors()
    if info.launcher == "none":  # one process: a private group on this machine
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(rendezvous.free_port())
    elif info.launcher == "env" and not {"MASTER_ADDR", "MASTER_PORT"} <= set(os.environ):
        stop(info, rendezvous.BY_HAND)
    elif info.launcher != "torchrun":  # torchrun sets both itself
        if "MASTER_ADDR" not in os.environ:
            if info.local_world_size != info.world_size:  # several nodes: rank 0's must be named
                launcher = {"slurm": "srun", "mpi": "mpirun"}[info.launcher]
                stop(info, f"Launched by {launcher} with {info.world_size} tasks on several "
                     "nodes, but MASTER_ADDR is not set. Export rank 0's host before the launch, "
                     f"e.g. in an sbatch script: {rendezvous.SCONTROL}")
            os.environ["MASTER_ADDR"] = "127.0.0.1"  # every rank is on this node
        os.environ.setdefault("MASTER_PORT", str(rendezvous.default_port()))
    elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" \
            and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0:
        rendezvous.fresh_store_after_restart(info)
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if info.launcher != "torchrun" and rendezvous.resolve(addr) is None:
        # Said by rank 0, and by the first rank of every other node: a name can resolve on one
        # node and not on another.
        stop(info, f"MASTER_ADDR={addr} does not resolve on {socket.gethostname()}. Check the "
             "spelling; it must be rank 0's host name or IP address "
             f"(in a Slurm job: {rendezvous.SCONTROL}).",
             everyone=info.local_rank == 0 and info.local_world_size != info.world_size)
    if info.launcher in ("slurm", "mpi", "env"):
        timeout = rendezvous_timeout_s or float(os.environ.get("DPCOURSE_RDZV_TIMEOUT_S", 60))
        rendezvous.roll_call(info, addr, port, timeout)
    return DistEnv(info.rank, info.local_rank, info.world_size, info.local_world_size,
                   info.launcher, backend, dev)

def setup(backend: str = "auto", device: str = "auto",
          timeout_s: float | None = None) -> DistEnv:
    """``prepare()``, then pin the GPU and start the process group: for tests and helpers.

    The labs make these calls themselves, where the learner reads them.
    """
    env = prepare(backend, device)
    if env.device.type == "cuda":
        torch.cuda.set_device(env.device)
    timeout = timedelta(
        seconds=timeout_s or float(os.environ.get("DPCOURSE_TIMEOUT_S", DEFAULT_TIMEOUT_S)))
    dist.init_process_group(env.backend, rank=env.rank, world_size=env.world_size, timeout=timeout)
    return env

def cleanup() -> None:
    """End the process group (safe to call when there is none)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    rendezvous.ROLL_CALL.clear()

def _all_ok(ok: bool) -> bool:
    """Every rank says whether it is fine; all learn whether everyone is."""
    backend = dist.get_backend()
    dev = (torch.device("cuda", torch.cuda.current_device()) if backend == "nccl"
           else torch.device("cpu"))
    flag = torch.tensor([1 if ok else 0], device=dev)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())

_inside_rank0_first = False  # nested blocks (a lab's around the data layer's) are plain blocks

@contextmanager
def rank0_first(local: bool = False):
    """Rank 0 runs the block first (download, unpack, cache); the others wait, then run it.

    ``local=True``: the first process of *each node* (local rank 0) runs it first, the node's
    others wait: one copy of the data per node-local disk. If one that goes first fails, it
    raises its own error and the others exit quietly with status 1, so the learner reads one
    message, not one traceback per rank. Without a process group, or inside another
    ``rank0_first`` block, this is a plain block.
    """
    global _inside_rank0_first
    if _inside_rank0_first or not (dist.is_available() and dist.is_initialized()) \
            or dist.get_world_size() == 1:
        yield
        return
    _inside_rank0_first = True
    first = (env_info().local_rank if local else dist.get_rank()) == 0
    try:
        if first:
            try:
                yield
            except BaseException:
                _all_ok(False)
                raise
            _all_ok(True)
        else:
            if not _all_ok(True):
                time.sleep(1.0)  # as stop() does: the one that went first ends first, and is named
                raise SystemExit(1)  # it has printed why
            yield
    finally:
        _inside_rank0_first = False
