"""dpcourse.explore.memory: the memory arithmetic of DDP and ZeRO, against the ZeRO paper's own
numbers."""
import pytest

from dpcourse.explore import memory, widgets


def test_the_zero_papers_figure_1():
    """Rajbhandari et al. (2020), Fig. 1: Ψ = 7.5 B, N = 64, mixed precision with Adam (K = 12):
    120 GB for plain DP, 31.4 GB for P_os, 16.6 GB for P_os+g, 1.9 GB for P_os+g+p."""
    want = {0: 120, 1: 31.4, 2: 16.6, 3: 1.9}
    for stage, gb in want.items():
        assert (memory.per_worker(7.5e9, 64, stage, "mixed")["total"] / 1e9
                == pytest.approx(gb, abs=0.05))


def test_what_each_stage_shards():
    P = 8
    dp = memory.per_worker(1e6, P, 0)
    assert dp == {"weights": 4e6, "grads": 4e6, "optimizer": 8e6, "total": 16e6}
    assert (memory.per_worker(1e6, P, 1)["optimizer"] == 8e6 / P
            and memory.per_worker(1e6, P, 1)["grads"] == 4e6)
    assert (memory.per_worker(1e6, P, 2)["grads"] == 4e6 / P
            and memory.per_worker(1e6, P, 2)["weights"] == 4e6)
    assert memory.per_worker(1e6, P, 3)["total"] == pytest.approx(16e6 / P)
    # mixed precision keeps the same 16 bytes per parameter, split 2 + 2 + 12
    assert memory.per_worker(1e6, 1, 0, "mixed") == {"weights": 2e6, "grads": 2e6,
                                                     "optimizer": 12e6, "total": 16e6}
    # one worker: every stage is plain DP
    assert {memory.per_worker(1e6, 1, s)["total"] for s in memory.STAGES} == {16e6}


def test_communication_two_psi_then_three():
    P, psi = 64, 1e9
    ring = (P - 1) / P
    for stage in (0, 1, 2):
        assert memory.comm_per_step(psi, P, stage, "fp32") == pytest.approx(2 * psi * ring * 4)
    assert (memory.comm_per_step(psi, P, 3, "fp32") / memory.comm_per_step(psi, P, 0, "fp32")
            == pytest.approx(1.5))
    assert memory.comm_per_step(psi, 1, 3) == 0  # alone: nothing to send
    assert memory.comm_per_step(psi, P, 0, "mixed") == memory.comm_per_step(psi, P, 0, "fp32") / 2


def test_what_fits_and_on_how_many():
    gpt3, a100 = memory.MODELS["GPT-3"], memory.GPUS["A100 80 GB"]
    assert memory.min_world_size(gpt3, 0, a100, "mixed") is None  # DDP: never, on any number
    assert memory.min_world_size(gpt3, 1, a100, "mixed") is None  # weights + grads alone are 700 GB
    assert memory.min_world_size(gpt3, 3, a100, "mixed") == 64  # 2.8 TB / 64 = 43.8 GB ≤ 64 GB
    assert memory.fits(memory.MODELS["ResNet-50"], 1, 0, memory.GPUS["V100 16 GB"])
    lines = memory.explain(gpt3, 64, "A100 80 GB", "mixed")
    assert len(lines) == 4 and "never" in lines[0] and "✓ fits" in lines[3]


@pytest.mark.parametrize("bad", [dict(stage=4), dict(precision="fp16"), dict(world_size=0)])
def test_wrong_arguments_say_what_is_allowed(bad):
    args = {"params": 1e6, "world_size": 2, "stage": 0, "precision": "fp32", **bad}
    with pytest.raises(ValueError, match="must be"):
        memory.per_worker(**args)


def test_human_units():
    assert (memory.human(512) == "512 B" and memory.human(1.6e10) == "16.0 GB"
            and memory.human(2.8e12) == "2.8 TB")


def test_explorer_builds_and_redraws():
    assert widgets.memory_explorer(precision="mixed").children[0].children[2].value == "mixed"
    box = widgets.memory_explorer()
    preset, gpu, precision = box.children[0].children
    billions, workers = box.children[1].children
    preset.value = "GPT-3"
    assert billions.value == pytest.approx(175, rel=1e-6)
    workers.value = 1024
    precision.value = "mixed"
    gpu.value = "H200 141 GB"
