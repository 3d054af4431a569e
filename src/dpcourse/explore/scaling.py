"""Strong and weak scaling studies of a training lab: run them, tabulate them, plot them.

    python -m dpcourse.explore.scaling run --workers 1 2 4 --mode strong weak \\
        -- --max-steps 300 --no-eval
    python -m dpcourse.explore.scaling table runs/scaling  # the table, as text
    python -m dpcourse.explore.scaling plot runs/scaling   # throughput, speedup, efficiency vs K

Strong scaling splits a fixed global batch between K workers (the same problem, more hands);
weak scaling gives each worker a fixed batch (K workers, K times the work per step). Every
worker gets the same number of threads, so K × threads is what the study asks of the cores; a
run that asks for more than the machine has is kept but flagged "oversubscribed".

`run` writes OUT/study.json (the plan, each run's command, the machine) and one JSON-lines log
per run, OUT/<mode>-k<K>.jsonl, written by the lab's rank 0. A run whose log has the lab's final
"done" record is complete and skipped when the same command runs again: an interrupted study
resumes where it stopped. `--task i` runs only the i-th run of the plan (one task of a Slurm
job array). `table` and `plot` read only study.json and the logs.
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import os
import platform
import socket
import sys
from datetime import datetime
from pathlib import Path

from dpcourse.explore import launch
from dpcourse.lab.errors import CourseError
from dpcourse.lab.metrics import read_log
from dpcourse.lab.world import bar_off

MODES = ("strong", "weak")
LAB_ARGS = ("--max-steps", "300", "--no-eval")  # long enough for a steady state, no evaluation
RATE_EVENTS = ("train", "eval", "epoch", "done")  # the lab's records that close a timing window


# ------------------------------------------------------------------------------- the plan
def plan(modes=MODES, workers=(1, 2), batch_size: int = 128, global_batch_size: int | None = None,
         threads: int = 1) -> list[dict]:
    """One dict per run: ``name`` (``weak-k2``: its log is ``weak-k2.jsonl``), ``mode``,
    ``workers`` (K), ``threads`` (per worker), ``batch_size`` (per worker), ``global_batch``
    and ``args``, the lab's batch options.

    weak: ``--batch-size B`` per worker, global batch K × B. strong: ``--global-batch-size G``
    for every K, G = B × max(K) unless given; every K must divide G.
    """
    modes = list(dict.fromkeys(modes))
    workers = sorted(set(int(k) for k in workers))
    if not modes or any(m not in MODES for m in modes):
        raise ValueError(f"modes must be among {MODES}, not {modes}")
    if not workers or workers[0] < 1 or threads < 1 or batch_size < 1:
        raise ValueError("workers, threads and batch size must be at least 1")
    G = global_batch_size or batch_size * workers[-1]
    if "strong" in modes:
        bad = [k for k in workers if G % k]
        if bad:
            step = math.lcm(*workers)  # the smallest batch every K divides
            usable = max(1, round(G / step)) * step
            raise ValueError(
                f"Strong scaling splits one global batch of {G} between K workers, and "
                f"K = {', '.join(map(str, bad))} does not divide {G}. Use a global batch "
                f"that every K divides, e.g. --global-batch-size {usable}.")
    runs = []
    for mode in modes:
        for k in workers:
            if mode == "weak":
                b, g, args = batch_size, batch_size * k, ["--batch-size", str(batch_size)]
            else:
                b, g, args = G // k, G, ["--global-batch-size", str(G)]
            runs.append({"name": f"{mode}-k{k}", "mode": mode, "workers": k, "threads": threads,
                         "batch_size": b, "global_batch": g, "args": args})
    return runs


def machine(threads: int) -> dict:
    """What the throughputs depend on: cores this process may use, CPU, GPU, torch, the date."""
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return {"host": socket.gethostname(), "cores": cores, "cpu": _cpu_name(), "threads": threads,
            "gpus": gpus, "cuda_device": torch.cuda.get_device_name(0) if gpus else None,
            "torch": torch.__version__, "python": platform.python_version(),
            "date": datetime.now().astimezone().isoformat(timespec="seconds")}


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# ------------------------------------------------------------------------------ the study
def run(out, lab=None, modes=MODES, workers=(1, 2), batch_size: int = 128,
        global_batch_size: int | None = None, threads: int = 1, lab_args=LAB_ARGS,
        task: int | None = None, echo: bool = False, timeout: float = 3600) -> list[Path]:
    """Run the study's runs that have no complete log of this lab yet, one after the other; return
    the logs. A complete log is reused only when the lab file that wrote it is the same, byte for
    byte: each run's ``<name>.lab-sha256`` holds the hash of the lab it was started with (and of
    the labs beside it that it imports: ``lab_digest``), so an edited lab (a learner's exercise,
    a fix) runs the study again.

    ``lab``: a lab script (default: ``fashion_study.py``, the learner's or the solution, as
    ``launch.lab`` finds it), launched as ``torchrun --nproc-per-node K lab <batch option>
    *lab_args --log-json OUT/<name>.jsonl`` with OMP_NUM_THREADS=threads. ``task=i``: only the
    i-th run of the plan (a Slurm array task). ``echo`` shows the lab's own lines. A run that
    fails raises CourseError with the lab's error; the runs already complete stay complete.
    """
    from tqdm.auto import tqdm

    runs = plan(modes, workers, batch_size, global_batch_size, threads)
    out, lab = Path(out), _find_lab(lab)
    for r in runs:
        log = out / f"{r['name']}.jsonl"
        r.update(lab=lab.name, lab_args=[str(a) for a in lab_args], log=log.name,
                 command=f"OMP_NUM_THREADS={threads} torchrun --standalone "
                         f"--nproc-per-node={r['workers']} "
                         + " ".join([launch._relative(lab), *r["args"], *map(str, lab_args),
                                     "--log-json", str(log)]))
    if task is not None and not 0 <= task < len(runs):
        raise CourseError(f"--task {task}: this study has {len(runs)} runs, numbered 0 to "
                          f"{len(runs) - 1} ({', '.join(r['name'] for r in runs)}). "
                          f"For a Slurm job array: --array=0-{len(runs) - 1}.")
    study = _save_study(out, runs, machine(threads))
    todo = runs if task is None else [runs[task]]
    cores, gpus = study["machine"]["cores"], study["machine"]["gpus"]
    print(f"scaling study in {out}: {len(todo)} of {len(runs)} runs, {lab.name}, {threads} thread"
          f"{'s' if threads > 1 else ''} per worker, {cores} cores", flush=True)
    for k in sorted({r["workers"] for r in todo if r["workers"] * threads > cores}):
        print(f"  K={k}: {k} workers × {threads} thread{'s' if threads > 1 else ''} > "
              f"{cores} cores: oversubscribed, flagged in the table and the plot", flush=True)
    if gpus and any(r["workers"] > gpus for r in todo) and "--device" not in lab_args:
        print(f"  this node has {gpus} GPU(s): runs with more workers train on the CPU "
              "(one GPU per process), which is a different study: keep K ≤ the GPUs", flush=True)

    logs = []
    digest = lab_digest(lab)
    bar = tqdm(todo, unit="run", desc="scaling", disable=bar_off(0))
    for r in bar:
        log, made_by = out / r["log"], out / f"{r['name']}.lab-sha256"
        what = f"{r['mode']:6} K={r['workers']}"
        bar.set_postfix_str(what.replace("  ", " "))
        if log.exists() and is_complete(read_log(log)):
            if made_by.exists() and made_by.read_text().strip() == digest:
                tqdm.write(f"{what}: skipped, its log is complete ({log})")
                logs.append(log)
                continue
            tqdm.write(f"{what}: its log was written by another version of {lab.name}: run again")
        log.unlink(missing_ok=True)  # an interrupted run starts again from scratch
        # before the run: a log is never newer than its lab's hash
        made_by.write_text(digest + "\n")
        try:
            launch.run_ok(launch.torchrun(lab, *r["args"], *lab_args, "--log-json", log,
                                          nproc=r["workers"], log_json=False, echo=echo, ranks="0",
                                          env={"OMP_NUM_THREADS": str(threads)}, timeout=timeout))
        except CourseError as err:
            done = sum((out / x["log"]).exists() and is_complete(read_log(out / x["log"]))
                       for x in runs)
            raise CourseError(f"{err.message}\n{what.replace('  ', ' ')} did not complete; "
                              f"{done} of {len(runs)} runs are. "
                              "The same command resumes the study.") from None
        rate = throughput(read_log(log))
        tqdm.write(f"{what}: {rate:9,.1f} samples/s  (global batch {r['global_batch']}, {log})")
        logs.append(log)
    bar.close()
    return logs


def lab_digest(lab: Path) -> str:
    """The SHA-256 of ``lab`` and of the labs beside it that it imports (fashion_study.py runs
    fashion_ddp.py's data, setup and Trainer): an edit to either is another lab."""
    digest = hashlib.sha256(lab.read_bytes())
    names = set()
    for node in ast.walk(ast.parse(lab.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    for name in sorted(names):
        beside = lab.parent / f"{name}.py"
        if beside.is_file():
            digest.update(beside.read_bytes())
    return digest.hexdigest()


def _find_lab(lab) -> Path:
    if lab is None:
        return launch.lab("fashion_study.py")
    path = Path(lab)
    if path.is_file():
        return path
    return launch.lab(str(lab))  # a lab's name: fashion_study or fashion_study.py


def _save_study(out: Path, runs: list[dict], facts: dict) -> dict:
    """study.json: create it, or add the new runs to the study already there.

    A folder holds one study (one lab, batch and thread count); more worker counts may be added
    to it. A run that exists under the same name with other options is refused, since its
    complete log would be taken for this run's. Written atomically; a new file is never
    clobbered (the tasks of a job array all write the same plan at about the same time).
    """
    path = out / "study.json"
    if not path.exists():
        study = {"runs": runs, "machine": facts}
        _write(path, study, replace=False)
        if not path.exists():  # the filesystem has no hard links: a plain write
            _write(path, study, replace=True)
    study = json.loads(path.read_text())
    known = {r["name"]: r for r in study["runs"]}
    old = study["runs"][0]

    def refuse(why):
        raise CourseError(f"{out} already holds a study {why}. Give another --out, or delete "
                          f"{out} to start afresh.")

    if (old["lab"], old["threads"]) != (runs[0]["lab"], runs[0]["threads"]):
        refuse(f"of {old['lab']} with {old['threads']} thread(s) per worker; this one is "
               f"{runs[0]['lab']} with {runs[0]['threads']}")
    for mode, key, flag in (("strong", "global_batch", "--global-batch-size"),
                            ("weak", "batch_size", "--batch-size")):
        before = {r[key] for r in study["runs"] if r["mode"] == mode}
        now = {r[key] for r in runs if r["mode"] == mode}
        if before and now and before != now:
            refuse(f"whose {mode} runs use {flag} {before.pop()} (this one: {now.pop()}); "
                   f"add {flag} to this command to match")
    for r in runs:
        if r["name"] in known and _meaning(known[r["name"]]["lab_args"]) != _meaning(r["lab_args"]):
            refuse(f"whose {r['name']} ran with the lab options "
                   f"{' '.join(known[r['name']]['lab_args'])!r} "
                   f"(this one: {' '.join(r['lab_args'])!r})")
    new = [r for r in runs if r["name"] not in known]
    if new:
        study["runs"] += new
        _write(path, study, replace=True)
    return study


def _meaning(lab_args: list[str]) -> list[str]:
    """The lab options that change what a run measures: all but where the data is read from
    (each task of a Slurm job array may stage it to its own node-local folder)."""
    out, skip = [], False
    for arg in lab_args:
        if skip:
            skip = False
        elif arg == "--data-root":
            skip = True
        elif not arg.startswith("--data-root="):
            out.append(arg)
    return out


def _write(path: Path, data: dict, replace: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    try:
        if replace:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)  # fails if the file exists: the first writer wins
    except (FileExistsError, PermissionError, NotImplementedError):
        pass
    finally:
        tmp.unlink(missing_ok=True)


# ------------------------------------------------------------------------------ the table
def is_complete(records: list[dict]) -> bool:
    """Whether the lab finished: its last act is the ``done`` record."""
    return any(r.get("event") == "done" for r in records)


def throughput(records: list[dict]) -> float | None:
    """Steady-state samples per second of one run, from the lab's own records.

    Each ``train``/``eval``/``epoch``/``done`` record's ``samples_per_s`` covers the steps since
    the previous one (training steps only, evaluation excluded). The first window is dropped
    (warm-up: first-touch allocations, the first collectives) unless it is the only one. The
    rest are weighted by their steps: total samples over total seconds,
    Σ stepsᵢ / Σ (stepsᵢ / rateᵢ), the global batch being the same throughout a run.
    """
    windows, last_step = [], 0
    for rec in records:
        if rec.get("event") == "resume":  # a resumed run counts again from its checkpoint
            last_step = rec["step"]
        if rec.get("event") not in RATE_EVENTS:
            continue
        steps, last_step = rec["step"] - last_step, rec["step"]
        if steps > 0 and rec.get("samples_per_s"):
            windows.append((steps, rec["samples_per_s"]))
    windows = windows[1:] or windows
    if not windows:
        return None
    return sum(s for s, _ in windows) / sum(s / rate for s, rate in windows)


def load_study(out) -> dict:
    path = Path(out) / "study.json"
    if not path.is_file():
        raise CourseError(f"No study in {out} (no study.json): run "
                          f"`python -m dpcourse.explore.scaling run --out {out}` first.")
    return json.loads(path.read_text())


def table(out) -> list[dict]:
    """One row per run of the study in ``out``, from study.json and the logs only.

    ``samples_per_s``: steady-state global throughput T(K) (see ``throughput``).
    ``speedup``: T(K) / T(1) of the same mode. ``efficiency``: T(K) / (K · T(1)) in both modes:
    for strong scaling that is speedup / K; for weak scaling, where K workers do K times the
    work per step, it is the same formula (equivalently: step time at K=1 / step time at K),
    and 1.0 is perfect in both. Without a K=1 run of a mode, its speedup and efficiency are None.
    ``oversubscribed``: K × threads > the cores study.json recorded. ``complete``: the log has
    the lab's ``done`` record (an incomplete run still shows the throughput it had reached).
    """
    out = Path(out)
    study = load_study(out)
    facts = study["machine"]
    rows = []
    for r in study["runs"]:
        log = out / r["log"]
        records = read_log(log) if log.is_file() else []
        rows.append({"name": r["name"], "mode": r["mode"],
                     "workers": r["workers"], "threads": r["threads"],
                     "batch_size": r["batch_size"], "global_batch": r["global_batch"],
                     "samples_per_s": throughput(records), "speedup": None, "efficiency": None,
                     "oversubscribed": r["workers"] * r["threads"] > facts["cores"],
                     "complete": is_complete(records), "log": str(log), "lab": r["lab"],
                     "host": facts["host"], "cores": facts["cores"], "cpu": facts.get("cpu"),
                     "cuda_device": facts.get("cuda_device")})
    for row in rows:
        base = next((b["samples_per_s"] for b in rows if b["mode"] == row["mode"]
                     and b["workers"] == 1 and b["samples_per_s"]), None)
        if base and row["samples_per_s"]:
            row["speedup"] = row["samples_per_s"] / base
            row["efficiency"] = row["speedup"] / row["workers"]
    return sorted(rows, key=lambda row: (MODES.index(row["mode"]), row["workers"]))


def format_table(rows: list[dict]) -> str:
    """The table as text, one line per run, and what machine it ran on."""
    if not rows:
        return "(no runs)"
    r0 = rows[0]
    where = r0["cuda_device"] or r0["cpu"]
    lines = [f"{r0['lab']} on {r0['host']} ({r0['cores']} cores, {where}), "
             f"{r0['threads']} thread{'s' if r0['threads'] > 1 else ''} per worker",
             f"{'mode':6} {'K':>3} {'batch/worker':>12} {'global':>7} {'samples/s':>10} "
             f"{'speedup':>8} {'efficiency':>10}  note"]
    num = lambda v, f: format(v, f) if v is not None else "—"  # noqa: E731
    for r in rows:
        notes = [n for n, on in (("oversubscribed", r["oversubscribed"]),
                                 ("incomplete", not r["complete"])) if on]
        lines.append(f"{r['mode']:6} {r['workers']:>3} {r['batch_size']:>12} "
                     f"{r['global_batch']:>7} "
                     f"{num(r['samples_per_s'], '10,.1f'):>10} {num(r['speedup'], '8.2f'):>8} "
                     f"{num(r['efficiency'], '10.2f'):>10}  {', '.join(notes)}".rstrip())
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- CLI
def parse_args(argv=None):
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    lab_args = None
    if "--" in argv:  # what follows goes to the lab untouched
        cut = argv.index("--")
        argv, lab_args = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(prog="python -m dpcourse.explore.scaling",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run the study (complete runs are skipped)",
                       usage="python -m dpcourse.explore.scaling run [options] [-- LAB OPTIONS]",
                       description="Run a lab for each K and mode; one JSON log per run in --out. "
                                   "Options after -- go to the lab, replacing the default "
                                   f"{' '.join(LAB_ARGS)}.")
    r.add_argument("--out", default="runs/scaling",
                   help="folder for study.json and the logs (default: runs/scaling)")
    r.add_argument("--lab", default=None,
                   help="lab script or name (default: fashion_study.py: labs/'s copy, "
                        "or solutions/labs/'s when run under solutions/)")
    r.add_argument("--mode", nargs="+", default=list(MODES), choices=MODES,
                   help="strong: a fixed global batch; weak: a fixed batch per worker "
                        "(default: both)")
    r.add_argument("--workers", nargs="+", type=int, default=[1, 2], metavar="K",
                   help="worker counts (default: 1 2)")
    r.add_argument("--batch-size", type=int, default=128, metavar="B",
                   help="per worker, weak scaling (default: 128); strong scaling's global batch "
                        "is B × the largest K unless given")
    r.add_argument("--global-batch-size", type=int, default=None, metavar="G",
                   help="strong scaling's global batch; every K must divide it")
    r.add_argument("--threads", type=int, default=1, metavar="N",
                   help="threads per worker, OMP_NUM_THREADS (default: 1)")
    r.add_argument("--task", type=int, default=None, metavar="I",
                   help="run only the i-th run (a Slurm array task: --task $SLURM_ARRAY_TASK_ID)")
    r.add_argument("--echo", action="store_true", help="show the lab's own output")
    r.add_argument("--timeout", type=float, default=3600, metavar="S",
                   help="seconds one run may take (default: 3600)")
    for name, what in (("table", "print the table"),
                       ("plot", "draw throughput, speedup and efficiency vs K")):
        s = sub.add_parser(name, help=what, description=what + " from OUT/study.json and the logs")
        s.add_argument("out", metavar="OUT", help="the study's folder (run's --out)")
        if name == "plot":
            s.add_argument("--save", default=None, help="image file (default: OUT/scaling.png)")
    args = p.parse_args(argv)
    if lab_args is not None and args.command != "run":
        p.error("options after -- are for `run` only")
    args.lab_args = LAB_ARGS if lab_args is None else lab_args
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.command == "run":
        try:
            run(args.out, args.lab, args.mode, args.workers,
                args.batch_size, args.global_batch_size, args.threads, args.lab_args,
                args.task, args.echo, args.timeout)
        except ValueError as err:  # the plan's own message says what to change
            raise CourseError(str(err)) from None
        except NotImplementedError as err:  # the learner's labs/ copy, exercises not done yet
            raise CourseError(f"{str(err).split('. ')[0]}. Complete it (its notebook's check says "
                              "when it is right), or study the complete lab: "
                              "--lab solutions/labs/fashion_study.py") from None
        print(format_table(table(args.out)))
    elif args.command == "table":
        print(format_table(table(args.out)))
    else:
        from dpcourse.explore import plots

        rows = table(args.out)
        print(format_table(rows))
        fig = plots.scaling(rows)
        save = Path(args.save or Path(args.out) / "scaling.png")
        save.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(save, dpi=120, bbox_inches="tight")
        print(f"saved {save}")


if __name__ == "__main__":
    main()
