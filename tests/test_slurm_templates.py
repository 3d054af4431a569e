"""The sbatch templates of slurm/: shellcheck-clean, dry runs that add up (and name what does not),
and every template submitted to a real two-node Slurm (the `slurm` fixture,
dpcourse/cluster/localslurm.py): across both nodes, failing fast when a rank dies, resuming after a
requeue."""
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from conftest import AT_ONCE_S, ROOT, run
from dpcourse.cluster import localslurm
from dpcourse.cluster.slurm import Job, analyse, describe, directives, dry_run, job_from
from dpcourse.lab import images
from dpcourse.lab.data import ensure_fashion_mnist
from dpcourse.lab.errors import CourseError
from dpcourse.lab.metrics import read_log

SLURM_DIR = ROOT / "slurm"
TEMPLATES = sorted(p.name for p in SLURM_DIR.glob("*.sbatch"))
# The test cluster's nodes: 2 CPUs and 2 (pretend) GPUs each; FIT shrinks a job to them.
FIT = list(localslurm.FIT)
SHORT = ["--max-steps", "30", "--eval-every", "15", "--global-batch-size", "64"]


def test_templates_are_shellcheck_clean():
    if shutil.which("shellcheck") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI installs shellcheck (.ci/run): it is missing")
        pytest.skip("shellcheck is not installed (apt-get install shellcheck)")
    jobs = [*(f"slurm/{t}" for t in TEMPLATES), "slurm/env.sh", "slurm/delete_at_end.sh",
            *(str(p.relative_to(ROOT)) for p in (ROOT / "solutions" / "labs").glob("*.sbatch"))]
    # from the course folder, where `source slurm/env.sh` points
    done = run(["shellcheck", "-x", *jobs])
    assert done.returncode == 0, done.stdout


def test_every_template_sets_the_basics():
    for name in TEMPLATES:
        text = (SLURM_DIR / name).read_text()
        assert "set -euo pipefail" in text and "source " in text and "slurm/env.sh" in text, name
        assert all("--kill-on-bad-exit=1" in line
                   for line in text.splitlines() if line.startswith("srun ")), name
        for what in ("--account", "--partition", "--reservation", "--time"):
            assert re.search(rf"^#+SBATCH {what}=.*EDIT", text, re.M), \
                f"{name}: no {what} line to EDIT"
        # what some sites ask for, switched off until a '#' is deleted: memory (per GPU or per
        # node; a CPU job: per node), a node feature, a QOS; the same set in every template
        for what in ("--mem(-per-gpu)?", "--constraint", "--qos"):
            assert re.search(rf"^##SBATCH {what}=EDIT ", text, re.M), \
                f"{name}: no ##SBATCH {what}=EDIT line"
    env = (SLURM_DIR / "env.sh").read_text()
    assert "SRUN_CPUS_PER_TASK" in env and "NCCL_DEBUG" in env and "NCCL_SOCKET_IFNAME" in env
    assert "scontrol show hostnames" in env and "--resume auto" in env


# ---------------------------------------------------------------- dry runs
@pytest.mark.parametrize("name, world, per_node", [
    ("single_node.sbatch", 4, 4), ("multi_node.sbatch", 8, 4), ("task_per_gpu.sbatch", 8, 4),
    ("cpu.sbatch", 4, 2), ("imagenet.sbatch", 8, 4), ("horovod.sbatch", 8, 4)])
def test_dry_run_of_a_template_adds_up(name, world, per_node):
    result = dry_run(SLURM_DIR / name)
    assert result.problems == [], result.report()
    step = result.training
    assert (step.world_size, step.procs_per_node) == (world, per_node), result.report()
    assert "--kill-on-bad-exit=1" in step.argv and str(step.argv[-1]).endswith("log.jsonl")


def test_in_the_container_a_job_sees_every_folder_it_reads(monkeypatch):
    """CONTAINER set: apptainer binds the course, DATA, RUNS, the node-local folder and, for the
    ImageNet template, IMAGENET (outside them, Apptainer binds only $HOME, the current folder and
    /tmp)."""
    monkeypatch.setenv("CONTAINER", "/shared/course/dpcourse.sif")
    monkeypatch.setenv("IMAGENET", "/datasets/imagenet-shards")
    monkeypatch.setenv("DATA", "/datasets/fashion")
    for name, extra in (("multi_node.sbatch", []),
                        ("imagenet.sbatch", ["/datasets/imagenet-shards"])):
        train = next(step.argv for step in dry_run(SLURM_DIR / name, [], []).steps
                     if any(a.endswith("_ddp.py") for a in step.argv))
        assert (train[train.index("apptainer"):train.index("apptainer") + 3]
                == ["apptainer", "exec", "--nv"]), train
        binds = train[train.index("--bind") + 1].split(",")
        assert {str(ROOT), "/datasets/fashion", *extra} <= set(binds), (name, binds)
        assert any(b.startswith(str(ROOT / "runs")) for b in binds), (name, binds)


def test_dry_run_takes_sbatch_options_and_lab_options():
    result = dry_run(SLURM_DIR / "multi_node.sbatch", ["--nodes=3", "--gpus-per-node=2"],
                     ["--epochs", "1"])
    step = result.training
    assert step.world_size == 6 and step.argv[-2:] == ["--epochs", "1"], result.report()
    assert "ranks 0-1 on node001, 2-3 on node002, 4-5 on node003" in result.report()
    assert "--nnodes=3" in step.argv and "--rdzv-endpoint=node001:24242" in step.argv


def test_sbatch_directives_are_read_as_sbatch_reads_them():
    text = ("#!/bin/bash\n#SBATCH --nodes=2   # EDIT\n##SBATCH --account=x\n#SBATCH -c 4\nset -e\n"
            "#SBATCH --nodes=9\n")
    # switched-off lines and lines after a command: ignored
    assert directives(text) == ["--nodes=2", "-c", "4"]
    job = job_from(directives(text), Path("x.sbatch"))
    assert (job.nodes, job.cpus_per_task, job.gpus_per_node) == (2, 4, 0)


WRONG_LAUNCHES = {
    "--nnodes=1": ("multi_node.sbatch", ('--nnodes="$SLURM_NNODES"', "--nnodes=1"),
                   "torchrun --nnodes=1, but srun starts 2"),
    "standalone on every node": ("multi_node.sbatch", ('--nnodes="$SLURM_NNODES"', "--standalone"),
                                 "separate jobs"),
    "a torchrun per GPU": ("multi_node.sbatch", ("srun --kill-on-bad-exit=1",
                                                 "srun --kill-on-bad-exit=1 --ntasks-per-node=4"),
                           "Slurm ignores --ntasks-per-node"),
    "one torchrun per GPU, asked for in the job": (
        "multi_node.sbatch", ("#SBATCH --ntasks-per-node=1 ", "#SBATCH --ntasks-per-node=4 "),
        "4 torchruns per node"),
    # the bug a real Slurm found: a staging step of one task per node inherited the job's 8 tasks
    "staging without --ntasks": ("env.sh", ('srun --ntasks="$SLURM_NNODES" --ntasks-per-node=1',
                                            "srun --ntasks-per-node=1"),
                                 "inherits the job's 8 (SLURM_NTASKS)"),
    "no rendezvous endpoint": ("multi_node.sbatch",
                               ('--rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT"', ""),
                               "--rdzv-endpoint"),
    "more processes than GPUs": ("single_node.sbatch",
                                 ('--nproc-per-node="$NPROC"', "--nproc-per-node=8"),
                                 "8 processes per node but 4 GPU"),
    "fewer processes than GPUs": ("task_per_gpu.sbatch",
                                  ("#SBATCH --ntasks-per-node=4", "#SBATCH --ntasks-per-node=1"),
                                  "3 GPU(s) per node sit idle"),
}


@pytest.mark.parametrize("what", WRONG_LAUNCHES)
def test_dry_run_names_what_does_not_add_up(what, tmp_path):
    name, (old, new), message = WRONG_LAUNCHES[what]
    # the job is submitted from tmp_path: its slurm/env.sh
    shutil.copytree(SLURM_DIR, tmp_path / "slurm")
    changed = tmp_path / "slurm" / name
    text = changed.read_text()
    assert old in text
    changed.write_text(text.replace(old, new))
    wrong = changed if name != "env.sh" else tmp_path / "slurm" / "task_per_gpu.sbatch"
    result = dry_run(wrong, root=tmp_path)
    assert any(message in p for p in result.problems), result.report()
    cli = run([ROOT / ".venv/bin/python", "-m", "dpcourse.cluster.slurm", "dry-run", wrong],
              cwd=tmp_path)
    assert (cli.returncode == 1 and "✗" in cli.stdout
            and "Traceback" not in cli.stdout), cli.stdout


def test_rendezvous_spellings_and_mistakes_in_a_launch_line():
    job = Job("j", nodes=2, tasks_per_node=1, cpus_per_task=2, gpus_per_node=4)
    line = ["--kill-on-bad-exit=1", "/c/.venv/bin/torchrun", "--nnodes=2", "--nproc-per-node=4"]
    right = analyse([*line, "--rdzv_backend", "c10d", "--rdzv_endpoint=node001:20000",
                     "lab.py"], job)
    # torchrun's underscore spellings count too
    assert right.problems == [] and right.world_size == 8
    for rdzv, message in ((["--rdzv-endpoint=node001:20000"],
                           "--rdzv-backend=static (the default)"),
                          (["--rdzv-backend=c10d", "--rdzv-endpoint=localhost:29500"], "loopback"),
                          (["--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:29500"], "loopback"),
                          (["--rdzv-backend=c10d", "--rdzv-endpoint=login1:29500"],
                           "login1 is not a node of this job")):
        wrong = analyse([*line, *rdzv, "lab.py"], job)
        assert any(message in p for p in wrong.problems), (rdzv, wrong.problems)
    alone = analyse(["/c/.venv/bin/torchrun", "--standalone", "--nproc-per-node=4", "lab.py"], job)
    assert describe(alone, job).endswith("2 separate worlds of size 4: "
                                         "ranks 0-3 on node001, 0-3 on node002")
    told = analyse([*line[:2], "--nnodes=2", "--nproc-per-node=2", "lab.py"], Job("j", 4, 1, 2, 2))
    assert ("8 processes, but each torchrun is told of 2 node(s) (a world of 4)"
            in describe(told, Job("j", 4, 1, 2, 2)))


def test_dry_run_names_lost_lab_options_and_the_line_a_script_stopped_at(tmp_path):
    shutil.copytree(SLURM_DIR, tmp_path / "slurm")
    template = tmp_path / "slurm" / "multi_node.sbatch"
    template.write_text(template.read_text().replace('"${LAB_ARGS[@]}" "$@"', '"${LAB_ARGS[@]}"'))
    lost = dry_run(template, lab_args=["--max-steps", "60"], root=tmp_path)
    assert any("(--max-steps 60) do not reach the lab" in p for p in lost.problems), lost.report()
    stops = tmp_path / "slurm" / "stops.sbatch"
    stops.write_text('#!/bin/bash\n#SBATCH --nodes=2\nset -euo pipefail\n'
                     'echo "procs: $SLURM_GPUS_PER_TASK"\n')
    stopped = dry_run(stops, root=tmp_path)
    assert stopped.problems[0].startswith("the script stopped with exit status 1: ") and \
        "SLURM_GPUS_PER_TASK: unbound variable" in stopped.problems[0], stopped.report()


# ---------------------------------------------------------------- the clean-up step, by itself
def _children(pid: int) -> set[int]:
    """The live processes whose parent is ``pid``."""
    found = set()
    for proc in Path("/proc").iterdir():
        try:
            stat = (proc / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after the command's name, which may hold spaces
        if proc.name.isdigit() and fields[0] != "Z" and int(fields[1]) == pid:
            found.add(int(proc.name))
    return found


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def test_the_clean_up_step_deletes_the_folder_and_leaves_nothing_behind(tmp_path):
    """slurm/delete_at_end.sh outside Slurm, with a squeue that says what the test writes. Where
    Slurm tracks a step's processes by parentage (the test cluster's proctrack/linuxproc), a sleep
    the script leaves behind keeps the step's output open: the step, the job and the node stayed
    COMPLETING for a minute (UnkillableStepTimeout), a job's teardown found the node busy. So the
    step's output must reach its end (EOF) as the script exits, and its process group must be empty.
    - SIGTERM to the whole group while the job still RUNS (a preemption's grace time): nothing
      deleted, the step waits on; then, the job ended, SIGTERM to the script alone: the folder and
      its lock are deleted, and the sleep it was waiting on ends with it."""
    bin_dir, state = tmp_path / "bin", tmp_path / "state"
    bin_dir.mkdir()
    (bin_dir / "squeue").write_text(f'#!/bin/sh\ncat "{state}"\n')
    (bin_dir / "squeue").chmod(0o755)
    folder = tmp_path / "node" / "dpcourse-7"
    lock = folder / images.LOCK  # images.stage's, inside the copy
    folder.mkdir(parents=True)
    (folder / "train-images-idx3-ubyte").write_text("data")
    lock.touch()
    state.write_text("RUNNING\n")
    step = subprocess.Popen(["bash", str(SLURM_DIR / "delete_at_end.sh"), "7", str(folder)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True,
                            env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"})

    # the script's sleep: a new one, when asked
    def sleeping(other_than: set[int] = frozenset()) -> set[int]:
        deadline = time.monotonic() + AT_ONCE_S  # a cap only a hang reaches
        while (not (sleeps := _children(step.pid) - other_than) and step.poll() is None
               and time.monotonic() < deadline):
            time.sleep(0.05)
        return sleeps

    try:
        first = sleeping()
        assert first, "the script started no sleep to wait on"
        os.killpg(step.pid, signal.SIGTERM)  # as Slurm signals a step: every process of it
        assert sleeping(first) and step.poll() is None, \
            "a SIGTERM while the job runs ended the step"
        assert folder.exists() and lock.exists(), "a SIGTERM while the job runs deleted the data"
        state.write_text("COMPLETING\n")
        os.kill(step.pid, signal.SIGTERM)  # the script alone: its sleep must not outlive it
        try:
            # reads to EOF: no process holds the output
            output, _ = step.communicate(timeout=AT_ONCE_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the step's output is still open {AT_ONCE_S} s after the script was told "
                        f"to end (script {'alive' if step.poll() is None else 'ended'}): "
                        "a process it started holds it")
        assert step.returncode == 0, output
        assert not folder.exists() and not lock.exists() and not list(folder.parent.iterdir()), \
            list(folder.parent.iterdir())
        deadline = time.monotonic() + AT_ONCE_S  # the script's SIGTERM to its sleep takes a moment
        while _group_alive(step.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _group_alive(step.pid), "a process of the clean-up step outlived it"
    finally:
        if _group_alive(step.pid):
            os.killpg(step.pid, signal.SIGKILL)
        step.wait()


# ---------------------------------------------------------------- node-local data: the job's own
def _another_users(folder: Path) -> Path:
    """``folder``, made as another user (nobody) would make it at a name they can guess: writable by
    all, their file in it as FashionMNIST's."""
    if os.geteuid() != 0:
        if os.environ.get("CI") == "true":
            pytest.fail("CI runs as root, which can make a folder of another user's")
        pytest.skip("only root can make a folder of another user's")
    raw = folder / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    (raw / "train-images-idx3-ubyte").write_text("theirs")
    for path in (folder, *folder.rglob("*")):
        os.chown(path, 65534, 65534)
        path.chmod(0o777)
    return folder


def test_a_node_local_folder_that_is_not_the_users_alone_is_refused(tmp_path, fashion_root):
    """What each node's staging step runs (`fetch --from DATA --data-root LOCAL_DATA`, whose default
    name, /tmp/dpcourse-<job id>, anyone can guess): a folder there that another user made, one of
    the user's own that others can write to, or a link, stops it with one line, nothing read or
    written; where there is none, it makes one of mode 0700 and stages into it. images.stage (the
    ImageNet template's --stage-to) holds its copy to the same rule, and keeps its lock inside."""
    node = tmp_path / "node"
    node.mkdir()
    theirs = _another_users(node / "dpcourse-7")
    done = run([ROOT / ".venv/bin/python", "-m", "dpcourse.lab.data", "fetch", "--from",
                fashion_root, "--data-root", theirs])
    assert (done.returncode == 1 and f"{theirs} is there already and is not yours alone (owned "
            "by nobody (uid 65534))" in done.stdout and "Traceback" not in done.stdout), done.stdout
    planted = theirs / "FashionMNIST" / "raw" / "train-images-idx3-ubyte"
    assert list(planted.parent.iterdir()) == [planted] and planted.read_text() == "theirs"
    loose = node / "dpcourse-8"
    loose.mkdir()
    loose.chmod(0o777)
    link = node / "dpcourse-9"
    link.symlink_to(tmp_path)
    for dest, why in ((loose, r"others can write to it \(mode 777\)"), (link, "a link")):
        with pytest.raises(CourseError, match=f"not yours alone \\({why}\\)"):
            ensure_fashion_mnist(dest, download=False, source=fashion_root)
    assert not list(loose.iterdir()) and not (tmp_path / "FashionMNIST").exists()
    fresh = node / "dpcourse-10"
    ensure_fashion_mnist(fresh, download=False, source=fashion_root)
    assert fresh.stat().st_mode & 0o777 == 0o700
    ensure_fashion_mnist(fresh, download=False, source=fashion_root)  # a requeued run's, its own

    src = tmp_path / "imagenet" / "train"
    src.mkdir(parents=True)
    (src / "shard-000000.tar").write_bytes(b"images")
    with pytest.raises(CourseError, match="not yours alone"):
        images.stage(src.parent, theirs)
    images.stage(src.parent, node / "dpcourse-11")
    assert (node / "dpcourse-11" / "train" / "shard-000000.tar").read_bytes() == b"images"
    assert (node / "dpcourse-11").stat().st_mode & 0o777 == 0o700
    assert (node / "dpcourse-11" / images.LOCK).exists() and not list(node.glob(".*"))


@pytest.mark.slow
def test_a_job_stops_at_a_node_local_folder_another_user_made(slurm, tmp_path):
    """cpu.sbatch on two nodes, with LOCAL_DATA's default name taken by another user before the job
    starts (submitted held, its id known, then released): each node's staging step refuses it, the
    job fails with the line that says whose it is, and its clean-up step leaves the folder, which is
    not the job's, as it was."""
    node = tmp_path / "node"
    node.mkdir()
    submitted = slurm.run(["sbatch", "--parsable", "--hold", f"--output={slurm.tmp}/job-%j.out",
                           str(SLURM_DIR / "cpu.sbatch")],
                          env={"RUNS": str(tmp_path / "runs"), "TMPDIR": str(node)})
    assert submitted.returncode == 0, submitted.stdout
    job_id = int(submitted.stdout.strip().split(";")[0])
    theirs = _another_users(node / f"dpcourse-{job_id}")
    assert slurm.run(["scontrol", "release", str(job_id)]).returncode == 0
    state, _ = slurm.wait(job_id, timeout=180)
    output = slurm.output(job_id)
    assert state == "FAILED", output + slurm.logs()
    assert (f"{theirs} is there already and is not yours alone (owned by nobody (uid 65534))"
            in output and "ready and verified" not in output), output
    deadline = time.monotonic() + 60  # the clean-up steps get their SIGTERM as the job ends
    while _job_processes(job_id) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _job_processes(job_id), _job_processes(job_id)
    assert (theirs / "FashionMNIST" / "raw" / "train-images-idx3-ubyte").read_text() == "theirs"
    assert sorted(p.name for p in node.iterdir()) == [theirs.name]


# ---------------------------------------------------------------- a real Slurm
def final_line(output: str) -> re.Match:
    """Rank 0's last line: 'step N: test accuracy A, test loss L, T s (why)'."""
    return re.search(r"\[rank0\]:\s*step (\d+): test accuracy (0\.\d+)"
                     r"|^0: step (\d+): test accuracy (0\.\d+)", output, re.M)


def submit(slurm, name, tmp_path, *options, args=SHORT, timeout=240, env=None):
    """Submit a template and wait; node-local data goes under tmp_path/node (its $TMPDIR)."""
    runs = tmp_path / "runs"
    (tmp_path / "node").mkdir(exist_ok=True)
    # a GPU template says --device cuda; the test cluster's GPUs are pretend
    if name != "cpu.sbatch":
        args = [*args, *localslurm.ON_THE_CPU]
    t0 = time.monotonic()
    job = slurm.sbatch(SLURM_DIR / name, *options, args=args, timeout=timeout,
                       env={"RUNS": str(runs), "TMPDIR": str(tmp_path / "node"), **(env or {})})
    return job, time.monotonic() - t0, runs


def assert_local_data_deleted(job, tmp_path):
    """The job staged FashionMNIST under tmp_path/node/dpcourse-<job id>, and that folder (and its
    lock file) is gone once the job has ended: the clean-up step deletes it as Slurm ends the job's
    steps."""
    local = tmp_path / "node" / f"dpcourse-{job.job_id}"
    assert f"FashionMNIST ready and verified in {local}/FashionMNIST/raw" in job.output, job.output
    ours = lambda: [p for p in (tmp_path / "node").iterdir()  # noqa: E731 - copy, lock, .deleting
                    if local.name in p.name]
    deadline = time.monotonic() + 60  # the steps' SIGTERM follows the job's end
    while ours() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not ours(), f"left on the node: {ours()}"
    # none outlives the job's steps (the clean-up step's sleep)
    left = lambda: _job_processes(job.job_id)  # noqa: E731
    while left() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left(), f"processes of job {job.job_id} left on the node: {left()}"


def _job_processes(job_id) -> list[str]:
    """The command lines of live processes whose environment holds SLURM_JOB_ID=job_id."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            if proc.name.isdigit() and f"SLURM_JOB_ID={job_id}".encode() in environ and \
                    (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                found.append((proc / "cmdline").read_text().replace("\0", " ").strip())
        except OSError:
            continue
    return found


@pytest.mark.slow
@pytest.mark.parametrize("name, options, world", [
    ("single_node.sbatch", FIT, 2),
    ("multi_node.sbatch", FIT, 4),
    ("task_per_gpu.sbatch", [*FIT, "--ntasks-per-node=2", "--cpus-per-task=1"], 4),
    # cpu.sbatch runs (and is requeued) in test_a_preempted_job_resumes_from_its_last_checkpoint
    # and at a real time limit
])
def test_template_runs_on_a_two_node_slurm(slurm, name, options, world, tmp_path):
    job, seconds, runs = submit(slurm, name, tmp_path, *options)
    assert job.returncode == 0, job.log + job.output
    records = read_log(runs / "log.jsonl")
    done = records[-1]
    assert (done["event"] == "done" and done["world_size"] == world
            and done["step"] == 30), job.output
    assert done["test_images"] == 10_000 and done["replicas_max_diff"] == 0.0
    assert final_line(job.output), job.output  # rank 0's accuracy line is in the job's log
    staged = job.output.count("FashionMNIST ready and verified")
    nodes = 1 if name == "single_node.sbatch" else 2
    assert staged == nodes, job.output  # the data went to node-local disk once per node
    assert (runs / "last.pt").exists()  # the final checkpoint, in the shared folder
    assert_local_data_deleted(job, tmp_path)
    print(f"{name}: world size {world} on {nodes} node(s), {seconds:.1f} s from sbatch to the end")


@pytest.mark.slow
def test_a_failed_job_deletes_its_node_local_data_too(slurm, tmp_path):
    # the lab stops at its options
    job, _, _ = submit(slurm, "cpu.sbatch", tmp_path, args=["--max-steps", "many"])
    assert job.returncode != 0 and "--max-steps: invalid int value" in job.output, job.output
    assert_local_data_deleted(job, tmp_path)


@pytest.mark.slow
def test_without_data_a_job_stages_from_dpcourse_data(slurm, tmp_path, monkeypatch):
    """env.sh's DATA, unset, is DPCOURSE_DATA (what make and the notebooks read): a job whose
    DPCOURSE_DATA holds no FashionMNIST stops at the staging and names that folder. DATA, set, wins
    over it."""
    monkeypatch.delenv("DATA", raising=False)  # the jobs get this environment (sbatch --export=ALL)
    empty = tmp_path / "no-data-here"
    empty.mkdir()
    job, _, _ = submit(slurm, "cpu.sbatch", tmp_path, env={"DPCOURSE_DATA": str(empty)})
    assert (job.returncode != 0
            and f"--from {empty}: no FashionMNIST/raw/ there" in job.output), job.output
    # a training job's first line is env.sh's
    assert job.output.startswith(f"job {job.job_id} on "), job.output
    # the lab stops at its options
    job, _, _ = submit(slurm, "cpu.sbatch", tmp_path, args=["--max-steps", "many"],
                       env={"DPCOURSE_DATA": str(empty), "DATA": str(ROOT / "data")})
    assert ("FashionMNIST ready and verified" in job.output
            and "--max-steps: invalid int value" in job.output), job.output


@pytest.mark.slow
def test_scaling_array_writes_a_study_the_plot_reads(slurm, tmp_path):
    study = tmp_path / "study"
    # weak K=1, 2: two array tasks
    job, seconds, _ = submit(slurm, "scaling_array.sbatch", tmp_path, *FIT, "--array=0-1",
                             args=["--max-steps", "15"], env={"STUDY": str(study), "MODES": "weak"})
    assert job.returncode == 0, job.log
    table = run([".venv/bin/python", "-m", "dpcourse.explore.scaling", "table", study])
    assert table.returncode == 0, table.stdout
    rows = [line.split() for line in table.stdout.splitlines()
            if line.startswith(("strong", "weak"))]
    assert [(r[0], r[1]) for r in rows] == [("weak", "1"), ("weak", "2")], table.stdout
    assert "incomplete" not in table.stdout and "efficiency" in table.stdout
    print(f"scaling_array.sbatch: 2 array tasks, {seconds:.1f} s")


def rank_pid(rank: int, job_marker: str, job: threading.Thread) -> int | None:
    """The pid of the lab process whose RANK is ``rank`` and whose environment holds ``job_marker``,
    looked for while the job (``job``, the thread that waits on it) is still on the cluster: no
    clock, since under the other worker's load a job takes anything from seconds to a minute to
    start its ranks. None if the job ended first."""
    while job.is_alive():
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                env = dict(item.split("=", 1) for item in (proc / "environ").read_text().split("\0")
                           if "=" in item)
                cmd = (proc / "cmdline").read_text()
            except OSError:
                continue
            if "fashion_ddp.py" in cmd and env.get("RUNS") == job_marker and \
                    env.get("RANK", env.get("SLURM_PROCID")) == str(rank) and \
                    "torchrun" not in cmd.split("\0")[0]:
                return int(proc.name)
        time.sleep(0.2)
    return None


@pytest.mark.slow
@pytest.mark.parametrize("name, options", [
    ("multi_node.sbatch", FIT),
    ("task_per_gpu.sbatch", [*FIT, "--ntasks-per-node=2", "--cpus-per-task=1"]),
])
def test_a_dead_rank_ends_the_job_fast(slurm, name, options, tmp_path):
    """Rank 3 (on the second node) is killed mid-training: the job fails long before the collective
    timeout (600 s here) could end it. Under torchrun, its agent ends the node's other process;
    srun --kill-on-bad-exit ends the rest. Structural, not timed: the job's 300 s allowance is half
    the timeout, so a job that ends at all was ended by the launchers; the seconds it took are
    printed."""
    runs = tmp_path / "runs"
    result = {}
    thread = threading.Thread(target=lambda: result.update(job=slurm.sbatch(
        SLURM_DIR / name, *options,
        args=["--epochs", "1", "--timeout", "600", *localslurm.ON_THE_CPU], timeout=300,
        env={"RUNS": str(runs)})))
    thread.start()
    ended_early = lambda what: (f"the job ended before {what}:\n"  # noqa: E731
                                f"{result['job'].output if result else 'sbatch failed'}")
    pid = rank_pid(3, str(runs), thread)
    assert pid, ended_early("a process of rank 3 appeared")
    while (not (runs / "log.jsonl").exists()
           or "epoch_start" not in (runs / "log.jsonl").read_text()):
        assert thread.is_alive(), ended_early("training started")
        time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    # sbatch --wait, at most its 300 s (then it cancels the job, and result stays empty)
    thread.join()
    ended = time.monotonic() - killed
    assert result, f"the job was still running {ended:.0f} s after rank 3 died (cancelled)"
    job = result["job"]
    assert job.returncode != 0, job.output
    assert "done" not in (runs / "log.jsonl").read_text()
    print(f"{name}: rank 3 killed, job over {ended:.1f} s later (exit status {job.returncode})")


def _wait_for(what, ready, timeout=120):
    deadline = time.monotonic() + timeout
    while not (found := ready()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.2)
    return found


def _records(path):
    """The log's complete records so far (the last line may be half written)."""
    records = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            records.append(json.loads(line))
        except ValueError:
            break
    return records


def _split_runs(records):
    """The log split at each resume: one list of records per run of the job."""
    runs_ = [[]]
    for r in records:
        if r["event"] == "resume":
            runs_.append([])
        runs_[-1].append(r)
    return runs_


@pytest.mark.slow
def test_a_preempted_job_resumes_from_its_last_checkpoint(slurm, tmp_path):
    """cpu.sbatch, 2 nodes × 2 tasks, requeued from outside (`scontrol requeue`: preemption, a node
    failure) once its first periodic checkpoint is there. The lab cannot end by itself in the first
    run (tests/helpers/open_ended_lab.py): only the requeue stops it, so no clock decides. The next
    run resumes from the step the first one saved on SIGTERM, if Slurm's KillWait left it the time,
    else from the last periodic checkpoint (--checkpoint-every 10), and finishes. The time limit's
    warning is the next test's, with a real --time."""
    runs = tmp_path / "runs"
    log = runs / "log.jsonl"
    args = ["--global-batch-size", "64", "--no-eval", "--log-every", "1",
            "--checkpoint-every", "10"]
    # Submitted without --wait: sbatch --wait can miss the end of a job that was requeued;
    # slurm.wait asks for it.
    submitted = slurm.run(["sbatch", "--parsable", f"--output={slurm.tmp}/job-%j.out",
                           str(SLURM_DIR / "cpu.sbatch"), *args],
                          env={"RUNS": str(runs),
                               "LAB": str(ROOT / "tests" / "helpers" / "open_ended_lab.py"),
                               "OPEN_RUNS": "1"})
    assert submitted.returncode == 0, submitted.stdout
    job_id = submitted.stdout.strip().split(";")[0]
    _wait_for("a checkpoint", lambda: (runs / "last.pt").exists())
    requeue = slurm.run(["scontrol", "requeue", job_id])
    assert requeue.returncode == 0, requeue.stdout
    # Slurm holds a requeued job back until the first run's job credential has expired (AuthInfo's
    # cred_expire: 10 s on the test cluster, 120 s by default); started sooner, slurmd refuses it.
    state, code = slurm.wait(int(job_id), timeout=180)
    output = slurm.output(int(job_id))
    assert (state, code) == ("COMPLETED", "0:0"), output + slurm.logs()
    records = read_log(log)
    runs_ = _split_runs(records)
    assert len(runs_) == 2, records
    first, second = runs_
    # `scontrol requeue` sends SIGTERM, which the lab takes as it takes the warning: it saves the
    # step it stopped after, if Slurm's KillWait leaves it the time; else the last periodic
    # checkpoint is used.
    resumed = second[0]["step"]
    saved = [r["step"] for r in first if r["event"] == "done" and r["stop"] == "signal"]
    assert (resumed == (saved[0] if saved else resumed // 10 * 10)
            and resumed >= 10), first[-3:] + second[:1]
    assert (second[-1]["event"] == "done" and second[-1]["stop"] == "max_steps"
            and second[-1]["step"] == resumed + 10)
    assert second[-1]["world_size"] == 4
    assert f"resumed at step {resumed}" in output and "DUE TO JOB REQUEUE" in output, output
    print(f"cpu.sbatch on 2 nodes × 2 tasks: requeued from outside, resumed at step {resumed} "
          f"(saved on SIGTERM: {bool(saved)}), finished at step {resumed + 10}")


@pytest.mark.slow
def test_a_distributed_checkpoint_resumes_in_a_job_with_fewer_nodes(slurm, tmp_path):
    """cpu.sbatch with LAB=fashion_elastic.py: 2 nodes write a distributed checkpoint (a part per
    rank); the same job script submitted again on 1 node resumes it (--resume auto, the
    template's) at the same step and place in the data, and finishes."""
    elastic = {"LAB": str(ROOT / "solutions" / "labs" / "fashion_elastic.py")}
    args = ["--train-images", "6000", "--global-batch-size", "600", "--no-eval", "--epochs", "2",
            "--width", "4", "--norm", "none", "--log-every", "1"]
    first, _, runs = submit(slurm, "cpu.sbatch", tmp_path, "--ntasks-per-node=1",
                            args=[*args, "--max-steps", "12"], env=elastic)
    assert first.returncode == 0, first.log + first.output
    assert sorted(p.name for p in (runs / "step-0000012").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp"]  # a part from each node's rank
    second, _, _ = submit(slurm, "cpu.sbatch", tmp_path, "--nodes=1", "--ntasks-per-node=1",
                          args=args, env=elastic)
    assert second.returncode == 0, second.log + second.output
    assert "resumed at step 12 (1,200 images into epoch 1)" in second.output, second.output
    done = read_log(runs / "log.jsonl")[-1]
    assert (done["event"], done["stop"], done["step"], done["world_size"]) == \
        ("done", "epochs", 20, 1), done


def test_a_requeue_waits_for_a_distributed_checkpoint_written_after_the_warning(tmp_path):
    """env.sh's newest_checkpoint, which requeue_job compares with the warning's time: last.pt or
    a complete step-NNNNNNN/ (its .metadata), the newest of them; a step folder without its
    .metadata (a save cut short) does not count."""
    def newest(runs):
        function = f'sed -n "/^newest_checkpoint()/,/^}}/p" {SLURM_DIR / "env.sh"}'
        return subprocess.run(["bash", "-c", f"RUNS={runs}; source <({function}); "
                               "newest_checkpoint"], capture_output=True, text=True,
                              check=True).stdout.strip()

    runs = tmp_path / "runs"
    for step in ("step-0000005", "step-0000009"):
        (runs / step).mkdir(parents=True)
    (runs / "last.pt").write_text("")
    (runs / "step-0000005" / ".metadata").write_text("")
    (runs / "step-0000009" / "__0_0.distcp").write_text("cut short")
    os.utime(runs / "last.pt", (1000, 1000))
    os.utime(runs / "step-0000005" / ".metadata", (2000, 2000))
    assert newest(runs) == f"{runs}/step-0000005/.metadata"
    (runs / "step-0000009" / ".metadata").write_text("")  # the save, completed later
    os.utime(runs / "step-0000009" / ".metadata", (3000, 3000))
    assert newest(runs) == f"{runs}/step-0000009/.metadata"
    os.utime(runs / "last.pt", (4000, 4000))  # rank 0's torch.save, the newest
    assert newest(runs) == f"{runs}/last.pt"
    assert newest(tmp_path / "none") == ""


def _wait_all(slurm, jobs: dict, timeout: float) -> dict:
    """{name: (state, exit code)} of jobs that run side by side, each asked for in turn until it
    has ended: slurmctld forgets an ended job after MinJobAge (3 s here), so waiting for one job
    at a time can miss the end of another that ended first."""
    ended, deadline = {}, time.monotonic() + timeout
    while len(ended) < len(jobs):
        for name, job in jobs.items():
            if name not in ended:
                try:
                    ended[name] = slurm.wait(job, timeout=0)  # asks once
                except TimeoutError:
                    if time.monotonic() > deadline:
                        raise
        time.sleep(slurm.poll_s)
    return ended


@pytest.mark.slow
def test_at_a_real_time_limit_a_warned_job_saves_requeues_finishes_an_unwarned_is_cut_off(
        slurm, tmp_path):
    """cpu.sbatch on 2 nodes × 1 task with a real limit, --time=1 (Slurm counts in minutes), two
    jobs at once, side by side on both nodes: as written, with its warning brought to 1 s before the
    limit (--signal=B:USR1@1 on the command line), training fashion_elastic.py, whose checkpoints
    are distributed (a part per rank, step-NNNNNNN/), and a copy without its #SBATCH --signal line,
    training fashion_ddp.py (last.pt). The lab cannot end by itself in a first run
    (tests/helpers/open_ended_lab.py): only the limit ends it, whenever Slurm enforces it, so the
    test asserts what happened, not when.
    slurmctld looks at limits and warnings every 30 s (PERIODIC_TIMEOUT in its source; sbatch's
    manual only promises "up to 60 s" early) and sends a warning at the first look within 30 s of
    its lead, so the 1-s lead normally comes 30 to 60 s into a run, and the limit is enforced at a
    later look. The template's 120 s would come before training begins; 15 s (tried first) can come
    15 s into a run, and on a loaded machine a requeued run was warned again before it had trained,
    run after run; at 1 s that is rare. The unwarned job runs at niceness 5: it only waits for its
    limit.
    - Warned: every run that a warning stops saves the step it stopped after, and the next resumes
      at that very step (nothing repeated); the last finishes; the job ends COMPLETED.
    - Unwarned: the job ends as TIMEOUT, never requeued: the rest of the training is lost until it
      is submitted again, and the steps since the last saved checkpoint with it."""
    lab = str(ROOT / "tests" / "helpers" / "open_ended_lab.py")
    args = ["--global-batch-size", "64", "--no-eval", "--log-every", "1",
            "--checkpoint-every", "10"]
    unwarned = tmp_path / "cpu-unwarned.sbatch"
    unwarned.write_text("".join(
        line for line in (SLURM_DIR / "cpu.sbatch").read_text().splitlines(True)
        if not line.startswith("#SBATCH --signal")))
    jobs, seen = {}, {}
    (tmp_path / "node").mkdir()
    for name, script, options, open_runs, nice, open_lab in (
            ("warned", SLURM_DIR / "cpu.sbatch", ["--signal=B:USR1@1"], "1", "0",
             "fashion_elastic.py"),
            ("unwarned", unwarned, [], "1000", "5", "fashion_ddp.py")):
        submitted = slurm.run(["sbatch", "--parsable", "--time=1", "--ntasks-per-node=1", *options,
                               f"--output={slurm.tmp}/job-%j.out", str(script), *args],
                              env={"RUNS": str(tmp_path / name), "LAB": lab, "OPEN_RUNS": open_runs,
                                   "NICE": nice, "TMPDIR": str(tmp_path / "node"),
                                   "OPEN_LAB": open_lab})
        assert submitted.returncode == 0, submitted.stdout
        jobs[name] = int(submitted.stdout.strip().split(";")[0])
    start = time.monotonic()

    def watch():  # for the report only: when the warning came and when training went on
        warned_log = tmp_path / "warned" / "log.jsonl"
        while "resumed" not in seen and time.monotonic() - start < 240:
            if "warning" not in seen and "time-limit warning" in slurm.output(jobs["warned"]):
                seen["warning"] = time.monotonic()
            records = _records(warned_log)
            first_resume = next((i for i, r in enumerate(records) if r["event"] == "resume"), None)
            if (first_resume is not None
                    and any(r["event"] == "train" for r in records[first_resume:])):
                seen["resumed"] = time.monotonic()
            time.sleep(0.2)
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        ended = _wait_all(slurm, jobs, timeout=900)
    except TimeoutError as late:
        pytest.fail(f"{late}\n--- warned job:\n{slurm.output(jobs['warned'])}\n--- unwarned job:\n"
                    f"{slurm.output(jobs['unwarned'])}\n{slurm.logs()}", pytrace=False)
    watcher.join(10)
    output = {name: slurm.output(job) for name, job in jobs.items()}

    assert ended["warned"] == ("COMPLETED", "0:0"), output["warned"] + slurm.logs()
    # the lab's records; each save's `checkpoint` record (the last comes after `done`) left out
    runs_ = _split_runs([r for r in read_log(tmp_path / "warned" / "log.jsonl")
                         if r["event"] != "checkpoint"])
    assert len(runs_) >= 2, output["warned"]
    # each warning: saved where it stopped, resumed right there
    for before, after in zip(runs_, runs_[1:]):
        stopped = [r for r in before if r["event"] == "done"]
        assert stopped and stopped[-1]["stop"] == "signal", before[-3:]
        assert after[0]["step"] == stopped[-1]["step"], (before[-2:], after[:1])
    assert runs_[-1][-1]["event"] == "done" and runs_[-1][-1]["stop"] == "max_steps", runs_[-1][-3:]
    # each run resumed from the distributed checkpoint of the step the warning stopped at, whose
    # parts (one from each node's rank) rank 0 keeps with the next one
    for after in runs_[1:]:
        assert after[0]["checkpoint"] == str(tmp_path / "warned" / f"step-{after[0]['step']:07d}")
    kept = sorted((tmp_path / "warned").glob("step-*"))
    assert kept and all(sorted(p.name for p in folder.iterdir())
                        == [".metadata", "__0_0.distcp", "__1_0.distcp"] for folder in kept)
    assert not (tmp_path / "warned" / "last.pt").exists()
    assert runs_[-1][-1]["world_size"] == 2 and runs_[-1][-1]["step"] == runs_[1][0]["step"] + 10
    assert ("time-limit warning (SIGUSR1)" in output["warned"]
            and "DUE TO TIME LIMIT" not in output["warned"])
    stops = [r["step"] for run_ in runs_[:-1] for r in run_ if r["event"] == "done"]
    assert all(f"stopped after step {step} by " in output["warned"]
               and f"resumed at step {step}" in output["warned"]
               for step in stops), output["warned"]
    # The template's own line. Slurm's "CANCELLED ... DUE TO JOB REQUEUE" is not asserted:
    # slurmstepd writes it only when the requeue reaches the batch shell before the shell's own
    # `exit 0` (CI saw both orders).
    assert (output["warned"].count(f"scontrol requeue {jobs['warned']}: the next run resumes")
            == len(runs_) - 1), output["warned"]

    assert ended["unwarned"][0] == "TIMEOUT", output["unwarned"] + slurm.logs()
    records = read_log(tmp_path / "unwarned" / "log.jsonl")
    assert not any(r["event"] == "resume" for r in records), \
        "a job that reached its limit was requeued"
    assert ("time-limit warning" not in output["unwarned"]
            and "DUE TO TIME LIMIT" in output["unwarned"])
    trained = max(r["step"] for r in records if r["event"] == "train")
    import torch

    saved = torch.load(tmp_path / "unwarned" / "last.pt", weights_only=True)["progress"]["step"]
    assert 10 <= saved <= trained, (saved, trained)
    print(f"--time=1: warned (@1 s) at {seen.get('warning', float('nan')) - start:.1f} s "
          "after sbatch, training again "
          f"{seen.get('resumed', float('nan')) - seen.get('warning', float('nan')):.1f} s "
          f"after the warning, {len(runs_) - 1} requeue(s), 0 steps repeated; "
          f"without --signal: TIMEOUT, not requeued, trained to step {trained}, "
          f"last checkpoint step {saved} ({trained - saved} steps lost, and the rest of the run "
          "until it is submitted again)")


@pytest.mark.slow
def test_jupyter_on_a_compute_node_keeps_its_token_to_its_owner(slurm, tmp_path):
    """jupyter.sbatch: the tunnel line and the token go to a connection file of mode 0600 that the
    job's log names; the token is on no process's command line and not in the log; the server
    answers with the token and refuses without it. JupyterLab is started with --port=0 and binds a
    port itself: the port in the tunnel and in the log is the one this job's JupyterLab listens on,
    never one the script picked and let go."""
    import psutil

    out, connect = tmp_path / "jupyter.out", tmp_path / "private" / "jupyter.txt"
    sub = slurm.run(["sbatch", "--parsable", f"--output={out}", "--cpus-per-task=2",
                     str(SLURM_DIR / "jupyter.sbatch")],
                    env={"RUNS": str(tmp_path / "runs"), "LOGIN": "login.example.org",
                         "CONNECT": str(connect)})
    assert sub.returncode == 0, sub.stdout
    job_id = sub.stdout.strip().split(";")[0]
    tunnel = r"ssh -N -o ExitOnForwardFailure=yes -L 8888:(\S+):(\d+) \S+@login.example.org"
    try:
        deadline = time.monotonic() + 300  # queue and start; a cap for a hang
        while not (connect.exists() and (m := re.search(tunnel, connect.read_text()))):
            assert time.monotonic() < deadline, out.read_text() if out.exists() else "no output"
            time.sleep(0.5)
        node, port = m.groups()
        token = re.search(r"lab\?token=(\w+)", connect.read_text()).group(1)
        assert node in ("n1", "n2") and len(token) == 32
        assert oct(connect.stat().st_mode & 0o777) == "0o600", oct(connect.stat().st_mode)
        direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        while True:
            try:
                with direct.open(f"http://127.0.0.1:{port}/api/status?token={token}",
                                 timeout=5) as response:
                    assert response.status == 200
                    break
            except OSError:
                assert time.monotonic() < deadline, out.read_text()
                time.sleep(0.5)
        with pytest.raises(urllib.error.HTTPError) as refused:
            direct.open(f"http://127.0.0.1:{port}/api/status", timeout=5)
        assert refused.value.code == 403
        args = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
        # the server is running, and its token is nowhere in argv
        assert "jupyter lab" in args and token not in args
        log = out.read_text()
        assert token not in log and (f"JupyterLab runs on {node}, port {port}. The tunnel to type "
                                     f"and the address to open: cat {connect} (readable by you "
                                     "alone)") in log, log
        listener = next(psutil.Process(c.pid) for c in psutil.net_connections("tcp")
                        if c.status == psutil.CONN_LISTEN and c.laddr.port == int(port))
        assert (listener.environ().get("SLURM_JOB_ID") == job_id
                and "--port=0" in listener.cmdline()), (listener.cmdline(), log)
    finally:
        slurm.run(["scancel", job_id])


@pytest.mark.slow
def test_jupyter_on_a_taken_port_ends_the_job_with_one_line(slurm, tmp_path):
    """--ServerApp.port_retries=0: JupyterLab does not move to another port than the tunnel names;
    the job ends, and its last line says why. Its first line is JupyterLab's, not a training
    job's."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        job = slurm.sbatch(SLURM_DIR / "jupyter.sbatch", "--cpus-per-task=2", timeout=120,
                           env={"RUNS": str(tmp_path / "runs"), "PORT": str(port),
                                "CONNECT": str(tmp_path / "c.txt")})
    assert job.returncode != 0, job.output
    last = [line for line in job.output.splitlines() if line.strip()][-1]
    assert re.fullmatch(rf"JupyterLab stopped or could not start on n[12]:{port} "
                        r"\(a port another program took, or an error above\): submit again",
                        last), job.output
    assert f"The port {port} is already in use" in job.output, job.output
    # It trains nothing: its log opens with JupyterLab's node and port, not env.sh's "rendezvous …,
    # lab …" line.
    first = next(line for line in job.output.splitlines() if line.strip())
    assert first.startswith("JupyterLab starts on n") and "rendezvous" not in job.output, job.output


def test_without_slurm_notebook_09_falls_back_to_the_committed_job(monkeypatch, tmp_path):
    """A laptop without root or Slurm: no cluster, one reason, and the committed job's files are
    there."""
    monkeypatch.setattr(localslurm, "unavailable",
                        lambda: "the local Slurm cluster runs its daemons as root")
    monkeypatch.setattr(localslurm.shutil, "which", lambda name: None)
    cluster, why, stop = localslurm.for_notebook(tmp_path)
    assert cluster is None and "as root" in why
    stop()  # nothing to stop
    results = ROOT / "results" / "09_cluster"
    done = read_log(results / "log.jsonl")[-1]
    assert done["event"] == "done" and done["world_size"] == 4 and done["test_images"] == 10_000
    assert "slurm/multi_node.sbatch" in (results / "command.txt").read_text()
    assert "[rank0]:step" in (results / "job.out").read_text()
