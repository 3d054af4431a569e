"""What the three training labs share that is plumbing, not a lesson.

Checkpoint files (written whole; a missing, unreadable or mismatched one refused with what to do),
the resume, the log and its window of running sums, the batch sizes and the options that cannot go
together, each rank's vote on when to stop, the replicas' spread, and mixed precision. The lessons
stay in the labs: *who* saves (rank 0: ``if rank == 0:``), *who* loads (every rank, or rank 0 and
then a broadcast in Horovod's lab), the DDP wrap or Horovod's optimizer, the all-reduce that
averages the logged loss over the ranks and the one that agrees on when to stop (docs/design.md,
"The library"). Every function takes plain values, never a lab's command line. Two are
collectives and say so in their names (``max_over_ranks``, ``broadcast_from_rank0``);
``replicas_max_diff`` makes none of its own: the lab hands it the collectives it calls.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Callable, NamedTuple, NoReturn

import torch
import torch.distributed as dist

from dpcourse.lab.metrics import JsonLog


def save_checkpoint(path: str | os.PathLike, config: dict, **parts) -> None:
    """Write ``parts`` to ``path`` atomically: a crash mid-write never leaves half a file.

    Each part that has a ``state_dict()`` (model, optimizer, scheduler, scaler) is saved as its
    state; the others (progress, an RNG state) as they are. ``config`` is what a resume must match.
    """
    state = {name: part.state_dict() if hasattr(part, "state_dict") else part
             for name, part in parts.items()}
    state["config"] = config
    tmp = Path(f"{path}.tmp")
    tmp.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, tmp)
    os.replace(tmp, path)  # readers see the old file or the new one, never half of one


def load_checkpoint(path: str | os.PathLike, config: dict, stop: Callable[[str], NoReturn],
                    map_location=None, **parts) -> dict:
    """Load a checkpoint of ``save_checkpoint`` into ``parts`` (each by ``load_state_dict``) and
    return its ``progress``; an ``rng`` in the file becomes torch's random state again.

    A missing or unreadable file, or one written by a run with another ``config`` (model, world
    size, global batch), ends the run through ``stop(message)`` with what to do instead.
    """
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        stop(f"--resume {path}: no such checkpoint. Give the path of a .pt file that "
             "--checkpoint-dir wrote, or leave out --resume.")
    except Exception as err:  # noqa: BLE001 - any unreadable file gets the same advice
        stop(f"--resume {path}: not a readable checkpoint ({type(err).__name__}); it may be "
             "truncated or from another program. Delete it, or resume from an earlier one.")
    if state["config"] != config:
        stop(other_run(path, state["config"], config, "model, world size and global batch"))
    for name, part in parts.items():
        part.load_state_dict(state[name])
    if "rng" in state:
        torch.set_rng_state(state["rng"].cpu())
    return state["progress"]


def other_run(path, saved: dict, config: dict, same: str = "model") -> str:
    """The message for a checkpoint whose ``saved`` config is not this run's ``config``: what
    differs, and what to do (resume with the ``same`` settings, or start afresh)."""
    diff = ", ".join(f"{k} {saved.get(k)} (this run: {v})" for k, v in config.items()
                     if saved.get(k) != v) or f"its config {saved}"
    return (f"--resume {path} was written by another run: {diff}. Resume with the same {same}, "
            "or start afresh without --resume.")


def other_format(path, found: int, known: int, lab: str) -> str:
    """The message for a checkpoint whose format (a number the lab writes into it) is not the one
    this ``lab`` reads (``known``): one written by a newer version, or an older one."""
    if found > known:
        return (f"--resume {path} was written by a newer {lab} (checkpoint format {found}; this "
                f"one reads format {known}). Update the course (git pull), or start afresh.")
    return (f"--resume {path} was written by an older {lab} (checkpoint format {found}; this one "
            f"reads format {known}). Resume it with the version that wrote it, or start afresh.")


def not_yours(path) -> str | None:
    """Why the distributed checkpoint at ``path`` must not be read by this user, or None: reading
    one runs what its .metadata holds (a pickle) and what its pickled values hold, so the folder
    and every file in it must be this user's, writable by no one else (by its group only when that
    is the user's own primary group)."""
    uid, gid = os.getuid(), os.getgid()
    for entry in [Path(path), *sorted(Path(path).iterdir())]:
        st = entry.lstat()
        if entry.is_symlink() or st.st_uid != uid:
            why = "a link" if entry.is_symlink() else f"owned by uid {st.st_uid}, not you ({uid})"
        elif st.st_mode & 0o002 or (st.st_mode & 0o020 and st.st_gid != gid):
            why = "writable by others" if st.st_mode & 0o002 else f"writable by group {st.st_gid}"
        else:
            continue
        return (f"--resume {path}: {entry.name} is {why}. Reading a distributed checkpoint runs "
                "the code its .metadata (a pickle) may hold: resume only from checkpoints you "
                "wrote, in a folder no one else can write to.")
    return None


def unreadable_dcp(path, err: BaseException | None = None) -> str:
    """The message for a distributed checkpoint (a folder of torch.distributed.checkpoint) that
    cannot be read: one without its .metadata (incomplete, or not one), or one whose load raised
    ``err`` (DCP's CheckpointException: the first rank's own error is named)."""
    if err is None:
        return (f"--resume {path}: not a complete distributed checkpoint (no .metadata in it). "
                "Give a step-NNNNNNN folder that --checkpoint-dir holds, or --resume auto.")
    failures = getattr(err, "failures", None)
    if failures:  # {rank: (exception, traceback)}
        err = failures[min(failures)][0]
    why = next((line.strip() for line in str(err).splitlines() if line.strip()), "")
    if why.startswith("Missing key in checkpoint state_dict"):  # asked for a key it does not hold
        key = why.rsplit(":", 1)[-1].strip(" .")
        if re.fullmatch(r"optim\.param_groups\.\d+\.[^.]+", key):  # by group number: not FLAT
            return (f"--resume {path} holds no {key}: it holds the optimizer's options by "
                    "parameter name, not by group number. Call get_state_dict with the options "
                    "save() passes (StateDictOptions(flatten_optimizer_state_dict=True)).")
        if key.startswith(("model.", "optim.")):  # the model's or the optimizer's, misnamed
            return (f"--resume {path} holds no {key}: it holds get_state_dict's keys (no module. "
                    "prefix, the optimizer's state by parameter name). Load into get_state_dict's "
                    "dicts and put them back with set_state_dict.")
        return (f"--resume {path} holds no {key}: the lab asks for a key its save() did not "
                "write, or another program wrote it. Resume from a checkpoint of this lab, or "
                "start afresh.")
    return (f"--resume {path}: it cannot be read ({type(err).__name__}: {why[:200]}); a file may "
            "be missing or damaged, or another version of the lab wrote it. Resume from an "
            "earlier step-NNNNNNN folder, or start afresh.")


def resume_path(resume: str | None, checkpoint_dir: str | None) -> str | None:
    """The checkpoint ``resume`` (--resume) names; with ``auto`` (a requeued job, a torchrun
    restart), CHECKPOINT_DIR/last.pt if it is there, else None: a fresh start."""
    if resume != "auto":
        return resume
    last = Path(checkpoint_dir or ".") / "last.pt"
    return str(last) if last.exists() else None


def finished(progress: dict, epochs: int, max_steps: int | None) -> str | None:
    """Why the run a checkpoint comes from had already ended (what stopped it), or None."""
    if progress.get("finished"):
        return progress["finished"]
    if progress["epoch"] >= epochs:
        return "epochs"
    return "max_steps" if max_steps and progress["step"] >= max_steps else None



class Window:
    """The training figures of one rank since the last log record: the sum of its step losses, its
    steps, the images it trained on, the seconds they took and, of those, the seconds spent waiting
    for data. ``take()`` turns them into a record's fields and starts a new window; ``run`` keeps
    the whole run's images and seconds, for the last record."""

    def __init__(self, device):
        self.device = device
        self.run = {"images": 0, "seconds": 0.0, "data_s": 0.0}
        self._reset()

    def _reset(self):
        self.loss = torch.zeros((), device=self.device)
        self.steps, self.images, self.seconds, self.data_s = 0, 0, 0.0, 0.0

    def add(self, loss: torch.Tensor, images: int, seconds: float = 0.0,
            data_s: float = 0.0) -> None:
        """One step: its loss (a tensor: no wait for the device), images and seconds."""
        self.loss += loss.detach().float()
        self.steps += 1
        self.images += images
        self.seconds += seconds
        self.data_s += data_s

    def take(self, loss_sum: float, world_size: int, whole_run: bool = False,
             data_wait: bool = False) -> dict:
        """``train_loss`` (``loss_sum``: the window's loss summed over every rank, averaged over
        ranks and steps) and ``samples_per_s`` over all ranks, of this window or of the whole run;
        with ``data_wait``, also the images per second of one worker and the share of time spent
        waiting for data. Then a new window starts."""
        for key in self.run:
            self.run[key] += getattr(self, key)
        images, seconds, data_s = ((self.run[k] for k in ("images", "seconds", "data_s"))
                                   if whole_run else (self.images, self.seconds, self.data_s))
        per_worker = images / seconds if seconds else None
        fields = {
            "train_loss": round(loss_sum / (self.steps * world_size), 5) if self.steps else None,
            "samples_per_s": round(per_worker * world_size, 1) if per_worker else None}
        if data_wait:
            fields.update(samples_per_s_per_worker=round(per_worker, 1) if per_worker else None,
                          data_wait=round(data_s / seconds, 4) if per_worker else None)
        self._reset()
        return fields


def stop_votes(elapsed: float, time_budget: float | None, caught, device="cpu",
               clock: bool = True) -> torch.Tensor:
    """This process's votes to stop after this step, a tensor on ``device``: [its clock
    (``elapsed``) has run past ``time_budget``, the number of a signal it caught (0: none)]. In a
    data-parallel lab, every rank all-reduces its votes with MAX, so that all stop after the same
    step; only rank 0's clock counts there (``clock`` False on the others): the ranks' clocks
    differ."""
    over = clock and time_budget is not None and elapsed >= time_budget
    return torch.tensor([float(over), float(caught.number)], device=device)


def stop_reason(votes: torch.Tensor, caught, step: int, max_steps: int | None) -> str | None:
    """'max_steps', 'time_budget', 'signal' or None, from every rank's ``stop_votes`` reduced
    with MAX and the step just done: the same on every rank. Every rank also learns which signal
    stops the run (``caught.number``)."""
    over, signum = votes.tolist()
    caught.number = caught.number or int(signum)
    if max_steps and step >= max_steps:
        return "max_steps"
    return "time_budget" if over else "signal" if signum else None


def max_over_ranks(tensor: torch.Tensor) -> torch.Tensor:
    """A collective: ``tensor`` replaced, on every rank, by its elementwise maximum over the ranks
    (torch.distributed's all-reduce with MAX)."""
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor


def broadcast_from_rank0(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """A collective: rank 0's ``tensor`` on every rank, in a copy (torch.distributed's broadcast;
    ``name`` is for Horovod's, which names its collectives)."""
    copy = tensor.clone()
    dist.broadcast(copy, src=0)
    return copy


def replicas_max_diff(model: torch.nn.Module, rank0_copy: Callable, largest: Callable) -> float:
    """The largest difference between any rank's weights and rank 0's: 0.0 when the replicas stayed
    in sync, as data parallelism promises (the last log record's ``replicas_max_diff``).
    Collectives, handed over by the lab: ``rank0_copy`` once per parameter tensor (rank 0's copy
    of it), then ``largest`` once (the maximum over the ranks): every rank must call this
    together."""
    spread = None
    for name, p in model.named_parameters():
        diff = (p.detach() - rank0_copy(p.detach(), f"spread.{name}")).abs().max().float()
        spread = diff if spread is None else torch.maximum(spread, diff)
    return largest(spread).item()


class Run(NamedTuple):
    """What a training lab's loop carries besides the model: ``progress`` (what a checkpoint
    resumes: epoch, step, ...), ``config`` (what a resume must match), ``log`` (the run's JSON
    lines) and ``caught`` (the signals, preemption.catch)."""
    progress: dict
    config: dict
    log: JsonLog
    caught: object


def tested(record: dict) -> str:
    """'test accuracy 0.9030, test loss 0.2712' for a log record, or 'not evaluated' (--no-eval)."""
    if record.get("test_accuracy") is None:
        return "not evaluated"
    return f"test accuracy {record['test_accuracy']:.4f}, test loss {record['test_loss']:.4f}"


def resume(path: str | None, config: dict, stop: Callable[[str], NoReturn], map_location,
           epochs: int, max_steps: int | None, **parts) -> dict | None:
    """Where training starts: step 0, or the progress of the checkpoint at ``path``
    (``resume_path``), loaded into ``parts`` (``load_checkpoint``). None when that checkpoint's
    run had already finished (its ``epochs`` or ``max_steps`` done): rank 0 says so (the same
    command run twice), and there is nothing to do."""
    progress = {"epoch": 0, "step": 0, "step_in_epoch": 0, "elapsed_s": 0.0,
                "global_batch": config["global_batch"]}
    if not path:
        return progress
    progress = load_checkpoint(path, config, stop, map_location, **parts)
    reason = finished(progress, epochs, max_steps)
    if not reason:
        return progress
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"{path} is the checkpoint of a finished run (step {progress['step']}, "
              f"stopped by {reason}): nothing to do. Delete it, or give another "
              "--checkpoint-dir, to train afresh.", flush=True)
    return None


def batch_sizes(batch_size: int | None, global_batch_size: int, world_size: int,
                stop: Callable[[str], NoReturn]) -> tuple[int, int]:
    """(per-worker batch, global batch) from ``batch_size`` (--batch-size, per worker: the global
    batch is that many times the world size) or else ``global_batch_size`` (--global-batch-size,
    split into equal shares: it must divide)."""
    if batch_size:
        return batch_size, batch_size * world_size
    if global_batch_size < world_size or global_batch_size % world_size:
        stop(f"--global-batch-size {global_batch_size} does not split into {world_size} "
             f"equal per-worker batches: use a multiple of {world_size} (e.g. "
             f"{max(1, round(global_batch_size / world_size)) * world_size}), "
             "or give --batch-size per worker.")
    return global_batch_size // world_size, global_batch_size


def open_log(path, progress: dict, steps_per_epoch: int, checkpoint: str | None,
             **common) -> JsonLog:
    """The run's JSON-lines log (``path`` None: a no-op log, for the ranks that do not write). A
    run resumed from ``checkpoint`` appends to it, goes on counting ``elapsed_s`` from the
    checkpoint's, and says where it resumed."""
    resumed = progress["step"] > 0
    log = JsonLog(path, append=resumed, elapsed_before=progress["elapsed_s"], **common)
    if resumed:  # a restart shows in the log: training went on from this step
        log.write("resume", epoch=round(progress["step"] / steps_per_epoch, 4),
                  step=progress["step"], checkpoint=checkpoint)
    return log


def deterministic(on: bool, warn_only: bool = False) -> torch.dtype:
    """--deterministic: the same kernels every run (cuBLAS too, through CUBLAS_WORKSPACE_CONFIG), so
    that a resumed run equals an uninterrupted one; ``warn_only`` where a kernel has no
    deterministic version (ImageNet: CUDA's average-pool backward). Returns the FashionMNIST labs'
    dtype: float64 when on, because in float32 a rounding difference of 1e-7 can flip a ReLU or a
    max-pool choice, and such flips grow step by step; float32 otherwise."""
    if on:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(on, warn_only=warn_only)  # off: as torch starts
    return torch.float64 if on else torch.float32


def warmup_note(warmup_epochs: float, epochs: int, lr: float) -> None:
    """A note (print it on rank 0) when --warmup-epochs is not below --epochs: the rate climbs all
    the run and never decays (the schedule handles it: optim.warmup_then_decay)."""
    if warmup_epochs >= epochs:
        print(f"note: --warmup-epochs {warmup_epochs:g} is not below --epochs {epochs}: "
              f"the rate climbs all the run towards {lr:g} and never decays. Give fewer warm-up "
              "epochs (Goyal et al.: 5 of 90).", flush=True)


def comm_hook(name: str, powersgd_rank: int = 1,
              powersgd_start: int = 10) -> tuple[object, Callable | None]:
    """(state, hook) for DDP's ``register_comm_hook`` from ``name`` (--comm-hook, notebook 08):
    torch's own hooks, or (None, None) for DDP's built-in all-reduce. PowerSGD sends low-rank
    gradients after ``powersgd_start`` steps of plain all-reduce, with rank ``powersgd_rank``."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    hooks = {"none": None, "allreduce": default_hooks.allreduce_hook,
             "fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook,
             "powersgd": powerSGD_hook.powerSGD_hook}
    if name != "powersgd":
        return None, hooks[name]
    state = powerSGD_hook.PowerSGDState(process_group=None,
                                        matrix_approximation_rank=powersgd_rank,
                                        start_powerSGD_iter=powersgd_start)
    return state, hooks["powersgd"]


BASELINES = {"no_ddp": "--no-ddp trains without DistributedDataParallel",
             "no_hvd": "--no-hvd trains without hvd.DistributedOptimizer"}


def check_options(world_size: int, batch: int, stop: Callable[[str], NoReturn], no_eval: bool,
                  target_accuracy: float | None, comm_hook: str = "none", accumulate: int = 1,
                  device="cpu", **baselines: bool) -> None:
    """Stop at once, with what to do, on options that cannot work together: a target without
    evaluations, a one-process baseline (``no_ddp``, ``no_hvd``: BASELINES) on several, PowerSGD on
    a CPU run beside a visible GPU, micro-batches that do not divide the per-worker batch
    (--accumulate)."""
    if no_eval and target_accuracy:
        stop("--target-accuracy needs evaluations: leave out --no-eval.")
    for flag, on in baselines.items():
        if on and world_size > 1:
            stop(f"{BASELINES[flag]}: launch one process.")
    if comm_hook == "powersgd" and torch.device(device).type == "cpu" and torch.cuda.is_available():
        stop("--comm-hook powersgd on the CPU where a GPU is visible: PyTorch's PowerSGD hook "
             "would synchronize that GPU and fail. Hide the GPUs from this run: "
             "CUDA_VISIBLE_DEVICES= torchrun ...")
    if batch % accumulate:
        stop(f"--accumulate {accumulate} does not split the per-worker batch {batch} into equal "
             f"micro-batches: use a batch that is a multiple of {accumulate}.")


class Precision(NamedTuple):
    """How ImageNet's lab computes: ``autocast`` (a context), ``scaler`` (fp16's loss scaling; a
    no-op otherwise), ``memory_format`` of the images and weights, and ``amp``, its name in the
    log."""
    autocast: torch.autocast
    scaler: torch.amp.GradScaler
    memory_format: torch.memory_format
    amp: str


def mixed_precision(amp: str, channels_last: bool | None, device) -> Precision:
    """The Precision of --amp and --channels-last: ``auto`` is bf16 on a GPU that has it and off on
    a CPU; fp16 needs loss scaling (the scaler), bf16 does not; channels_last (NHWC) by default on
    GPUs, where tensor cores want it."""
    device = torch.device(device)
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported()
                     else None,
             "off": None, "bf16": torch.bfloat16, "fp16": torch.float16}[amp]
    autocast = torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    channels_last = device.type == "cuda" if channels_last is None else channels_last
    return Precision(autocast, scaler,
                     torch.channels_last if channels_last else torch.contiguous_format,
                     str(dtype or "off").replace("torch.", ""))


def top5_summary(record: dict) -> str:
    """'top-1 0.7120, top-5 0.9810, 812 img/s, MFU 41.0%' for a log record of ImageNet's lab."""
    acc = (f"top-1 {record['test_accuracy']:.4f}, top-5 {record['test_top5']:.4f}, "
           if record.get("test_accuracy") is not None else "")
    speed = f"{record['samples_per_s']:.0f} img/s" if record.get("samples_per_s") else "no steps"
    return acc + speed + (f", MFU {record['mfu']:.1%}" if record.get("mfu") else "")
