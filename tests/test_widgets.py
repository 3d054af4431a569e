"""The explorers' pure functions, on real FashionMNIST, without a browser."""
import json
import math

import pytest

from conftest import ROOT, run, torchrun_cmd
from dpcourse.explore.widgets import (
    lr_batch_explorer,
    lr_rules_explorer,
    lr_schedule,
    peak_lr,
    sgd_softmax,
)
from dpcourse.lab.data import MEAN, STD, load_fashion_mnist


@pytest.fixture(scope="module")
def xy(fashion_root):
    images, labels = load_fashion_mnist(fashion_root)
    X = ((images[:10_000].float() / 255 - MEAN) / STD).reshape(10_000, -1)
    return X, labels[:10_000]


def test_a_sensible_learning_rate_lowers_the_loss(xy):
    run = sgd_softmax(*xy, lr=0.05, batch_size=64, samples=6400)
    assert run["steps"] == 100 and run["samples_seen"][-1] == 6400
    assert run["train_loss"][0] == pytest.approx(math.log(10), rel=1e-3)  # zero weights: uniform
    assert run["train_loss"][-1] < 0.8


def test_too_large_a_learning_rate_diverges_and_stops_early(xy):
    run = sgd_softmax(*xy, lr=10.0, batch_size=1, samples=5000)
    assert run["steps"] < 5000 and (not math.isfinite(run["train_loss"][-1])
                                    or run["train_loss"][-1] > 1e3)


def test_explorer_builds_with_two_sliders(xy):
    box = lr_batch_explorer(*xy, samples=640)
    lr, bs = box.children[0].children
    assert lr.description == "lr" and bs.value == 64
    bs.value = 256  # redraws without error


# ---------------------------------------------------------------- notebook 08: learning-rate rules
def test_peak_lr_rules():
    assert peak_lr("none", 0.1, 1024) == pytest.approx(0.1)
    assert peak_lr("linear", 0.1, 1024) == pytest.approx(0.8)  # 1024 / 128 = 8
    assert peak_lr("sqrt", 0.1, 1024) == pytest.approx(0.1 * math.sqrt(8))
    # smaller than the reference: smaller rate
    assert peak_lr("linear", 0.1, 32) == pytest.approx(0.025)
    with pytest.raises(ValueError, match="linear"):
        peak_lr("square", 0.1, 1024)


def test_schedule_warms_up_linearly_then_decays_to_zero():
    lrs = lr_schedule("linear", 0.1, batch=512, world_size=2, warmup_epochs=1, epochs=3)
    spe = 60_000 // 2 // 512  # 58 steps per epoch, the lab's count
    assert len(lrs) == 3 * spe + 1 and lrs[-1] == 0.0
    peak = 0.1 * 1024 / 128
    # the top at one epoch
    assert max(lrs) == pytest.approx(peak) and lrs.index(max(lrs)) in (spe - 1, spe)
    assert lrs[0] == pytest.approx(peak / spe)  # the first step: one warm-up step's share
    assert all(a < b for a, b in zip(lrs[:spe - 1], lrs[1:spe]))  # rising during the warm-up
    assert all(a > b for a, b in zip(lrs[spe:-1], lrs[spe + 1:]))  # falling after it
    # half-way down at the midpoint of the decay
    assert lrs[2 * spe] == pytest.approx(peak / 2, rel=0.02)


def test_schedule_refuses_a_batch_larger_than_the_data():
    with pytest.raises(ValueError, match="more than the 60,000"):
        lr_schedule("linear", 0.1, batch=4096, world_size=16, warmup_epochs=1, epochs=3)


@pytest.mark.slow
def test_schedule_is_what_the_lab_logs(tmp_path, fashion_root):
    """The explorer and fashion_ddp.py cannot drift apart: the lab's logged rate at every step."""
    log = tmp_path / "log.jsonl"
    # 2 workers × 3,000 = 6,000 per step: 10 steps per epoch, 3 of warm-up,
    # the whole schedule in 10 steps
    args = ["--batch-size", 3000, "--lr-scaling", "sqrt", "--lr", 0.05, "--warmup-epochs", 0.3,
            "--epochs", 1, "--width", 4, "--no-eval", "--log-every", 1, "--log-json", log]
    result = run(torchrun_cmd(2, ROOT / "solutions" / "labs" / "fashion_ddp.py", *args))
    assert result.returncode == 0, result.stdout
    records = [json.loads(line) for line in log.read_text().splitlines()]
    logged = {r["step"]: r["lr"] for r in records if "lr" in r}
    assert sorted(logged) == list(range(1, 11))
    want = lr_schedule("sqrt", 0.05, batch=3000, world_size=2, warmup_epochs=0.3, epochs=1)
    assert len(want) == 11
    for step, lr in logged.items():
        assert lr == pytest.approx(want[step], abs=2e-7), (f"step {step}: the lab logs {lr}, "
                                                           f"lr_schedule gives {want[step]}")
    assert records[0]["peak_lr"] == pytest.approx(max(want))


def test_lr_rules_explorer_builds_and_redraws():
    box = lr_rules_explorer()
    batch, workers, warmup = box.children[0].children
    assert batch.value == 512 and workers.value == 2
    workers.value = 64  # 64 × 512 > 60,000 images: still draws (one step per epoch)
    batch.value = 32
    warmup.value = 0.0
