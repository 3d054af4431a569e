"""The rendezvous before ``init_process_group``: the port, the address, the roll call, a restart.

``prepare()`` in dpcourse.lab.world calls these. Each problem a learner meets here (a port in use,
an address that does not resolve, a rank that never came, another job's rendezvous, a torchrun
restart's stale store) ends in one line that says what to do, instead of torch's long wait.
"""
from __future__ import annotations

import os
import socket
import threading
import time
import zlib
from datetime import timedelta

import torch.distributed as dist

from dpcourse.lab.errors import CourseError
from dpcourse.lab.whoami import DistEnv, env_info, job_token


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

def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]

def resolve(host: str, seconds: float = 10.0) -> str | None:
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

def ranks_text(ranks: list[int]) -> str:
    """'1', '1 and 3', '1, 2 and 5', or the first few of a long list."""
    words = [str(r) for r in ranks[:6]] + ([f"… ({len(ranks)} in all)"] if len(ranks) > 6 else [])
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]

def port_in_use(addr: str, port: int) -> str:
    return (f"Port {port} on {addr} is already in use (another job, or a run that has not ended). "
            "Set MASTER_PORT to a free port, e.g. export MASTER_PORT=$(python -c 'from "
            "dpcourse.lab.rendezvous import free_port; print(free_port())'), or use torchrun "
            "--standalone, which picks one.")

def wait_until_listening(addr: str, port: int, timeout_s: float) -> None:
    """Return once something accepts connections at addr:port; raise TimeoutError after
    timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(
                (addr, port), timeout=max(0.1, min(2.0, deadline - time.monotonic()))).close()
            return
        except OSError:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"nothing listens at {addr}:{port}") from None
            time.sleep(0.2)

BY_HAND = ("RANK and WORLD_SIZE are set, as torchrun sets them, but MASTER_ADDR or MASTER_PORT is "
           "not. Start the program with torchrun (it sets all four), or export "
           "MASTER_ADDR=<rank 0's host> and MASTER_PORT=<a free port> for every rank; if RANK and "
           "WORLD_SIZE are left over in this shell, unset them.")

ROLL_CALL: list = []

# rank 0's store: init_process_group's env:// rendezvous serves on it too
SCONTROL = 'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)'

def roll_call(info: DistEnv, addr: str, port: int, timeout_s: float) -> None:
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
                raise CourseError(f"[rank 0] {port_in_use(addr, port)}") from None
            raise CourseError(f"[rank 0] could not serve the rendezvous at {where}: "
                              f"{str(err).splitlines()[0]}") from None
        ROLL_CALL.append(store)
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
                f"[rank 0] rank{'s' if len(missing) > 1 else ''} {ranks_text(missing)} of "
                f"{info.world_size} did not join within {timeout_s:g} s "
                f"(rank 0 waited at {where}). "
                "Usual causes: those tasks crashed before set-up (read their output above), "
                "the world size is wrong (more tasks asked for than started), or a firewall "
                "blocks the port. Under srun, add --kill-on-bad-exit=1 so one failed task ends "
                "the whole step.")
        return
    try:
        wait_until_listening(addr, port, timeout_s)  # quietly: torch's own retries print pages
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

def fresh_store_after_restart(info: DistEnv) -> None:
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
