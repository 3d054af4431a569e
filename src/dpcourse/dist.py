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

import os
import re
import socket
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
    """Read rank, local rank and world size from the variables of the launcher that started us.

    Order: torchrun → horovodrun (gloo) → ``mpirun`` → an ``srun`` job step → one process. The innermost launcher
    wins: torchrun runs inside srun steps, and ``mpirun`` inside an sbatch job or an srun step
    starts its ranks through Slurm's helper steps, whose SLURM_* variables describe mpirun's
    daemons, not the MPI ranks. The batch script of an sbatch job has SLURM_PROCID but no
    SLURM_STEP_ID: that is one process.
    """
    e = os.environ if environ is None else environ
    if "RANK" in e and "WORLD_SIZE" in e:
        world = int(e["WORLD_SIZE"])
        return DistEnv(int(e["RANK"]), int(e.get("LOCAL_RANK", 0)), world,
                       int(e.get("LOCAL_WORLD_SIZE", world)), "torchrun")
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


def _gpus_for(local_world_size: int) -> bool:
    """True when this node has a GPU for each of its processes (NCCL needs one GPU per rank)."""
    return torch.cuda.is_available() and local_world_size <= torch.cuda.device_count()


def choose_backend(backend: str = "auto", device: str = "auto", local_world_size: int = 1) -> str:
    """NCCL when we train on GPUs (one per process), gloo on the CPU; NCCL without a GPU for
    each process on this node is refused with a fix."""
    if backend not in ("auto", "gloo", "nccl", "mpi"):
        raise CourseError(f"Unknown backend {backend!r}: use auto, gloo or nccl.")
    cuda = torch.cuda.is_available() and device != "cpu"
    if backend == "auto":  # more processes than GPUs (2 ranks on a laptop's 1 GPU): the CPU
        return "nccl" if cuda and _gpus_for(local_world_size) and dist.is_nccl_available() else "gloo"
    if backend == "nccl" and not cuda:
        why = "this process sees no GPU" if not torch.cuda.is_available() else "--device cpu was asked for"
        raise CourseError(
            f"NCCL needs a GPU, and {why}. On a CPU node use --backend gloo (or --backend auto); "
            "on a GPU node check `nvidia-smi` and that the job asked for GPUs (--gpus-per-node).")
    if backend == "nccl" and not _gpus_for(local_world_size):
        raise CourseError(
            f"NCCL needs one GPU per process: this node runs {local_world_size} processes and has "
            f"{torch.cuda.device_count()} GPU(s). Start at most {torch.cuda.device_count()} per node "
            "(--nproc-per-node, --ntasks-per-node), or use --backend gloo.")
    if backend == "mpi" and not dist.is_mpi_available():
        raise CourseError("This PyTorch build has no MPI backend: use --backend gloo or nccl.")
    return backend


def choose_device(backend: str, local_rank: int = 0, device: str = "auto",
                  local_world_size: int = 1) -> torch.device:
    """One GPU per process (cuda:LOCAL_RANK) with NCCL, or when asked; else the CPU. ``auto``
    takes the GPU only when every process on this node can have one of its own."""
    if device == "cuda" and not torch.cuda.is_available():
        raise CourseError("--device cuda was asked for, but this process sees no GPU: use --device cpu.")
    if backend == "nccl" or device == "cuda" or (device == "auto" and _gpus_for(local_world_size)):
        if torch.cuda.is_available():
            return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


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


def _explain_lost_peer(kind, err, tb, fallback=sys.excepthook) -> None:
    """sys.excepthook of a rank in a group: a collective whose peer died is one line, not a traceback;
    so is an unfinished exercise of a learner's lab, which every rank meets alike: rank 0 says it.

    (torch's own hook, installed by init_process_group around this one, adds the "[rankN]:" tag.)
    """
    text = str(err)
    if isinstance(err, NotImplementedError) and text.startswith("Exercise:") \
            and not os.environ.get("DPCOURSE_TRACEBACK"):
        if env_info().rank != 0:  # rank 0 says it; if it is busy elsewhere for a few seconds more, this rank does
            time.sleep(3.0)
        where = traceback.extract_tb(tb)[-1]
        try:
            path = os.path.relpath(where.filename)
        except ValueError:
            path = where.filename
        print(f'File "{path}", line {where.lineno}, in {where.name}: {text}. This exercise of the lab is '
              "not done yet: complete it (its notebook's check says when it is right), or run the "
              "complete lab in solutions/labs/.", file=sys.stderr, flush=True)
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
    that the address resolves, and under srun and mpirun makes every rank report to rank 0
    first, so a rank that never started is named within ``rendezvous_timeout_s`` (default
    60 s, or $DPCOURSE_RDZV_TIMEOUT_S). Each problem ends in one line saying what to do.
    """
    info = env_info()
    try:
        backend = choose_backend(backend, device, info.local_world_size)
        dev = choose_device(backend, info.local_rank, device, info.local_world_size)
    except CourseError as err:  # every rank asked for the same thing: rank 0 says it
        stop(info, err.message)
    if info.world_size > 1:
        explain_errors()
    if info.launcher == "none":  # one process: a private group on this machine
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(free_port())
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
    if info.launcher in ("slurm", "mpi"):
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
