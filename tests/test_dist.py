"""dpcourse.dist: launcher variables, backend choice, and real multi-process runs."""
import json
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest
import torch

from conftest import ROOT, run, torchrun_cmd
from dpcourse import CourseError
from dpcourse.dist import DistEnv, _tasks_per_node, choose_backend, env_info, free_port

HELLO = ROOT / "solutions" / "labs" / "hello.py"


@pytest.mark.parametrize("variables, expected", [
    ({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "2"}, (3, 1, 8, 2, "torchrun")),
    ({"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_STEP_NUM_TASKS": "6", "SLURM_STEP_ID": "0",
      "SLURM_NODEID": "2", "SLURM_STEP_TASKS_PER_NODE": "2(x2),1"}, (5, 1, 6, 1, "slurm")),
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, (2, 0, 4, 2, "mpi")),
    # the batch script of an sbatch job is one process, whatever --ntasks says
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_JOB_ID": "7"}, (0, 0, 1, 1, "none")),
    # torchrun inside an srun step: torchrun's variables win
    ({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "SLURM_PROCID": "0", "SLURM_STEP_ID": "0"},
     (1, 1, 4, 4, "torchrun")),
    ({}, (0, 0, 1, 1, "none")),
])
def test_env_info(variables, expected):
    e = env_info(variables)
    assert (e.rank, e.local_rank, e.world_size, e.local_world_size, e.launcher) == expected


def test_tasks_per_node():
    assert [_tasks_per_node("4(x2),3", i) for i in range(3)] == [4, 4, 3]
    assert _tasks_per_node("2", 0) == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_nccl_without_gpu_is_refused_with_a_fix():
    assert choose_backend("auto") == "gloo"
    with pytest.raises(CourseError, match="NCCL needs a GPU.*--backend gloo"):
        choose_backend("nccl")


def test_hello_two_ranks_under_torchrun(tmp_path):
    log = tmp_path / "log.jsonl"
    result = run(torchrun_cmd(2, HELLO, "--log-json", log))
    assert result.returncode == 0, result.stdout
    assert "hello from rank 0 of 2" in result.stdout and "hello from rank 1 of 2" in result.stdout
    assert result.stdout.count("all_reduce(rank + 1) = 3") == 1  # rank 0 alone prints it
    [record] = [json.loads(line) for line in log.read_text().splitlines()]
    assert record["world_size"] == 2 and record["all_reduce"] == 3.0 and record["launcher"] == "torchrun"


def test_hello_as_plain_python():
    result = run([sys.executable, str(HELLO)])
    assert result.returncode == 0, result.stdout
    assert "hello from rank 0 of 1" in result.stdout


def _start_ranks(world, launcher_env, extra=None):
    """Start `world` plain python processes with srun- or mpirun-style variables, as those launchers would."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**launcher_env(rank, world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), **(extra or {})}
        procs.append(subprocess.Popen([sys.executable, str(HELLO)], cwd=ROOT, text=True,
                                      env={**os.environ, **env},
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    return [(p.wait(timeout=60), p.stdout.read()) for p in procs]


def slurm_vars(rank, world):
    return {"SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), "SLURM_STEP_ID": "0",
            "SLURM_STEP_NUM_TASKS": str(world), "SLURM_NODEID": "0", "SLURM_STEP_TASKS_PER_NODE": str(world)}


def ompi_vars(rank, world):
    return {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_LOCAL_RANK": str(rank),
            "OMPI_COMM_WORLD_SIZE": str(world), "OMPI_COMM_WORLD_LOCAL_SIZE": str(world)}


@pytest.mark.parametrize("launcher_env, name", [(slurm_vars, "slurm"), (ompi_vars, "mpi")])
def test_ranks_from_srun_and_mpirun_variables(launcher_env, name):
    results = _start_ranks(2, launcher_env)  # srun's own variables; the real srun is module 07's
    for code, out in results:
        assert code == 0, out
    assert "hello from rank 1 of 2" in results[1][1]
    assert "all_reduce(rank + 1) = 3" in results[0][1]


@pytest.mark.skipif("MASTER_ADDR" in os.environ, reason="MASTER_ADDR is set in this environment")
def test_multinode_srun_without_master_addr_says_how_to_set_it():
    two_nodes = {**slurm_vars(0, 2), "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}
    result = run([sys.executable, str(HELLO)], env=two_nodes)
    assert result.returncode == 1
    assert "MASTER_ADDR is not set" in result.stdout and "scontrol show hostnames" in result.stdout
    assert "Traceback" not in result.stdout


def test_port_in_use_gives_one_clear_message():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        start = time.perf_counter()
        result = run([sys.executable, str(HELLO)], env={**slurm_vars(0, 1), "MASTER_ADDR": "127.0.0.1",
                                                        "MASTER_PORT": str(port)}, timeout=60)
    assert result.returncode == 1
    assert time.perf_counter() - start < 30
    assert f"Port {port}" in result.stdout and "already in use" in result.stdout and "MASTER_PORT" in result.stdout
    assert "Traceback" not in result.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_nccl_on_cpu_node_under_torchrun_fails_fast_and_clearly():
    start = time.perf_counter()
    result = run(torchrun_cmd(2, HELLO, "--backend", "nccl"), timeout=60)
    assert result.returncode != 0 and time.perf_counter() - start < 30
    assert "NCCL needs a GPU" in result.stdout
    assert f'File "{HELLO}"' not in result.stdout  # no worker tracebacks


def test_rank0_first_runs_rank0_before_the_others(tmp_path, root):
    result = run(torchrun_cmd(2, root / "tests/helpers/rank0_first.py", tmp_path / "order.txt"))
    assert result.returncode == 0, result.stdout
    assert (tmp_path / "order.txt").read_text().split() == ["0", "1"]


def test_dist_env_defaults():
    assert DistEnv().is_rank0 and DistEnv().world_size == 1


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs Open MPI (apt-get install openmpi-bin)")
def test_hello_under_real_mpirun_on_one_node():
    """`mpirun -np 2 python lab.py` as the README writes it: ranks from OMPI_*, no MASTER_ADDR needed."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env["MASTER_PORT"] = str(free_port())
    result = subprocess.run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2",
                             "-x", "MASTER_PORT", "-x", "PATH", "-x", "OMP_NUM_THREADS",
                             sys.executable, str(HELLO)], cwd=ROOT, env=env, text=True, timeout=120,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert result.returncode == 0, result.stdout
    assert "hello from rank 0 of 2" in result.stdout and "hello from rank 1 of 2" in result.stdout
    assert result.stdout.count("all_reduce(rank + 1) = 3") == 1
