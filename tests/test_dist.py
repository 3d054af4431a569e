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
from dpcourse.dist import DistEnv, _tasks_per_node, choose_backend, choose_device, default_port, env_info, free_port

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
    # mpirun inside an srun step or an sbatch job: Slurm's variables describe mpirun's helper
    # step (one task), the OMPI ones the MPI rank; the launcher that started us wins
    ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "SLURM_PROCID": "0", "SLURM_STEP_ID": "0",
      "SLURM_STEP_NUM_TASKS": "1", "SLURM_LOCALID": "0"}, (3, 1, 4, 2, "mpi")),
    # horovodrun --gloo (horovodrun --mpi sets the OMPI ones)
    ({"HOROVOD_RANK": "1", "HOROVOD_SIZE": "2", "HOROVOD_LOCAL_RANK": "1", "HOROVOD_LOCAL_SIZE": "2",
      "HOROVOD_CROSS_RANK": "0"}, (1, 1, 2, 2, "horovodrun")),
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


def test_more_processes_than_gpus_train_on_the_cpu(monkeypatch):
    """2 ranks on a node with 1 GPU: auto picks gloo on the CPU; nccl is refused with the fix."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    assert choose_backend("auto", local_world_size=2) == "gloo"
    assert choose_device("gloo", 1, "auto", local_world_size=2) == torch.device("cpu")
    assert choose_backend("auto", local_world_size=1) == "nccl"
    assert choose_device("nccl", 0, "auto", local_world_size=1) == torch.device("cuda", 0)
    with pytest.raises(CourseError, match="one GPU per process: this node runs 2 processes and has 1 GPU"):
        choose_backend("nccl", local_world_size=2)


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


MPIRUN = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-x", "PATH", "-x", "OMP_NUM_THREADS"]
needs_mpirun = pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs Open MPI (apt-get install openmpi-bin)")


def _mpirun(np, *args):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "SLURM_", "OMPI_", "PMIX_"))}
    return subprocess.Popen([*MPIRUN, "-np", str(np), *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


@needs_mpirun
def test_hello_under_real_mpirun_on_one_node():
    """`mpirun -np 2 python lab.py` as the README writes it: ranks from OMPI_*, no MASTER_ADDR needed."""
    proc = _mpirun(2, sys.executable, str(HELLO))
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out
    assert "hello from rank 0 of 2" in out and "hello from rank 1 of 2" in out
    assert out.count("all_reduce(rank + 1) = 3") == 1


@needs_mpirun
def test_two_real_mpiruns_at_once_each_get_their_own_port():
    """No MASTER_PORT exported: each mpirun job derives its own from its job id."""
    procs = [_mpirun(2, sys.executable, str(HELLO)) for _ in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert all(out.count("all_reduce(rank + 1) = 3") == 1 for out in outs)


# ---- issue 5: the right ranks, a port per job, an address checked, a missing rank named ------
def _launch(ranks, env_of, extra=None, script=HELLO, timeout=60):
    """Start the given ranks at once as plain processes; return [(returncode, output)] and seconds."""
    start = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, str(script)], cwd=ROOT, text=True,
                              env={**_clean_env(), **env_of(rank), **(extra or {})},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for rank in ranks]
    out = [(p.wait(timeout=timeout), p.stdout.read()) for p in procs]
    return out, time.perf_counter() - start


def _clean_env():
    """This process's environment without any launcher's or rendezvous variables."""
    prefixes = ("SLURM_", "OMPI_", "PMIX_", "MASTER_", "RANK", "WORLD_SIZE", "LOCAL_RANK")
    return {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}


def srun_task(job, world, nodes=1):
    """The variables srun gives task `rank` of job `job`'s step 0 (`world` tasks on `nodes` nodes)."""
    per_node = world // nodes
    return lambda rank: {**slurm_vars(rank, world), "SLURM_JOB_ID": str(job), "SLURM_LOCALID": str(rank % per_node),
                         "SLURM_NODEID": str(rank // per_node),
                         "SLURM_STEP_TASKS_PER_NODE": f"{per_node}(x{nodes})" if nodes > 1 else str(world)}


def messages(results):
    """The non-empty lines all ranks printed."""
    return [line for _, out in results for line in out.splitlines() if line.strip()]


def test_default_port_differs_per_job_and_step_and_is_shared_by_its_ranks():
    job = lambda j, step, rank=0: {**slurm_vars(rank, 2), "SLURM_JOB_ID": str(j), "SLURM_STEP_ID": str(step)}
    ports = {default_port(job(j, s)) for j in (4100, 4101, 4102) for s in (0, 1)}
    assert len(ports) == 6 and all(20000 <= p < 30000 for p in ports)
    assert default_port(job(4100, 0, rank=0)) == default_port(job(4100, 0, rank=1))
    mpi = lambda jobid: {**ompi_vars(0, 2), "OMPI_MCA_ess_base_jobid": jobid}
    assert default_port(mpi("1724710913")) != default_port(mpi("1724710914"))


def test_mpirun_inside_a_slurm_step_gets_the_mpi_ranks():
    """Under mpirun inside an srun step each rank also sees the helper step's SLURM_PROCID=0 of 1."""
    helper_step = {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "900",
                   "SLURM_STEP_NUM_TASKS": "1", "SLURM_NODEID": "0", "SLURM_STEP_TASKS_PER_NODE": "1"}
    results, _ = _launch([0, 1], lambda r: {**helper_step, **ompi_vars(r, 2), "OMPI_MCA_ess_base_jobid": "55"})
    assert [code for code, _ in results] == [0, 0], messages(results)
    assert "hello from rank 0 of 2" in results[0][1] and "hello from rank 1 of 2" in results[1][1]
    assert "all_reduce(rank + 1) = 3" in results[0][1]


def test_two_concurrent_jobs_on_one_host_each_get_their_own_group():
    """Two 2-task srun jobs start at the same moment on one host, no MASTER_PORT exported."""
    a, b = srun_task(7301, 2), srun_task(7302, 2)
    results, _ = _launch([0, 1, 2, 3], lambda i: (a if i < 2 else b)(i % 2))
    assert [code for code, _ in results] == [0] * 4, messages(results)
    assert [out.count("all_reduce(rank + 1) = 3") for _, out in results] == [1, 0, 1, 0]
    assert all(out.count(" of 2 ") == 1 for _, out in results)


def test_an_exported_master_port_wins():
    results, _ = _launch([0, 1], srun_task(7303, 2), {"MASTER_PORT": str(free_port())})
    assert [code for code, _ in results] == [0, 0], messages(results)


def test_another_jobs_rendezvous_on_the_same_port_is_named(tmp_path):
    """Job 2's tasks meet job 1's rendezvous on an exported MASTER_PORT: rank 0 cannot serve, rank 1 is told."""
    import torch.distributed as dist
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False, multi_tenant=True)
    store.set("dpcourse/owner", "slurm-1.0")  # job 1's rank 0 serves here
    results, seconds = _launch([0, 1], srun_task(2, 2), {"MASTER_PORT": str(port), "DPCOURSE_RDZV_TIMEOUT_S": "5"})
    assert [code for code, _ in results] == [1, 1] and seconds < 20
    assert messages(results[:1]) == [f"[rank 0] Port {port} on 127.0.0.1 is already in use "
                                     + messages(results[:1])[0].split("already in use ", 1)[1]]
    assert len(messages(results[1:])) == 1 and "another job's rendezvous (slurm-1.0)" in results[1][1]


def test_unresolvable_master_addr_stops_within_seconds_with_one_line():
    results, seconds = _launch([0, 1], srun_task(7304, 2), {"MASTER_ADDR": "no-such-node.invalid"})
    assert [code for code, _ in results] == [1, 1] and seconds < 20
    [line] = messages(results)  # one line, from rank 0, not one per rank
    assert line.startswith("[rank 0] MASTER_ADDR=no-such-node.invalid does not resolve") and "scontrol" in line


def test_a_rank_that_never_starts_is_named_within_the_rendezvous_timeout():
    results, seconds = _launch([0], srun_task(7305, 3), {"DPCOURSE_RDZV_TIMEOUT_S": "3"})  # ranks 1 and 2 never start
    assert results[0][0] == 1 and seconds < 15
    [line] = messages(results)
    assert line.startswith("[rank 0] ranks 1 and 2 of 3 did not join within 3 s") and "--kill-on-bad-exit=1" in line


def test_ranks_whose_rank0_never_starts_say_so_within_the_timeout():
    results, seconds = _launch([1], srun_task(7306, 2), {"DPCOURSE_RDZV_TIMEOUT_S": "3"})
    assert results[0][0] == 1 and seconds < 15
    [line] = messages(results)  # no c10d retry noise, no traceback
    assert line.startswith("[rank 1] could not reach rank 0 at 127.0.0.1:") and "within 3 s" in line


@pytest.mark.skipif("MASTER_ADDR" in os.environ, reason="MASTER_ADDR is set in this environment")
def test_missing_master_addr_is_said_once():
    results, _ = _launch([0, 1], srun_task(7307, 2, nodes=2))
    assert [code for code, _ in results] == [1, 1]
    [line] = messages(results)
    assert line.startswith("[rank 0] Launched by srun with 2 tasks on several nodes, but MASTER_ADDR is not set")
