"""The ImageNet lab (solutions/labs/imagenet_ddp.py) and its data layer (dpcourse/lab/images.py):
a generated ImageFolder tree and its tar shards, node-local staging, 2 processes under torchrun
and a two-node job of slurm/imagenet.sbatch on the real test Slurm, from folders and from shards,
and a resumed run equal to an uninterrupted one."""
import json
import os
import re
import subprocess
import tarfile
from pathlib import Path

import pytest
import torch

from conftest import ROOT, lab_cmd, ranks_part, run
from dpcourse.lab import images
from dpcourse.lab.errors import CourseError
from dpcourse.lab.metrics import read_log

LAB = ROOT / "solutions" / "labs" / "imagenet_ddp.py"
# resnet18 on 48-px crops of the generated 64-px tree: 200 training and 100 validation images.
SMALL = ["--arch", "resnet18", "--image-size", "48", "--batch-size", "16", "--workers", "1",
         "--warmup-epochs", "1", "--lr", "0.1", "--label-smoothing", "0"]


def lab(nproc, *args, timeout=240, script=LAB):
    """torchrun the lab (python for one process); (CompletedProcess, rank 0's log records)."""
    log = Path(args[args.index("--log-json") + 1]) if "--log-json" in args else None
    result = run(lab_cmd(nproc, script, *args), timeout=timeout)
    return result, read_log(log) if log and log.exists() else []


# ------------------------------------------------------------------------------ the data layer
def test_generated_tree_is_imagenet_shaped_and_reproducible(tree, tmp_path):
    train = sorted(p.relative_to(tree["folders"])
                   for p in (tree["folders"] / "train").rglob("*.JPEG"))
    val = list((tree["folders"] / "val").rglob("*.JPEG"))
    assert len(train) == 200 and len(val) == 100
    assert len({p.parent for p in train}) == 10  # one folder per class
    again = images.make_imagefolder(tmp_path / "again", classes=10, per_class=2, val_per_class=1)
    first = tree["folders"] / "train" / images.class_names(10)[3]
    assert (again / "train" / first.name / "train_03_00001.JPEG").read_bytes() == \
        (first / "train_03_00001.JPEG").read_bytes(), \
        "the same arguments must write the same images"


def test_shards_hold_every_image_once_with_its_label(tree):
    for split in ("train", "val"):
        folder = images.JpegFolder(tree["folders"] / split, train=False, size=32)
        shards = images.TarShards(tree["shards"] / split, train=False, size=32)
        assert shards.classes == folder.classes and len(shards) == len(folder)
        by_bytes = {bytes(folder.read(i).numpy()): folder.targets[i] for i in range(len(folder))}
        seen = [(bytes(shards.read(i).numpy()), shards.targets[i]) for i in range(len(shards))]
        assert len({b for b, _ in seen}) == len(folder), f"{split}: an image is missing or twice"
        assert all(by_bytes.get(b) == t for b, t in seen), \
            f"{split}: a shard image has another label"
        assert (shards.targets[:10] != sorted(shards.targets[:10])
                or len(set(shards.targets[:50])) > 1), \
            "the shards are not shuffled: a shard would hold one class"
    # WebDataset's convention
    with tarfile.open(tree["shards"] / "train" / "shard-000000.tar") as tar:
        names = tar.getnames()
        assert names[:2] == ["train_00000000.jpg", "train_00000000.cls"] and len(names) == 100
        label = int(tar.extractfile(names[1]).read())
    assert label == images.TarShards(tree["shards"] / "train", True, 32).targets[0]


def test_random_crops_depend_on_image_and_epoch_not_on_the_worker(tree):
    a = images.JpegFolder(tree["folders"] / "train", train=True, size=32, seed=1)
    b = images.JpegFolder(tree["folders"] / "train", train=True, size=32, seed=1)
    b[5], b[9]  # another process would have loaded other images first
    assert torch.equal(a[7][0], b[7][0])
    a.set_epoch(1)
    assert not torch.equal(a[7][0], b[7][0]), "epoch 1 must crop anew"
    assert a[7][0].shape == (3, 32, 32) and a[7][0].dtype == torch.uint8


def test_staging_copies_once_and_never_trusts_half_a_copy(tree, tmp_path):
    dest = tmp_path / "local"
    images.stage(tree["shards"], dest)
    assert json.loads((dest / images.STAGED).read_text())["train/shard-000000.tar"] > 0
    tar = dest / "train" / "shard-000000.tar"
    stamp = tar.stat().st_mtime_ns
    images.stage(tree["shards"], dest)
    assert tar.stat().st_mtime_ns == stamp, "an identical copy was copied again"
    (dest / images.STAGED).unlink()  # a job killed mid-copy leaves no marker
    tar.write_bytes(b"half")
    images.stage(tree["shards"], dest)
    assert tar.read_bytes() == (tree["shards"] / "train" / "shard-000000.tar").read_bytes()


def test_a_missing_or_empty_data_root_is_one_clear_message(tmp_path):
    (tmp_path / "train").mkdir()
    for root in (None, tmp_path):
        args = ["--data-root", str(root)] if root else []
        result, _ = lab(2, *SMALL, *args, timeout=120)
        assert result.returncode != 0
        ranks = ranks_part(result.stdout)  # before torchrun's own report
        assert "make-imagefolder data/imagenet-mini" in ranks and "Traceback" not in ranks, \
            result.stdout
        assert result.stdout.count("make-imagefolder data/imagenet-mini") == 1, \
            "more than one rank said it"


def test_a_misspelt_architecture_is_one_line(tree):
    result, _ = lab(2, *SMALL, "--data-root", tree["folders"], "--arch", "resnet-50", timeout=120)
    ranks = ranks_part(result.stdout)
    assert result.returncode != 0 and "Traceback" not in ranks, result.stdout
    assert ranks.count("--arch resnet-50: torchvision has no such model") == 1, result.stdout


def test_an_unfinished_exercise_of_the_learners_lab_is_one_line(tree):
    """labs/imagenet_ddp.py as `make student` writes it: every rank meets the stub; rank 0 says
    where, once."""
    result, _ = lab(2, *SMALL, "--data-root", tree["folders"], timeout=120,
                    script=ROOT / "labs" / "imagenet_ddp.py")
    assert result.returncode != 0
    ranks = ranks_part(result.stdout)
    assert ("Traceback" not in ranks
            and ranks.count("This exercise of the lab is not done yet") == 1), result.stdout
    assert re.search(r'File "[^"]*imagenet_ddp.py", line \d+, in param_groups: '
                     r'Exercise: see the hint above', ranks)


# ------------------------------------------------------------------------------- the lab
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["folders", "shards"])
def test_two_processes_learn_and_count_every_validation_image_once(tree, layout, tmp_path):
    result, log = lab(2, *SMALL, "--data-root", tree[layout], "--epochs", "4",
                      "--log-json", tmp_path / "log.jsonl")
    assert result.returncode == 0, result.stdout
    done = log[-1]
    assert (done["event"] == "done" and done["world_size"] == 2
            and done["step"] == 4 * 6), result.stdout
    assert done["test_images"] == 100  # 50 per rank, none twice, none left out
    assert done["data"] == {"folders": "JpegFolder", "shards": "TarShards"}[layout]
    assert done["test_accuracy"] >= 0.4, f"no better than guessing (0.1): {done}"
    assert done["test_top5"] >= done["test_accuracy"]
    # rounded to 0.1
    assert done["samples_per_s_per_worker"] * 2 == pytest.approx(done["samples_per_s"], abs=0.2)
    assert 0 <= done["data_wait"] < 1 and done["flops_per_image"] > 1e8
    assert [r["epoch"] for r in log if r["event"] == "epoch"] == [1, 2, 3, 4]
    print(f"{layout}: top-1 {done['test_accuracy']:.2f}, top-5 {done['test_top5']:.2f}, "
          f"{done['samples_per_s']:.0f} img/s, {done['elapsed_s']:.1f} s")


@pytest.mark.slow
def test_resume_mid_epoch_is_bit_identical_to_an_uninterrupted_run(tree, tmp_path):
    common = [*SMALL, "--data-root", tree["folders"], "--epochs", "2", "--deterministic",
              "--no-eval"]
    full, _ = lab(2, *common, "--save-model", tmp_path / "full.pt")
    part, _ = lab(2, *common, "--max-steps", "8", "--checkpoint-dir", tmp_path / "ck")
    rest, log = lab(2, *common, "--resume", tmp_path / "ck" / "last.pt",
                    "--save-model", tmp_path / "resumed.pt", "--log-json", tmp_path / "log.jsonl")
    assert full.returncode == part.returncode == rest.returncode == 0, \
        full.stdout + part.stdout + rest.stdout
    assert "resumed at step 8" in rest.stdout, rest.stdout  # mid-epoch 2: 6 steps per epoch
    a, b = torch.load(tmp_path / "full.pt"), torch.load(tmp_path / "resumed.pt")
    assert all(torch.equal(a[k], b[k]) for k in a), "the resumed run ended with other weights"
    assert log[0]["event"] == "resume" and log[-1]["step"] == 12


@pytest.mark.slow
def test_synthetic_images_measure_compute_alone(tmp_path):
    result, log = lab(1, "--synthetic", "--arch", "resnet18", "--image-size", "32",
                      "--batch-size", "8", "--max-steps", "6", "--log-every", "3",
                      "--classes", "10", "--log-json", tmp_path / "log.jsonl")
    assert result.returncode == 0, result.stdout
    assert (log[-1]["data"] == "synthetic" and log[-1]["stop"] == "max_steps"
            and log[-1]["samples_per_s"] > 0)
    assert "test_accuracy" not in log[-1]


# ------------------------------------------------------------------ node-local copies (issue 24)
def test_a_staged_copy_is_listed_from_its_stage_record_as_imagefolder_lists_it(tree, tmp_path,
                                                                                monkeypatch):
    """Every rank of a node reads the file list stage() wrote once, instead of walking a million
    files."""
    from torchvision.datasets import ImageFolder

    staged = images.stage(tree["folders"], tmp_path / "local")
    expected = ImageFolder(staged / "train")
    # after staging: not listed
    (staged / "train" / expected.classes[0] / "notes.txt").write_text("not an image")

    def no_walk(*_, **__):
        raise AssertionError("the tree was walked")
    monkeypatch.setattr(os, "walk", no_walk)
    listed = images.JpegFolder(staged / "train", train=True, size=32)
    assert (list(zip(listed.files, listed.targets)) == expected.samples
            and listed.classes == expected.classes)
    # a tree that was not staged is walked, as before
    with pytest.raises(AssertionError, match="walked"):
        images.JpegFolder(tree["folders"] / "train", train=True, size=32)


def test_staging_onto_a_tmpfs_too_small_fails_before_copying(tree, tmp_path):
    """A RAM-backed /tmp that cannot hold the data: one message before a byte is copied."""
    small = tmp_path / "small"
    small.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(small)],
                             capture_output=True, text=True)
    assert mounted.returncode == 0, mounted.stderr
    try:
        with pytest.raises(CourseError) as err:
            images.stage(tree["shards"], small / "imagenet")
        message = str(err.value)
        assert (message.startswith("stage: ") and " to copy to " in message
                and "(a tmpfs: RAM" in message), message
        assert [p.name for p in (small / "imagenet").rglob("*")] == [images.LOCK], \
            "something was copied"
    finally:
        subprocess.run(["umount", str(small)], check=False)


def test_staging_onto_a_tmpfs_beyond_the_jobs_memory_limit_fails_before_copying(tree, tmp_path,
                                                                                 monkeypatch):
    """The tmpfs has room (the node's RAM), but the job's cgroup may use less than the copy
    needs."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    roomy = tmp_path / "roomy"
    roomy.mkdir()
    assert subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs",
                           str(roomy)]).returncode == 0
    try:
        # what the job's cgroup would leave
        monkeypatch.setattr(images, "memory_left", lambda: 10_000)
        with pytest.raises(CourseError,
                           match=r"is a tmpfs \(RAM\), and the job's memory limit leaves 0.0 MB"):
            images.stage(tree["shards"], roomy / "imagenet")
        assert [p.name for p in (roomy / "imagenet").rglob("*")] == [images.LOCK], \
            "something was copied"
        # no limit known: the tmpfs's own room decides
        monkeypatch.setattr(images, "memory_left", lambda: None)
        images.stage(tree["shards"], roomy / "imagenet")
    finally:
        subprocess.run(["umount", str(roomy)], check=False)
