"""A real two-node Slurm cluster on this one machine: for the tests, notebook 09
and `make slurm-demo`.

munged, slurmctld and two slurmd daemons (nodes n1 and n2, 2 CPUs and 2 pretend GPUs each, both
127.0.0.1, each on its own port) run as root with their config, state, sockets and logs in one
temporary folder. The GPUs are pretend (device files that are /dev/null): `--gpus-per-node=2` is
granted, and Slurm sets SLURM_GPUS_ON_NODE and each task's CUDA_VISIBLE_DEVICES as on a GPU node;
torch finds no GPU behind them, so the GPU templates' processes run on the CPU (``ON_THE_CPU``).
Every Slurm command finds that config through SLURM_CONF in ``Cluster.env``; ``Cluster.run``,
``srun`` and ``sbatch`` set it, and drop the launcher variables (RANK, SLURM_*, ...) of whatever
runs the tests, so that a job sees only what Slurm and the test give it.

    with start() as cluster:                       # the `slurm` fixture in tests/conftest.py
        cluster.srun("-N2", "-n2", "hostname")     # CompletedProcess, stdout+stderr in .stdout
        job = cluster.sbatch("#!/bin/bash\nsrun hostname\n", "-N2")
                                                       # Batch(returncode, output, ...)
"""
from __future__ import annotations

import ctypes
import fcntl
import json
import os
import re
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[3]  # the course checkout (src/dpcourse/cluster/ is 3 below)
NODES = ("n1", "n2")
CPUS = 2  # per node
GPUS = 2  # per node, pretend: Slurm hands them out, torch finds none behind them
# The templates ask for a real node's worth (4 GPUs, 32 CPUs); these sbatch options shrink a job
# to this cluster's nodes, as a learner's own options would.
FIT = ("--gpus-per-node=2", "--cpus-per-task=2")
# The GPU templates pass --device cuda: a job that cannot use its GPUs ends with one message instead
# of training on the CPU. This cluster's GPUs are pretend, so a lab option after the template's
# (the last one wins) puts the processes on the CPU.
ON_THE_CPU = ("--device", "cpu")
DAEMONS = ("munged", "slurmctld", "slurmd")
# Set by an outer launcher (an outer Slurm job, torchrun, mpirun): a job must not inherit them.
LEAKY = re.compile(r"(SLURM_|SBATCH_|SRUN_|SALLOC_|OMPI_|PMIX_|PMI_|TORCHELASTIC_|MASTER_).*"
                   r"|RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|GROUP_RANK|ROLE_RANK")


class Batch(NamedTuple):
    returncode: int  # the job's exit status (sbatch --wait exits with it)
    output: str      # the job's output file (stdout and stderr)
    job_id: int | None
    log: str         # what sbatch itself printed


def unavailable() -> str | None:
    """Why this machine cannot run the cluster, or None if it can."""
    if os.geteuid() != 0:
        return "the local Slurm cluster runs its daemons as root"
    missing = [d for d in (*DAEMONS, "srun", "sbatch", "sinfo") if shutil.which(d) is None
               and not Path("/usr/sbin", d).exists()]
    return (f"not installed: {', '.join(missing)} (apt-get install slurm-wlm munge)"
            if missing else None)


def _exe(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"  # daemons live in /usr/sbin, often not on PATH


def _free_ports(n: int) -> list[int]:
    """n distinct TCP ports that nobody listens on (all held open until all are picked)."""
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def _loopback(name: str) -> bool:
    try:
        return socket.gethostbyname(name).startswith("127.")
    except OSError:
        return False


# n1 and n2 must name this machine (slurmd looks itself up, jobs use MASTER_ADDR=n1). Where they do
# not, the line below goes into /etc/hosts while a cluster runs, and only that line comes out again
# when the last one stops: each running cluster (several processes may run one, a notebook's kernel
# beside the tests) leaves a file named for it in HOSTS_USERS.
HOSTS = Path("/etc/hosts")
HOSTS_USERS = Path("/run/dpcourse-slurm-hosts")
HOSTS_LINE = f"127.0.0.1 {' '.join(NODES)}  # dpcourse test Slurm cluster, while one runs"
ADDED = "added.json"  # in HOSTS_USERS: the line the clusters added, until the last one removes it


def _names_resolve() -> bool:
    return all(map(_loopback, NODES))


def _started_at(pid: int) -> str | None:
    """The process's start time (clock ticks since boot), None if it is gone: with the pid, it
    names one process, even after the pid is reused."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(entry: Path) -> bool:
    pid, started, _ = entry.name.split("-", 2)
    return _started_at(int(pid)) == started


@contextmanager
def node_names(hosts: Path = HOSTS, users: Path = HOSTS_USERS, resolves=_names_resolve):
    """While in this block, n1 and n2 name this machine: if they did not, HOSTS_LINE is added to
    ``hosts``, and taken out again (that line alone, whatever else changed in the file meanwhile)
    when the last cluster that needs it leaves. A process killed before it could leave keeps the
    line there until the next cluster stops."""
    users.mkdir(mode=0o700, exist_ok=True)
    entry = None
    try:
        with _hosts_lock(users):
            fd, name = tempfile.mkstemp(prefix=f"{os.getpid()}-{_started_at(os.getpid())}-",
                                        dir=users)
            os.close(fd)
            entry = Path(name)
            if not resolves():
                print(f"{' and '.join(NODES)} must name this machine: adding to {hosts} while "
                      f"the cluster runs:  {HOSTS_LINE}", file=sys.stderr, flush=True)
                text = hosts.read_text()
                joined = bool(text) and not text.endswith("\n")  # its last line had no newline
                with open(hosts, "a") as f:
                    f.write(("\n" if joined else "") + HOSTS_LINE + "\n")
                (users / ADDED).write_text(json.dumps({"line": HOSTS_LINE, "joined": joined}))
        if not resolves():
            raise RuntimeError(f"{', '.join(NODES)} do not resolve to 127.0.0.1 even with "
                               f"{hosts}'s line for them: check /etc/nsswitch.conf")
        yield
    finally:
        with _hosts_lock(users):
            if entry is not None:
                entry.unlink(missing_ok=True)
            for other in users.glob("[0-9]*-*"):
                if not _alive(other):  # its cluster was killed: it needs the names no more
                    other.unlink(missing_ok=True)
            added = users / ADDED
            if added.exists() and not any(users.glob("[0-9]*-*")):
                _remove_line(hosts, **json.loads(added.read_text()))
                added.unlink()


@contextmanager
def _hosts_lock(users: Path):
    with open(users / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _remove_line(hosts: Path, line: str, joined: bool) -> None:
    """The last line of ``hosts`` that is ``line`` taken out; the file rewritten in place (in a
    container, /etc/hosts is often a bind mount: it cannot be replaced by a rename)."""
    lines = hosts.read_text().splitlines(keepends=True)
    at = next((i for i in range(len(lines) - 1, -1, -1) if lines[i].rstrip("\n") == line), None)
    if at is None:
        return  # someone took it out already
    del lines[at]
    if joined and at == len(lines) and lines:  # it was last: the newline added before it goes too
        lines[-1] = lines[-1].removesuffix("\n")
    with open(hosts, "r+") as f:
        f.write("".join(lines))
        f.truncate()


def clean_env(**extra: str) -> dict[str, str]:
    """os.environ without the launcher variables of whatever runs the tests, plus ``extra``."""
    return {**{k: v for k, v in os.environ.items() if not LEAKY.fullmatch(k)},
            "PYTHONUNBUFFERED": "1", **extra}


class SlurmTimeout(TimeoutError):
    """A Slurm client command (sbatch, squeue, srun) did not answer in time:
    nothing was cancelled."""


class Cluster:
    """The course's own two-node cluster, started by ``start()``: everything on it is ours."""

    # between two squeue/scontrol calls that wait for a job: this cluster is ours alone
    poll_s = 0.5

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.conf = tmp / "slurm.conf"
        # Merged into a subprocess environment. TMPDIR: the jobs' "node-local disk" (env.sh stages
        # the data there) lies in the cluster's folder, and goes when the cluster stops.
        self.env = {"SLURM_CONF": str(self.conf), "TMPDIR": str(tmp / "node-tmp")}
        self.python = sys.executable  # the venv python: jobs import dpcourse from it

    def run(self, cmd: list[str], timeout: float = 60, env: dict | None = None,
            input: str | None = None) -> subprocess.CompletedProcess:
        """Run ``cmd`` in the repo root against this cluster; stdout and stderr merged, as text.
        A job that ``sbatch`` submits is recorded (``submitted``): the only jobs
        ``cancel_submitted`` ever cancels."""
        try:
            done = subprocess.run(cmd, cwd=ROOT,
                                  env=clean_env(**{**self.env, **(env or {})}),  # the caller's win
                                  input=input, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            self.timed_out(cmd, timeout)
            raise
        if cmd and Path(cmd[0]).name == "sbatch" and done.returncode == 0:
            self._record(done.stdout, cmd)
        return done

    def timed_out(self, cmd: list[str], timeout: float) -> None:
        """A client command hung. On the course's own cluster, whatever it left behind is ours: end
        it (a killed srun/sbatch leaves its job running, and the next test needs the nodes)."""
        self.cancel_all()

    # ----------------------------------------------------------- the jobs this object submitted
    @property
    def _ledger(self) -> Path:
        # the id of each job sbatch submitted, one per line
        return self.tmp / ".dpcourse-submitted"

    def _record(self, sbatch_out: str, cmd: list[str]) -> None:
        m = (re.search(r"Submitted batch job (\d+)", sbatch_out)
             or re.match(r"\s*(\d+)(;\S+)?\s*$", sbatch_out))
        if m:
            self._ledger.parent.mkdir(parents=True, exist_ok=True)
            with open(self._ledger, "a") as f:
                f.write(m.group(1) + "\n")

    def submitted(self) -> list[str]:
        """The ids of the jobs this cluster object submitted
        (kept in its folder, across kernels)."""
        return self._ledger.read_text().split() if self._ledger.exists() else []

    def cancel_submitted(self, name: str | None = None, timeout: float = 30) -> list[str]:
        """scancel the jobs this object submitted (those named ``name``, if given) that are still
        queued or running, and wait until they have left the queue; their ids. Never anybody else's
        job, and none of this user's other jobs (their JupyterLab job, another course's run)."""
        def alive() -> list[str]:
            if not (ids := self.submitted()):
                return []
            # This user's jobs, then ours among them
            # (squeue --jobs fails outright on a job that has left)
            shown = self.run(["squeue", "--noheader", "--format=%i %j", f"--user={os.getuid()}"],
                             timeout=timeout)
            rows = [line.split(maxsplit=1) for line in shown.stdout.splitlines()]
            return [row[0] for row in rows
                    if len(row) == 2 and row[0] in ids and name in (None, row[1])]

        ours = alive()
        if ours:
            self.run(["scancel", *ours], timeout=timeout)
        deadline = time.monotonic() + timeout
        while alive():
            if time.monotonic() > deadline:
                raise SlurmTimeout(f"job(s) {', '.join(ours)} still in the queue {timeout:.0f} s "
                                   "after scancel: look with  squeue --me")
            time.sleep(self.poll_s)
        return ours

    def srun(self, *args: str, timeout: float = 120, env: dict | None = None):
        return self.run(["srun", *map(str, args)], timeout, env)

    def sbatch(self, script: str | Path, *options: str, args=(), timeout: float = 60,
               env: dict | None = None) -> Batch:
        """Submit a job and wait for it. ``script`` is a file (Path) or the script's text (str);
        ``options`` go to sbatch, ``args`` to the script (after its name)."""
        cmd = ["sbatch", "--wait", f"--output={self.tmp}/job-%j.out", *map(str, options)]
        if isinstance(script, Path):
            done = self.run([*cmd, str(script), *map(str, args)], timeout, env)
        else:
            done = self.run(cmd, timeout, env, input=script)  # sbatch reads the script from stdin
        m = re.search(r"Submitted batch job (\d+)", done.stdout)
        job_id = int(m.group(1)) if m else None
        return Batch(done.returncode, self.output(job_id) if m else "", job_id, done.stdout)

    def wait(self, job_id: int, timeout: float = 60) -> tuple[str, str]:
        """Wait until slurmctld says job ``job_id`` has ended; its (state, exit code), e.g.
        ("COMPLETED", "0:0").
        ``sbatch --wait`` may return at a requeue (it polls, and can see the first run end):
        this asks for the job's last state instead."""
        deadline = time.monotonic() + timeout
        while True:
            shown = self.run(["scontrol", "show", "job", "--oneliner", str(job_id)],
                             timeout=10).stdout
            state = re.search(r"JobState=(\S+)", shown)
            code = re.search(r" ExitCode=(\S+)", shown)
            if state and state.group(1) in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                            "NODE_FAIL", "OUT_OF_MEMORY"):
                return state.group(1), code.group(1) if code else "?"
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} has not ended after {timeout:.0f} s: "
                                   f"{shown.strip()}")
            time.sleep(self.poll_s)

    def output(self, job_id: int) -> str:
        """A batch job's output file ('' if it has none yet)."""
        path = self.tmp / f"job-{job_id}.out"
        return path.read_text() if path.exists() else ""

    def cancel_all(self) -> None:
        """Every job on the course's own cluster
        (SLURM_CONF points at it, nothing else runs there)."""
        subprocess.run(["scancel", f"--user={os.getuid()}"], env=clean_env(**self.env),
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=10)

    def settle(self, timeout: float = 60) -> None:
        """End whatever is still on the course's own cluster and wait until its queue is empty and
        every node idle, so that the next job starts at once instead of queueing behind a left-over
        one (a cancelled JupyterLab, a sleeper). Raises SlurmTimeout, naming what is left."""
        self.cancel_all()
        deadline = time.monotonic() + timeout
        queue, states = "?", {}
        while True:
            try:
                queue = self.run(["squeue", "--noheader", "--format=%i %j %T"],
                                 timeout=10).stdout.strip()
                states = self.node_states()
            except subprocess.TimeoutExpired:  # a busy slurmctld: ask again
                queue, states = "?", {}
            # "idle*": a node whose last ping went unanswered on a loaded machine is still idle
            if not queue and all(states.get(n, "").rstrip("*~#!%$@^-") == "idle" for n in NODES):
                return
            if time.monotonic() > deadline:
                raise SlurmTimeout(f"the test cluster did not settle within {timeout:g} s: "
                                   f"queue {queue or 'empty'}, nodes {states}\n{self.logs()}")
            time.sleep(0.2)

    def logs(self) -> str:
        """The tail of every daemon's log, for a failure message."""
        return "\n".join(f"--- {p.name}\n"
                         + "\n".join(p.read_text(errors="replace").splitlines()[-15:])
                         for p in sorted(self.tmp.glob("*.log")))

    def node_states(self) -> dict[str, str]:
        done = self.run(["sinfo", "--noheader", "--Node", "--format=%N %t"], timeout=10)
        return dict(line.split() for line in done.stdout.splitlines() if len(line.split()) == 2)


def _write_config(tmp: Path, ctld_port: int, node_ports: list[int]) -> None:
    # slurmctld only starts on the host SlurmctldHost names
    host = socket.gethostname().split(".")[0]
    # RealMemory (MB): what a job's --mem is checked against (not tracked: CR_CPU); 8 GB a node
    nodes = "\n".join(f"NodeName={n} NodeAddr=127.0.0.1 Port={p} CPUs={CPUS} RealMemory=8192 "
                      f"Gres=gpu:{GPUS} State=UNKNOWN" for n, p in zip(NODES, node_ports))
    # Pretend GPUs: slurmd wants a character device per GPU. These are /dev/null's (1, 3): nothing
    # uses them, and they point at no real GPU even on a machine that has some. Given devices, Slurm
    # sets CUDA_VISIBLE_DEVICES for each task as on a real GPU node (--gpus-per-task, --gpu-bind).
    for i in range(GPUS):
        os.mknod(tmp / f"pretend-gpu{i}", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    (tmp / "gres.conf").write_text("AutoDetect=off\n" + "".join(
        f"NodeName={n} Name=gpu File={tmp}/pretend-gpu[0-{GPUS - 1}]\n" for n in NODES))
    (tmp / "slurm.conf").write_text(f"""\
ClusterName=dpcourse
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={tmp}/munge.socket,cred_expire=10
StateSaveLocation={tmp}/state
SlurmdSpoolDir={tmp}/spool-%n
SlurmctldPidFile={tmp}/slurmctld.pid
SlurmdPidFile={tmp}/slurmd-%n.pid
# No cgroups in a container: plain process tracking, no task binding or accounting.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
GresTypes=gpu
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
# A requeued job waits for its BeginTime (cred_expire), and then for the next pass of the main
# scheduling loop: every 60 s by default, every 2 s here.
SchedulerParameters=sched_interval=2
# Trust CPUs=2 even on a machine with fewer cores; a node that was down comes back by itself.
SlurmdParameters=config_overrides
ReturnToService=2
# Refuse a request the cluster can never satisfy (srun -n5) instead of queueing it forever.
EnforcePartLimits=ALL
# sbatch --wait polls every 2 s while MinJobAge/2 <= 2 (else every 8, 32... s); a finished
# job must outlive one poll, so it is kept 3 s.
MinJobAge=3
KillWait=2
InactiveLimit=0
{nodes}
PartitionName=debug Nodes={NODES[0]},{NODES[1]} Default=YES MaxTime=INFINITE State=UP
""")


_LIBC = ctypes.CDLL(None, use_errno=True)  # loaded here: a forked child should not load libraries


def _end_with_parent() -> None:
    """In a daemon, before it starts (Linux): SIGTERM when the process that started it ends, even
    by SIGKILL (a notebook's kernel killed or restarted), so that no daemon outlives its cluster."""
    _LIBC.prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG


@contextmanager
def start(timeout: float = 30):
    """Start munged, slurmctld and a slurmd per node; yield a Cluster once every node is idle."""
    if why := unavailable():
        raise RuntimeError(why)
    with node_names(), _started(timeout) as cluster:
        yield cluster


@contextmanager
def _started(timeout: float):
    tmp = Path(tempfile.mkdtemp(prefix="dpcourse-slurm-"))
    tmp.chmod(0o755)  # munged wants its socket folder reachable by every user
    for sub in ("state", "node-tmp", *(f"spool-{n}" for n in NODES)):
        (tmp / sub).mkdir()
    cluster, procs = Cluster(tmp), []
    try:
        ctld_port, *node_ports = _free_ports(1 + len(NODES))
        _write_config(tmp, ctld_port, node_ports)
        key = tmp / "munge.key"  # our own key: no clash with a system munged, nothing to share
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)

        def daemon(name: str, *args: str) -> None:
            # In the foreground (-F/-D), so that we own its pid; it logs to stderr, to NAME.log.
            # A session of its own: Ctrl-C on pytest reaches pytest,
            # whose teardown stops the daemons.
            with open(tmp / f"{name}{'-' + args[-1] if name == 'slurmd' else ''}.log", "w") as log:
                procs.append(subprocess.Popen([_exe(name), *args], env=clean_env(**cluster.env),
                                              cwd=tmp, stdout=log, stderr=subprocess.STDOUT,
                                              start_new_session=True, preexec_fn=_end_with_parent))

        daemon("munged", "-F", "--force", f"--key-file={key}", f"--socket={tmp}/munge.socket",
               f"--pid-file={tmp}/munged.pid", "--log-file=/dev/null",
               f"--seed-file={tmp}/munged.seed")
        _wait(lambda: (tmp / "munge.socket").exists(), 10,
              "munged did not create its socket", cluster)
        daemon("slurmctld", "-D", "-i")  # -i: ignore state from an earlier run (there is none)
        for node in NODES:
            daemon("slurmd", "-D", "-N", node)
        _wait(lambda: _all_idle(cluster, procs), timeout,
              f"the nodes did not become idle within {timeout:g} s", cluster)
        yield cluster
    finally:
        if procs:
            try:
                cluster.cancel_all()
            except (OSError, subprocess.SubprocessError):
                pass
        for p in reversed(procs):  # slurmds, then slurmctld, then munged
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def _keep_up(cluster: Cluster) -> int:
    """Say how to reach the cluster from another shell, then wait for Ctrl-C or SIGTERM."""
    shrink = (f"{' '.join(FIT)} slurm/multi_node.sbatch --max-steps 20 --eval-every 10 "
              f"{' '.join(ON_THE_CPU)}")
    print(f"""
The cluster stays up until you press Ctrl-C here (or: kill {os.getpid()}). In another shell, \
in {ROOT} (as root):

    export SLURM_CONF={cluster.conf}
    sinfo
    srun -N2 printenv SLURMD_NODENAME
    sbatch {shrink}
    squeue --me --format="%.8i %.20j %.10T %.8M %R"
    tail -f dpcourse-nodes-<job id>.out
    sbatch --ntasks-per-node=2 --cpus-per-task=1 --gpus-per-node=0 slurm/doctor.sbatch

Its nodes (n1, n2) have {CPUS} CPUs and {GPUS} pretend GPUs each, and the templates ask for a \
real node's:
shrink a job to them with {' '.join(FIT)}, and end the lab's options with {' '.join(ON_THE_CPU)}
(torch finds no GPU behind the pretend ones); the doctor, which runs a task per GPU, takes 2 tasks \
per node and
no GPUs. Jobs write their logs (%x-%j.out) and runs/ in this folder; there is no accounting \
(sacct).""",
          flush=True)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM stops it as Ctrl-C does
    try:
        while True:
            signal.pause()
    except KeyboardInterrupt:
        print("\nstopping the cluster (its jobs are cancelled)", flush=True)
    return 0


def _all_idle(cluster: Cluster, procs: list) -> bool:
    if dead := [p.args[0] for p in procs if p.poll() is not None]:
        raise RuntimeError(f"{', '.join(dead)} exited during start-up\n{cluster.logs()}")
    states = cluster.node_states()
    return all(states.get(n) == "idle" for n in NODES)


def _wait(ready, timeout: float, what: str, cluster: Cluster) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}\n{cluster.logs()}")
        time.sleep(0.2)


# ---------------------------------------------------------------- outside the tests
class Existing(Cluster):
    """The Slurm this machine already submits to (a login node). Job logs go to ``out``, which
    must be on a filesystem the compute nodes see; your SBATCH_ACCOUNT, SBATCH_PARTITION and
    SBATCH_RESERVATION are kept."""

    # Every squeue and scontrol is a request to the one controller that all users and all their jobs
    # share: on a real cluster, wait 10 s between two of them.
    poll_s = 10.0

    def __init__(self, out: Path):
        super().__init__(out)
        self.env = {}

    def run(self, cmd, timeout=60, env=None, input=None):
        keep = {k: v for k, v in os.environ.items() if k.startswith("SBATCH_")}
        return super().run(cmd, timeout, {**keep, **(env or {})}, input)

    def timed_out(self, cmd: list[str], timeout: float) -> None:
        """A busy controller, on a cluster shared with others: cancel nothing, say what happened."""
        raise SlurmTimeout(
            f"`{' '.join(map(str, cmd[:2]))} …` got no answer from Slurm within {timeout:.0f} s "
            "(a busy controller); nothing was cancelled. Look at your jobs with  squeue --me  and "
            "cancel one you do not want with  scancel JOBID")

    def cancel_all(self) -> None:
        """On a real cluster, only the jobs this notebook submitted: never the learner's others."""
        self.cancel_submitted()


# the stop() of the cluster for_notebook started last in this process (a kernel)
_NOTEBOOK_STOP = []


def for_notebook(out: Path, timeout: float = 30):
    """(cluster, where, stop) for notebook 09: this machine's two-node Slurm when it can start
    here (root, with slurm-wlm and munge); else the Slurm this machine already submits to (when
    ``sinfo`` answers); else (None, why, a no-op). ``stop()`` stops a cluster started here."""
    while _NOTEBOOK_STOP:  # Run All again: the kernel's earlier cluster goes first
        _NOTEBOOK_STOP.pop()()
    if (why := unavailable()) is None:
        cluster, stop = start_background(timeout)
        _NOTEBOOK_STOP.append(stop)
        return cluster, "the course's two-node Slurm on this machine (nodes n1, n2)", stop
    if shutil.which("sinfo"):
        probe = subprocess.run(["sinfo", "--noheader", "--format=%P"], capture_output=True,
                               text=True, timeout=30)
        if probe.returncode == 0 and probe.stdout.strip():
            out.mkdir(parents=True, exist_ok=True)
            return (Existing(out), "this machine's own Slurm (partitions: "
                    + ", ".join(probe.stdout.split()) + ")", lambda: None)
        why = ("sinfo does not answer here: "
               + (probe.stderr.strip().splitlines() or ["no Slurm"])[-1])
    return None, why, lambda: None


def start_background(timeout: float = 30) -> tuple[Cluster, callable]:
    """``start()`` for a notebook: the cluster, and the function that stops it (also called when
    Python exits). Cells in between submit jobs to ``cluster``."""
    import atexit

    stack = ExitStack()
    cluster = stack.enter_context(start(timeout))
    atexit.register(stack.close)
    return cluster, stack.close


def demo(lab_args=(), save: Path | None = None, keep: bool = False) -> int:
    """`make slurm-demo`: the two-node cluster, one job of slurm/multi_node.sbatch across both
    nodes (2 pretend GPUs each: 4 processes on this machine's CPUs), its log, then a clean stop.
    ``save``: a folder for the job's output (job.out), rank 0's log.jsonl and the command.
    ``keep`` (`make slurm-demo KEEP=1`): no job; the cluster stays up, for your own sbatch, squeue,
    srun and tail -f in another shell, until Ctrl-C (or SIGTERM) here."""
    # Ctrl-C is how it stops: heard even where it was started ignoring SIGINT (a job started in
    # the background by a shell without job control inherits SIGINT ignored, and so would this)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if why := unavailable():
        print(f"The local Slurm cluster cannot start here: {why}.")
        return 1
    template = ROOT / "slurm" / "multi_node.sbatch"
    args = [*(list(lab_args) or ["--max-steps", "60", "--eval-every", "20",
                                 "--global-batch-size", "64"]), *ON_THE_CPU]
    t0 = time.monotonic()
    with start() as cluster:
        print(f"two-node Slurm up in {time.monotonic() - t0:.1f} s (config in {cluster.tmp}):")
        print(cluster.run(["sinfo", "--Node", "--format=%N %T %c %G"]).stdout.rstrip())
        status = _keep_up(cluster) if keep else _demo_job(cluster, template, args, save)
    print("cluster stopped")
    return status


def _demo_job(cluster: Cluster, template: Path, args: list, save: Path | None) -> int:
    """The demo's job: submitted, waited for, its log printed (and saved)."""
    print(f"$ sbatch --wait {' '.join(FIT)} slurm/multi_node.sbatch {shlex.join(args)}", flush=True)
    t1 = time.monotonic()
    runs = cluster.tmp / "runs"
    job = cluster.sbatch(template, *FIT, args=args, timeout=600, env={"RUNS": str(runs)})
    print(job.output.rstrip())
    print(f"job {job.job_id}: exit status {job.returncode}, {time.monotonic() - t1:.1f} s")
    if save is not None and job.returncode == 0:
        save = Path(save)
        save.mkdir(parents=True, exist_ok=True)
        (save / "job.out").write_text(job.output.replace(str(cluster.tmp), "$TMP"))
        shutil.copy(runs / "log.jsonl", save / "log.jsonl")
        (save / "command.txt").write_text(
            f"sbatch {' '.join(FIT)} slurm/multi_node.sbatch {shlex.join(args)}\n"
            "(made by: sudo .venv/bin/python -m dpcourse.cluster.slurm demo --save DIR)\n")
        print(f"saved the job's output and rank 0's log in {save}")
    return job.returncode
