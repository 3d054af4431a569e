"""Shared fixtures. The suite runs real processes: torchrun, notebooks, the real FashionMNIST."""
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Stable output and fair sharing of the 2 cores between the processes a test starts.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("DPCOURSE_DATA", str(ROOT / "data"))
# The processes the tests start (plain ones, srun's, mpirun's, notebook kernels) keep freed memory
# for the next step, as the course's own launches do (dpcourse.explore.launch.CPU_MALLOC says why).
from dpcourse.explore.launch import CPU_MALLOC  # noqa: E402 - it imports torch: after OMP_NUM_THREADS is set

os.environ.setdefault("GLIBC_TUNABLES", CPU_MALLOC)

# "Within seconds": how long a test lets an error that must come at once take, from the launch to
# the message. Alone, these runs take 2-8 s (Python, torch's import, a launcher); `make test`'s
# other worker can make that 3-5 times as long. The bound catches a hang (c10d's 80-139 s of retries
# for an unknown host, say); each test's message, not the clock, shows which path ended the run.
AT_ONCE_S = 60

# Simulates a machine with no network: every download goes to a closed local port.
OFFLINE = {"http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9",
           "HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9", "no_proxy": ""}


@pytest.fixture(scope="session")
def root() -> Path:
    return ROOT


@pytest.fixture(scope="session")
def fashion_root() -> Path:
    """The checkout's staged, verified FashionMNIST (staged here if `make course` has not yet)."""
    from dpcourse.lab.data import ensure_fashion_mnist

    ensure_fashion_mnist(ROOT / "data")
    return ROOT / "data"


def run(cmd, timeout=120, env=None, cwd=ROOT):
    """Run a command, return CompletedProcess with text output (stdout+stderr merged). Past
    ``timeout``, the command and every process it started in its session (a launcher's workers) are
    killed, so that a failed test leaves nothing running beside the next ones.

    ``python -m dpcourse.lab.torchrun`` (torchrun_cmd) runs as the notebooks run it: torchrun's
    agent in a fork of this process, which has imported torch already, not a new interpreter that
    imports it again (dpcourse.explore.launch._ForkedTorchrun; test_launch shows the two alike).
    The workers are new interpreters either way. DPCOURSE_FORK_LAUNCHER=0: a new interpreter."""
    from dpcourse.explore.launch import _can_fork, _ForkedTorchrun

    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    if _can_fork(cmd):
        # arguments as Popen takes them (paths, numbers)
        proc = _ForkedTorchrun([str(arg) for arg in cmd[3:]], full_env, cwd=cwd)
        said = []
        reader = threading.Thread(target=lambda: said.append(proc.stdout.read()), daemon=True)
        reader.start()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            end_session(proc)
            raise
        finally:
            reader.join(timeout=30)
            proc.stdout.close()
        return subprocess.CompletedProcess(cmd, proc.returncode, "".join(said))
    proc = subprocess.Popen(cmd, cwd=cwd, env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        end_session(proc)
        raise
    finally:
        proc.stdout.close()
    return subprocess.CompletedProcess(cmd, proc.returncode, out)


def end_session(proc: subprocess.Popen) -> None:
    """End a process started with start_new_session=True and what it started: SIGTERM to its session
    first (torchrun's agent then ends its workers, each in a session of its own), SIGKILL after
    15 s."""
    for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(grace)
            break
        except subprocess.TimeoutExpired:
            continue
    proc.wait()


# The launchers' own log lines (torchrun's agent, c10d): "W1126 07:12:03.527000 ..." (level, month,
# day, time).
LAUNCHER_LOG = re.compile(r"^[WEI]\d{4} \d\d:\d\d:\d\d", re.M)


# torchrun across nodes, at the very end: after their exit barrier, the agents each mark the c10d
# rendezvous closed in the store that the endpoint node's agent keeps; when that agent has exited
# first, the others warn that they "failed to shutdown the rendezvous", under a C++ warning with its
# stack (torch's dynamic_rendezvous.py, DynamicRendezvousHandler.shutdown, called by
# launcher/api.py). Training and the job have finished by then: these lines, and only these, are
# taken out of a log that must otherwise hold no error.
_SHUTDOWN_RACE = re.compile(r"^(\[W\d{4} [\d:.]+ TCPStore\.cpp:\d+\] .*recvVector failed.*"
                            r"|Exception raised from recvBytes .*"
                            r"|frame #\d+: .*|<omitting python frames>"
                            r"|W\d{4} [\d:.]+ \d+ .*dynamic_rendezvous\.py:\d+\] The node "
                            r"'[^']+' has failed to shutdown the rendezvous '[^']+' "
                            r"due to an error of type RendezvousConnectionError\.)\n",
                            re.M)


def without_torchrun_shutdown_race(log: str) -> str:
    """``log`` without torchrun's end-of-run rendezvous shutdown warning (above),
    if it holds one."""
    if "has failed to shutdown the rendezvous" not in log:
        return log
    return _SHUTDOWN_RACE.sub("", log)


def ranks_part(output: str) -> str:
    """What the ranks printed: the lines after the launcher's opening log lines (a banner) and
    before its next one (its report of a failure)."""
    lines = output.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if not LAUNCHER_LOG.match(line)), len(lines))
    end = next((i for i in range(start, len(lines)) if LAUNCHER_LOG.match(lines[i])), len(lines))
    return "".join(lines[start:end])


def torchrun_cmd(nproc, script, *args):
    """torchrun as dpcourse.explore.launch starts it (dpcourse/lab/torchrun.py: torch's torchrun,
    without the agent's teardown); test_fashion_ddp's restart test runs
    `python -m torch.distributed.run` itself."""
    return [sys.executable, "-m", "dpcourse.lab.torchrun", "--standalone",
            f"--nproc-per-node={nproc}", str(script), *map(str, args)]


def lab_cmd(nproc, script, *args):
    """torchrun for several processes; plain python for one (every lab's one-process mode), which
    spares the launcher's own process and its import of torch."""
    if nproc == 1:
        return [sys.executable, str(script), *map(str, args)]
    return torchrun_cmd(nproc, script, *args)


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """{'folders': root, 'shards': root}: the default tree of make-imagefolder, and its shards
    (the ImageNet lab's data in tests/test_imagenet.py and tests/test_imagenet_slurm.py)."""
    top = tmp_path_factory.mktemp("imagenet")
    made = run([ROOT / ".venv/bin/python", "-m", "dpcourse.lab.data", "make-imagefolder",
                top / "folders"])
    assert made.returncode == 0 and "10 classes" in made.stdout, made.stdout
    packed = run([ROOT / ".venv/bin/python", "-m", "dpcourse.lab.data", "make-shards",
                  top / "folders", top / "shards", "--shard-size", "50"])
    assert packed.returncode == 0, packed.stdout
    return {"folders": top / "folders", "shards": top / "shards"}


@pytest.fixture(scope="session")
def slurm_cluster():
    """A real two-node Slurm cluster (nodes n1, n2) on this machine;
    see dpcourse/cluster/localslurm.py.

    Skipped where it cannot run (not root, Slurm or munge not installed), except in CI
    (CI=true), which installs them: there a skip would hide a broken harness, so it fails.
    """
    from dpcourse.cluster import localslurm as harness

    if why := harness.unavailable():
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI needs the local Slurm cluster: {why}", pytrace=False)
        pytest.skip(f"no local Slurm cluster: {why}")
    with harness.start(timeout=120) as cluster:  # nodes idle in seconds; a cap for a hang
        yield cluster


@pytest.fixture
def slurm(slurm_cluster):
    """The session's cluster, left empty and idle after each test (Cluster.settle): a job one test
    leaves behind never delays the next test's."""
    yield slurm_cluster
    slurm_cluster.settle()
