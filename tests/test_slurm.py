"""hello.py under a real Slurm (the `slurm` fixture, dpcourse/cluster/localslurm.py): srun on one
node and on two, sbatch; and the hierarchical all-reduce on two real nodes."""
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest

from conftest import AT_ONCE_S, without_torchrun_shutdown_race

pytestmark = pytest.mark.slow
HELLO = "solutions/labs/hello.py"
ALLREDUCE = "src/dpcourse/lab/allreduce.py"


def assert_hello(output: str, world: int = 2) -> None:
    for rank in range(world):
        assert f"hello from rank {rank} of {world}" in output, output
    # Rank 0 alone prints the sum 1 + 2 = 3.
    assert len(re.findall(r"all_reduce\(rank \+ 1\) = 3\b", output)) == 1, output


def test_srun_two_tasks_on_one_node(slurm, monkeypatch):
    # What a torchrun or an outer job left in our environment must not reach the tasks:
    # with these, hello.py would take the torchrun path or look for a master that is not there.
    for name, value in {"RANK": "5", "WORLD_SIZE": "9", "MASTER_ADDR": "no-such-host.invalid",
                        "SLURM_PROCID": "3", "SLURM_STEP_ID": "7"}.items():
        monkeypatch.setenv(name, value)
    done = slurm.srun("-N1", "-n2", slurm.python, HELLO)
    assert done.returncode == 0, done.stdout
    assert_hello(done.stdout)


def test_srun_one_task_on_each_of_two_nodes(slurm):
    done = slurm.srun("-N2", "-n2", slurm.python, HELLO, env={"MASTER_ADDR": "n1"})
    assert done.returncode == 0, done.stdout
    assert_hello(done.stdout)


def test_sbatch_job_on_two_nodes(slurm):
    script = f"""#!/bin/bash
#SBATCH -N2 --ntasks-per-node=1
set -euo pipefail
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_ADDR
srun --label printenv SLURMD_NODENAME
srun {shlex.quote(slurm.python)} {HELLO}
"""
    job = slurm.sbatch(script)
    assert job.returncode == 0, job.log + job.output
    assert "0: n1" in job.output and "1: n2" in job.output, job.output  # one task on each node
    assert_hello(job.output)


# ---- issue 5: what real launchers got wrong -----------------------------------------------
MPIRUN = "mpirun --allow-run-as-root --oversubscribe -x PATH -x OMP_NUM_THREADS"


def one_line(output: str) -> str:
    """The only line a failed launch printed, besides Slurm's own `srun: error:` lines."""
    lines = [line for line in output.splitlines() if line.strip() and not line.startswith("srun: ")]
    assert len(lines) == 1, output
    return lines[0]


def test_mpirun_inside_a_two_node_sbatch_job_forms_one_group(slurm):
    """mpirun's ranks also see the SLURM_* of the steps mpirun starts its daemons in: OMPI_* must
    win."""
    script = f"""#!/bin/bash
#SBATCH -N2 --ntasks-per-node=2
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_ADDR
{MPIRUN} -x MASTER_ADDR -np 4 {shlex.quote(slurm.python)} {HELLO}
"""
    job = slurm.sbatch(script, timeout=120)
    assert job.returncode == 0, job.log + job.output
    for rank in range(4):
        assert f"hello from rank {rank} of 4" in job.output, job.output
    assert job.output.count("all_reduce(rank + 1) = 10") == 1, job.output


def test_mpirun_inside_an_srun_step_forms_one_group(slurm):
    # mpirun starts its daemon on "n1" with a nested srun step; the emulated node's 2 CPUs are
    # the outer step's, so that step must be allowed to overlap it.
    done = slurm.run(
        ["srun", "-N1", "-n1", "-c2", *MPIRUN.split(), "-np", "2", slurm.python, HELLO],
        timeout=120, env={"SLURM_OVERLAP": "1"})
    assert done.returncode == 0, done.stdout
    assert_hello(done.stdout)


def test_two_jobs_on_one_host_at_once_never_join_each_other(slurm):
    """Two single-node `srun -n2` jobs start together (on n1 and n2: one host); no MASTER_PORT."""
    import subprocess

    from dpcourse.cluster.localslurm import ROOT, clean_env
    cmd = ["srun", "-N1", "-n2", slurm.python, HELLO]
    jobs = [subprocess.Popen(cmd, cwd=ROOT, env=clean_env(**slurm.env), text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for _ in range(2)]
    outs = [job.communicate(timeout=120)[0] for job in jobs]
    assert [job.returncode for job in jobs] == [0, 0], outs
    for out in outs:
        assert_hello(out)


def test_unresolvable_master_addr_under_srun_is_one_line_within_seconds(slurm):
    start = time.perf_counter()
    done = slurm.srun("-N1", "-n2", slurm.python, HELLO,
                      env={"MASTER_ADDR": "no-such-node.invalid"})
    assert done.returncode != 0 and time.perf_counter() - start < AT_ONCE_S
    assert one_line(done.stdout).startswith(
        "[rank 0] MASTER_ADDR=no-such-node.invalid does not resolve")


def test_a_task_that_dies_before_setup_is_named_by_rank0(slurm):
    """Task 1 crashes before it reaches the rendezvous; srun without --kill-on-bad-exit lets rank 0
    wait."""
    crash_1 = f'[ "$SLURM_PROCID" = 1 ] && exit 3; exec {shlex.quote(slurm.python)} {HELLO}'
    start = time.perf_counter()
    done = slurm.srun("-N1", "-n2", "bash", "-c", crash_1, env={"DPCOURSE_RDZV_TIMEOUT_S": "4"})
    assert done.returncode != 0 and time.perf_counter() - start < AT_ONCE_S
    line = one_line(done.stdout)
    assert line.startswith("[rank 0] rank 1 of 2 did not join within 4 s") \
        and "--kill-on-bad-exit=1" in line


def test_the_clusters_daemons_end_when_their_starter_is_killed():
    """A notebook's kernel killed (kill -9, or a restart) must not leave slurmd and friends behind:
    the daemons are started with _end_with_parent, as this stand-in daemon is."""
    starter = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time\n"
         "from dpcourse.cluster.localslurm import _end_with_parent\n"
         "d = subprocess.Popen(['sleep', '300'], start_new_session=True, "
         "preexec_fn=_end_with_parent)\n"
         "print(d.pid, flush=True)\ntime.sleep(300)"], stdout=subprocess.PIPE, text=True)
    daemon = int(starter.stdout.readline())
    os.kill(starter.pid, signal.SIGKILL)
    starter.wait()
    deadline = time.monotonic() + 5
    while os.path.exists(f"/proc/{daemon}") \
            and "Z" not in open(f"/proc/{daemon}/stat").read().split()[2]:
        assert time.monotonic() < deadline, "the daemon outlived the process that started it"
        time.sleep(0.1)


# ---------------------------------------------------------------- n1 and n2 in /etc/hosts
def _names(hosts, users):
    """localslurm.node_names on a hosts file of the test's, with a resolver that reads that file."""
    from dpcourse.cluster import localslurm

    def resolves():
        return any(line.split("#")[0].split()[:1] == ["127.0.0.1"]
                   and {"n1", "n2"} <= set(line.split("#")[0].split()[1:])
                   for line in hosts.read_text().splitlines())
    return localslurm.node_names(hosts, users, resolves)


def test_the_node_names_are_in_etc_hosts_only_while_a_cluster_runs(tmp_path):
    """What localslurm.start() does to /etc/hosts, on a copy: the line goes in with the first
    cluster and out with the last, whichever order they stop in, the file byte for byte as before
    (its last line had no newline); a cluster killed before it stopped holds nothing."""
    from dpcourse.cluster.localslurm import HOSTS_LINE

    hosts, users = tmp_path / "hosts", tmp_path / "users"
    before = "127.0.0.1 localhost\n::1 localhost ip6-localhost"
    hosts.write_text(before)
    with _names(hosts, users):
        assert hosts.read_text() == f"{before}\n{HOSTS_LINE}\n"
        with _names(hosts, users):  # a second cluster (a notebook's, beside the tests'): no more
            assert hosts.read_text().count(HOSTS_LINE) == 1
        assert HOSTS_LINE in hosts.read_text(), "taken out while the first cluster still runs"
    assert hosts.read_text() == before
    first, second = _names(hosts, users), _names(hosts, users)
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)  # the first to start stops first
    assert HOSTS_LINE in hosts.read_text(), "taken out while the second cluster still runs"
    second.__exit__(None, None, None)
    assert hosts.read_text() == before
    gone = subprocess.Popen(["true"])
    gone.wait()
    with pytest.raises(KeyboardInterrupt), _names(hosts, users):
        # clusters killed before they could stop: a process gone, and a pid since reused
        (users / f"{gone.pid}-4242-killed").touch()
        (users / f"{os.getpid()}-0-reused").touch()
        raise KeyboardInterrupt  # Ctrl-C in the middle: the line goes all the same
    assert hosts.read_text() == before and not list(users.glob("[0-9]*"))


def test_only_the_clusters_own_line_leaves_etc_hosts(tmp_path):
    """A file edited while the cluster ran keeps every change but the cluster's line; a file whose
    own line named n1 and n2 already is left as it was."""
    hosts, users = tmp_path / "hosts", tmp_path / "users"
    hosts.write_text("127.0.0.1 localhost\n")
    with _names(hosts, users):
        edited = hosts.read_text().replace("localhost", "localhost box") + "10.0.0.7 nfs\n"
        hosts.write_text(edited)
    assert hosts.read_text() == "127.0.0.1 localhost box\n10.0.0.7 nfs\n"
    mine = "127.0.0.1 localhost\n127.0.0.1 n1 n2  # the admin's own\n"
    hosts.write_text(mine)
    with _names(hosts, users):
        assert hosts.read_text() == mine
    assert hosts.read_text() == mine


def test_the_running_cluster_holds_the_node_names(slurm):
    """The session's cluster, started by localslurm.start(), counts among those that need n1 and n2
    (localslurm.node_names): its line stays in /etc/hosts until the cluster stops."""
    from dpcourse.cluster import localslurm

    assert any(localslurm._alive(entry)
               for entry in localslurm.HOSTS_USERS.glob(f"{os.getpid()}-*")), \
        list(localslurm.HOSTS_USERS.iterdir())


def _state(slurm, job_id: str) -> str:
    """squeue's state for the job, or GONE once it has left the queue."""
    shown = slurm.run(["squeue", "--noheader", "--format=%i %T", f"--user={os.getuid()}"],
                      timeout=10).stdout
    return dict(line.split() for line in shown.splitlines()
                if len(line.split()) == 2).get(job_id, "GONE")


def _wait_running(slurm, *job_ids: str) -> None:
    deadline = time.monotonic() + 120  # a cap for a hang: two sleepers start at once
    while any(_state(slurm, j) != "RUNNING" for j in job_ids):
        assert time.monotonic() < deadline, slurm.run(["squeue"]).stdout
        time.sleep(0.3)


def test_on_a_real_cluster_the_course_cancels_only_the_jobs_it_submitted(slurm, tmp_path):
    """What notebook 09 does on a login node (localslurm.Existing): a client that times out cancels
    nothing and says how to look; a clean-up ends the jobs it submitted, never the learner's others
    (here, a job submitted outside it with plain sbatch: their JupyterLab job, say)."""
    from dpcourse.cluster.localslurm import Existing, SlurmTimeout

    sleeper = ["--parsable", "-n1", "--cpus-per-task=1", f"--output={tmp_path}/%j.out",
               "--wrap=sleep 300"]
    foreign = slurm.run(["sbatch", "--job-name=first-job", *sleeper]).stdout.strip().split(";")[0]
    existing = Existing(tmp_path / "out")
    existing.env = dict(slurm.env)  # a login node's Slurm: here, the test cluster's config
    ours = existing.run(["sbatch", "--job-name=first-job", *sleeper]).stdout.strip().split(";")[0]
    assert existing.submitted() == [ours]
    try:
        _wait_running(slurm, foreign, ours)
        # A client that never answers in time (sbatch --wait on a job that sleeps 300 s): one
        # message, no scancel.
        with pytest.raises(SlurmTimeout, match=r"nothing was cancelled.*squeue --me"):
            existing.run(["sbatch", "--wait", *sleeper[1:]], timeout=2)
        assert _state(slurm, foreign) == "RUNNING" and _state(slurm, ours) == "RUNNING"
        # cancel_all on a real cluster: the job it submitted, by id; the foreign one with the same
        # name runs on.
        assert existing.cancel_submitted("first-job") == [ours]
        assert _state(slurm, ours) == "GONE" and _state(slurm, foreign) == "RUNNING"
    finally:
        slurm.cancel_all()  # the test's own cluster: everything on it is the test's


@pytest.mark.parametrize("options, expected", [
    # --gpus-per-node: every task sees the node's 2 GPUs and takes cuda:LOCAL_RANK
    (["--gpus-per-node=2"], [("0,1", "cuda:0"), ("0,1", "cuda:1")]),
    # --gpus-per-task=1: Slurm binds one to each task, which sees it as cuda:0
    (["--gpus-per-task=1"], [("0", "cuda:0"), ("1", "cuda:0")]),
    # --gpus-per-node with --gpu-bind=single:1: one each as well
    (["--gpus-per-node=2", "--gpu-bind=single:1"], [("0", "cuda:0"), ("1", "cuda:0")]),
], ids=["gpus-per-node", "gpus-per-task", "gpu-bind"])
def test_each_task_takes_the_gpu_slurm_bound_to_it(slurm, options, expected):
    """srun -N1 -n2 with each binding mode; each task's CUDA_VISIBLE_DEVICES comes from Slurm, and
    tests/helpers/placement_probe.py prints the device and backend dpcourse.lab.world.placement
    picks."""
    done = slurm.srun("-N1", "-n2", "--cpus-per-task=1", *options, slurm.python,
                      "tests/helpers/placement_probe.py")
    assert done.returncode == 0, done.stdout
    rows = sorted((json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")),
                  key=lambda r: r["rank"])
    assert [(r["visible"], r["device"]) for r in rows] == expected, done.stdout
    assert all(r["backend"] == "nccl" and r["note"] is None for r in rows), rows


def test_a_gpu_job_whose_processes_see_no_gpu_ends_with_one_line(slurm):
    """--gpus-per-node=2 on the test cluster: Slurm hands out its pretend GPUs, CUDA finds none.
    --device cuda (what the GPU templates pass) ends in one line from rank 0 naming the cause; auto
    says it trains on the CPU."""
    start = time.perf_counter()
    done = slurm.srun("-N1", "-n2", "--cpus-per-task=1", "--gpus-per-node=2", slurm.python, HELLO,
                      "--device", "cuda")
    assert done.returncode != 0 and time.perf_counter() - start < AT_ONCE_S, done.stdout
    said = [line for line in done.stdout.splitlines()
            if "--device cuda, but this process sees no GPU" in line]
    assert len(said) == 1 and "CUDA finds none of the GPUs Slurm gave the job" in said[0] \
        and "Traceback" not in done.stdout, done.stdout
    auto = slurm.srun("-N1", "-n2", "--cpus-per-task=1", "--gpus-per-node=2", slurm.python, HELLO)
    assert auto.returncode == 0, auto.stdout
    assert auto.stdout.count("this job holds GPUs here") == 1 \
        and "training on the CPU" in auto.stdout, auto.stdout


def test_the_kept_demo_cluster_takes_the_commands_it_prints_and_stops_on_ctrl_c(slurm, tmp_path):
    """`make slurm-demo KEEP=1` (demo --keep): the cluster stays up and prints the commands to type
    in another shell. Each one, as printed (but tail -f), works against it: sinfo, srun on both
    nodes, the shrunk multi_node.sbatch, squeue --me, the shrunk doctor. Ctrl-C then stops it and
    leaves nothing behind."""
    from conftest import ROOT, end_session
    from dpcourse.cluster.localslurm import clean_env

    said = tmp_path / "demo.out"
    with open(said, "w") as out:
        # started ignoring SIGINT (a background job of a shell without job control): Ctrl-C
        # still stops it
        demo = subprocess.Popen([sys.executable, "-m", "dpcourse.cluster.slurm", "demo", "--keep"],
                                cwd=ROOT, env=clean_env(), stdout=out, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    jobs = []
    try:
        # a cap that ends only a hang: the cluster is up in seconds
        deadline = time.monotonic() + 300
        while "tail -f" not in said.read_text():
            assert demo.poll() is None and time.monotonic() < deadline, said.read_text()
            time.sleep(0.2)
        text = said.read_text()
        block = text[text.index("In another shell"):].split("\n\n")[1]
        commands = [line.strip() for line in block.splitlines()
                    if not line.strip().startswith("tail -f")]
        assert commands[0].startswith("export SLURM_CONF=") and len(commands) == 6, text
        typed = subprocess.run(["bash", "-euc", "\n".join(commands)], cwd=ROOT, env=clean_env(),
                               text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               timeout=120)
        assert typed.returncode == 0, typed.stdout
        jobs = [int(j) for j in re.findall(r"Submitted batch job (\d+)", typed.stdout)]
        job, doctor = jobs
        lines = typed.stdout.splitlines()
        # srun -N2: a task on each
        assert sorted(n for n in lines if n in ("n1", "n2")) == ["n1", "n2"], typed.stdout
        # squeue --me lists the job
        assert any(re.match(rf" +{job} ", line) for line in lines), typed.stdout
        conf = {"SLURM_CONF": commands[0].split("=", 1)[1]}
        # the jobs run: wait for their end
        while subprocess.run(["squeue", "--noheader", f"--jobs={job},{doctor}"],
                             env=clean_env(**conf), text=True, capture_output=True).stdout.strip():
            assert demo.poll() is None and time.monotonic() < deadline, said.read_text()
            time.sleep(1)
        log = (ROOT / f"dpcourse-nodes-{job}.out").read_text()  # the name tail -f is given
        # the clean-up step's messages are elsewhere;
        # torchrun's own end-of-run race is not the course's
        assert "[rank0]:step 20: test accuracy" in log \
            and "error" not in without_torchrun_shutdown_race(log), log
        said_doctor = (ROOT / f"dpcourse-doctor-{doctor}.out").read_text()
        assert said_doctor.rstrip().endswith("\nall ok"), said_doctor
        demo.send_signal(signal.SIGINT)
        assert demo.wait(60) == 0, said.read_text()
        assert said.read_text().rstrip().endswith("cluster stopped")
        assert not os.path.exists(os.path.dirname(conf["SLURM_CONF"])), \
            "the cluster's folder is left behind"
    finally:
        if demo.poll() is None:
            end_session(demo)
        for name, number in zip(("nodes", "doctor"), jobs):
            (ROOT / f"dpcourse-{name}-{number}.out").unlink(missing_ok=True)
            subprocess.run(["rm", "-rf", str(ROOT / "runs" / f"dpcourse-{name}-{number}")])


def test_hierarchical_on_two_slurm_nodes(slurm):
    """srun puts 2 tasks on each of the 2 nodes: the ranks per node come from Slurm itself."""
    done = slurm.srun("-N2", "--ntasks-per-node=2", slurm.python, ALLREDUCE, "check",
                      "--algo", "ring,hierarchical", env={"MASTER_ADDR": "n1"})
    assert done.returncode == 0, done.stdout[-3000:]
    assert "4 ranks (2 node(s) of 2): 40 of 40 cases agree" in done.stdout, done.stdout[-2000:]
