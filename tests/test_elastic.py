"""Notebook 14's lab, solutions/labs/fashion_elastic.py: a checkpoint every rank writes
(torch.distributed.checkpoint), resumed on the same world size bit for bit and on another one with
the same batches; a rank killed mid-run and the run restarted by torchrun from its last
checkpoint; every checkpoint it cannot resume refused in one line. Real runs: torchrun on 2 and 3
ranks, one process without a launcher, real FashionMNIST."""
import json
import os
import signal
import socket
import subprocess
import sys
from collections import Counter

import pytest
import torch

from conftest import ROOT, end_session, lab_cmd, run
from dpcourse.lab.rendezvous import free_port
from test_fashion_ddp import messages, wait_until

LAB = ROOT / "solutions" / "labs" / "fashion_elastic.py"
COUNTED = ROOT / "tests" / "helpers" / "elastic_indices.py"  # the lab, logging its indices
# 6,000 images, 600 a step: 10 steps an epoch on 1, 2 or 3 ranks (600 = 1 × 600 = 2 × 300 = 3 × 200)
N, G = 6000, 600
COMMON = ["--train-images", N, "--global-batch-size", G, "--epochs", 2, "--width", 4,
          "--norm", "none", "--deterministic", "--no-eval", "--log-every", 1, "--seed", 1]


def ok(result):
    assert result.returncode == 0, result.stdout
    return result


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, fashion_root):
    """2 ranks with ZeRO-1 (--zero: each holds the momentum of its share of the parameters),
    stopped after step 13 of 20 (3 into epoch 1), checkpointed every 5 steps and at the stop: (its
    checkpoint folder, the index log's prefix). The tests below resume it with and without --zero,
    and compare it with a DDP run's checkpoint."""
    tmp = tmp_path_factory.mktemp("elastic")
    ok(run(lab_cmd(2, COUNTED, *COMMON, "--zero", "--checkpoint-dir", tmp / "ck",
                   "--checkpoint-every", 5, "--max-steps", 13),
           env={"INDEX_LOG": str(tmp / "seen")}, timeout=300))
    return tmp / "ck", tmp / "seen"


def weights(path):
    return torch.load(path, weights_only=True)


@pytest.fixture(scope="module")
def never_run(tmp_path_factory, fashion_root):
    """The same run on 2 ranks, never stopped, saving asynchronously (--async-save) at step 10
    (epoch 0's end) and at its end: (its folder, with ck/, log.jsonl and never.pt, its weights)."""
    tmp = tmp_path_factory.mktemp("never")
    ok(run(lab_cmd(2, LAB, *COMMON, "--checkpoint-dir", tmp / "ck", "--checkpoint-every", 10,
                   "--async-save", "--log-json", tmp / "log.jsonl", "--save-model",
                   tmp / "never.pt"), timeout=300))
    return tmp


@pytest.fixture(scope="module")
def never(never_run):
    """The weights of the run never stopped."""
    return weights(never_run / "never.pt")


def max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


def zero_owners(model, world_size):
    """ZeroRedundancyOptimizer's owner of each parameter (its _partition_parameters): the largest
    first, each to the rank that holds the fewest numbers so far, the lowest such rank."""
    sizes, owner = [0] * world_size, {}
    for name, p in sorted(model.named_parameters(), key=lambda named: named[1].numel(),
                          reverse=True):
        owner[name] = sizes.index(min(sizes))
        sizes[owner[name]] += p.numel()
    return owner


def test_every_rank_writes_its_part_and_a_complete_checkpoint_has_its_metadata(stopped):
    ck, _ = stopped
    # saved at steps 5, 10 (the epoch's end) and 13 (the stop); rank 0 keeps the last two
    assert sorted(p.name for p in ck.iterdir()) == ["step-0000010", "step-0000013"]
    for step in ck.iterdir():
        assert sorted(p.name for p in step.iterdir()) == [".metadata", "__0_0.distcp",
                                                          "__1_0.distcp"], step
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(ck / "step-0000013")).read_metadata()
    files = {info.relative_path for info in meta.storage_data.values()}
    assert files == {"__0_0.distcp", "__1_0.distcp"}  # both ranks wrote some of it
    # The keys of a plain model and of its optimizer state by parameter name: no wrapper's
    # `module.`, no parameter numbers, so any wrapper and any world size reads them.
    from dpcourse.lab.models import FashionCNN

    plain = FashionCNN(4, "none").state_dict()
    keys = set(meta.state_dict_metadata)
    assert {k for k in keys if k.startswith("model.")} == {f"model.{k}" for k in plain}
    assert {k for k in keys if k.startswith("optim.state.")} == \
        {f"optim.state.{k}.momentum_buffer" for k in plain}
    # ZeRO-1's two shares: each parameter's momentum in its owner's file, and only there
    files = {index.fqn: info.relative_path for index, info in meta.storage_data.items()}
    owners = zero_owners(FashionCNN(4, "none"), 2)
    assert {k: files[f"optim.state.{k}.momentum_buffer"] for k in owners} == \
        {k: f"__{rank}_0.distcp" for k, rank in owners.items()}


@pytest.mark.slow
def test_a_resume_on_1_2_or_3_ranks_trains_the_same_batches_and_weights(stopped, never,
                                                                      tmp_path):
    """From ZeRO-1's 2 ranks' step 13: on 2 ranks (DDP, without --zero), bit for bit the weights
    of a run never stopped; on 1 (one process, without it) and on 3 (ZeRO-1, each rank owning other
    parameters than the 2 did), the same batches (each image once an epoch, across the stop) and
    the weights within float64 rounding (the gradients are averaged in another order)."""
    ck, seen = stopped
    resumed = {}
    for nproc in (1, 2, 3):
        out = tmp_path / f"r{nproc}.pt"
        env = {"INDEX_LOG": str(seen)} if nproc == 3 else None
        zero = ["--zero"] if nproc == 3 else []
        result = ok(run(lab_cmd(nproc, COUNTED if nproc == 3 else LAB, *COMMON, *zero,
                                "--resume", ck / "step-0000013", "--save-model", out),
                        env=env, timeout=300))
        assert (f"{nproc} × {G // nproc} = global batch {G}" in result.stdout
                and "resumed at step 13 (1,800 images into epoch 1)" in result.stdout), \
            result.stdout
        resumed[nproc] = weights(out)
    assert max_diff(resumed[2], never) == 0.0
    for nproc in (1, 3):
        # measured: 1.4e-15 on 1, 7.8e-16 on 3
        assert max_diff(resumed[nproc], never) < 1e-12, nproc

    # every training image once an epoch: steps 0-12 on 2 ranks, 13-19 on 3
    counts = {0: Counter(), 1: Counter()}
    for path in seen.parent.glob(seen.name + ".*"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            counts[record["epoch"]].update(record["indices"])
    for epoch, count in counts.items():
        assert sorted(count) == list(range(N)) and set(count.values()) == {1}, \
            (epoch, len(count), Counter(count.values()))
    assert len(list(seen.parent.glob(seen.name + ".*"))) == 3  # ranks 0-1, then 0-2


@pytest.mark.slow
@pytest.mark.parametrize("fault, flags", [("1:12:SIGKILL", []),
                                          ("0:12:exception", ["--zero", "--async-save"])])
def test_a_killed_rank_restarts_the_run_from_its_last_checkpoint(tmp_path, fashion_root, fault,
                                                                 flags):
    """--fail RANK:12:KIND under torchrun --max-restarts=1: the rank dies before step 12 (killed,
    or an exception raised; the second with ZeRO-1 and asynchronous saves), torchrun starts both
    ranks again, they resume at step 10 (the last checkpoint: one step done again) and finish;
    the fault fires in the fresh run only."""
    log = tmp_path / "log.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "--max-restarts=1", str(LAB), *map(str, COMMON), *flags, "--checkpoint-dir",
           str(tmp_path / "ck"), "--checkpoint-every", "5", "--resume", "auto",
           "--fail", fault, "--max-steps", "15", "--log-json", str(log)]
    result = run(cmd, timeout=300)
    assert result.returncode == 0, result.stdout
    rank, _, kind = fault.split(":")
    assert result.stdout.count(f"--fail: {kind} before step 12") == 1, result.stdout
    if kind == "exception":  # the rank's own error, then the restart
        assert f"RuntimeError: --fail: an exception on rank {rank} before step 12" in result.stdout
    # step 10 is epoch 0's last: saved at the epoch's end, with the epoch done
    assert "resumed at step 10 (0 images into epoch 1)" in result.stdout, result.stdout
    assert "--fail left out: this run goes on from a checkpoint" in result.stdout
    assert "Detected an existing checkpoint" not in result.stdout  # each step saved once
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in records if r["event"] == "resume"] == [10]
    assert records[-1]["event"] == "done" and records[-1]["step"] == 15, records[-1]
    assert records[-1]["replicas_max_diff"] == 0.0


def format_of(checkpoint, tmp_path, number):
    """A copy of ``checkpoint`` that says it has format ``number``, made as a later lab would:
    one file, changed, and saved again as a distributed checkpoint."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

    dcp_to_torch_save(checkpoint, tmp_path / "whole.pt")
    state = torch.load(tmp_path / "whole.pt", weights_only=True)
    torch.save({**state, "format": number}, tmp_path / "whole.pt")
    torch_save_to_dcp(tmp_path / "whole.pt", tmp_path / f"format-{number}")
    return tmp_path / f"format-{number}"


@pytest.mark.slow
def test_an_asynchronous_save_writes_the_checkpoint_a_blocking_one_writes(stopped, never_run,
                                                                          tmp_path):
    """--async-save: training goes on while a thread writes; the folders it leaves are complete
    and hold, tensor for tensor, what the blocking saves of ZeRO-1's run hold at the same step
    (the checkpoint does not depend on who held which momentum); each save logs how long training
    waited for it."""
    ck, _ = stopped
    assert sorted(p.name for p in (never_run / "ck").iterdir()) == ["step-0000010",
                                                                    "step-0000020"]
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    whole = {}
    for name, folder in (("async", never_run / "ck"), ("blocking", ck)):
        dcp_to_torch_save(folder / "step-0000010", tmp_path / f"{name}.pt")
        whole[name] = torch.load(tmp_path / f"{name}.pt", weights_only=True)
    assert whole["async"]["progress"]["step"] == 10
    for part in ("model", "optim", "progress", "config", "format"):
        a, b = whole["async"][part], whole["blocking"][part]
        if part == "model":
            assert max_diff(a, b) == 0.0
        elif part == "optim":  # momentum buffers and options, by parameter name (FLAT)
            assert sorted(a) == sorted(b) and any(k.endswith(".momentum_buffer") for k in a)
            assert max_diff(*({k: v for k, v in d.items() if torch.is_tensor(v)}
                              for d in (a, b))) == 0.0
            assert {k: v for k, v in a.items() if not torch.is_tensor(v)} == \
                {k: v for k, v in b.items() if not torch.is_tensor(v)}
        elif part == "progress":  # its clock is its own
            assert {**a, "elapsed_s": 0} == {**b, "elapsed_s": 0}
        else:
            assert a == b, part
    saves = [json.loads(line) for line in (never_run / "log.jsonl").read_text().splitlines()
             if '"checkpoint"' in line]
    assert [(r["step"], r["async_save"]) for r in saves] == [(10, True), (20, True)]
    assert all(r["blocked_ms"] >= 0 for r in saves)


@pytest.mark.slow
def test_a_checkpoint_this_run_cannot_resume_is_one_line(stopped, tmp_path):
    ck, _ = stopped
    broken = tmp_path / "broken"
    subprocess.run(["cp", "-r", str(ck / "step-0000010"), str(broken)], check=True)
    (broken / "__1_0.distcp").unlink()
    newer = format_of(ck / "step-0000010", tmp_path, 3)
    import torch.distributed.checkpoint as dcp

    foreign = tmp_path / "foreign"  # a distributed checkpoint of another program
    dcp.save({"model": {"w": torch.zeros(3)}, "step": 7}, checkpoint_id=foreign, no_dist=True)
    cases = [
        # each setting a resume must keep, changed at once: the message names every one
        (["--global-batch-size", 300, "--width", 8, "--seed", 2, "--train-images", 3000],
         ck / "step-0000010", "was written by another run: width 4 (this run: 8), global_batch "
         "600 (this run: 300), seed 1 (this run: 2), train_images 6000 (this run: 3000). Resume "
         "with the same model, global batch, seed and training images"),
        (["--checkpoint-dir", ck], None, f"--checkpoint-dir {ck} holds another run's "
         "checkpoints: --resume auto to go on from its newest"),
        (["--fail", "2:3:SIGKILL"], None, "there is no rank 2 among 1"),
        (["--zero"], None, "--zero: 4 parameter tensors cannot be shared by 5 ranks; train on at "
         "most 4 ranks, or without --zero."),
        ([], ck, "not a complete distributed checkpoint (no .metadata in it)"),
        ([], broken, "No such file or directory"),
        ([], newer, "was written by a newer fashion_elastic.py (checkpoint format 3; this one "
         "reads format 2). Update the course (git pull), or start afresh."),
        ([], foreign, "holds no format: the lab asks for a key its save() did not write, or "
         "another program wrote it"),
    ]
    for extra, path, says in cases:
        resume = ["--resume", path] if path else []
        # the missing part on 2 ranks (DCP's error on every rank, said once); --zero on 5, one
        # more than the model's 4 tensors; the others, which every rank meets alike, on one
        # process (a launcher and a second rank less to start)
        nproc = 2 if path == broken else 5 if "--zero" in extra else 1
        result = run(lab_cmd(nproc, LAB, *COMMON, *extra, *resume), timeout=300)
        said = [line for line in messages(result.stdout) if line.startswith("[rank")]
        assert result.returncode != 0 and len(said) == 1 and says in said[0], result.stdout
        assert said[0].startswith(f"[rank 0] --resume {path}" if path else "[rank 0] --"), said


def test_resume_auto_takes_the_newest_complete_checkpoint_and_a_finished_run_stops(stopped,
                                                                                   tmp_path):
    """A newer folder without its .metadata (a save cut short) is passed over; the newest
    complete one is of a run that reached its --max-steps: the same command again does nothing,
    on 3 ranks too."""
    ck, _ = stopped
    copy = tmp_path / "ck"
    subprocess.run(["cp", "-r", str(ck), str(copy)], check=True)
    (copy / "step-0000019").mkdir()
    (copy / "step-0000019" / "__0_0.distcp").write_bytes(b"cut short")
    result = ok(run(lab_cmd(3, LAB, *COMMON, "--checkpoint-dir", copy, "--resume", "auto",
                            "--max-steps", 13), timeout=300))
    assert (f"{copy}/step-0000013 is the checkpoint of a finished run (step 13, stopped by "
            "max_steps): nothing to do") in result.stdout, result.stdout


def _records(log):
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def _listening(port):
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.slow
def test_an_agent_that_leaves_is_a_smaller_world_that_resumes_and_finishes(tmp_path, fashion_root):
    """torchrun --nnodes=1:2, two agents on this machine (two "nodes" of one process each) meeting
    at a c10d rendezvous: the run trains on 2 ranks; the second agent and its worker are killed;
    the first agent restarts its worker in a world of 1, which resumes from the newest complete
    distributed checkpoint and finishes. The shared store is off
    (TORCH_DISABLE_SHARE_RDZV_TCP_STORE: with it, the agents of one host meet the next round on
    the dead one's port)."""
    port, log = free_port(), tmp_path / "log.jsonl"
    # an agent that stops answering is gone after 10 missed heartbeats of 1 s: a live one under
    # load (a busy CI machine) is not taken for dead, and the dead one is let go in seconds
    conf = ("join_timeout=120,last_call_timeout=3,close_timeout=5,keep_alive_interval=1,"
            "keep_alive_max_attempt=10")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=1",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=elastic-test",
           f"--rdzv-conf={conf}", "--max-restarts=3", str(LAB), *map(str, COMMON),
           "--epochs", "4", "--max-steps", "40", "--checkpoint-dir", str(tmp_path / "ck"),
           "--checkpoint-every", "2", "--resume", "auto", "--log-json", str(log)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    agents = []
    try:
        for name in ("first", "second"):
            with open(tmp_path / f"{name}.out", "w") as out:
                agents.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out,
                                               stderr=subprocess.STDOUT, start_new_session=True))
            if name == "first":  # it hosts the rendezvous: the second must not
                wait_until(lambda: _listening(port), agents[0], what="the first agent's store")
        first, second = agents
        wait_until(lambda: any(r["event"] == "train" and r["world_size"] == 2 and r["step"] >= 3
                               for r in _records(log)), first, second, what="training on 2 ranks")
        workers = subprocess.run(["pgrep", "-P", str(second.pid)], capture_output=True,
                                 text=True).stdout.split()
        for pid in [*map(int, workers), second.pid]:  # the "node" is gone: agent and worker
            os.kill(pid, signal.SIGKILL)
        first.wait(timeout=300)
    finally:
        for agent in agents:
            end_session(agent)
    said = (tmp_path / "first.out").read_text()
    assert first.returncode == 0, said
    records = _records(log)
    resumes = [r for r in records if r["event"] == "resume"]
    assert resumes and resumes[-1]["world_size"] == 1, said
    resumed_at = resumes[-1]["step"]
    assert resumes[-1]["checkpoint"].endswith(f"step-{resumed_at:07d}")
    assert "1 × 600 = global batch 600" in said and f"resumed at step {resumed_at}" in said
    # the 2 ranks, the only run before it, trained the step the one rank resumed: rank 0 logged the
    # step before it (--log-every 1), and a step is saved only once both ranks have done it. (Not
    # asserted: that step's own `train` or `checkpoint` record. Rank 0 writes .metadata inside
    # dcp.save's last collective, and the collectives after it fail once the peer is gone: a
    # complete checkpoint can have neither record.)
    before = records[:records.index(resumes[-1])]
    assert resumed_at >= 2 and {r["world_size"] for r in before} == {2}, records
    assert any(r["event"] == "train" and r["step"] >= resumed_at - 1 for r in before), records
    done = [r for r in records if r["event"] == "done"][-1]
    assert (done["step"], done["world_size"], done["stop"]) == (40, 1, "max_steps"), done


GPUCHECK = ROOT / "src" / "dpcourse" / "cluster" / "gpucheck.py"  # its checkpoint worker


def _reshard(nproc, action, wrap, path):
    log = path.with_suffix(f".{action}{nproc}{wrap}.jsonl")
    ok(run(lab_cmd(nproc, GPUCHECK, "--worker", "reshard", "--action", action, "--wrap", wrap,
                   "--path", path, "--backend", "gloo", "--device", "cpu", "--log-json", log),
           timeout=300))
    return json.loads(log.read_text().splitlines()[-1])


@pytest.mark.slow
def test_fsdp2_shards_and_ddp_replicas_are_resumed_by_any_wrapper_at_any_world_size(tmp_path):
    """make gpu-check's checkpoint worker on CPU processes, with the lab's calls (get_state_dict
    with FLAT, dcp.save; dcp.load, set_state_dict), on the course CNN with AdamW: FSDP2 saved on
    2 ranks, its shards re-cut for 3 ranks and joined for one plain process; DDP saved on 2 ranks,
    loaded as FSDP2 shards on 3. Each then trains 2 more steps on the same global batches: the
    weights are those of the run never stopped (float64; measured 2.8e-17)."""
    from dpcourse.cluster.gpucheck import max_weight_diff

    fsdp2 = _reshard(2, "save", "fsdp", tmp_path / "fsdp")
    ddp2 = _reshard(2, "save", "ddp", tmp_path / "ddp")
    assert max_weight_diff(fsdp2, ddp2) == 0.0  # two ranks: the same sums
    total = ddp2["held"]  # a replica holds all of Adam's moments
    assert fsdp2["held"] < 0.6 * total  # FSDP2: each rank its shards' (about 1/2)
    for nproc, kind, saved, reference in ((3, "fsdp", "fsdp", fsdp2), (1, "plain", "fsdp", fsdp2),
                                          (3, "fsdp", "ddp", ddp2)):
        resumed = _reshard(nproc, "load", kind, tmp_path / saved)
        assert resumed["world_size"] == nproc
        assert max_weight_diff(resumed, reference) < 1e-12, (saved, kind, nproc)
        assert resumed["held"] == total if kind == "plain" else resumed["held"] < 0.45 * total


class _Planted:
    """What a hostile .metadata holds: unpickling it runs a command."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.slow
def test_a_checkpoint_someone_else_could_have_written_is_never_read(stopped, tmp_path):
    """A distributed checkpoint's .metadata is a pickle: reading it runs what it holds. A
    classmate's folder (another owner), and one of yours that others may write to, each with a
    planted .metadata: the lab refuses both in one line, before DCP reads a byte, and the planted
    command never runs."""
    import pickle
    import shutil

    ck, _ = stopped
    marker = tmp_path / "ran"
    for case, says in (("theirs", "owned by uid 65534"), ("writable", "is writable by others")):
        folder = tmp_path / case
        shutil.copytree(ck / "step-0000010", folder)
        (folder / ".metadata").write_bytes(pickle.dumps(_Planted(marker)))
        if case == "theirs":  # another account's files (the test runs as root: chown works)
            for entry in [folder, *folder.iterdir()]:
                os.chown(entry, 65534, 65534)
        else:
            (folder / ".metadata").chmod(0o646)
        result = run(lab_cmd(1, LAB, *COMMON, "--resume", folder), timeout=300)
        said = [line for line in messages(result.stdout) if line.startswith("[rank")]
        assert result.returncode != 0 and len(said) == 1, result.stdout
        assert said[0].startswith(f"[rank 0] --resume {folder}: ") and says in said[0], said
        assert "runs the code its .metadata (a pickle) may hold" in said[0]
        assert not marker.exists(), "the planted pickle ran"
