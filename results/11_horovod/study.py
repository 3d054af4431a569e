"""The runs behind notebook 11 where Horovod is not installed, and its one-process overheads
measured with more care than a notebook cell can afford.

    make horovod && .venv/bin/python results/11_horovod/study.py      # about 8 minutes on 2 cores

- ddp.jsonl, horovod.jsonl: notebook 11's section 2, the two labs on 2 processes with the same
  settings (torchrun and horovodrun --gloo).
- overhead.json: each lab on one process with and without its library's wrapper, ROUNDS rounds
  interleaved (plain, wrapped, plain, wrapped, ...), each run's median images/s over its logged
  intervals; the figure per configuration is the median over the rounds. On a shared 2-core
  machine a single run can be 10-20 % off (other work, CPU steal), hence the rounds.
- study.json: every command, the machine, and the load average before each run.
"""
from __future__ import annotations

import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
BIN = Path(sys.executable).parent
DDP, HVD = "solutions/labs/fashion_ddp.py", "solutions/labs/fashion_horovod.py"
SIDE_BY_SIDE = ["--global-batch-size", "128", "--max-steps", "240", "--eval-every", "60",
                "--log-every", "20"]
ONE = ["--global-batch-size", "128", "--max-steps", "600", "--no-eval", "--log-every", "25"]
ROUNDS = 5


def command(lab, nproc, args, log):
    launcher = ([str(BIN / "torchrun"), "--standalone", f"--nproc-per-node={nproc}"] if lab == DDP
                else [str(BIN / "horovodrun"), "--gloo", "-np", str(nproc), str(BIN / "python")])
    return [*launcher, lab, *args, "--log-json", str(log)]


def run(cmd, threads, record):
    record.append({"command": f"OMP_NUM_THREADS={threads} " + shlex.join(
                       os.path.relpath(c, ROOT) if c.startswith("/") else c for c in cmd),
                   "load_before": round(os.getloadavg()[0], 2)})
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
                   env={**os.environ, "OMP_NUM_THREADS": str(threads), "TQDM_DISABLE": "1"})


def median_rate(log: Path) -> float:
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    return statistics.median(r["samples_per_s"] for r in recs
                             if r["event"] == "train" and r["step"] > 25)


def main():
    runs: list[dict] = []
    for name, lab in (("ddp", DDP), ("horovod", HVD)):
        run(command(lab, 2, SIDE_BY_SIDE, HERE / f"{name}.jsonl"), 1, runs)
    rates: dict[str, list[float]] = {}
    tmp = HERE / "tmp.jsonl"
    for _ in range(ROUNDS):
        for name, lab, plain in (("DDP", DDP, "--no-ddp"), ("Horovod", HVD, "--no-hvd")):
            for kind, extra in (("plain", [plain]), ("wrapped", [])):
                tmp.unlink(missing_ok=True)
                run(command(lab, 1, ONE + extra, tmp), 2, runs)
                rates.setdefault(f"{name} {kind}", []).append(round(median_rate(tmp), 1))
    tmp.unlink(missing_ok=True)
    overhead = {k: statistics.median(v) for k, v in rates.items()}
    (HERE / "overhead.json").write_text(json.dumps(overhead, indent=1) + "\n")
    (HERE / "study.json").write_text(json.dumps({
        "machine": f"{platform.node()}: {os.cpu_count()} CPUs, "
                   f"{platform.processor() or platform.machine()}",
        "rounds": rates, "runs": runs}, indent=1) + "\n")
    for lib in ("DDP", "Horovod"):
        plain, wrapped = overhead[f"{lib} plain"], overhead[f"{lib} wrapped"]
        print(f"{lib:8s} plain {plain:7,.0f} images/s, wrapped {wrapped:7,.0f}: "
              f"{wrapped / plain:.1%} of plain "
              f"(rounds: {rates[f'{lib} plain']} / {rates[f'{lib} wrapped']})")


if __name__ == "__main__":
    main()
