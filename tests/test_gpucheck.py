"""make gpu-check: on a machine without a GPU it ends at once with one line and a failure; its steps,
rehearsed on the CPU (gloo, tiny sizes), launch the labs they name and read back their figures."""
import json
import subprocess
import sys

import pytest
import torch

from conftest import ROOT

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: run make gpu-check itself")


def test_without_a_gpu_make_gpu_check_fails_at_once_with_one_line():
    done = subprocess.run(["make", "--no-print-directory", "gpu-check"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    said = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert done.returncode != 0, said
    assert len(said) == 1 and said[0].startswith("make gpu-check needs a GPU") \
        and "there is no GPU on this machine" in said[0], said


def rehearse(tmp_path, *args):
    out = tmp_path / "gpu-check.json"
    done = subprocess.run([sys.executable, "-m", "dpcourse.gpucheck", "--cpu-rehearsal", "--json", str(out), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout, json.loads(out.read_text())


def test_the_rehearsal_runs_every_step_and_writes_one_table_and_its_figures(tmp_path):
    out, report = rehearse(tmp_path, "--nproc", "1")  # one process each: no launcher, the cheapest wiring check
    assert report["rehearsal"] is True and report["nproc"] == 1
    rows = {c["name"]: c for c in report["checks"]}
    assert list(rows) == ["doctor", "nccl", "fashion", "resnet50", "memory", "clinic"]
    assert all(c["ok"] for c in rows.values()), rows
    assert "skipped" in rows["nccl"]["summary"]  # one process: nothing to all-reduce between
    assert rows["fashion"]["figures"]["test_accuracy"] > 0 and rows["fashion"]["commands"][0].startswith("python ")
    assert rows["resnet50"]["figures"]["synthetic_images_per_s"] > 0 and rows["resnet50"]["figures"]["jpeg_images_per_s"] > 0
    assert set(rows["memory"]["figures"]["peak_bytes"]) == {"ddp", "fsdp"}
    assert "CPU REHEARSAL" in out and all(f"\n{name:9}  " in out for name in rows)


def test_the_bandwidth_step_all_reduces_between_two_processes(tmp_path):
    _, report = rehearse(tmp_path, "--only", "nccl")
    (row,) = report["checks"]
    assert row["ok"] and row["figures"]["world_size"] == 2 and row["figures"]["backend"] == "gloo", row
    # nccl-tests' bus bandwidth: bytes / time × 2(n − 1)/n, which for two ranks is the algorithm bandwidth
    assert row["figures"]["busbw_gbs"] == row["figures"]["algbw_gbs"] > 0
    assert row["commands"][0].startswith("torchrun --standalone --nproc-per-node 2 ")
