"""One learning-rate schedule (dpcourse.lab.optim.warmup_then_decay) for every lab and notebook 08's
explorer: its values, a warm-up as long as the run or longer, and that the labs use it rather than
their own."""
import math
import re
import sys

import pytest

from conftest import ROOT, run
from dpcourse.explore.widgets import REFERENCE_BATCH as EXPLORER_REFERENCE_BATCH
from dpcourse.lab.optim import warmup_then_decay

LABS = ROOT / "solutions" / "labs"


def test_a_linear_climb_then_a_linear_or_cosine_decay_to_zero():
    linear, cosine = warmup_then_decay(10, 4), warmup_then_decay(10, 4, decay="cosine")
    assert [linear(s) for s in range(12)] == pytest.approx(
        [0.25, 0.5, 0.75, 1.0, 1.0, 5 / 6, 4 / 6, 3 / 6, 2 / 6, 1 / 6, 0.0, 0.0])
    assert [cosine(s) for s in range(4)] == [linear(s) for s in range(4)]  # the same warm-up
    assert [cosine(s) for s in range(4, 11)] == pytest.approx(
        [0.5 * (1 + math.cos(math.pi * (s - 4) / 6)) for s in range(4, 10)] + [0.0])
    assert [warmup_then_decay(4, 0)(s) for s in range(5)] == pytest.approx(
        [1.0, 0.75, 0.5, 0.25, 0.0])
    with pytest.raises(ValueError, match="'linear' or 'cosine'"):
        warmup_then_decay(10, 4, decay="step")


@pytest.mark.parametrize("warmup", [10, 25])
def test_a_warm_up_as_long_as_the_run_or_longer_climbs_and_never_divides_by_zero(warmup):
    """The labs divided by (total - warmup): 0/0 after the last step when the two were equal."""
    factor = warmup_then_decay(10, warmup)
    values = [factor(s) for s in range(14)]  # past the end too: LambdaLR asks for step `total`
    assert values[:10] == pytest.approx([(s + 1) / warmup for s in range(10)])  # rising all the run
    assert values[10:] == [0.0] * 4  # and nothing after it, never rising again
    assert max(values) == pytest.approx(10 / warmup)  # the peak only when warm-up = run


def test_every_lab_takes_the_one_schedule_and_states_its_one_batch_and_rate_policy():
    """One schedule and one scaling rule (dpcourse.lab.optim's), and in each training lab its
    reference batch, stated once (issue 44, item 5): FashionMNIST's 128, the explorer's too;
    ImageNet's Goyal et al.'s 256. The study lab takes the lesson's and writes the rule itself
    (notebook 08's exercise 1)."""
    for name in ("fashion_single.py", "fashion_ddp.py", "fashion_horovod.py", "imagenet_ddp.py"):
        text = (LABS / name).read_text()
        assert "warmup_then_decay(" in text, \
            f"{name} does not use dpcourse.lab.optim.warmup_then_decay"
        assert not re.search(r"LambdaLR\(\w+, lambda|ramp = lambda|/ \(total - warmup\)", text), \
            f"{name} has its own schedule"
        assert "scaled_lr(args.lr, " in text and "math.sqrt" not in text and "** 0.5" not in text, \
            f"{name} scales its learning rate some other way than optim.scaled_lr"
    defined = {p.name: int(m.group(1)) for p in LABS.rglob("*.py")
               if (m := re.search(r"^REFERENCE_BATCH = (\d+)\b", p.read_text(), re.M))}
    assert defined == {"fashion_single.py": 128, "fashion_ddp.py": 128, "fashion_horovod.py": 128,
                       "imagenet_ddp.py": 256}, defined
    assert EXPLORER_REFERENCE_BATCH == 128
    study = (LABS / "fashion_study.py").read_text()
    assert "from fashion_ddp import REFERENCE_BATCH" in study


def test_a_run_whose_warm_up_is_all_of_it_ends_normally(fashion_root):
    """--warmup-epochs = --epochs: the lab's last scheduler step divided 0 by 0 before
    (ZeroDivisionError)."""
    done = run([sys.executable, str(LABS / "fashion_ddp.py"), "--train-images", "1280",
                "--epochs", "1", "--warmup-epochs", "1", "--no-eval"], timeout=120)
    assert done.returncode == 0 and "ZeroDivisionError" not in done.stdout, done.stdout
