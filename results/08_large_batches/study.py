"""The study behind notebook 08: a batch sweep, the learning-rate rules, and ways to send less.

    .venv/bin/python results/08_large_batches/study.py # the runs whose log is missing or incomplete
    .venv/bin/python results/08_large_batches/study.py --force    # every run again
    .venv/bin/python results/08_large_batches/study.py --only comm-fp16 batch-32

Every run is one command, written into study.json beside its log, for example:

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 solutions/labs/fashion_study.py \\
        --epochs 2 --time-split --device cpu --batch-size 128 --lr-scaling none --eval-every 32 \\
        --log-json results/08_large_batches/batch-128.jsonl

Two workers with one thread each, one after the other (about 20 minutes on 2 cores). Every run
trains for the same 2 epochs (the learning rate warms up, then decays to 0 at their end), so the
final records compare runs after a fixed number of epochs, and the evaluations along the way
(every ~8,192 images) compare them at a fixed time. study.json also records the machine and the
load average before each run: other work on the machine slows a run down.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
LAB = ROOT / "solutions" / "labs" / "fashion_study.py"
WORKERS = 2
COMMON = ["--epochs", "2", "--time-split", "--device", "cpu"]
# the sweep keeps --lr as it is: the rules diverge at large batches here (see RUNS)
SWEEP_RULE = "none"
EVAL_IMAGES = 8192  # evaluate about every this many training images, whatever the batch


def batch_args(batch: int, rule: str = SWEEP_RULE, *extra) -> list[str]:
    every = max(1, EVAL_IMAGES // (WORKERS * batch))
    return ["--batch-size", str(batch), "--lr-scaling", rule, "--eval-every", str(every), *extra]


# name → (group, label, lab arguments on top of COMMON)
RUNS = {f"batch-{b}": ("sweep", f"{b} per worker", batch_args(b))
        for b in (32, 64, 128, 256, 512, 1024, 2048)}
RUNS.update({  # the rules at 512 and 2048 per worker; "none" there is batch-512 and batch-2048
    "rule-512-sqrt": ("rules", "sqrt", batch_args(512, "sqrt")),
    "rule-512-linear": ("rules", "linear", batch_args(512, "linear")),
    "rule-2048-sqrt": ("rules", "sqrt", batch_args(2048, "sqrt")),
    "rule-2048-linear": ("rules", "linear", batch_args(2048, "linear")),
    "rule-2048-sqrt-warmup-1.5": ("rules", "sqrt, warm-up 1.5 epochs",
                                  batch_args(2048, "sqrt", "--warmup-epochs", "1.5")),
    "rule-2048-linear-lars": ("rules", "linear + LARS (eta 0.01)",
                              batch_args(2048, "linear", "--optimizer", "lars",
                                         "--lars-eta", "0.01")),
    # the same rules from a reference rate a third as large, at global batches of 128 and 1,024
    "lr0.05-64": ("rules", "none, --lr 0.05", batch_args(64, "none", "--lr", "0.05")),
    "lr0.05-512": ("rules", "none, --lr 0.05", batch_args(512, "none", "--lr", "0.05")),
    "lr0.05-512-sqrt": ("rules", "sqrt, --lr 0.05", batch_args(512, "sqrt", "--lr", "0.05")),
    "lr0.05-512-linear": ("rules", "linear, --lr 0.05", batch_args(512, "linear", "--lr", "0.05")),
})
# less communication at 128 per worker: batch-128 is the plain all-reduce, batch-32 the small batch
RUNS.update({
    "comm-fp16": ("comm", "fp16 hook", batch_args(128, SWEEP_RULE, "--comm-hook", "fp16")),
    "comm-bf16": ("comm", "bf16 hook", batch_args(128, SWEEP_RULE, "--comm-hook", "bf16")),
    "comm-powersgd": ("comm", "PowerSGD, rank 1",
                      batch_args(128, SWEEP_RULE, "--comm-hook", "powersgd")),
    "comm-accumulate-4": ("comm", "4 × 32 accumulated (no_sync)",
                          batch_args(128, SWEEP_RULE, "--accumulate", "4")),
    "comm-local-sgd-8": ("comm", "post-local SGD, average every 8",
                         batch_args(128, SWEEP_RULE, "--local-sgd", "8",
                                    "--local-sgd-warmup", "50")),
})


def command(name: str) -> list[str]:
    """The run's command line, as a learner would type it from the checkout."""
    return ["torchrun", "--standalone", f"--nproc-per-node={WORKERS}", str(LAB.relative_to(ROOT)),
            *COMMON, *RUNS[name][2], "--log-json", str((HERE / f"{name}.jsonl").relative_to(ROOT))]


def complete(path: Path) -> bool:
    return path.is_file() and any(json.loads(line).get("event") == "done"
                                  for line in path.read_text().splitlines() if line.strip())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--force", action="store_true",
                   help="run every run again, even those with a complete log")
    p.add_argument("--only", nargs="+", choices=list(RUNS), metavar="NAME",
                   help=f"only these runs: {', '.join(RUNS)}")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT / "src"))
    from dpcourse.explore.launch import run_ok, torchrun
    from dpcourse.explore.scaling import machine

    study_path = HERE / "study.json"
    study = json.loads(study_path.read_text()) if study_path.exists() else {"runs": {}}
    study["machine"] = machine(threads=1)
    study["workers"] = WORKERS
    for name in args.only or RUNS:
        group, label, _ = RUNS[name]
        log = HERE / f"{name}.jsonl"
        if complete(log) and not args.force:
            print(f"{name}: complete, skipped", flush=True)
            continue
        load = os.getloadavg()[0]
        # a CPU study: no GPU seen
        run_ok(torchrun(LAB, *COMMON, *RUNS[name][2], "--log-json", log, nproc=WORKERS,
                        log_json=False, env={"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""},
                        ranks="0", timeout=900))
        study["runs"][name] = {"group": group, "label": label,
                               "command": "OMP_NUM_THREADS=1 " + shlex.join(command(name)),
                               "load_before": round(load, 2),
                               "load_after": round(os.getloadavg()[0], 2)}
        # after each run: an interrupted study resumes
        study_path.write_text(json.dumps(study, indent=1) + "\n")
    # the order above
    study["runs"] = {name: study["runs"][name] for name in RUNS if name in study["runs"]}
    study_path.write_text(json.dumps(study, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
