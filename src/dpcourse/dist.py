"""Who am I, and the process group around me.

The same lab runs under ``torchrun`` (RANK, LOCAL_RANK, WORLD_SIZE, ...), under ``srun``
(SLURM_PROCID, SLURM_LOCALID, SLURM_STEP_NUM_TASKS, ...), under ``mpirun`` (OMPI_COMM_WORLD_*),
or as plain ``python lab.py`` (one process). A lab calls ``prepare()``, which reads whichever
is there, settles MASTER_ADDR/MASTER_PORT, checks them and gathers the ranks, and then calls
``dist.init_process_group`` itself::

    env = prepare(backend="auto", device="auto")
    dist.init_process_group(env.backend, rank=env.rank, world_size=env.world_size)

``setup()`` does both (for tests and helpers); ``cleanup()`` ends the group.
"""
from __future__ import annotations

import atexit
import gc
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import traceback
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import NoReturn
from datetime import timedelta

import torch
import torch.distributed as dist
# torch 2.14: the first optimiser imports torch.distributed.nn, whose functions keep the default
# group alive if it exists by then; gloo's threads then outlive Python at exit and a rank can
# abort ("terminate called without an active exception"). Imported here, before any group.
import torch.distributed.nn  # noqa: F401,E402

from .errors import CourseError


def _report_threads_at_exit() -> None:
    """$DPCOURSE_EXIT_THREADS=1: this process's threads as it exits, in one line (the tests read it).
    Registered before ``_release_destroyed_groups``, so it runs after it (atexit runs in reverse)."""
    if os.environ.get("DPCOURSE_EXIT_THREADS") != "1":
        return
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                names.append(comm.read().strip())
        except FileNotFoundError:  # a thread that ended meanwhile
            pass
    os.write(1, f"[exit] rank {os.environ.get('RANK', '?')} threads: {' '.join(sorted(names))}\n".encode())


def _release_destroyed_groups() -> None:
    """At exit, once a lab has called ``destroy_process_group``: let go of what still holds its groups.

    torch 2.14's DTensor keeps every DeviceMesh it has seen in module-level caches (sharding
    propagation, redistribution plans, mesh topology), and a mesh keeps its process groups. So after
    FSDP (``fully_shard``) the destroyed group and gloo's threads live on into the interpreter's exit,
    where a rank can abort ("terminate called without an active exception"; 3 gloo ranks of
    labs/fsdp_fashion.py, in CI). Emptied here, the group is freed and its threads end before Python
    does. The sharding cache is per thread: this empties the main thread's, which is all of it on the
    CPU (backward runs there), not what autograd's GPU threads filled. A group still initialized (no
    cleanup) is left as it is."""
    if not dist.is_available() or dist.is_initialized() or "torch.distributed.tensor" not in sys.modules:
        return
    from torch.distributed.tensor import _collective_utils, _redistribute, debug

    for clear in (debug._clear_sharding_prop_cache, _redistribute.clear_redistribute_planner_cache,
                  _redistribute._gen_transform_infos.cache_clear,
                  _collective_utils.MeshTopoInfo.build_from_mesh.cache_clear):
        clear()
    gc.collect()


atexit.register(_report_threads_at_exit)
atexit.register(_release_destroyed_groups)

DEFAULT_TIMEOUT_S = 300  # a collective that waits longer than this ends the run


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    launcher: str = "none"  # torchrun | env (RANK and WORLD_SIZE exported by hand) | horovodrun | slurm | mpi | none
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

    Order: torchrun (or RANK and WORLD_SIZE exported by hand: "env") → horovodrun (gloo) → ``mpirun`` →
    an ``srun`` job step → one process. torchrun is told from a hand-made launch by TORCHELASTIC_RUN_ID,
    which torchrun always sets: a hand-made launch gets the address check and the roll call that srun's
    and mpirun's get, since no launcher watches its ranks. The innermost launcher
    wins: torchrun runs inside srun steps, and ``mpirun`` inside an sbatch job or an srun step
    starts its ranks through Slurm's helper steps, whose SLURM_* variables describe mpirun's
    daemons, not the MPI ranks. The batch script of an sbatch job has SLURM_PROCID but no
    SLURM_STEP_ID: that is one process.
    """
    e = os.environ if environ is None else environ
    if "RANK" in e and "WORLD_SIZE" in e:
        world = int(e["WORLD_SIZE"])
        return DistEnv(int(e["RANK"]), int(e.get("LOCAL_RANK", 0)), world, int(e.get("LOCAL_WORLD_SIZE", world)),
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


def default_port(environ: os._Environ | dict | None = None) -> int:
    """The MASTER_PORT a launch uses when none is exported: the same on every rank of it.

    Under srun it is 20000 + (10·job id + step id) mod 10000, so two jobs (or two steps of a
    job) sharing a node never meet on one port; under mpirun it comes from mpirun's job id.
    The range 20000–29999 stays below Linux's ephemeral ports (32768+), which the OS hands out.
    """
    e = os.environ if environ is None else environ
    info = env_info(e)
    if info.launcher == "slurm" and e.get("SLURM_JOB_ID", "").isdigit():
        step = int(e["SLURM_STEP_ID"]) if e.get("SLURM_STEP_ID", "").isdigit() else 0
        return 20000 + (10 * int(e["SLURM_JOB_ID"]) + step) % 10000
    if info.launcher == "mpi":
        return 20000 + zlib.crc32(job_token(e).encode()) % 10000
    return 29500


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
        if driver and torch.version.cuda and _version(driver.group(1)) < _version(torch.version.cuda):
            version = re.search(r"Driver Version:\s*([\d.]+)", said)
            return (f"the NVIDIA driver{' ' + version.group(1) if version else ''} supports CUDA up to "
                    f"{driver.group(1)}, older than the CUDA {torch.version.cuda} this PyTorch was built for: "
                    f"load a newer driver (ask your admins), or install a PyTorch built for CUDA {driver.group(1)}")
        if not driver:
            return "nvidia-smi finds no working GPU: " + (said.strip().splitlines() or ["(no output)"])[-1]
    elif os.path.exists("/dev/kfd") or shutil.which("rocm-smi"):
        return ("this node's GPUs are AMD (ROCm) and this PyTorch is NVIDIA's CUDA build: use the ROCm "
                "build of PyTorch, or a partition with NVIDIA GPUs")
    if job_gpus(e) is None:
        if "SLURM_JOB_ID" in e:
            return "the job asked Slurm for no GPU: add #SBATCH --gpus-per-node=N (or --gpus-per-task=1)"
        if shutil.which("nvidia-smi"):  # it listed GPUs (else we returned above), and CUDA finds none
            if e.get("CUDA_VISIBLE_DEVICES", "unset").strip() == "":
                return ("CUDA_VISIBLE_DEVICES is set and empty, which hides every GPU nvidia-smi lists here: "
                        "unset it, or name the GPUs by index from 0 (CUDA_VISIBLE_DEVICES=0,1)")
            return (f"nvidia-smi lists GPUs here, but CUDA finds none (CUDA_VISIBLE_DEVICES="
                    f"{e.get('CUDA_VISIBLE_DEVICES', 'unset')}; this PyTorch's CUDA is {torch.version.cuda}): "
                    "compare with nvidia-smi, and ask your admins")
        return "there is no GPU on this machine"
    return (f"CUDA finds none of the GPUs Slurm gave the job ({job_gpus(e)}; CUDA_VISIBLE_DEVICES="
            f"{e.get('CUDA_VISIBLE_DEVICES', 'unset')}): check nvidia-smi on the node")


@dataclass(frozen=True)
class Placement:
    backend: str
    device: torch.device
    note: str | None = None  # one line to say: auto trains on the CPU although the job holds GPUs


def place(backend: str = "auto", device: str = "auto", local_rank: int = 0, local_world_size: int = 1, *,
          gpus: int, bound: bool = False, held: str | None = None, nccl: bool = True,
          why_none=lambda: "") -> Placement:
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
    share = (f"this node runs {local_world_size} processes and has {gpus} GPU(s) they would share. Start at "
             f"most {gpus} per node (--nproc-per-node, --ntasks-per-node), or give each task its own "
             "(srun --gpus-per-task=1)")
    if device == "cuda" and gpu is None:
        raise CourseError(f"--device cuda needs one GPU per process: {share}." if sharing
                          else f"--device cuda, but this process sees no GPU: {why_none()}.")
    if backend == "nccl" and (gpu is None or device == "cpu"):
        if device == "cpu":
            raise CourseError("NCCL needs a GPU, and --device cpu was asked for: use --backend gloo.")
        if sharing:
            raise CourseError(f"NCCL needs one GPU per process: {share}, or use --backend gloo.")
        raise CourseError(f"NCCL needs a GPU, and this process sees none: {why_none()}. On a CPU node "
                          "use --backend gloo (or --backend auto).")
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


def placement(backend: str = "auto", device: str = "auto", info: DistEnv | None = None) -> Placement:
    """``place()`` for this process: what torch sees, the launcher's binding, Slurm's variables."""
    info = info or env_info()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return place(backend, device, info.local_rank, info.local_world_size, gpus=gpus,
                 bound=bound_one_each(info.launcher, visible=gpus), held=job_gpus(), nccl=dist.is_nccl_available(),
                 why_none=why_no_gpu)


def describe_gpus(rows: list[dict]) -> tuple[list[str], str | None]:
    """Rank 0's lines for ``gpu_roll_call`` (one per rank), and the problem when two ranks share a GPU."""
    lines = [f"rank {r['rank']:>3} on {r['node']}, local rank {r['local_rank']}: {r['device']} = {r['name']} "
             f"({r['uuid']}), CUDA_VISIBLE_DEVICES={r['visible']}; torch {r['torch']}, CUDA {r['cuda']}, "
             f"driver {r['driver']}" for r in sorted(rows, key=lambda r: r["rank"])]
    seen: dict[tuple, list[int]] = {}
    for r in rows:
        seen.setdefault((r["node"], r["uuid"]), []).append(r["rank"])
    shared = [(node, uuid, ranks) for (node, uuid), ranks in seen.items() if len(ranks) > 1]
    if not shared:
        return lines, None
    node, uuid, ranks = shared[0]
    return lines, (f"ranks {_ranks(sorted(ranks))} on {node} share one GPU ({uuid}): each process needs its own. "
                   "Ask Slurm for one per process (--gpus-per-node equal to the processes per node, or srun "
                   "--gpus-per-task=1), or start fewer processes per node.")


def _driver(proc: str = "/proc/driver/nvidia/version") -> str:
    """The NVIDIA driver's version, e.g. 580.159.04: from the kernel module's file (no process
    started), else from nvidia-smi; "?" if neither says. torch has no call for it."""
    try:
        with open(proc) as f:  # "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  ...", or
            found = re.search(r"Kernel Module(?: for \S+)?\s+([\d.]+)", f.read())  # "...Open Kernel Module for x86_64  580.159.04"
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
    """In a GPU run, right after init_process_group: rank 0 prints one line per rank (node, local rank,
    the GPU it took with its name and UUID, torch, CUDA, driver), and two ranks on one GPU end the run
    with the fix. Nothing on the CPU. ``gather(obj)`` returns every rank's ``obj`` in rank order
    (default: torch.distributed's all_gather_object; Horovod: hvd.allgather_object)."""
    if env.device.type != "cuda":
        return
    props = torch.cuda.get_device_properties(env.device)
    mine = {"rank": env.rank, "node": socket.gethostname(), "local_rank": env.local_rank, "device": str(env.device),
            "name": props.name, "uuid": str(getattr(props, "uuid", "?")), "torch": torch.__version__,
            "cuda": torch.version.cuda, "driver": _driver(), "visible": os.environ.get("CUDA_VISIBLE_DEVICES", "unset")}
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
    return placement(backend, device, DistEnv(local_world_size=local_world_size, launcher=env_info().launcher)).backend


def choose_device(backend: str, local_rank: int = 0, device: str = "auto",
                  local_world_size: int = 1) -> torch.device:
    """The device ``placement`` picks for ``local_rank`` of ``local_world_size`` with ``backend``."""
    info = DistEnv(local_rank=local_rank, local_world_size=local_world_size, launcher=env_info().launcher)
    return placement(backend, device, info).device


def bar_off(rank: int) -> bool | None:
    """tqdm's ``disable`` for a rank's progress bar: off on every rank but 0, and off with
    $TQDM_DISABLE (an explicit argument would override it); None lets tqdm switch itself off
    when the output is not a terminal (CI, log files)."""
    return True if rank != 0 or os.environ.get("TQDM_DISABLE") else None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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


# What gloo, NCCL and the TCPStore say when the rank on the other end of a collective is gone.
_LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
              "Socket Timeout", "Timed out waiting", "timed out", "NCCL communicator was aborted")


_SAID = "dpcourse/exercise_said"  # set in the group's store by rank 0 once it has said the unfinished exercise
_SAID_WAIT_S = 30.0


def _rank0_said_it() -> bool:
    """A rank other than 0 at an unfinished exercise: wait until rank 0 has said it (it meets the same stub,
    but on a loaded machine it can come there seconds later). True once it has, or once the store has gone
    with rank 0 (srun, mpirun, by hand: rank 0 serves it; under torchrun the agent does, and ends this rank
    when rank 0 fails); False if rank 0 has not said it within _SAID_WAIT_S (busy elsewhere, in a collective
    this rank will never join, say): then this rank says it. Without a process group: 3 s, then this rank
    says it."""
    store = dist.distributed_c10d._get_default_store() if dist.is_available() and dist.is_initialized() else None
    if store is None:
        time.sleep(3.0)
        return False
    try:
        store.wait([_SAID], timedelta(seconds=_SAID_WAIT_S))
        return True
    except (dist.DistNetworkError, KeyboardInterrupt):  # the store has gone with rank 0; or Ctrl-C: quietly
        return True
    except RuntimeError:  # DistStoreError: the wait's timeout
        return False


def _tell_the_others() -> None:
    """Rank 0, once it has said the unfinished exercise: the other ranks may end without a word."""
    try:
        if dist.is_available() and dist.is_initialized():
            dist.distributed_c10d._get_default_store().set(_SAID, "1")
    except RuntimeError:
        pass  # nobody left to tell


def _explain_lost_peer(kind, err, tb, fallback=sys.excepthook) -> None:
    """sys.excepthook of a rank in a group: a collective whose peer died is one line, not a traceback;
    so is an unfinished exercise of a learner's lab, which every rank meets alike: rank 0 says it.

    (torch's own hook, installed by init_process_group around this one, adds the "[rankN]:" tag.)
    """
    text = str(err)
    if isinstance(err, NotImplementedError) and text.startswith("Exercise:") \
            and not os.environ.get("DPCOURSE_TRACEBACK"):
        if env_info().rank != 0 and _rank0_said_it():
            return  # exit status 1, without a word: rank 0 has said it
        where = traceback.extract_tb(tb)[-1]
        try:
            path = os.path.relpath(where.filename)
        except ValueError:
            path = where.filename
        print(f'File "{path}", line {where.lineno}, in {where.name}: {text}. This exercise of the lab is '
              "not done yet: complete it (its notebook's check says when it is right), or run the "
              "complete lab in solutions/labs/.", file=sys.stderr, flush=True)
        if env_info().rank == 0:  # once torch's hook around this one has written the line (atexit runs after it)
            atexit.register(_tell_the_others)
        return
    if isinstance(err, RuntimeError) and any(s in text for s in _LOST_PEER) \
            and not os.environ.get("DPCOURSE_TRACEBACK"):
        first = next((line.strip() for line in text.splitlines() if line.strip()), "")
        first = re.sub(r"^(\[[^\]]*\]:?\s*)+", "", first).split(". ")[0][:120]  # no source paths
        collective, where = _waiting_in(tb)
        if "imed out" in text or "Timeout" in text:  # nobody answered: most often a hang, not a crash
            print(f"{collective} at {where} waited its whole timeout and no other rank joined it ({first}). "
                  "This is a hang: another rank is not calling the same collective: it called a different "
                  "one or none (a collective under `if rank == 0:`, ranks that take different numbers of "
                  "steps), or it is stuck or gone. Compare where each rank waits (this line, on each rank); "
                  "DPCOURSE_TRACEBACK=1 shows this rank's traceback.",
                  file=sys.stderr, flush=True)
        else:
            print(f"lost another rank in the middle of {collective} at {where} ({first}). It probably "
                  "crashed, was killed or ran out of time (its own output says why), or it ended without "
                  "calling this collective. "
                  "(DPCOURSE_TRACEBACK=1 shows this rank's traceback.)", file=sys.stderr, flush=True)
        return
    fallback(kind, err, tb)


def _waiting_in(tb) -> tuple[str, str]:
    """(the collective, "file:line (function)" of the code that called it) from a traceback."""
    frames = traceback.extract_tb(tb)
    torch_dir = os.path.dirname(torch.__file__)
    ours = [f for f in frames if not f.filename.startswith(torch_dir)]
    collective = next((f.name for f in reversed(frames) if f.filename.endswith("distributed_c10d.py")
                       and f.name != "wrapper"), "a collective")
    if not ours:
        return collective, "?"
    return collective, f"{os.path.basename(ours[-1].filename)}:{ours[-1].lineno} ({ours[-1].name})"


def explain_errors() -> None:
    """From now on, an unfinished exercise of a lab, or a collective whose peer died, ends this
    rank with one line (rank 0's, for an exercise) instead of a traceback per rank. ``prepare``
    calls it; a lab without ``prepare`` (Horovod's) calls it itself."""
    if env_info().world_size > 1:
        sys.excepthook = partial(_explain_lost_peer, fallback=sys.__excepthook__)


def _resolve(host: str, seconds: float = 10.0) -> str | None:
    """The IP address of ``host``, or None if it does not resolve within ``seconds``."""
    answer: list[str] = []

    def look_up():
        try:
            answer.append(socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)[0][4][0])
        except OSError:
            pass

    worker = threading.Thread(target=look_up, daemon=True)  # a dead DNS server can take minutes
    worker.start()
    worker.join(seconds)
    return answer[0] if answer else None


def _ranks(ranks: list[int]) -> str:
    """'1', '1 and 3', '1, 2 and 5', or the first few of a long list."""
    words = [str(r) for r in ranks[:6]] + ([f"… ({len(ranks)} in all)"] if len(ranks) > 6 else [])
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def _port_in_use(addr: str, port: int) -> str:
    return (f"Port {port} on {addr} is already in use (another job, or a run that has not ended). "
            "Set MASTER_PORT to a free port, e.g. export MASTER_PORT=$(python -c 'from "
            "dpcourse.dist import free_port; print(free_port())'), or use torchrun --standalone, "
            "which picks one.")


def _wait_until_listening(addr: str, port: int, timeout_s: float) -> None:
    """Return once something accepts connections at addr:port; raise TimeoutError after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((addr, port), timeout=max(0.1, min(2.0, deadline - time.monotonic()))).close()
            return
        except OSError:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"nothing listens at {addr}:{port}") from None
            time.sleep(0.2)


_BY_HAND = ("RANK and WORLD_SIZE are set, as torchrun sets them, but MASTER_ADDR or MASTER_PORT is not. Start "
            "the program with torchrun (it sets all four), or export MASTER_ADDR=<rank 0's host> and "
            "MASTER_PORT=<a free port> for every rank; if RANK and WORLD_SIZE are left over in this shell, "
            "unset them.")
_ROLL_CALL: list = []
_SCONTROL = 'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)'  # rank 0's store: init_process_group's env:// rendezvous serves on it too


def _roll_call(info: DistEnv, addr: str, port: int, timeout_s: float) -> None:
    """Every rank reports to rank 0 before ``init_process_group``, so a missing rank is named.

    Rank 0 serves a TCPStore at MASTER_ADDR:MASTER_PORT (multi-tenant: the env:// rendezvous
    of ``init_process_group`` joins the same server afterwards). Each rank writes its name
    under this launch's token; rank 0 waits up to ``timeout_s`` for all of them, then answers
    "go" or names the ranks that never came. Without this, torch waits its full collective
    timeout and says only "1/2 clients joined".
    """
    token = job_token()
    key = f"dpcourse/{token}/"
    wait = timedelta(seconds=timeout_s)
    where = f"{addr}:{port}"
    if info.rank == 0:
        try:
            store = dist.TCPStore(addr, port, info.world_size, is_master=True, timeout=wait,
                                  wait_for_workers=False, multi_tenant=True)
        except RuntimeError as err:
            if "EADDRINUSE" in str(err) or "address already in use" in str(err).lower():
                raise CourseError(f"[rank 0] {_port_in_use(addr, port)}") from None
            raise CourseError(f"[rank 0] could not serve the rendezvous at {where}: "
                              f"{str(err).splitlines()[0]}") from None
        _ROLL_CALL.append(store)
        store.set("dpcourse/owner", token)
        deadline = time.monotonic() + timeout_s
        missing = list(range(1, info.world_size))
        while missing and time.monotonic() < deadline:
            missing = [r for r in missing if not store.check([f"{key}joined/{r}"])]
            if missing:
                time.sleep(0.05)
        store.set(f"{key}go", "missing " + " ".join(map(str, missing)) if missing else "ok")
        if missing:
            raise CourseError(
                f"[rank 0] rank{'s' if len(missing) > 1 else ''} {_ranks(missing)} of "
                f"{info.world_size} did not join within {timeout_s:g} s (rank 0 waited at {where}). "
                "Usual causes: those tasks crashed before set-up (read their output above), "
                "the world size is wrong (more tasks asked for than started), or a firewall "
                "blocks the port. Under srun, add --kill-on-bad-exit=1 so one failed task ends "
                "the whole step.")
        return
    try:
        _wait_until_listening(addr, port, timeout_s)  # quietly: torch's own retries print pages
        store = dist.TCPStore(addr, port, info.world_size, is_master=False, timeout=wait,
                              wait_for_workers=False)
        store.wait(["dpcourse/owner"], wait)
        owner = store.get("dpcourse/owner").decode()
    except (RuntimeError, TimeoutError):
        raise CourseError(
            f"[rank {info.rank}] could not reach rank 0 at {where} within {timeout_s:g} s. "
            "Usual causes: rank 0's task crashed or never started (read its output), "
            "MASTER_ADDR names the wrong host (it must be rank 0's), or a firewall blocks "
            "the port.") from None
    if owner != token:
        raise CourseError(f"[rank {info.rank}] {where} is another job's rendezvous ({owner}), "
                          f"not this one's ({token}). Unset MASTER_PORT (each job then gets "
                          "its own) or export a different one.")
    store.set(f"{key}joined/{info.rank}", socket.gethostname())
    try:
        store.wait([f"{key}go"], wait + timedelta(seconds=10))
        go = store.get(f"{key}go").decode()
    except RuntimeError:
        raise CourseError(f"[rank {info.rank}] rank 0 at {where} stopped answering while the "
                          "ranks gathered (its output says why).") from None
    if go != "ok":
        raise SystemExit(1)  # rank 0 names the missing ranks


def _fresh_store_after_restart(info: DistEnv) -> None:
    """After a ``torchrun --max-restarts`` restart, point env:// at a fresh store on a new port.

    torchrun (torch >= 2.4) lends its own rendezvous store to the workers. After a restart that
    store still holds the dead attempt's addresses, and the new attempt's init_process_group
    connects to them and fails (pytorch/pytorch#135712; TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    on torchrun's side avoids it too). Rank 0 picks a free port and announces it through
    torchrun's store under this attempt's number; init_process_group then starts afresh there.
    """
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timedelta(seconds=60), wait_for_workers=False)
    key = f"dpcourse/restart{attempt}/port"
    if info.rank == 0:
        agent.set(key, str(free_port("0.0.0.0")))
    agent.wait([key])
    os.environ["MASTER_PORT"] = agent.get(key).decode()
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"


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
        os.environ["MASTER_PORT"] = str(free_port())
    elif info.launcher == "env" and not {"MASTER_ADDR", "MASTER_PORT"} <= set(os.environ):
        stop(info, _BY_HAND)
    elif info.launcher != "torchrun":  # torchrun sets both itself
        if "MASTER_ADDR" not in os.environ:
            if info.local_world_size != info.world_size:  # several nodes: rank 0's must be named
                launcher = {"slurm": "srun", "mpi": "mpirun"}[info.launcher]
                stop(info, f"Launched by {launcher} with {info.world_size} tasks on several "
                     "nodes, but MASTER_ADDR is not set. Export rank 0's host before the launch, "
                     f"e.g. in an sbatch script: {_SCONTROL}")
            os.environ["MASTER_ADDR"] = "127.0.0.1"  # every rank is on this node
        os.environ.setdefault("MASTER_PORT", str(default_port()))
    elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" \
            and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0:
        _fresh_store_after_restart(info)
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if info.launcher != "torchrun" and _resolve(addr) is None:
        # Said by rank 0, and by the first rank of every other node: a name can resolve on one
        # node and not on another.
        stop(info, f"MASTER_ADDR={addr} does not resolve on {socket.gethostname()}. Check the "
             f"spelling; it must be rank 0's host name or IP address (in a Slurm job: {_SCONTROL}).",
             everyone=info.local_rank == 0 and info.local_world_size != info.world_size)
    if info.launcher in ("slurm", "mpi", "env"):
        timeout = rendezvous_timeout_s or float(os.environ.get("DPCOURSE_RDZV_TIMEOUT_S", 60))
        _roll_call(info, addr, port, timeout)
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
    timeout = timedelta(seconds=timeout_s or float(os.environ.get("DPCOURSE_TIMEOUT_S", DEFAULT_TIMEOUT_S)))
    dist.init_process_group(env.backend, rank=env.rank, world_size=env.world_size, timeout=timeout)
    return env


def cleanup() -> None:
    """End the process group (safe to call when there is none)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _ROLL_CALL.clear()


def _all_ok(ok: bool) -> bool:
    """Every rank says whether it is fine; all learn whether everyone is."""
    backend = dist.get_backend()
    dev = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
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
