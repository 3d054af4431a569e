"""Notebook 14's numbers: dpcourse.explore.checkpoints (Llama 3's failure rate, Young's interval,
the loss it minimises, a distributed checkpoint's pieces) and the interval explorer that draws
them."""
import math

import pytest
import torch

from dpcourse.explore import checkpoints


def test_the_failure_rate_is_llama_3s():
    # 419 interruptions in 54 days on 16,384 GPUs (arXiv:2407.21783, §3.3.4)
    assert checkpoints.GPU_MTBF_H == pytest.approx(50_677, abs=1)
    assert checkpoints.mtbf_s(16_384) / 3600 == pytest.approx(54 * 24 / 419)
    assert checkpoints.mtbf_s(8) == pytest.approx(2048 * checkpoints.mtbf_s(16_384))


@pytest.mark.parametrize("save_s,mtbf_s", [(0.02, 3600.0), (30.0, 86_400.0), (300.0, 11_000.0)])
def test_youngs_interval_is_where_the_loss_is_least(save_s, mtbf_s):
    best = checkpoints.young_daly_s(save_s, mtbf_s)
    assert best == pytest.approx(math.sqrt(2 * save_s * mtbf_s))
    at = checkpoints.waste(best, save_s, mtbf_s, restart_s=60)
    for factor in (0.5, 0.9, 1.1, 2.0):  # on both sides, and near it
        assert checkpoints.waste(best * factor, save_s, mtbf_s, restart_s=60) > at
    # at the optimum, saving and the work done again cost the same: C/τ = τ/(2M)
    assert save_s / best == pytest.approx(best / (2 * mtbf_s))


def test_human_durations():
    assert [checkpoints.human_s(s) for s in (45, 750, 11_000, 3 * 86_400)] == \
        ["45 s", "12.5 min", "3.1 h", "3.0 days"]


def test_the_pieces_of_a_checkpoint_are_read_from_its_metadata(tmp_path):
    """One process's checkpoint of two tensors and a number: each piece, its file and its bytes;
    the totals per file."""
    import torch.distributed.checkpoint as dcp

    state = {"model": {"w": torch.zeros(100), "b": torch.ones(3)}, "step": 7}
    dcp.save(state, checkpoint_id=tmp_path / "ck", no_dist=True)
    rows = checkpoints.pieces(tmp_path / "ck")
    assert [key for key, _, _ in rows] == ["model.b", "model.w", "step"]
    assert {file for _, file, _ in rows} == {"__0_0.distcp"}
    assert dict((k, size) for k, _, size in rows)["model.w"] > 400  # 100 float32 and a header
    assert checkpoints.by_file(rows) == {"__0_0.distcp": (3, sum(s for _, _, s in rows))}
