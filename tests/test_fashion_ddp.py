"""The DDP lab, solutions/labs/fashion_ddp.py, through real torchrun runs
on the real FashionMNIST."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from conftest import AT_ONCE_S, LAUNCHER_LOG, OFFLINE, ROOT, end_session, lab_cmd, run, torchrun_cmd
from dpcourse.lab.data import InMemoryFashionMNIST
from dpcourse.lab.metrics import read_log
from dpcourse.lab.models import FashionCNN
from dpcourse.lab.rendezvous import free_port

pytestmark = pytest.mark.slow
LAB = ROOT / "solutions" / "labs" / "fashion_ddp.py"


def lab(nproc, *args, timeout=180, env=None, script=LAB):
    """torchrun the lab (python for one process); (CompletedProcess, rank 0's log records)."""
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "log.jsonl"
        result = run(lab_cmd(nproc, script, *args, "--log-json", log), timeout=timeout, env=env)
        records = ([json.loads(line) for line in log.read_text().splitlines()]
                   if log.exists() else [])
    return result, records


def messages(output):
    """What the ranks said, without torchrun's own lines."""
    return [line for line in output.splitlines() if line.strip() and not LAUNCHER_LOG.match(line)
            and "torch.distributed" not in line and "torchrun" not in line.lower()]


def single_process_accuracy(weights):
    """Accuracy of saved weights on all 10,000 test images, in this process, no group."""
    model = FashionCNN()
    model.load_state_dict(torch.load(weights, weights_only=True))
    model.eval()
    x, y = InMemoryFashionMNIST(train=False)[torch.arange(10_000)]
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


# 3 ranks: shards of 3,334/3,333/3,333 test images and a global batch of 3 × 42. Two ranks are
# checked by notebook 05's exercise 3 (10,000 images counted) on the solution lab, in
# tests/test_exercises.py.
@pytest.mark.parametrize("nproc, batch", [(3, "126")])
def test_sharded_evaluation_counts_every_test_image_once(nproc, batch, tmp_path, fashion_root):
    weights = tmp_path / "w.pt"
    result, log = lab(nproc, "--max-steps", "15", "--global-batch-size", batch,
                      "--save-model", weights)
    assert result.returncode == 0, result.stdout
    done = log[-1]
    assert done["event"] == "done" and done["test_images"] == 10_000 and done["world_size"] == nproc
    assert done["test_accuracy"] == pytest.approx(single_process_accuracy(weights), abs=1e-6)
    assert done["replicas_max_diff"] == 0.0  # DDP kept the replicas identical


# 2 workers = 1 worker with the same global batch (same weights), set_epoch's new order each epoch
# and the torchvision DataLoader's batches = the in-memory loader's are what the checks of notebook
# 05's exercise 3 and notebook 06's exercise 3 prove on the solution lab (tests/test_exercises.py
# runs them, and feeds them the wrong answers): not repeated here.


def test_resume_is_bit_identical_to_an_uninterrupted_run(tmp_path, fashion_root):
    # a narrow model: 4 runs, 3 s less each
    common = ["--deterministic", "--epochs", "1", "--width", "4"]
    full, _ = lab(2, *common, "--max-steps", "24", "--save-model", tmp_path / "full.pt")
    part, _ = lab(2, *common, "--max-steps", "13", "--checkpoint-dir", tmp_path / "ck")
    rest, log = lab(2, *common, "--max-steps", "24", "--resume", tmp_path / "ck" / "last.pt",
                    "--save-model", tmp_path / "resumed.pt")
    assert full.returncode == part.returncode == rest.returncode == 0, \
        full.stdout + part.stdout + rest.stdout
    assert "resumed at step 13" in rest.stdout
    a, b = torch.load(tmp_path / "full.pt"), torch.load(tmp_path / "resumed.pt")
    assert all(torch.equal(a[k], b[k]) for k in a), "the resumed run ended with other weights"
    assert log[-1]["step"] == 24
    resumed = [r for r in log if r["event"] == "resume"]
    assert len(resumed) == 1 and resumed[0]["step"] == 13, \
        "the log does not say where training went on"
    steps_per_epoch = 60_000 // 128
    assert log[-1]["epoch"] == round(24 / steps_per_epoch, 4), "epoch: training done, in epochs"
    assert all("test_accuracy" not in r for r in log if r["event"] == "train"), \
        "train records repeat old test figures"
    # The same command again, once the run has finished: one line that says so, exit 0, no training.
    again, _ = lab(2, *common, "--max-steps", "13", "--resume", tmp_path / "ck" / "last.pt")
    assert (again.returncode == 0
            and "checkpoint of a finished run (step 13, stopped by max_steps)" in again.stdout), \
        again.stdout
    assert "test accuracy" not in again.stdout


def _worker_pid(marker: str, rank: int) -> int | None:
    """The pid of the lab worker with RANK=rank whose command line holds ``marker``."""
    for proc in Path("/proc").iterdir():
        try:
            if (marker in (proc / "cmdline").read_text()
                    and "torch.distributed.run" not in (proc / "cmdline").read_text()):
                if f"\0RANK={rank}\0" in "\0" + (proc / "environ").read_text():
                    return int(proc.name)
        except (OSError, ValueError):
            continue
    return None


@contextmanager
def started(cmd, env=None):
    """The command, started in a session of its own; at the end, whatever is left of it (a
    launcher's workers, a run a failed assertion left behind) is killed, so that it does not train
    on beside the next tests."""
    proc = subprocess.Popen(list(map(str, cmd)), cwd=ROOT, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                            start_new_session=True)
    try:
        yield proc
    finally:
        end_session(proc)
        proc.stdout.close()


def wait_until(ready, *procs, what: str, cap: float = 600):
    """Wait for ``ready()`` while every process runs: an event, not a clock
    (``cap`` ends only a hang)."""
    deadline = time.monotonic() + cap
    while not ready():
        dead = [p for p in procs if p.poll() is not None]
        assert not dead, f"{what}: the run ended first:\n{dead[0].communicate()[0]}"
        assert time.monotonic() < deadline, f"{what}: not within {cap:.0f} s (a hang)"
        time.sleep(0.2)


def test_a_killed_worker_restarts_from_the_checkpoint_and_reaches_the_target(
        tmp_path, fashion_root):
    ck = tmp_path / "ck"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "--max-restarts=1", str(LAB), "--checkpoint-dir", str(ck), "--checkpoint-every", "100",
           "--resume", "auto", "--target-accuracy", "0.85",  # one epoch (0.90: two)
           "--log-json", str(tmp_path / "log.jsonl")]
    with started(cmd) as proc:
        # The first checkpoint (written whole: a rename), however long the load makes it take.
        wait_until((ck / "last.pt").exists, proc, what="the first checkpoint")
        pid = _worker_pid(str(ck), rank=1)
        assert pid, "no rank-1 worker found"
        os.kill(pid, signal.SIGKILL)
        out = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, out
    # The last checkpoint before the kill: step 100 on a quiet machine, 200 or later under load.
    resumed = re.search(r"resumed at step ([1-9]\d*00)\b", out)
    assert resumed, out
    log = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if r["event"] == "resume"] == [int(resumed[1])], \
        "the restart left no record in the log"
    assert (log[-1]["event"] == "done" and log[-1]["test_accuracy"] >= 0.85
            and log[-1]["stop"] == "target_accuracy")


def test_a_signal_to_one_rank_stops_every_rank_after_the_same_step_saved_then_resumed(
        tmp_path, fashion_root):
    """SIGUSR1 (a job's time-limit warning) to rank 1 alone, mid-training: every rank stops after
    the same step (one all_reduce a step), rank 0 saves that step and says so, all exit 0; --resume
    auto goes on from exactly there. The run cannot end by itself (no step limit), so no clock
    decides what the test sees."""
    ck, log = tmp_path / "ck", tmp_path / "log.jsonl"
    common = ["--checkpoint-dir", ck, "--resume", "auto", "--log-json", log, "--log-every", 1,
              "--no-eval", "--global-batch-size", 64]
    with started(torchrun_cmd(2, LAB, *common, "--epochs", 1000)) as proc:
        wait_until(lambda: log.exists() and '"train"' in log.read_text(), proc,
                   what="the first step")
        os.kill(_worker_pid(str(ck), rank=1), signal.SIGUSR1)
        out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, out
    done = read_log(log)[-1]
    assert (done["event"] == "done" and done["stop"] == "signal"
            and done["replicas_max_diff"] == 0.0), done
    stopped = done["step"]
    assert f"stopped after step {stopped} by the job's time-limit warning (SIGUSR1); " \
           f"checkpoint of step {stopped}" in out, out
    assert "Traceback" not in out, out
    assert torch.load(ck / "last.pt", weights_only=True)["progress"]["step"] == stopped

    resumed = run(torchrun_cmd(2, LAB, *common, "--max-steps", stopped + 2), timeout=300)
    assert resumed.returncode == 0, resumed.stdout
    assert f"resumed at step {stopped}" in resumed.stdout
    assert read_log(log)[-1]["step"] == stopped + 2


def test_a_signal_before_any_checkpoint_dir_says_nothing_was_saved(tmp_path, fashion_root):
    """SIGTERM (scancel, the time limit itself) to a one-process run without --checkpoint-dir."""
    log = tmp_path / "log.jsonl"
    with started([sys.executable, LAB, "--log-json", log, "--log-every", 1, "--no-eval",
                  "--epochs", 1000]) as proc:
        wait_until(lambda: log.exists() and '"train"' in log.read_text(), proc,
                   what="the first step")
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, out
    step = read_log(log)[-1]["step"]
    assert f"stopped after step {step} by SIGTERM (time limit, scancel or preemption); " \
           "nothing was saved (no --checkpoint-dir)" in out, out


def test_a_dead_peer_without_restarts_ends_every_other_rank_quickly(tmp_path, fashion_root):
    """Two srun-style tasks; one is killed mid-training; the other exits non-zero with one
    line, long before its collective timeout (600 s here) could have ended it: under half of it,
    so not by it."""
    port = free_port()
    task = lambda rank: {"SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank),  # noqa: E731
                         "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "31", "SLURM_STEP_NUM_TASKS": "2",
                         "SLURM_NODEID": "0", "SLURM_STEP_TASKS_PER_NODE": "2",
                         "MASTER_PORT": str(port)}
    cmd = [sys.executable, LAB, "--timeout", 600, "--log-json", tmp_path / "l"]
    with started(cmd, env=task(0)) as rank0, started(cmd, env=task(1)) as rank1:
        wait_until(lambda: (tmp_path / "l").exists() and "train" in (tmp_path / "l").read_text(),
                   rank0, rank1, what="the first step")  # 3 epochs: it cannot end first
        rank1.kill()
        start = time.perf_counter()
        out = rank0.communicate(timeout=400)[0]
    assert rank0.returncode != 0 and time.perf_counter() - start < 300
    assert "lost another rank in the middle of" in out and "Traceback" not in out, out


def test_time_budget_stops(fashion_root):
    """--time-budget 2 ends 3 epochs (1,407 steps) early, at the first step past the budget,
    whatever the machine's load: the step before it was still inside the budget (the records' own
    clock, not the test's)."""
    result, log = lab(1, "--time-budget", "2", "--log-every", "1")
    assert result.returncode == 0, result.stdout
    done, steps = log[-1], [r for r in log if r["event"] == "train"]
    assert done["stop"] == "time_budget" and done["step"] < 3 * 469 and done["elapsed_s"] >= 2, done
    assert steps[-1]["step"] == done["step"] and steps[-2]["elapsed_s"] < 2, steps[-2:]


# ---- bad input: one clear line, non-zero exit, within seconds, no traceback per rank ------
def assert_one_message(result, *expected):
    """Non-zero exit, the message once, and no worker's traceback
    (torchrun's own summary may follow)."""
    assert result.returncode != 0
    assert f'File "{LAB}"' not in result.stdout, result.stdout
    hits = [line for line in result.stdout.splitlines() if all(e in line for e in expected)]
    assert len(hits) == 1, result.stdout


@pytest.mark.parametrize("args, expected", [
    (["--global-batch-size", "129"], ["--global-batch-size 129 does not split into 2", "128"]),
    (["--global-batch-size", "1"], ["--global-batch-size 1 does not split into 2"]),
    (["--resume", "/nonexistent/last.pt"], ["no such checkpoint"]),
    (["--no-ddp"], ["--no-ddp", "launch one process"]),
])
def test_bad_options_say_what_to_do(args, expected, fashion_root):
    start = time.perf_counter()
    result, _ = lab(2, *args, timeout=2 * AT_ONCE_S)
    assert time.perf_counter() - start < AT_ONCE_S
    assert_one_message(result, *expected)


def test_every_width_builds_a_model():
    """--width 6 once ended in a ValueError from GroupNorm on every rank (6 channels in 4 groups):
    the model takes 4 groups where 4 divides the channels, and fewer where it does not."""
    from dpcourse.lab.models import FashionCNN

    for width in range(1, 9):
        model = FashionCNN(width=width)
        groups = [m.num_groups for m in model if isinstance(m, torch.nn.GroupNorm)]
        assert groups == [4 if width % 4 == 0 else (2 if width % 2 == 0 else 1),
                          4 if width % 2 == 0 else 2]
        assert model(torch.zeros(2, 1, 28, 28)).shape == (2, 10)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_nccl_on_a_cpu_node(fashion_root):
    result, _ = lab(2, "--backend", "nccl", timeout=60)
    assert_one_message(result, "NCCL needs a GPU", "--backend gloo")


def test_corrupt_and_foreign_checkpoints_are_refused(tmp_path, fashion_root):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    result, _ = lab(2, "--resume", bad, timeout=60)
    assert_one_message(result, "not a readable checkpoint")
    ck = tmp_path / "ck"
    assert lab(1, "--max-steps", "3", "--width", "8", "--checkpoint-dir", ck)[0].returncode == 0
    result, _ = lab(2, "--resume", ck / "last.pt", "--width", "8", timeout=60)
    assert_one_message(result, "written by another run", "world_size 1 (this run: 2)")
    result, _ = lab(1, "--resume", ck / "last.pt", timeout=60)
    assert_one_message(result, "written by another run", "width 8 (this run: 16)")


def test_no_data_offline(tmp_path):
    env = {**OFFLINE, "DPCOURSE_DATA": str(tmp_path / "empty"),
           "DPCOURSE_SYSTEM_DATA": "/nonexistent"}
    start = time.perf_counter()
    result, _ = lab(2, timeout=2 * AT_ONCE_S, env=env)
    assert time.perf_counter() - start < AT_ONCE_S
    assert_one_message(result, "sudo apt-get install dataset-fashion-mnist")


def test_port_in_use_under_srun_style_launch(tmp_path, fashion_root):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_STEP_ID": "0",
               "SLURM_JOB_ID": "32", "SLURM_STEP_NUM_TASKS": "1", "SLURM_NODEID": "0",
               "SLURM_STEP_TASKS_PER_NODE": "1", "MASTER_PORT": str(port)}
        result = run([sys.executable, str(LAB)], env=env, timeout=60)
    assert result.returncode == 1 and f"Port {port} on 127.0.0.1 is already in use" in result.stdout
    assert "Traceback" not in result.stdout
