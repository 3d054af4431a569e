"""solutions/labs/grad_average.py: the gradient-averaging identity, and where it breaks, in real
processes on the real FashionMNIST; the hand-synced BatchNorm against torch's BatchNorm2d; the
student copy stops at its stub.
"""
import importlib.util
import json
import sys

import pytest
import torch
import torch.distributed as dist

from conftest import ROOT, run, torchrun_cmd

SOLUTION = ROOT / "solutions" / "labs" / "grad_average.py"
STUDENT = ROOT / "labs" / "grad_average.py"


def records(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("nproc", [1, 3])
def test_the_identity_holds(nproc, tmp_path, fashion_root):
    """all_reduce(SUM)/K of the shard gradients = the whole batch's gradient, ≤ 1e-6, every rank
    alike."""
    log = tmp_path / "log.jsonl"
    args = ["--data-root", fashion_root, "--log-json", log]
    cmd = [sys.executable, SOLUTION, *args] if nproc == 1 else torchrun_cmd(nproc, SOLUTION, *args)
    result = run(cmd, timeout=120)
    assert result.returncode == 0, result.stdout
    (r,) = records(log)
    assert r["world_size"] == nproc and r["shards"] == [240 // nproc] * nproc
    assert r["max_rel_error"] <= 1e-6 and r["ranks_max_diff"] == 0.0 and r["holds"], r
    assert "→ holds" in result.stdout


def test_where_it_breaks(tmp_path, fashion_root):
    """--case all on 2 ranks: each assumption broken gives a real error, each repair restores
    ≤ 1e-6."""
    log = tmp_path / "log.jsonl"
    result = run(torchrun_cmd(2, SOLUTION, "--case", "all", "--shards", "50,190",
                              "--data-root", fashion_root, "--log-json", log), timeout=180)
    assert result.returncode == 0, result.stdout
    by_case = {}
    for r in records(log):
        by_case.setdefault(r["case"], []).append(r)
    assert list(by_case) == ["average", "float32", "unequal", "sum", "batchnorm", "dropout"], \
        list(by_case)
    assert all(r["ranks_max_diff"] == 0.0 for r in records(log)), "ranks must always agree"

    (avg,) = by_case["average"]
    assert avg["holds"] and avg["max_rel_error"] <= 1e-6
    (f32,) = by_case["float32"]  # float32 rounds: visibly above float64, within 1e-4
    assert f32["holds"] and 1e-9 < f32["max_rel_error"] <= 1e-4, f32

    plain, weighted = by_case["unequal"]
    assert plain["shards"] == weighted["shards"] == [50, 190]
    assert not plain["holds"] and plain["max_rel_error"] > 1e-2, plain
    assert weighted["holds"] and weighted["max_rel_error"] <= 1e-6, weighted

    vs_mean, vs_sum = by_case["sum"]
    assert vs_mean["ratio"] == pytest.approx(120, rel=1e-9), \
        "a sum loss averaged: n/K times the mean gradient"
    assert not vs_mean["holds"] and vs_sum["holds"] and vs_sum["max_rel_error"] <= 1e-6

    per_rank, synced = by_case["batchnorm"]
    assert not per_rank["holds"] and per_rank["max_rel_error"] > 1e-3, per_rank
    assert synced["holds"] and synced["max_rel_error"] <= 1e-6, synced
    assert "nn.SyncBatchNorm on the CPU → ValueError" in result.stdout

    same_seed, per_rank_seed, global_mask = by_case["dropout"]
    assert same_seed["masks_agree"] == 1.0 and not same_seed["holds"]
    assert 0.45 < per_rank_seed["masks_agree"] < 0.55 and not per_rank_seed["holds"]
    assert global_mask["holds"] and global_mask["max_rel_error"] <= 1e-6


def test_bad_shards_end_in_one_line(fashion_root):
    result = run(torchrun_cmd(2, SOLUTION, "--batch", "241", "--data-root", fashion_root),
                 timeout=90)
    assert result.returncode != 0
    assert ("--batch 241 does not split into 2 equal shards: use a multiple of 2, e.g. --batch 240."
            in result.stdout)
    assert "Traceback" not in result.stdout.split("does not split")[0]


def test_student_copy_stops_at_its_stub(fashion_root):
    result = run(torchrun_cmd(2, STUDENT, "--data-root", fashion_root), timeout=90)
    assert result.returncode != 0
    assert ("average_gradients is not done yet — NotImplementedError: Exercise: see the hint above"
            in result.stdout)
    assert result.stdout.count("not done yet") == 1, "rank 0 says it, once"


@pytest.fixture
def lab_module():
    spec = importlib.util.spec_from_file_location("grad_average", SOLUTION)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield module
    dist.destroy_process_group()


def test_hand_sync_batchnorm_is_batchnorm_on_one_rank(lab_module):
    """On one rank, HandSyncBatchNorm = BatchNorm2d: output, gradients and running statistics."""
    torch.manual_seed(0)
    x = torch.randn(6, 3, 5, 5, dtype=torch.float64) * 2 + 1
    ref = torch.nn.BatchNorm2d(3).double()
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5)
        ref.bias.uniform_(-1, 1)
    hand = lab_module.sync_batchnorm(torch.nn.Sequential(ref), torch.device("cpu"))[0]
    assert isinstance(hand, lab_module.HandSyncBatchNorm)
    ref = torch.nn.BatchNorm2d(3).double()
    ref.load_state_dict(hand.state_dict())
    outputs = []
    for bn in (ref, hand):
        xi = x.clone().requires_grad_()
        out = bn(xi)
        (out * torch.arange(out.numel(), dtype=out.dtype).reshape(out.shape)).sum().backward()
        outputs.append((out, xi.grad, bn.weight.grad, bn.bias.grad))
    for a, b in zip(*outputs):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(hand, name), getattr(ref, name), rtol=1e-10, atol=1e-10)
    hand.eval()
    ref.eval()
    torch.testing.assert_close(hand(x), ref(x))
