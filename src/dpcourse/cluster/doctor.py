"""Is this machine, or this job, ready for the course? One verdict a line: ok, warning or problem.

    python -m dpcourse.cluster.doctor  # this machine; starts 2 processes for an all_reduce
    python -m dpcourse.cluster.doctor --backend nccl  # as a GPU lab would run
    sbatch slurm/doctor.sbatch                # every rank of a job takes part; rank 0 reports
    # in an allocation (several nodes: export MASTER_ADDR)
    srun -N1 -n2 python -m dpcourse.cluster.doctor
    torchrun --standalone --nproc-per-node 2 -m dpcourse.cluster.doctor
    mpirun -np 2 python -m dpcourse.cluster.doctor

It checks torch, CUDA and NCCL; the GPUs against the processes on this node; the backends; the
network interfaces and NCCL_SOCKET_IFNAME/GLOO_SOCKET_IFNAME; MASTER_ADDR and MASTER_PORT; each
rank's launcher variables; FashionMNIST in the data root; and one all_reduce. A warning or a
problem says what to do. Every network step has a timeout, and the whole check ends within
2 × --timeout + 15 s (35 s). Exit status 1 when a problem was found (warnings alone: 0). It never
downloads anything.
"""
from __future__ import annotations

import argparse
import fcntl
import json
import os
import platform
import re
import socket
import struct
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from dpcourse.lab import data, rendezvous, world
from dpcourse.lab.errors import CourseError

OK, WARNING, PROBLEM = "ok", "warning", "problem"
SHOWN = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
         "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_STEP_NUM_TASKS",
         "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE",
         "CUDA_VISIBLE_DEVICES")
NODE = os.environ.get("SLURMD_NODENAME", socket.gethostname())  # Slurm's name for this node
LAUNCHERS = {"torchrun": "torchrun", "env": "RANK and WORLD_SIZE set by hand", "slurm": "srun",
             "mpi": "mpirun", "horovodrun": "horovodrun"}


# The PyTorch the course is tested with: pyproject.toml's pin
# (tests/test_doctor.py keeps them equal).
TESTED_TORCH = "2.14.1"


def check_torch() -> list:
    release = torch.__version__.split("+")[0]
    # e.g. a site's own PyTorch module or container: said first, then the build
    if release != TESTED_TORCH:
        return [(WARNING, "torch", f"{torch.__version__}, not the {TESTED_TORCH} the course is "
                 f"tested with: some labs call what older releases lack (2.11 has no "
                 "dist.reduce_scatter_single, which notebook 03 uses). Use the course's "
                 "environment: make setup, or the course's container."), *_torch_build()]
    return _torch_build()


def _torch_build() -> list:
    if not torch.version.cuda:
        return [(OK, "torch", f"{torch.__version__}, a CPU-only build (no CUDA, no NCCL): fine on "
                 f"a CPU node")]
    try:
        nccl = "NCCL " + ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:  # noqa: BLE001 - a build without NCCL
        nccl = "no NCCL"
    gpus = "GPUs visible" if torch.cuda.is_available() else "no GPU visible: fine on a CPU node"
    return [(OK, "torch", f"{torch.__version__}, CUDA {torch.version.cuda} build, {nccl}; {gpus}")]


def check_gpus(info: world.DistEnv, backend: str) -> list:
    """What the labs' --device auto (and --device cuda) would take here, and why
    (dist.placement)."""
    visible = f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}"
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    # the device; --backend's own line is check_backends'
    placed = world.placement("auto", "auto", info)
    if placed.note:  # the job holds GPUs that the labs cannot use: --device cuda would fail
        return [(PROBLEM, "GPUs", placed.note)]
    if n == 0:
        return [(OK, "GPUs", f"none visible ({visible}): the labs train on the CPU")]
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(n))
    if placed.device.type != "cuda":
        return [(PROBLEM if backend == "nccl" else WARNING, "GPUs",
                 f"{n} ({names}, {visible}) for {info.local_world_size} processes on this node, "
                 f"which would share them: NCCL needs one GPU per process, and --device auto "
                 f"trains on the CPU. Start at most {n} per node (--nproc-per-node, "
                 "--ntasks-per-node), or give each task its own (srun --gpus-per-task=1).")]
    how = ("bound to this process by the launcher"
           if world.bound_one_each(info.launcher, visible=n) and n < info.local_world_size
           else f"local rank {info.local_rank} of {info.local_world_size}")
    return [(OK, "GPUs", f"{n} ({names}, {visible}); {how}: {placed.device} with {placed.backend}")]


def check_backends(info: world.DistEnv, backend: str) -> tuple[list, str | None]:
    """The backends compiled in, and the one this launch would use (None: none can)."""
    have = ", ".join(f"{b} {'yes' if on else 'no'}"
                     for b, on in world.available_backends().items())
    try:
        chosen = world.choose_backend(backend, "auto", info.local_world_size)
    except CourseError as err:
        if torch.cuda.is_available() and backend == "nccl":  # too few GPUs: the GPUs line says so
            return [(OK, "backends", f"compiled in: {have}")], None
        return [(PROBLEM, "backends", f"--backend {backend}: {err.message}")], None
    return [(OK, "backends", f"compiled in: {have}; --backend {backend} uses {chosen}")], chosen


def _ipv4(name: str) -> str | None:
    """The IPv4 address of interface ``name`` (Linux's SIOCGIFADDR), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            return socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915,
                                                struct.pack("256s", name.encode()[:15]))[20:24])
        except OSError:
            return None


def interfaces() -> dict[str, str | None]:
    return {name: _ipv4(name) for _, name in socket.if_nameindex()}


def _unknown(value: str, names, prefix: bool) -> list[str]:
    """The names in an *_SOCKET_IFNAME value that match no interface
    (NCCL: by prefix, '=' exact)."""
    if value.startswith("^"):  # NCCL: the interfaces *not* to use
        return []
    exact = value.startswith("=") or not prefix
    return [w for w in value.lstrip("=").split(",") if w and
            not any(n == w if exact else n.startswith(w) for n in names)]


def _route(ip: str) -> str | None:
    """The source address this host uses to reach ``ip`` (no packet is sent)."""
    with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((ip, 9))
            return s.getsockname()[0]
        except OSError:
            return None


def check_network(backend: str | None, addr: str | None, ip: str | None) -> list:
    ifaces = interfaces()
    bare = [n for n, a in ifaces.items() if not a]
    lines = [(OK, "network", "interfaces " + ", ".join(f"{n} {a}" for n, a in ifaces.items() if a)
              + (f"; {', '.join(bare)} without IPv4" if bare else ""))]
    for var, lib in (("NCCL_SOCKET_IFNAME", "nccl"), ("GLOO_SOCKET_IFNAME", "gloo")):
        value = os.environ.get(var, "")
        if unknown := _unknown(value, ifaces, prefix=lib == "nccl"):
            lines.append((PROBLEM if backend == lib else WARNING, "network",
                          f"{var}={value}: this host has no interface {', '.join(unknown)}. "
                          f"Set it to one of {', '.join(ifaces)} (the one that reaches "
                          "MASTER_ADDR), or unset it."))
    if ip:
        src = _route(ip)
        via = ("lo" if src and src.startswith("127.")
               else next((n for n, a in ifaces.items() if a == src), "?"))
        chosen = [f"{v}={os.environ[v]}" for v in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
                  if v in os.environ]
        hint = ", ".join(chosen) if chosen else "this host" if via == "lo" else (
            f"if NCCL or gloo picks another interface, export NCCL_SOCKET_IFNAME={via} "
            f"GLOO_SOCKET_IFNAME={via}")
        lines.append((OK, "route", f"MASTER_ADDR {addr} ({ip}) is reached through {via}: {hint}"))
    return lines


def _local(ip: str) -> bool:
    return ip.startswith("127.") or ip == "::1" or ip in interfaces().values()


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's TCPStore does
        try:
            s.bind(("", port))
            return True
        except OSError:
            return False


def check_launch(info: world.DistEnv, given: dict, ip: str | None) -> list:
    """MASTER_ADDR and MASTER_PORT as the launcher gave them (``given``; ``ip``: the address's), and
    whether they can work."""
    addr, port, host = given.get("MASTER_ADDR"), given.get("MASTER_PORT"), socket.gethostname()
    who = f"{LAUNCHERS.get(info.launcher, 'no launcher')}: rank {info.rank} of " \
          f"{info.world_size}, local rank {info.local_rank} of {info.local_world_size}"
    if info.launcher in ("torchrun", "env") and not (addr and port):
        return [(PROBLEM, "launch", rendezvous.BY_HAND)]
    if info.launcher != "torchrun" and not addr and info.local_world_size != info.world_size:
        return [(PROBLEM, "launch", f"{who}, on several nodes, but MASTER_ADDR is not set. Export "
                 f"rank 0's host before the launch, e.g. in an sbatch script: "
                 f"{rendezvous.SCONTROL}")]
    if addr and ip is None:
        return [(PROBLEM, "launch", f"MASTER_ADDR={addr} does not resolve on {host}. Check the "
                 f"spelling; it must be rank 0's host name or IP address (in a Slurm job: "
                 f"{rendezvous.SCONTROL}).")]
    lines = [(OK, "launch", "no launcher: one process (a lab then uses 127.0.0.1 and a free port)"
              if info.launcher == "none" and not (addr or port) else
              f"{who}, MASTER_ADDR={addr or '127.0.0.1 (one node)'} MASTER_PORT="
              + (port or ("unset" if info.launcher == "none"
                          else f"{rendezvous.default_port()} (from the job)")))]
    if info.launcher in ("torchrun", "horovodrun") or info.rank != 0:
        return lines  # torchrun serves its own store on MASTER_PORT; rank 0 serves the others'
    if info.launcher == "none" and not port:
        return lines  # plain `python lab.py` picks a free port itself
    port, ip = int(port or rendezvous.default_port()), ip or "127.0.0.1"
    if not _local(ip):  # rank 0 serves the rendezvous at MASTER_ADDR: it must be this host
        if info.launcher != "none":
            lines.append((PROBLEM, "port", f"MASTER_ADDR={addr} ({ip}) is not this host ({host}), "
                          f"where rank 0 runs: it must name rank 0's host. {rendezvous.SCONTROL}"))
    else:
        lines.append((OK, "port", f"{port} is free on {NODE}") if _port_free(port)
                     else (PROBLEM, "port", rendezvous.port_in_use(addr or "127.0.0.1", port)))
    return lines


def check_data(root: str | None) -> list:
    root = data.default_root(root)
    raw = root / "FashionMNIST" / "raw"
    fetch = f".venv/bin/python -m dpcourse.lab.data fetch --data-root {root}"
    missing = [n for n in data.FILES if not (raw / n).exists()]
    for name in data.FILES:
        try:
            bad = None if name in missing else data.check_file(raw / name, name)
        except OSError as err:
            bad = f"{raw / name} cannot be read ({err.strerror})"
        if bad:
            return [(PROBLEM, "data", f"{bad}. Delete it and stage the data again: "
                     f"rm {raw / name}; {fetch}")]
    if not missing:
        return [(OK, "data", f"FashionMNIST in {raw}: {len(data.FILES)} files, SHA-256 verified")]
    system = Path(os.environ.get("DPCOURSE_SYSTEM_DATA", data.SYSTEM_DIR))
    if all((raw / f"{n}.gz").exists() or (system / f"{n}.gz").exists() for n in missing):
        return [(WARNING, "data", f"FashionMNIST is not staged in {raw} yet, but its .gz files are "
                 f"here: the first lab stages them, or run `make data` ({fetch}) now.")]
    return [(PROBLEM, "data", f"FashionMNIST is missing from {raw} ({len(missing)} of "
             f"{len(data.FILES)} files). Run `make data` ({fetch}) where the internet is reachable "
             f"(on a cluster: on the login node), or point --data-root / DPCOURSE_DATA at a "
             "staged copy.")]


def allreduce_locally(backend: str | None, timeout: float) -> list:
    """Start 2 processes here (``--worker``) that all_reduce over a fresh port."""
    backend = "nccl" if backend == "nccl" and torch.cuda.device_count() >= 2 else "gloo"
    port, start = rendezvous.free_port(), time.perf_counter()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
           "OMP_NUM_THREADS": "1", "DPCOURSE_DOCTOR_BACKEND": backend}
    procs = [subprocess.Popen([sys.executable, "-m", "dpcourse.cluster.doctor", "--worker",
                               "--timeout", str(timeout)],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in (0, 1)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(
                timeout=max(1.0, start + timeout + 10 - time.perf_counter()))[0])
        except subprocess.TimeoutExpired:
            p.kill()
            outs.append(p.communicate()[0] + f"\nno answer within {timeout + 10:g} s")
    where = f"2 local processes, {backend} on 127.0.0.1:{port}"
    result = next((json.loads(line) for line in outs[0].splitlines() if line.startswith("{")), None)
    if all(p.returncode == 0 for p in procs) and result and result["sum"] == 3:
        return [(OK, "all_reduce", f"{where}: 1 + 2 = 3 in {result['seconds']:.3f} s (started and "
                 f"joined in {time.perf_counter() - start:.1f} s)")]
    said = [line.strip() for out in outs for line in out.splitlines() if line.strip()]
    return [(PROBLEM, "all_reduce", f"{where} failed: {said[-1] if said else 'no output'}. Check "
             f"the network lines above (GLOO_SOCKET_IFNAME, the host name's address); a firewall "
             "may block local ports.")]


def worker(timeout: float) -> int:
    """One of the 2 processes ``allreduce_locally`` starts."""
    backend, rank = os.environ["DPCOURSE_DOCTOR_BACKEND"], int(os.environ["RANK"])
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout))
    value, start = torch.tensor([rank + 1.0], device=device), time.perf_counter()
    dist.all_reduce(value)
    seconds = time.perf_counter() - start
    if rank == 0:
        print(json.dumps({"sum": value.item(), "seconds": seconds}), flush=True)
    dist.destroy_process_group()
    return 0


def allreduce_in_job(backend: str, timeout: float, mine: dict) -> tuple[list, list[dict] | None]:
    """Every rank of the job joins one group, all_reduces, and sends ``mine`` to rank 0."""
    try:
        env = world.prepare(backend, "auto", rendezvous_timeout_s=timeout)
        if env.device.type == "cuda":
            torch.cuda.set_device(env.device)
        dist.init_process_group(env.backend, rank=env.rank, world_size=env.world_size,
                                timeout=timedelta(seconds=timeout))
        value, start = torch.tensor([env.rank + 1.0], device=env.device), time.perf_counter()
        dist.all_reduce(value)
        seconds = time.perf_counter() - start
        everyone = [None] * env.world_size
        dist.all_gather_object(everyone, mine)
        dist.destroy_process_group()
    except SystemExit as err:  # CourseError: prepare's one line; a bare exit: rank 0 says why
        return ([(PROBLEM, "all_reduce", re.sub(r"^\[rank \d+\] ", "", str(err)))]
                if err.code != 1 else []), None
    except Exception as err:  # noqa: BLE001 - whatever stopped the all_reduce, the table says it
        return [(PROBLEM, "all_reduce", f"the job's ranks did not complete one all_reduce within "
                 f"{timeout:g} s: {str(err).strip().splitlines()[0][:200]}. Check the route and "
                 f"network lines above.")], None
    w = env.world_size
    nodes = len({m["node"] for m in everyone})
    level = OK if value.item() == w * (w + 1) / 2 else PROBLEM
    return [(level, "all_reduce", f"the job's {w} ranks on {nodes} node(s), {env.backend}: sum of "
             f"ranks + 1 = {value.item():g} in {seconds:.3f} s")], everyone


def rank_line(info: world.DistEnv, given: dict) -> tuple:
    shown = " ".join(f"{k}={v}" for k, v in given.items())
    return (OK, f"rank {info.rank}", f"local rank {info.local_rank} of {info.local_world_size} "
            f"on {NODE}, pid {os.getpid()}: {shown}")


def summary(report: list) -> str:
    """'all ok', '2 problems: port, data', 'no problems, 1 warning: GPUs'."""
    topics: dict[str, list] = {}
    for level, topic, _ in report:
        topics.setdefault(level, []).append(topic)

    def said(level):
        n = len(topics[level])
        return f"{n} {level}{'s' if n > 1 else ''}: {', '.join(dict.fromkeys(topics[level]))}"
    if WARNING not in topics:
        return said(PROBLEM) if PROBLEM in topics else "all ok"
    return (said(PROBLEM) if PROBLEM in topics else "no problems") + ", " + said(WARNING)


def watchdog(seconds: float, rank: int, stage: list) -> None:
    def fire():
        if rank == 0:
            print(f"{PROBLEM:<8}doctor: no answer within {seconds:g} s while {stage[-1]}: a "
                  "network step hangs. Check MASTER_ADDR, the route and the firewall.", flush=True)
        os._exit(1)
    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dpcourse.cluster.doctor",
                                description=__doc__.split("\n")[0])
    p.add_argument("--data-root", default=None, help="folder for FashionMNIST (default: "
                   "$DPCOURSE_DATA or <checkout>/data)")
    p.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"),
                   help="the backend the labs will use")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds for each network step")
    p.add_argument("--skip-allreduce", action="store_true", help="no process group, no all_reduce")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args.timeout)

    info, given = world.env_info(), {k: os.environ[k] for k in SHOWN if k in os.environ}
    stage = ["checking this host"]
    watchdog(2 * args.timeout + 15, info.rank, stage)  # 15 s: starting processes on a busy node
    lines = check_torch() + check_gpus(info, args.backend)
    backend_lines, chosen = check_backends(info, args.backend)
    addr = given.get("MASTER_ADDR")
    ip = rendezvous.resolve(addr, 5) if addr else None
    lines += backend_lines + check_network(chosen, addr, ip)
    launch = check_launch(info, given, ip)
    lines += launch + (check_data(args.data_root) if info.local_rank == 0 else [])
    can_join = chosen is not None and not any(lv == PROBLEM for lv, t, _ in lines
                                              if t in ("launch", "network"))
    mine = {"rank": info.rank, "node": NODE, "lines": lines, "env": rank_line(info, given)}

    everyone, last = [mine], []
    if args.skip_allreduce:
        last = [(OK, "all_reduce", "not run (--skip-allreduce)")]
    elif info.world_size == 1:
        stage.append("2 local processes all_reduce")
        last = allreduce_locally(chosen, args.timeout)
    elif can_join:
        stage.append(f"the job's {info.world_size} ranks form a group and all_reduce")
        last, gathered = allreduce_in_job(args.backend, args.timeout, mine)
        everyone = gathered or everyone
    else:
        last = [(WARNING, "all_reduce",
                 "not tried: the problems above keep the ranks from forming a group")]
    others = [(lv, f"rank {m['rank']}: {t}", x) for m in everyone[1:] for lv, t, x in m["lines"]
              if lv != OK and (lv, t, x) not in lines]
    ranks = [m["env"] for m in everyone] if info.launcher != "none" else []
    report = lines + ranks + others + last
    failed = (any(lv == PROBLEM for m in everyone for lv, *_ in m["lines"])
              or any(lv == PROBLEM for lv, *_ in last))
    if info.rank == 0:
        print(f"dpcourse doctor on {NODE}: Python {platform.python_version()} ({sys.executable}), "
              + (f"{info.world_size} ranks under {LAUNCHERS[info.launcher]}"
                 if info.launcher != "none" else "one process"))
        for level, topic, text in report:
            print(f"{level:<8}{topic}: {text}")
        print(summary(report), flush=True)
    elif len(everyone) == 1 and info.local_rank == 0 and info.local_world_size != info.world_size:
        # no group: the first rank of each other node speaks for it
        for level, topic, text in report:
            if level == PROBLEM:
                print(f"[rank {info.rank}] {level:<8}{topic}: {text}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
