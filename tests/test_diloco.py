"""solutions/labs/diloco.py on 2 ranks under torchrun, over the emulated WAN link: DDP pays the
link at every step, DiLoCo once per H steps; the link's accounts say so, message by message;
the workers leave an outer step with the same weights; and DiLoCo trains (its accuracy within
a few points of DDP's after the same steps)."""
import json

import pytest

from conftest import ROOT, run, torchrun_cmd
from dpcourse.lab.links import PRESETS, EmulatedLink

LAB = ROOT / "solutions/labs/diloco.py"
STEPS, H = 100, 20
PARAMS = 4 * 20538  # FashionCNN(16)'s weights in float32


def done(folder, name, *args):
    log = folder / f"{name}.jsonl"
    result = run(torchrun_cmd(2, LAB, "--link", "wan", "--steps", STEPS, "--inner-steps", H,
                              "--log-json", log, *args), timeout=300)
    assert result.returncode == 0, result.stdout
    return [json.loads(line) for line in log.read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(fashion_root, tmp_path_factory):
    folder = tmp_path_factory.mktemp("diloco")
    return {"ddp": done(folder, "ddp", "--mode", "ddp"), "diloco": done(folder, "diloco")}


def test_diloco_sends_one_message_every_h_steps_and_ddp_one_every_step(runs):
    link = EmulatedLink(PRESETS["wan"], 2)
    test_all_reduce = link.seconds("all_reduce", 16)  # the test's two float64 totals
    for mode, messages in (("ddp", STEPS), ("diloco", STEPS // H)):
        final = runs[mode][-1]
        assert final["messages"] == messages, final
        assert final["bytes_sent"] == {"all_reduce": messages * PARAMS + 16}, final
        expected = messages * link.seconds("all_reduce", PARAMS) + test_all_reduce
        assert final["link_added_s"] == pytest.approx(expected, abs=1e-3), final
        assert final["replicas_max_diff"] == 0.0, final


def test_a_record_at_every_outer_step(runs):
    for mode in ("ddp", "diloco"):
        outer = [r for r in runs[mode] if r["event"] == "outer"]
        assert [r["step"] for r in outer] == list(range(H, STEPS + 1, H)), mode
        assert all(b["elapsed_s"] > a["elapsed_s"] for a, b in zip(outer, outer[1:])), mode


def test_diloco_trains_about_as_well_as_ddp_in_the_same_steps(runs):
    ddp, diloco = runs["ddp"][-1]["test_accuracy"], runs["diloco"][-1]["test_accuracy"]
    assert diloco > ddp - 0.05, (ddp, diloco)
    assert diloco > 0.7, diloco
