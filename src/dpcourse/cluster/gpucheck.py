"""make gpu-check: what one GPU node gives the course, in one table, the week before a workshop.

    srun --gpus-per-node=N --cpus-per-gpu=8 --time=30:00 make gpu-check   # on a GPU node
    python -m dpcourse.cluster.gpucheck --json build/gpu-check.json

On the GPUs this process sees (one process per GPU, each launch through torchrun) it runs:

    doctor     python -m dpcourse.cluster.doctor, its two-process all-reduce included
    nccl       all_reduce bus bandwidth of a 256 MiB float32 tensor (nccl-tests' definition:
               bytes / time × 2(n − 1)/n), over NCCL; needs 2 GPUs
    fashion    labs/fashion_ddp.py on every GPU to 90 % test accuracy: the time it took
    resnet50   labs/imagenet_ddp.py, ResNet-50 with autocast (bf16, or fp16 on GPUs without
               native bf16) and channels_last: images/s over all GPUs, with --synthetic (compute
               only) and from JPEG files (decoded by DataLoader workers, read from the page
               cache), past warm-up
    memory     labs/fsdp_fashion.py --memory ddp and fsdp: each rank's peak GPU memory
    clinic     labs/bugs/no_set_device.py and its fixed twin: where every rank's copy of a
               checkpoint saved from cuda:0 lands (the symptom needs 2 GPUs)
    drift      the equivalence matrix's cells that need NCCL, on the GPUs: DDP, ZeRO-1
               (ZeroRedundancyOptimizer) and FSDP2 trained 30 steps in float32 and with bfloat16
               compute (autocast; FSDP2's MixedPrecisionPolicy, gradients reduced in float32),
               each step's weights against one process's in float32, as torchtitan's
               docs/converging.md compares runs: float32 must stay on it, bfloat16 drifts; the
               curves plotted beside the JSON (gpu-check-drift.png)
    checkpoint FSDP2's shards saved through torch.distributed.checkpoint on every GPU and resumed
               on one GPU fewer (FSDP2 re-cuts them; on 1 or 2 GPUs, one plain process joins them),
               as labs/fashion_elastic.py saves: the weights 2 steps later are those of the run
               never stopped; the save's and the load's time

It prints one table and writes the figures as JSON (--json). Without a GPU it exits at once with
status 2 and one line saying why, so that it cannot be mistaken for a pass. --cpu-rehearsal runs
the same steps on the CPU (gloo, tiny sizes) so that the course's tests check this tool's wiring
where there is no GPU; its figures mean nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from dpcourse.explore.launch import Run, _cause, job_cores, lab, python, torchrun

# absolute imports: the bandwidth check runs this file as a script under torchrun
from dpcourse.lab import world
from dpcourse.lab.data import ensure_fashion_mnist
from dpcourse.lab.errors import CourseError
from dpcourse.lab.paths import project_root

MIB = 2**20


@dataclass
class Result:
    """One row of the table."""

    name: str
    ok: bool
    summary: str
    seconds: float = 0.0
    figures: dict = field(default_factory=dict)
    commands: list = field(default_factory=list)


class Checker:
    """Runs each check with the node's GPUs (or, rehearsing, on the CPU) and keeps its row."""

    def __init__(self, nproc: int, rehearsal: bool, root: Path):
        self.nproc, self.rehearsal, self.root = nproc, rehearsal, root
        self.device, self.backend = ("cpu", "gloo") if rehearsal else ("cuda", "nccl")
        self.on = f"{nproc} CPU process(es)" if rehearsal else f"{nproc} GPU(s)"
        self.results: list[Result] = []
        self._commands: list[str] = []
        self.plot: Path | None = None  # where the drift check draws its curves

    def launch(self, name: str, *args, nproc: int | None = None, timeout: float = 600) -> Run:
        """A lab of solutions/labs (or this file, as a worker) on ``nproc`` processes, quietly."""
        script = Path(__file__) if name == "gpucheck" else lab(name, start=self.root / "solutions")
        nproc = self.nproc if nproc is None else nproc
        args = tuple(map(str, args))
        shown = (f"python {script}" if nproc == 1
                 else f"torchrun --standalone --nproc-per-node {nproc} {script}")
        self._commands.append(" ".join([shown, *args]))
        if nproc == 1:
            return python(script, *args, timeout=timeout, echo=False)
        return torchrun(script, *args, nproc=nproc, timeout=timeout, echo=False)

    def check(self, name: str, step) -> None:
        """Run ``step()`` (it returns the row's summary and figures, or raises) and keep its row."""
        self._commands = []
        start = time.perf_counter()
        try:
            summary, figures = step()
            ok = True
        except CourseError as err:
            # Ctrl-C in a run: stop here, not at the next check
            if str(err).startswith("Interrupted"):
                raise KeyboardInterrupt from err
            summary, figures, ok = f"FAILED: {str(err).splitlines()[0]}", {}, False
        except Exception as err:  # noqa: BLE001 - a failed check is a table row, not a traceback
            summary, figures, ok = (f"FAILED: {type(err).__name__}: "
                                    f"{str(err).splitlines()[0] if str(err) else ''}"), {}, False
        row = Result(name, ok, summary, round(time.perf_counter() - start, 1), figures,
                     self._commands)
        self.results.append(row)
        print(f"{'ok' if ok else 'FAILED':6} {name:10} {summary} ({row.seconds:.0f} s)", flush=True)


def _last(run: Run, event: str | None = None) -> dict:
    """Rank 0's last log record (of ``event``), or an error with the run's last line."""
    if run.returncode != 0:  # the last error a rank printed, as run_ok names it
        raise CourseError(f"exit status {run.returncode}: {_cause(run.lines) or 'no output'}")
    records = [r for r in run.log if event is None or r.get("event") == event]
    if not records:
        raise CourseError(f"the run logged no {event or 'record'}")
    return records[-1]


# ------------------------------------------------------------------------------ the checks
def doctor(c: Checker):
    # rehearsing: the all-reduce is the nccl check's
    args = ["--skip-allreduce"] if c.rehearsal else []
    c._commands.append(" ".join(["python -m dpcourse.cluster.doctor", *args]))
    done = subprocess.run([sys.executable, "-m", "dpcourse.cluster.doctor", *args],
                          capture_output=True, text=True, timeout=300, cwd=c.root)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    if done.returncode != 0:
        problems = [line for line in lines if "✗" in line] or lines[-1:]
        raise CourseError(problems[0].strip() if problems else f"exit status {done.returncode}")
    return (lines[-1].strip() if lines else "no problem found"), {}


def nccl(c: Checker):
    if c.nproc < 2:
        return "one GPU: nothing to all-reduce between GPUs (skipped)", {}
    mib = 4 if c.rehearsal else 256
    done = _last(c.launch("gpucheck", "--worker", "busbw", "--mib", mib, "--backend", c.backend,
                          "--device", c.device), "busbw")
    return (f"{done['backend']} all_reduce of {mib} MiB on {c.on}: bus bandwidth "
            f"{done['busbw_gbs']:.1f} GB/s (algorithm {done['algbw_gbs']:.1f} GB/s)"), done


def fashion(c: Checker):
    target = 0.90
    args = ["--device", c.device, "--backend", c.backend]
    if c.rehearsal:
        args += ["--max-steps", 3, "--eval-every", 3, "--width", 4]
    else:
        args += ["--target-accuracy", target, "--epochs", 10]
    run = c.launch("fashion_ddp", *args)
    done = _last(run, "done")
    accuracy, seconds = done.get("test_accuracy"), done.get("elapsed_s")
    # the done record's window may be empty
    speeds = [r["samples_per_s"] for r in run.log if r.get("samples_per_s")]
    figures = {"test_accuracy": accuracy, "elapsed_s": seconds, "epoch": done.get("epoch"),
               "samples_per_s": speeds[-1] if speeds else None,
               "world_size": done.get("world_size")}
    if not c.rehearsal and (accuracy is None or accuracy < target):
        raise CourseError(f"test accuracy {accuracy} after {done.get('epoch')} epochs, "
                          f"below {target:.0%}")
    return (f"{accuracy:.2%} test accuracy after {done.get('epoch')} epochs in {seconds:.1f} s "
            f"on {c.on}"), figures


def resnet50(c: Checker):
    if c.rehearsal:
        amp, batch, steps, every = "off", 2, 2, 1
        model = ["--arch", "resnet18", "--image-size", 32, "--no-channels-last"]
    else:  # bf16 where the GPU has it natively (A100, H100 ...), else fp16 (V100, T4)
        amp = "bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp16"
        batch, steps, every = 128, 60, 20
        model = ["--arch", "resnet50", "--channels-last"]
    common = [*model, "--amp", amp, "--batch-size", batch, "--device", c.device,
              "--backend", c.backend, "--no-eval", "--log-every", every, "--max-steps", steps]
    synthetic = _throughput(c.launch("imagenet_ddp", "--synthetic", "--synthetic-steps", steps + 1,
                                     *common), steps, every)
    with tempfile.TemporaryDirectory(prefix="dpcourse-gpu-check-") as tmp:
        # One epoch longer than the run (a new epoch starts new DataLoader workers): a few hundred
        # drawn JPEGs, hard-linked until the epoch has (steps + 1) global batches.
        jpegs = _jpeg_set(Path(tmp), (steps + 1) * batch * c.nproc, rehearsal=c.rehearsal)
        workers = 2 if c.rehearsal else max(1, min(8, job_cores() // c.nproc - 1))
        jpeg = _throughput(c.launch("imagenet_ddp", "--data-root", jpegs, "--epochs", 1,
                                    "--workers", workers, *common),
                           steps, every)
    return (f"{synthetic:,.0f} images/s synthetic, {jpeg:,.0f} from JPEG files "
            f"({jpeg / synthetic:.0%} of it; "
            f"{'autocast ' + amp if amp != 'off' else 'no autocast'}, all {c.on}: "
            f"{synthetic / c.nproc:,.0f} and {jpeg / c.nproc:,.0f} per process)"), \
        {"synthetic_images_per_s": synthetic, "jpeg_images_per_s": jpeg, "amp": amp,
         "batch_per_process": batch, "dataloader_workers_per_process": workers}


def _jpeg_set(dest: Path, images: int, rehearsal: bool) -> Path:
    """An ImageFolder (train/, val/) with at least ``images`` training files: 400 drawn JPEGs of
    256 px (4 of 48 px rehearsing), hard-linked over and over (cheap: no more drawing, no more
    disk)."""
    from dpcourse.lab.images import make_imagefolder

    classes, drawn = (4, 1) if rehearsal else (100, 4)
    make_imagefolder(dest, classes=classes, per_class=drawn, val_per_class=1,
                     size=48 if rehearsal else 256, progress=False)
    per_class = -(-images // classes)
    for folder in sorted(p for p in (dest / "train").iterdir() if p.is_dir()):
        originals = sorted(folder.iterdir())
        for i in range(len(originals), per_class):
            source = originals[i % len(originals)]
            os.link(source, folder / f"{source.stem}_copy{i:06d}{source.suffix}")
    return dest


def _throughput(run: Run, steps: int, every: int) -> float:
    """Images per second over all processes in the last logged window, past the first (warm-up:
    cuDNN's autotuning, the first batches, the DataLoader's start)."""
    _last(run, "done")
    windows = [r for r in run.log if r.get("event") == "train" and r.get("samples_per_s")]
    if len(windows) < 2 and every < steps:
        raise CourseError(f"the run logged {len(windows)} throughput window(s) of {every} steps; "
                          "2 were expected (the first is warm-up)")
    return windows[-1]["samples_per_s"]


def memory(c: Checker):
    peaks = {}
    for strategy in ("ddp", "fsdp"):
        args = ["--memory", strategy, "--steps", 3, "--device", c.device, "--backend", c.backend]
        args += ["--width", 64, "--layers", 2] if c.rehearsal else []
        done = _last(c.launch("fsdp_fashion", *args), "memory")
        peaks[strategy] = max(r["peak_bytes"] for r in done["ranks"])
    return (f"peak per rank: DDP {peaks['ddp'] / MIB:,.0f} MiB, "
            f"FSDP {peaks['fsdp'] / MIB:,.0f} MiB "
            f"({peaks['fsdp'] / peaks['ddp']:.2f} of DDP's) on {c.on}"), {"peak_bytes": peaks}


def clinic(c: Checker):
    with tempfile.TemporaryDirectory(prefix="dpcourse-gpu-check-") as tmp:
        bug = c.launch("bugs/no_set_device", "--ckpt", f"{tmp}/ckpt.pt")
        fixed = _last(c.launch("bugs/no_set_device_fixed", "--ckpt", f"{tmp}/ckpt.pt"), "done")
    wrong = [r for r in fixed["ranks"] if r["loaded_on"] != [r["device"]]]
    if wrong:
        raise CourseError(f"the fixed twin: rank {wrong[0]['rank']} loaded onto "
                          f"{wrong[0]['loaded_on']}, not {wrong[0]['device']}")
    # on the CPU the buggy one cannot even load the checkpoint: the CPU symptom
    if c.rehearsal:
        if bug.returncode == 0 or not any("could not load" in line for line in bug.lines):
            raise CourseError("the buggy script did not fail to load a checkpoint saved from "
                              "cuda:0 on the CPU")
        return "the bug: no rank could load; fixed: each rank on its own device", {}
    ranks = _last(bug, "done")["ranks"]
    landed = sorted({d for r in ranks for d in r["loaded_on"]})
    if c.nproc >= 2 and landed != ["cuda:0"]:
        raise CourseError("the bug should put every rank's copy on cuda:0, "
                          f"but they landed on {landed}")
    mib = ranks[0]["mib_per_gpu"]
    return (f"the bug: every rank's copy on {', '.join(landed)} (rank 0's MiB per GPU {mib}); "
            "fixed: each rank's on its own GPU"), {"bug_loaded_on": landed, "fixed": fixed["ranks"]}


def checkpoint(c: Checker):
    fewer = max(1, c.nproc - 1)
    with tempfile.TemporaryDirectory(prefix="dpcourse-gpu-check-") as tmp:
        common = ["--worker", "reshard", "--path", f"{tmp}/ck", "--backend", c.backend,
                  "--device", c.device]
        saved = _last(c.launch("gpucheck", *common, "--action", "save", "--wrap", "fsdp"),
                      "reshard")
        resumed = _last(c.launch("gpucheck", *common, "--action", "load",
                                 "--wrap", "fsdp" if fewer > 1 else "plain", nproc=fewer),
                        "reshard")
    diff = max_weight_diff(saved, resumed)
    figures = {"saved_on": c.nproc, "resumed_on": fewer, "max_abs_diff": diff,
               "save_ms": saved["dcp_ms"], "load_ms": resumed["dcp_ms"]}
    if not diff < 1e-9:  # float64: rounding alone is about 1e-16
        raise CourseError(f"resumed on {fewer}, the weights 2 steps later are {diff:.2g} from "
                          "those of the run never stopped")
    whom = "one process" if fewer == 1 else f"FSDP2 on {fewer}"
    return (f"FSDP2 saved on {c.on} ({saved['dcp_ms']:.0f} ms), resumed as {whom} "
            f"({resumed['dcp_ms']:.0f} ms): max |Δweight| {diff:.1e}"), figures


# float32 on the GPU with TF32 off: the order of the additions differs from one process's, and
# 30 steps of training let that grow (2.5e-6 after 4 steps on 2 CPU processes)
DRIFT_FLOAT32_MAX = 1e-3


def drift(c: Checker):
    steps = 4 if c.rehearsal else 30
    run = c.launch("gpucheck", "--worker", "drift", "--backend", c.backend, "--device", c.device,
                   "--steps", steps)
    _last(run, "drift")  # a failed run, or one that logged nothing, said here
    rows = [r for r in run.log if r.get("event") == "drift"]
    final = {(r["strategy"], r["dtype"]): r["max_abs_diff"][-1] for r in rows}
    off = {k: v for k, v in final.items() if k[1] == "float32" and not v <= DRIFT_FLOAT32_MAX}
    if off:
        (name, _), diff = next(iter(off.items()))
        raise CourseError(f"{name} in float32 ended {diff:.2g} from one process's weights "
                          f"(more than {DRIFT_FLOAT32_MAX:g})")
    if not all(v == v and v < 1.0 for v in final.values()):  # NaN, or bfloat16 gone astray
        raise CourseError(f"a run in bfloat16 did not stay near float32's weights: {final}")
    if c.plot:
        _plot_drift(rows, steps, c.plot)
    worst = {dtype: max(v for (_, d), v in final.items() if d == dtype)
             for dtype in ("float32", "bfloat16")}
    return (f"after {steps} steps on {c.on}, max |Δweight| vs one process in float32: "
            f"float32 ≤ {worst['float32']:.1e}, bfloat16 ≤ {worst['bfloat16']:.1e}"
            + (f" (plotted: {c.plot})" if c.plot else "")), {"steps": steps, "rows": rows}


def _plot_drift(rows: list[dict], steps: int, path: Path) -> None:
    """Each row's max |Δweight| per step, log scale: float32 solid, bfloat16 dashed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), layout="constrained")
    for r in rows:
        ax.plot(range(1, steps + 1), [max(d, 1e-12) for d in r["max_abs_diff"]],
                ls="-" if r["dtype"] == "float32" else "--", label=f"{r['strategy']}, {r['dtype']}")
    ax.set(yscale="log", xlabel="step", ylabel="max |Δweight| vs one process (float32)",
           title=f"{rows[0]['world_size']} ranks on {rows[0]['backend']}: float32 vs bfloat16")
    ax.legend(fontsize=7)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


CHECKS = {"doctor": doctor, "nccl": nccl, "fashion": fashion, "resnet50": resnet50,
          "memory": memory, "clinic": clinic, "drift": drift, "checkpoint": checkpoint}


# -------------------------------------------------------------------------- the bandwidth worker
def busbw_worker(args) -> None:
    """One rank of the bandwidth check: time all_reduce of a float32 tensor, rank 0 logs it."""
    from dpcourse.lab.metrics import JsonLog

    env = world.prepare(args.backend, args.device)
    if env.device.type == "cuda":
        torch.cuda.set_device(env.device)
    dist.init_process_group(env.backend, rank=env.rank, world_size=env.world_size,
                            timeout=timedelta(seconds=120))
    x = torch.ones(args.mib * MIB // 4, device=env.device)

    def sync():
        if env.device.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(5):  # warm-up: NCCL sets up its rings and channels on the first calls
        dist.all_reduce(x)
    sync()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(args.iters):
        dist.all_reduce(x)
    sync()
    # NCCL: on the GPU
    seconds = torch.tensor([(time.perf_counter() - start) / args.iters], device=env.device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the slowest rank's time is the collective's
    n, size = env.world_size, args.mib * MIB
    algbw = size / seconds.item() / 1e9
    if env.rank == 0:
        JsonLog(args.log_json).write("busbw", backend=env.backend, world_size=n, bytes=size,
                                     iters=args.iters, seconds=round(seconds.item(), 6),
                                     algbw_gbs=round(algbw, 2),
                                     busbw_gbs=round(algbw * 2 * (n - 1) / n, 2))
    dist.destroy_process_group()


# images a step, cut evenly between the ranks: 1 to 8 GPUs; on CPU processes (the rehearsal, the
# tests) 1 to 6 or 8, and 7 times fewer images to compute
RESHARD_BATCH = {"cuda": 840, "cpu": 120}


def max_weight_diff(a: dict, b: dict) -> float:
    """The largest difference between two reshard records' weights (the same tensors)."""
    if {k: len(v) for k, v in a["weights"].items()} != {k: len(v) for k, v in b["weights"].items()}:
        raise CourseError("the two runs' weights are not the same tensors")
    return max(abs(x - y) for k in a["weights"] for x, y in zip(a["weights"][k], b["weights"][k]))


def reshard_worker(args) -> None:
    """One rank of the checkpoint check (and of tests/test_elastic.py's): the course CNN with AdamW
    in float64 under FSDP2's fully_shard (--wrap fsdp), DDP (ddp) or nothing (plain), trained on
    the same global batches on any number of ranks. --action save: steps 1-3, saved to --path
    through get_state_dict and DCP as labs/fashion_elastic.py saves, then steps 4-5; load: --path
    loaded, then steps 4-5. Rank 0 logs the step-5 weights (gathered), the numbers of Adam's state
    this rank holds (1/P of them under FSDP2) and the DCP call's time."""
    import torch.distributed.checkpoint as dcp
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
        set_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dpcourse.lab.metrics import JsonLog
    from dpcourse.lab.models import FashionCNN

    env = world.prepare(args.backend, args.device)
    if env.device.type == "cuda":
        torch.cuda.set_device(env.device)
    dist.init_process_group(env.backend, rank=env.rank, world_size=env.world_size,
                            timeout=timedelta(seconds=120))
    flat = StateDictOptions(flatten_optimizer_state_dict=True)  # as the lab saves
    torch.manual_seed(0)
    model = FashionCNN(4, "group").to(env.device, torch.float64)
    if args.wrap == "fsdp":
        mesh = init_device_mesh(env.device.type, (env.world_size,))
        for layer in model.modules():
            if isinstance(layer, (nn.Conv2d, nn.Linear)):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif args.wrap == "ddp":
        model = DDP(model, device_ids=[env.device] if env.device.type == "cuda" else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    batch = RESHARD_BATCH[env.device.type]

    def step(n):  # step n's global batch, the same on any world size; this rank's part of it
        g = torch.Generator().manual_seed(n)
        x = torch.randn(batch, 1, 28, 28, generator=g, dtype=torch.float64)
        y = torch.randint(0, 10, (batch,), generator=g)
        mine = slice(env.rank * batch // env.world_size, (env.rank + 1) * batch // env.world_size)
        opt.zero_grad()
        F.cross_entropy(model(x[mine].to(env.device)), y[mine].to(env.device)).backward()
        opt.step()

    def timed(call):
        if env.device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        call()
        seconds = torch.tensor([time.perf_counter() - start], device=env.device)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the slowest rank's
        return round(seconds.item() * 1e3, 2)

    if args.action == "save":
        for n in (1, 2, 3):
            step(n)
        model_state, optim_state = get_state_dict(model, opt, options=flat)
        ms = timed(lambda: dcp.save({"model": model_state, "optim": optim_state},
                                    checkpoint_id=args.path))
    else:
        model_state, optim_state = get_state_dict(model, opt, options=flat)
        state = {"model": model_state, "optim": optim_state}
        ms = timed(lambda: dcp.load(state, checkpoint_id=args.path))
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
    held = sum(s.to_local().numel() if hasattr(s, "to_local") else s.numel()
               for st in opt.state.values() for s in st.values() if torch.is_tensor(s) and s.dim())
    for n in (4, 5):
        step(n)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))
    if env.rank == 0:
        JsonLog(args.log_json).write(
            "reshard", action=args.action, wrap=args.wrap, world_size=env.world_size,
            backend=env.backend, held=held, dcp_ms=ms,
            weights={k: v.flatten().tolist() for k, v in full.items()})
    dist.destroy_process_group()


def drift_worker(args) -> None:
    """One rank of the drift check. The course CNN from the same weights on every rank, trained
    --steps steps of SGD with momentum on the same FashionMNIST batches (each rank its rows), by
    DDP, ZeroRedundancyOptimizer (ZeRO-1) and FSDP2, in float32 and with bfloat16 compute; after
    each step the weights (gathered) are compared with one process's on the whole batch in float32.
    TF32 is off, so float32 differs from one process by the order of additions alone. Rank 0 logs
    one record per strategy and dtype: the largest |Δweight| over the ranks after each step."""
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dpcourse.lab.data import InMemoryFashionMNIST
    from dpcourse.lab.metrics import JsonLog
    from dpcourse.lab.models import FashionCNN

    env = world.prepare(args.backend, args.device)
    if env.device.type == "cuda":
        torch.cuda.set_device(env.device)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    dist.init_process_group(env.backend, rank=env.rank, world_size=env.world_size,
                            timeout=timedelta(seconds=120))
    rank, size, dev = env.rank, env.world_size, env.device
    batch = 16 * size  # global batch: 16 rows a rank
    data = InMemoryFashionMNIST(None, train=True, first=args.steps * batch, device=dev)
    batches = [data[torch.arange(s * batch, (s + 1) * batch, device=dev)]
               for s in range(args.steps)]

    def fresh():
        torch.manual_seed(0)
        return FashionCNN().to(dev)

    def flat(model):
        return torch.cat([(p.full_tensor() if isinstance(p, DTensor) else p).detach().flatten()
                          for p in model.parameters()]).float()

    one, reference = fresh(), []  # one process, whole batches, float32: the same on every rank
    opt = torch.optim.SGD(one.parameters(), lr=0.05, momentum=0.9)
    for x, y in batches:
        opt.zero_grad()
        F.cross_entropy(one(x), y).backward()
        opt.step()
        reference.append(flat(one))

    log = JsonLog(args.log_json if rank == 0 else None)  # rank 0 logs
    for dtype in ("float32", "bfloat16"):
        bf16 = dtype == "bfloat16"
        for name in ("DDP", "ZeRO-1 (ZeroRedundancyOptimizer)", "FSDP2 fully_shard"):
            model = fresh()
            if name.startswith("FSDP2"):
                mesh = init_device_mesh(dev.type, (size,))
                policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                               reduce_dtype=torch.float32)
                          if bf16 else MixedPrecisionPolicy())
                for layer in model.modules():
                    if isinstance(layer, (nn.Conv2d, nn.Linear)):
                        fully_shard(layer, mesh=mesh, mp_policy=policy)
                fully_shard(model, mesh=mesh, mp_policy=policy)
                opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            else:
                model = DDP(model, device_ids=[dev] if dev.type == "cuda" else None)
                opt = (ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.05,
                                               momentum=0.9) if name.startswith("ZeRO")
                       else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
            diffs = []
            for (x, y), ref in zip(batches, reference):
                opt.zero_grad()
                # FSDP2 casts by its policy; DDP and ZeRO compute in bfloat16 under autocast
                with torch.autocast(dev.type, torch.bfloat16,
                                    enabled=bf16 and not name.startswith("FSDP2")):
                    loss = F.cross_entropy(model(x[rank::size]), y[rank::size])
                loss.backward()
                opt.step()
                diffs.append((flat(model) - ref).abs().max())
            worst = torch.stack(diffs)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # the worst rank's, step by step
            log.write("drift", strategy=name, dtype=dtype, world_size=size, backend=env.backend,
                      steps=args.steps, max_abs_diff=[float(f"{d:.4g}") for d in worst.tolist()])
    dist.destroy_process_group()


# ------------------------------------------------------------------------------ the command
def describe_node(rehearsal: bool) -> dict:
    gpus = ([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            if not rehearsal else [])
    return {"node": os.environ.get("SLURMD_NODENAME", socket.gethostname()), "gpus": gpus,
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "driver": world._driver() if gpus else None, "rehearsal": rehearsal}


def table(node: dict, results: list[Result]) -> str:
    head = (f"make gpu-check on {node['node']}: "
            + (f"{len(node['gpus'])} × {node['gpus'][0]}, driver {node['driver']}"
               if node["gpus"]
               else "CPU REHEARSAL (gloo, tiny sizes: these figures say nothing about a GPU)")
            + f"; torch {node['torch']} (CUDA {node['cuda']})")
    width = max(len(r.summary) for r in results)
    rows = [head, f"{'check':10}  {'result':{width}}  {'time':>6}",
            f"{'-' * 10}  {'-' * width}  {'-' * 6}"]
    rows += [f"{r.name:10}  {r.summary:{width}}  {r.seconds:>5.0f}s" for r in results]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dpcourse.cluster.gpucheck",
                                description=__doc__.split("\n")[0])
    p.add_argument("--json", default=None,
                   help="write the figures here (make gpu-check: build/gpu-check.json)")
    p.add_argument("--only", default=",".join(CHECKS),
                   help=f"a comma-separated subset of {', '.join(CHECKS)}")
    p.add_argument("--nproc", type=int, default=None,
                   help="processes (default: one per visible GPU)")
    p.add_argument("--cpu-rehearsal", action="store_true",
                   help="the same steps on the CPU with gloo and tiny sizes: "
                        "tests this tool, measures nothing")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--mib", type=int, default=256, help=argparse.SUPPRESS)
    p.add_argument("--iters", type=int, default=20, help=argparse.SUPPRESS)
    p.add_argument("--backend", default="nccl", help=argparse.SUPPRESS)
    p.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    p.add_argument("--log-json", default=None, help=argparse.SUPPRESS)
    p.add_argument("--action", choices=["save", "load"], default="save", help=argparse.SUPPRESS)
    p.add_argument("--wrap", choices=["fsdp", "ddp", "plain"], default="fsdp",
                   help=argparse.SUPPRESS)
    p.add_argument("--path", default=None, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=30, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker == "busbw":
        busbw_worker(args)
        return 0
    if args.worker == "reshard":
        reshard_worker(args)
        return 0
    if args.worker == "drift":
        drift_worker(args)
        return 0
    unknown = set(args.only.split(",")) - set(CHECKS)
    if unknown:
        p.error(f"unknown check(s) {', '.join(sorted(unknown))}: choose from {', '.join(CHECKS)}")
    if not args.cpu_rehearsal and not torch.cuda.is_available():
        print(f"make gpu-check needs a GPU, and none is usable here: {world.why_no_gpu()}. "
              "Run it on a GPU node, e.g. srun --gpus-per-node=4 --cpus-per-gpu=8 --time=30:00 "
              "make gpu-check (with your account and partition).", file=sys.stderr)
        return 2
    root = project_root(Path.cwd())
    if root is None:
        print("make gpu-check runs from inside the course checkout.", file=sys.stderr)
        return 2
    nproc = args.nproc or (2 if args.cpu_rehearsal else torch.cuda.device_count())
    try:
        ensure_fashion_mnist()
    except CourseError as err:
        print(f"make gpu-check: {err}", file=sys.stderr)
        return 1
    node = describe_node(args.cpu_rehearsal)
    checker = Checker(nproc, args.cpu_rehearsal, root)
    checker.plot = (Path(args.json).with_name(Path(args.json).stem + "-drift.png") if args.json
                    else root / "build" / "gpu-check-drift.png")
    try:
        for name in args.only.split(","):
            checker.check(name, lambda: CHECKS[name](checker))
    except KeyboardInterrupt:
        print("make gpu-check: interrupted; the checks done so far follow", file=sys.stderr)
        checker.results.append(Result("stopped", False, "interrupted (Ctrl-C)"))
    finally:
        if checker.results:
            print(table(node, checker.results), flush=True)
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(
                {**node, "nproc": nproc, "checks": [asdict(r) for r in checker.results]},
                indent=1) + "\n")
            print(f"figures in {args.json}", flush=True)
    failed = [r.name for r in checker.results if not r.ok]
    if failed:
        print(f"make gpu-check: {len(failed)} check(s) failed: {', '.join(failed)} "
              "(their lines above say why)", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
