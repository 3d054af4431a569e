"""make gpu-check: on a machine without a GPU it ends at once with one line and a failure;
its steps, rehearsed on the CPU (gloo, tiny sizes), launch the labs they name and read back
their figures."""
import json
import re
import subprocess
import sys

import pytest
import torch

from conftest import ROOT
from test_skeleton import lab_parser

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="a GPU is here: run make gpu-check itself")


def test_without_a_gpu_make_gpu_check_fails_at_once_with_one_line():
    done = subprocess.run(["make", "--no-print-directory", "gpu-check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    said = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert done.returncode != 0, said
    assert len(said) == 1 and said[0].startswith("make gpu-check needs a GPU") \
        and "there is no GPU on this machine" in said[0], said


def rehearse(tmp_path, *args):
    out = tmp_path / "gpu-check.json"
    done = subprocess.run([sys.executable, "-m", "dpcourse.cluster.gpucheck", "--cpu-rehearsal",
                           "--json", str(out), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout, json.loads(out.read_text())


def test_the_rehearsal_runs_every_step_and_writes_one_table_and_its_figures(tmp_path):
    # one process each: no launcher, the cheapest wiring check
    out, report = rehearse(tmp_path, "--nproc", "1")
    assert report["rehearsal"] is True and report["nproc"] == 1
    rows = {c["name"]: c for c in report["checks"]}
    assert list(rows) == ["doctor", "nccl", "fashion", "resnet50", "memory", "clinic", "drift",
                          "checkpoint"]
    assert all(c["ok"] for c in rows.values()), rows
    assert "skipped" in rows["nccl"]["summary"]  # one process: nothing to all-reduce between
    assert (rows["fashion"]["figures"]["test_accuracy"] > 0
            and rows["fashion"]["commands"][0].startswith("python "))
    assert (rows["resnet50"]["figures"]["synthetic_images_per_s"] > 0
            and rows["resnet50"]["figures"]["jpeg_images_per_s"] > 0)
    assert set(rows["memory"]["figures"]["peak_bytes"]) == {"ddp", "fsdp"}
    # saved by FSDP2 on one process, loaded by a plain one: the weights of the run never stopped
    assert rows["checkpoint"]["figures"]["resumed_on"] == 1
    assert rows["checkpoint"]["figures"]["max_abs_diff"] < 1e-12
    # one process: every strategy is the one process, in float32 to the bit; bfloat16 drifts
    drift = {(r["strategy"], r["dtype"]): r["max_abs_diff"]
             for r in rows["drift"]["figures"]["rows"]}
    assert len(drift) == 6 and all(len(d) == 4 for d in drift.values()), drift
    assert all(d[-1] <= 1e-6 for (_, dtype), d in drift.items() if dtype == "float32"), drift
    assert all(1e-4 < d[-1] < 1 for (_, dtype), d in drift.items() if dtype == "bfloat16"), drift
    assert (tmp_path / "gpu-check-drift.png").stat().st_size > 10_000
    assert "CPU REHEARSAL" in out and all(f"\n{name:10}  " in out for name in rows)


def test_the_bandwidth_step_all_reduces_between_two_processes(tmp_path):
    _, report = rehearse(tmp_path, "--only", "nccl")
    (row,) = report["checks"]
    assert (row["ok"] and row["figures"]["world_size"] == 2
            and row["figures"]["backend"] == "gloo"), row
    # nccl-tests' bus bandwidth: bytes / time × 2(n − 1)/n,
    # which for two ranks is the algorithm bandwidth
    assert row["figures"]["busbw_gbs"] == row["figures"]["algbw_gbs"] > 0
    assert row["commands"][0].startswith("torchrun --standalone --nproc-per-node 2 ")


def test_the_gpu_path_gives_each_lab_only_options_it_has_and_reads_its_figures_past_warm_up(
        monkeypatch):
    """The GPU path cannot run here: its launches are recorded instead, and answered with logs
    shaped like a 4-GPU node's. Every option it passes must be one its lab declares, and each row
    must read the right record (images/s: the last window, not the warm-up's)."""
    from dpcourse.cluster import gpucheck
    from dpcourse.explore.launch import Run

    def ranks(devices):
        return [{"rank": r, "device": f"cuda:{r}", "loaded_on": [d], "mib_per_gpu": [64, 0, 0, 0]}
                for r, d in enumerate(devices)]

    weights = {"w": [0.5, -0.25]}
    logs = {"gpucheck": [{"event": "busbw", "backend": "nccl", "world_size": 4, "algbw_gbs": 100.0,
                          "busbw_gbs": 150.0},
                         {"event": "reshard", "dcp_ms": 40.0, "weights": weights},
                         *[{"event": "drift", "strategy": name, "dtype": dtype, "world_size": 4,
                            "backend": "nccl", "steps": 30,
                            "max_abs_diff": [1e-7] * 29 + [3e-6 if dtype == "float32" else 2e-2]}
                           for dtype in ("float32", "bfloat16")
                           for name in ("DDP", "ZeRO-1 (ZeroRedundancyOptimizer)",
                                        "FSDP2 fully_shard")]],
            "fashion_ddp": [{"event": "epoch", "samples_per_s": 50_000.0},
                            {"event": "done", "test_accuracy": 0.905, "elapsed_s": 12.5,
                             "epoch": 3.0, "world_size": 4}],
            "imagenet_ddp": [{"event": "train", "samples_per_s": 900.0},
                             {"event": "train", "samples_per_s": 3000.0},
                             {"event": "done", "samples_per_s": 2000.0}],
            "fsdp_fashion": [{"event": "memory",
                              "ranks": [{"rank": 0, "peak_bytes": 400 * 2**20}]}],
            "bugs/no_set_device": [{"event": "done", "ranks": ranks(["cuda:0"] * 4)}],
            "bugs/no_set_device_fixed": [{"event": "done",
                                          "ranks": ranks([f"cuda:{r}" for r in range(4)])}]}
    calls = []

    def launch(self, name, *args, nproc=None, timeout=600):
        calls.append((name, [str(a) for a in args], nproc))
        return Run(["torchrun"], 0, [], logs[name])

    monkeypatch.setattr(gpucheck.Checker, "launch", launch)
    monkeypatch.setattr(gpucheck, "_jpeg_set", lambda dest, images, rehearsal: dest)
    # a V100: fp16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    checker = gpucheck.Checker(4, rehearsal=False, root=ROOT)
    for name in ("nccl", "fashion", "resnet50", "memory", "clinic", "drift", "checkpoint"):
        checker.check(name, lambda: gpucheck.CHECKS[name](checker))
    rows = {r.name: r for r in checker.results}
    assert all(r.ok for r in rows.values()), rows
    assert ("after 30 steps on 4 GPU(s), max |Δweight| vs one process in float32: float32 ≤ "
            "3.0e-06, bfloat16 ≤ 2.0e-02") in rows["drift"].summary, rows["drift"].summary
    assert (rows["resnet50"].figures["synthetic_images_per_s"] == 3000.0
            and rows["resnet50"].figures["amp"] == "fp16")
    assert (rows["fashion"].figures["samples_per_s"] == 50_000.0
            and "90.50%" in rows["fashion"].summary)
    assert "cuda:0" in rows["clinic"].summary
    # FSDP2 saved on the node's 4 GPUs, its shards re-cut for 3
    reshard = [(args[args.index("--action") + 1], args[args.index("--wrap") + 1], nproc)
               for name, args, nproc in calls if "reshard" in args]
    assert reshard == [("save", "fsdp", None), ("load", "fsdp", 3)], reshard
    assert "FSDP2 saved on 4 GPU(s) (40 ms), resumed as FSDP2 on 3" in rows["checkpoint"].summary
    for name, args, _ in calls:
        path = (ROOT / "src" / "dpcourse" / "cluster" / "gpucheck.py" if name == "gpucheck"
                else ROOT / "solutions" / "labs" / f"{name}.py")
        # the lab's own parser, with the option groups of dpcourse.lab.options
        if "def parse_args" in path.read_text():
            known = {o for action in lab_parser(path)._actions for o in action.option_strings}
        else:  # gpucheck's worker and the clinic's bugs: their options, as written
            known = set(re.findall(r'"(--[a-z0-9-]+)"', path.read_text()))
        for option in (a for a in args if a.startswith("--")):
            assert option in known, f"{name} has no option {option}"
        assert ("--device" in args and args[args.index("--device") + 1] == "cuda"
                or name.startswith("bugs/")), (name, args)


def test_a_failed_lab_run_is_a_failed_row_and_the_others_still_run(monkeypatch):
    from dpcourse.cluster import gpucheck
    from dpcourse.explore.launch import Run

    monkeypatch.setattr(gpucheck.Checker, "launch", lambda self, name, *a, **k: Run(
        ["torchrun"], 1, ["[rank1]: RuntimeError: CUDA out of memory"], []))
    checker = gpucheck.Checker(2, rehearsal=False, root=ROOT)
    checker.check("fashion", lambda: gpucheck.fashion(checker))
    checker.check("nccl", lambda: gpucheck.nccl(checker))
    assert [r.ok for r in checker.results] == [False, False]
    assert checker.results[0].summary == ("FAILED: exit status 1: "
                                          "[rank1]: RuntimeError: CUDA out of memory")


def test_a_float32_drift_beyond_rounding_fails_its_row(monkeypatch):
    """float32 on the GPUs must stay on one process's weights; a strategy 1e-2 away (a sum for a
    mean, say) is a failed row that names it."""
    from dpcourse.cluster import gpucheck
    from dpcourse.explore.launch import Run

    rows = [{"event": "drift", "strategy": name, "dtype": dtype, "max_abs_diff": [d]}
            for name, dtype, d in (("DDP", "float32", 2e-7), ("FSDP2 fully_shard", "float32", 1e-2),
                                   ("DDP", "bfloat16", 2e-2))]
    monkeypatch.setattr(gpucheck.Checker, "launch",
                        lambda self, name, *a, **k: Run(["torchrun"], 0, [], rows))
    checker = gpucheck.Checker(2, rehearsal=False, root=ROOT)
    checker.check("drift", lambda: gpucheck.drift(checker))
    (row,) = checker.results
    assert not row.ok and row.summary == ("FAILED: FSDP2 fully_shard in float32 ended 0.01 from "
                                          "one process's weights (more than 0.001)"), row.summary
