"""dpcourse.cluster.doctor: passes here, names each injected fault with its fix within seconds, and
under torchrun and a real srun reports once, from rank 0, with a line per rank."""
import re
import shutil
import socket
import subprocess
import sys
import time

import pytest
import torch

from conftest import AT_ONCE_S, OFFLINE, ROOT, run, torchrun_cmd
from dpcourse.cluster import doctor
from dpcourse.cluster.localslurm import clean_env

DOCTOR = [sys.executable, "-m", "dpcourse.cluster.doctor"]


def diagnose(*args, env=None, timeout=2 * AT_ONCE_S, launcher=()):
    """Run the doctor (under ``launcher``, else as a plain process), without the launcher variables
    of whatever runs the tests."""
    start = time.perf_counter()
    done = subprocess.run([*launcher, *DOCTOR, *map(str, args)], cwd=ROOT,
                          env=clean_env(**(env or {})), text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, timeout=timeout)
    return done, time.perf_counter() - start


def verdicts(output: str, level: str) -> list[str]:
    return re.findall(rf"^{level} +(.*)$", output, re.M)


def test_the_doctor_passes_here(fashion_root):
    done, _ = diagnose("--data-root", fashion_root)
    assert done.returncode == 0, done.stdout
    assert verdicts(done.stdout, "problem") == [], done.stdout
    assert re.search(r"^ok +all_reduce: 2 local processes, gloo on 127\.0\.0\.1:\d+: 1 \+ 2 = 3 in",
                     done.stdout, re.M)
    assert re.search(r"^ok +data: FashionMNIST in .*SHA-256 verified$", done.stdout, re.M)
    assert done.stdout.splitlines()[0].startswith("dpcourse doctor on ")
    assert re.fullmatch(r"all ok|no problems, .*", done.stdout.splitlines()[-1]), done.stdout


def slurm_task(rank, world, nodes=1):
    return {"SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank % (world // nodes)),
            "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "4242", "SLURM_STEP_NUM_TASKS": str(world),
            "SLURM_NODEID": str(rank * nodes // world),
            "SLURM_STEP_TASKS_PER_NODE": f"{world // nodes}(x{nodes})"}


def fashion_files(raw, truncated):
    """A data root whose FashionMNIST/raw holds one file, cut short."""
    raw.mkdir(parents=True)
    (raw / truncated).write_bytes(b"\0" * 100)
    return raw.parents[1]


# name: (a temporary folder -> (arguments, environment), the problem's topic, words of its fix)
FAULTS = {
    "no data, offline": (
        lambda tmp: ([], {"DPCOURSE_DATA": str(tmp), "DPCOURSE_SYSTEM_DATA": str(tmp), **OFFLINE}),
        "data", ["is missing from", "make data", "dpcourse.lab.data fetch"]),
    "truncated data": (
        lambda tmp: (["--data-root",
                      fashion_files(tmp / "FashionMNIST" / "raw", "t10k-labels-idx1-ubyte")],
                     {"DPCOURSE_SYSTEM_DATA": str(tmp)}),
        "data", ["is truncated", "rm ", "fetch"]),
    "NCCL without a GPU": (lambda tmp: (["--backend", "nccl"], {}), "backends",
                           ["NCCL needs a GPU", "--backend gloo"]),
    "RANK and WORLD_SIZE without MASTER_ADDR": (
        lambda tmp: ([], {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}),
        "launch", ["MASTER_ADDR", "torchrun"]),
    "two nodes without MASTER_ADDR": (
        lambda tmp: ([], slurm_task(0, 2, nodes=2)), "launch",
        ["several nodes, but MASTER_ADDR is not set", "scontrol show hostnames"]),
    "MASTER_ADDR misspelt": (
        lambda tmp: ([], {**slurm_task(0, 2), "MASTER_ADDR": "no-such-node.invalid"}), "launch",
        ["MASTER_ADDR=no-such-node.invalid does not resolve", "rank 0's host"]),
    "GLOO_SOCKET_IFNAME names no interface": (
        lambda tmp: ([], {"GLOO_SOCKET_IFNAME": "nosuch0"}), "network",
        ["GLOO_SOCKET_IFNAME=nosuch0: this host has no interface nosuch0", "lo"]),
}


@pytest.mark.parametrize("fault", FAULTS)
def test_each_fault_is_a_problem_with_its_fix_within_seconds(fault, tmp_path):
    if fault == "NCCL without a GPU" and torch.cuda.is_available():
        pytest.skip("needs a machine without a GPU")
    make, topic, fix = FAULTS[fault]
    args, env = make(tmp_path)
    done, seconds = diagnose(*args, "--skip-allreduce", env=env)
    assert done.returncode == 1 and seconds < AT_ONCE_S, done.stdout
    [problem] = [line for line in verdicts(done.stdout, "problem")
                 if line.startswith(f"{topic}: ")] or [done.stdout]
    assert all(words in problem for words in fix), problem
    assert (done.stdout.splitlines()[-1].startswith("1 problem: " + topic)
            and "Traceback" not in done.stdout)


def test_a_taken_master_port_is_a_problem():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done, seconds = diagnose("--skip-allreduce", env={"MASTER_PORT": str(port)})
    assert done.returncode == 1 and seconds < AT_ONCE_S, done.stdout
    [problem] = verdicts(done.stdout, "problem")
    assert (problem.startswith(f"port: Port {port} on 127.0.0.1 is already in use")
            and "MASTER_PORT" in problem)


def test_a_rank_that_never_comes_is_named_within_the_timeout():
    """Rank 0 of a 2-task srun step whose rank 1 never starts: no hang, one problem naming
    rank 1."""
    done, seconds = diagnose("--timeout", "2", env=slurm_task(0, 2))
    assert done.returncode == 1 and seconds < AT_ONCE_S, done.stdout
    assert any(p.startswith("all_reduce: rank 1 of 2 did not join within 2 s")
               for p in verdicts(done.stdout, "problem")), done.stdout


def test_the_watchdog_ends_a_hung_doctor_with_one_problem():
    code = ("from dpcourse.cluster import doctor; import time; "
            "doctor.watchdog(1, 0, ['a step hangs']); time.sleep(3600)")
    done = run([sys.executable, "-c", code], timeout=2 * AT_ONCE_S)
    assert done.returncode == 1 and done.stdout.startswith(
        "problem doctor: no answer within 1 s while a step hangs")


def test_more_processes_than_gpus(monkeypatch):
    """2 processes on a node with 1 GPU: a problem with NCCL, a warning otherwise; the backends line
    says it once."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "H100")
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    two = doctor.world.DistEnv(1, 1, 2, 2, "torchrun")
    [(level, _, text)] = doctor.check_gpus(two, "nccl")
    assert level == "problem" and "Start at most 1 per node" in text
    assert doctor.check_gpus(two, "auto")[0][0] == "warning"
    [(level, _, text)], chosen = doctor.check_backends(two, "nccl")  # the GPUs line says it
    assert level == "ok" and text.startswith("compiled in: gloo yes, nccl yes") and chosen is None
    one = doctor.world.DistEnv(0, 0, 1, 1, "torchrun")
    assert (doctor.check_gpus(one, "nccl")[0][0] == "ok"
            and doctor.check_backends(one, "auto")[1] == "nccl")


def test_a_torch_other_than_the_tested_one_is_a_warning_that_says_which(monkeypatch):
    """A GPU node's own PyTorch 2.11 ran the notebooks there into calls it lacks: the doctor says so
    first."""
    pin = re.search(r'"torch==([\d.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert doctor.TESTED_TORCH == pin
    monkeypatch.setattr(torch, "__version__", f"{pin}+cu130")
    assert doctor.check_torch()[0][0] == doctor.OK
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    # the warning, then the build's line as before
    (level, topic, said), build = doctor.check_torch()
    assert ((level, topic) == (doctor.WARNING, "torch")
            and said.startswith(f"2.11.0+cu130, not the {pin} the course"))
    assert build[:2] == (doctor.OK, "torch") and build[2].startswith("2.11.0+cu130, ")


def test_summary_line():
    assert doctor.summary([("ok", "torch", "")]) == "all ok"
    assert doctor.summary([("problem", "port", ""), ("warning", "GPUs", ""),
                           ("problem", "data", "")]) == "2 problems: port, data, 1 warning: GPUs"


def assert_one_report(output: str, world: int, names: dict | None = None) -> None:
    """One header, the shared verdicts once, then a line per rank with its launcher's variables."""
    assert (output.count("dpcourse doctor on ") == 1
            and len(verdicts(output, "ok +torch:")) == 1), output
    for rank in range(world):
        [line] = re.findall(rf"^ok +rank {rank}: .*$", output, re.M) or [output]
        for name, value in (names or {}).items():
            assert f"{name}={value(rank)}" in line, line
    assert re.search(rf"^ok +all_reduce: the job's {world} ranks .* "
                     rf"= {world * (world + 1) // 2} in", output, re.M), output


def test_under_torchrun_rank0_reports_for_both(fashion_root):
    done = run(torchrun_cmd(2, "-m", "dpcourse.cluster.doctor", "--data-root", fashion_root),
               timeout=60)
    assert done.returncode == 0, done.stdout
    assert_one_report(done.stdout, 2, {"RANK": str, "LOCAL_RANK": str, "WORLD_SIZE": lambda r: 2})


@pytest.mark.skipif(shutil.which("mpirun") is None,
                    reason="needs Open MPI (apt-get install openmpi-bin)")
def test_under_mpirun_rank0_reports_for_both(fashion_root):
    mpirun = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-x", "PATH",
              "-x", "OMP_NUM_THREADS", "-np", "2"]
    done, _ = diagnose("--data-root", fashion_root, launcher=mpirun)
    assert done.returncode == 0, done.stdout
    assert_one_report(done.stdout, 2,
                      {"OMPI_COMM_WORLD_RANK": str, "OMPI_COMM_WORLD_SIZE": lambda r: 2})


@pytest.mark.slow
def test_under_srun_on_one_node(slurm, fashion_root):
    done = slurm.srun("-N1", "-n2", slurm.python, "-m", "dpcourse.cluster.doctor", "--data-root",
                      fashion_root)
    assert done.returncode == 0, done.stdout
    assert_one_report(done.stdout, 2, {"SLURM_PROCID": str, "SLURM_LOCALID": str,
                                       "SLURM_STEP_NUM_TASKS": lambda r: 2})


@pytest.mark.slow
def test_under_srun_on_two_nodes(slurm, fashion_root):
    done = slurm.srun("-N2", "-n2", slurm.python, "-m", "dpcourse.cluster.doctor", "--data-root",
                      fashion_root, env={"MASTER_ADDR": "n1"})
    assert done.returncode == 0, done.stdout
    assert_one_report(done.stdout, 2, {"SLURM_PROCID": str, "SLURM_NODEID": str,
                                       "SLURM_LOCALID": lambda r: 0})
    assert re.search(r"^ok +rank 0: .* on n1, .*^ok +rank 1: .* on n2, ", done.stdout,
                     re.M | re.S), done.stdout
    assert "2 ranks on 2 node(s)" in done.stdout


@pytest.mark.slow
def test_under_srun_on_two_nodes_without_master_addr(slurm):
    start = time.perf_counter()
    done = slurm.srun("-N2", "-n2", slurm.python, "-m", "dpcourse.cluster.doctor")
    assert done.returncode != 0 and time.perf_counter() - start < AT_ONCE_S, done.stdout
    assert ("scontrol show hostnames" in done.stdout
            and done.stdout.count("dpcourse doctor on ") == 1)


@pytest.mark.slow
def test_the_instructor_guides_doctor_job_runs_as_printed(slurm, fashion_root):
    """docs/instructor.md's week-before step 5, as printed: `sbatch slurm/doctor.sbatch` (shrunk to
    the test cluster's nodes, on their CPUs), and the log it names ends with `all ok` from rank 0
    alone."""
    guide = (ROOT / "docs" / "instructor.md").read_text()
    step = re.search(r"^5\. \*\*The doctor.*?(?=^6\. )", guide, re.M | re.S).group(0)
    command, log_name = re.findall(r"`([^`]+)`", step)[:2]
    assert (command == "sbatch slurm/doctor.sbatch"
            and log_name == "cat dpcourse-doctor-<job id>.out"), step
    # 2 nodes × 2 CPUs, no GPU here
    shrink = ["--ntasks-per-node=2", "--cpus-per-task=1", "--gpus-per-node=0"]
    sbatch, *rest = command.split()
    done = slurm.run([sbatch, "--wait", *shrink, *rest], timeout=240,
                     env={"DATA": str(fashion_root)})
    job = re.search(r"Submitted batch job (\d+)", done.stdout).group(1)
    log = ROOT / log_name.removeprefix("cat ").replace("<job id>", job)
    try:
        said = log.read_text()
        assert done.returncode == 0, said
        assert (said.count("dpcourse doctor on n1: Python") == 1
                and said.rstrip().endswith("\nall ok")), said
        assert len(re.findall(r"^ok +rank \d: local rank \d of 2 on n[12]", said, re.M)) == 4, said
    finally:
        log.unlink(missing_ok=True)
        shutil.rmtree(ROOT / "runs" / f"dpcourse-doctor-{job}", ignore_errors=True)
