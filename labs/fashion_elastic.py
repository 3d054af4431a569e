"""fashion_ddp.py's training with checkpoints that every rank writes at once, that a run of any
world size resumes, and a fault you can aim.

    torchrun --standalone --nproc-per-node 2 labs/fashion_elastic.py \\
        --global-batch-size 96 --checkpoint-dir ck --checkpoint-every 5 --max-steps 13
    torchrun --standalone --nproc-per-node 3 labs/fashion_elastic.py \\
        --global-batch-size 96 --checkpoint-dir ck --resume auto --max-steps 20  # the same, on 3
    torchrun --standalone --nproc-per-node 2 --max-restarts 1 labs/fashion_elastic.py \\
        --global-batch-size 96 --checkpoint-dir ck2 --checkpoint-every 5 --resume auto \\
        --fail 1:12:SIGKILL                                # rank 1 dies; torchrun restarts the run

The lesson is fashion_ddp.py: this file takes its data, setup and Trainer and changes what a
checkpoint is. There, rank 0 alone writes one torch.save file: every replica holds the same
weights. With sharded training (FSDP, ZeRO) no rank holds them all, and one writer is a wait. Here
every rank writes its part of one distributed checkpoint (DCP, torch.distributed.checkpoint): a
folder, step-NNNNNNN/, with a file per rank and a .metadata, written last, that says which piece
is where (DDP's replicated tensors are written once, shared out between the ranks' files; FSDP's
shards are re-cut for a run of another size). Its state comes from get_state_dict: the same keys
for DDP, FSDP2 or one process, no `module.` prefix, the optimizer's state by parameter name. A
resume must keep the model, the global batch, the seed and the training images, not the world
size: with the same global batch, DistributedSampler deals each epoch's order out so that step k
is the same images on any number of ranks, and the checkpoint's data position (the epoch, the
images done in it) is the same place in the data for all of them. --fail RANK:STEP:KIND hits one
rank before that step in a run's first attempt: SIGKILL or an exception kill it (torchrun
--max-restarts then restarts every rank from the last checkpoint); SIGTERM, the signal of a job
cancelled or preempted, makes every rank stop after that step, saved, and exit 0. --async-save
saves with dcp.async_save: the state is copied, a thread writes it while training goes on, and
the next save waits for it (each save's `checkpoint` log record: how long training waited).
--zero trains with ZeRO-1 (torch's ZeroRedundancyOptimizer, notebook 13): each rank keeps the
momentum of its share of the parameters only, and each share is written once, by its owner; a run
with or without --zero, on any number of ranks, resumes it, every rank reading the momentum of the
parameters it owns now. Lines there because of this are marked `# DCP:`; ZeRO's, `# ZeRO:`;
DDP's, `# DDP:`.
"""
import argparse
import os
import shutil
import signal
import sys
import time
from datetime import timedelta
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

# DCP: a checkpoint written by every rank, its keys the same whatever wraps the model
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.optim import ZeroRedundancyOptimizer  # ZeRO: notebook 13's, torch's
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the fashion_ddp.py beside this file
from dpcourse.lab import optim, options, preemption, training, world
from dpcourse.lab.models import FashionCNN
from fashion_ddp import REFERENCE_BATCH, Trainer, cleanup, load_data, setup

FORMAT = 2  # DCP: the layout of this lab's checkpoints; one of another format is refused
# DCP: the optimizer's state and options (lr, momentum) by parameter name, not by group number:
# a ZeRO rank offers its own parameters' alone, and the ranks' keys do not collide
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
# what a resume keeps (the world size may change)
SAME = "model, global batch, seed and training images, on any number of ranks that divides it"


def complete(checkpoint_dir):
    """The complete checkpoints in ``checkpoint_dir``, oldest first: the step-NNNNNNN/ folders
    whose .metadata was written (DCP writes it last, once every rank's file is there)."""
    return [str(m.parent) for m in sorted(Path(checkpoint_dir).glob("step-*/.metadata"))]


def fail_here(fail, rank, step):
    """--fail RANK:STEP:KIND: hit this rank before ``step`` (counted from 1, as the log counts
    steps done) if it is RANK."""
    if fail is None or (fail.rank, fail.step) != (rank, step):
        return
    print(f"[rank {rank}] --fail: {fail.kind} before step {step}", flush=True)
    if fail.kind == "exception":
        raise RuntimeError(f"--fail: an exception on rank {rank} before step {step}")
    os.kill(os.getpid(), getattr(signal, fail.kind))


def copy_lr(source, target):
    """ZeRO: ZeroRedundancyOptimizer keeps two sets of parameter groups: its own, whose lr the
    schedule sets, and its share's optimizer's, which a checkpoint holds; a step copies the first
    onto the second. Between steps, copy_lr(source, target) does."""
    for group, other in zip(source.param_groups, target.param_groups):
        other["lr"] = group["lr"]


class ElasticTrainer(Trainer):
    """fashion_ddp's Trainer, saving through DCP on every rank, with --fail's fault."""

    def __init__(self, *lesson, held, fail, io_group=None, keep=2):
        super().__init__(*lesson)
        self.held = held  # the optimizer whose state this rank saves (see main())
        self.fail, self.keep, self.finishing = fail, keep, False
        self.io_group, self.writing = io_group, None  # --async-save's group and its last write
        self.saved = self.progress["step"]  # the step of the last save: a resume's is its own

    def run_step(self, x, y, step):
        fail_here(self.fail, self.rank, step + 1)  # step: the steps done before this one
        return super().run_step(x, y, step)

    def test(self):
        stop = super().test()
        self.progress["finished"] = stop  # a checkpoint of a run that reached its target says so
        return stop

    def finish(self, stop):
        self.finishing = True  # the last save may be of an epoch's last step
        super().finish(stop)
        self.wait()

    def save(self):
        """CHECKPOINT_DIR/step-NNNNNNN/: each rank's part of the model, the optimizer, the
        schedule and where the run is in the data; the last ``keep`` are kept."""
        p = self.progress
        # DCP: a step is saved once (a folder written again is not written whole); an epoch's
        # last step at the epoch's end, with the epoch done. The same on every rank: a collective
        if (not self.args.checkpoint_dir or self.saved == p["step"]
                or (p["step_in_epoch"] == self.steps_per_epoch and not self.finishing)):
            return
        # DCP: where the run is in the data: the epoch, and the images done in it. A key every
        # rank offers is written once, from one rank DCP picks (it compares keys, not values):
        # the clock in progress is that rank's; this model draws no random numbers after its
        # start, so no RNG state
        p.update(elapsed_s=self.log.elapsed(),
                 samples_in_epoch=p["step_in_epoch"] * self.batch * self.world_size)
        if self.args.zero:  # ZeRO: its share's groups get the lr the schedule has just set
            copy_lr(self.opt, self.held)
        # DCP: no module. prefix
        model_state, optim_state = get_state_dict(self.model, self.held, options=FLAT)
        state = {"format": FORMAT, "model": model_state, "optim": optim_state,
                 "sched": self.sched.state_dict(), "progress": dict(p), "config": self.config}
        path, started = f"{self.args.checkpoint_dir}/step-{p['step']:07d}", time.perf_counter()
        if self.writing:  # DCP: one save at a time: the last one whole before the next begins
            self.writing.result()
            self.drop_old()
        if self.args.async_save:
            # DCP: the state copied now; a thread writes it while training goes on
            self.writing = dcp.async_save(state, checkpoint_id=path, process_group=self.io_group)
        else:
            # DCP: a collective: every rank writes its part (never under `if rank == 0`)
            dcp.save(state, checkpoint_id=path)
        # DCP: how long training waited for this save: all of it, or the copy alone (async)
        self.log.write("checkpoint", step=p["step"], path=path, async_save=self.args.async_save,
                       blocked_ms=round((time.perf_counter() - started) * 1e3, 2))
        self.saved = p["step"]
        if not self.writing:
            self.drop_old()

    def drop_old(self):
        """Rank 0 deletes the oldest checkpoints once every part of the newest is written."""
        if self.rank == 0:  # DCP: one rank deletes; the others' parts are written (dcp.save)
            for old in complete(self.args.checkpoint_dir)[:-self.keep]:
                shutil.rmtree(old, ignore_errors=True)

    def wait(self):
        """The last asynchronous save written whole: before the run ends or a process exits."""
        if self.writing:  # DCP: before cleanup() destroys the group its thread writes with
            self.writing.result()
            self.writing = None
            self.drop_old()


def load(path, state, stop):
    """``state`` filled in place from the checkpoint at ``path``, on every rank (a collective); a
    part missing or damaged ends the run in one line."""
    try:
        dcp.load(state, checkpoint_id=path)  # DCP: every rank reads what it asks for
    except dcp.CheckpointException as err:  # every rank gets it
        stop(training.unreadable_dcp(path, err))
    return state


def resume(path, model, opt, sched, config, progress, stop):
    """The progress of the checkpoint at ``path``, loaded into ``model``, ``opt`` and ``sched`` on
    every rank, whatever the world size that wrote it; each mismatch ends the run in one line.
    ``config`` and ``progress``: this run's, whose keys say what to read."""
    if not (Path(path) / ".metadata").is_file():  # DCP: written last, once every part is there
        stop(training.unreadable_dcp(path))
    if why := training.not_yours(path):  # DCP: reading a checkpoint runs its pickles: yours alone
        stop(why)
    found = load(path, {"format": 0}, stop)["format"]  # DCP: its layout first (dcp.load fills)
    if found != FORMAT:  # DCP: a layout this lab does not know
        stop(training.other_format(path, found, FORMAT, "fashion_elastic.py"))
    # DCP: then its config and progress: a checkpoint of another run stops here
    head = load(path, {"config": dict(config), "progress": dict(progress)}, stop)
    if head["config"] != config:  # DCP: another model, or another order of the data
        stop(training.other_run(path, head["config"], config, SAME))
    progress = head["progress"]
    try:
        # YOUR CODE HERE
        # Hint: the model's and optimizer's state dicts from get_state_dict, with
        #       save()'s options=FLAT, as the shapes to fill;
        #       dcp.load them with the schedule's under save()'s keys model, optim,
        #       sched;
        #       then set_state_dict and sched.load_state_dict
        raise NotImplementedError("Exercise: see the hint above")
    except dcp.CheckpointException as err:  # a part missing or damaged: every rank gets it
        stop(training.unreadable_dcp(path, err))
    # DCP: the images done in this epoch, in this run's steps: step k is images k·G to (k+1)·G - 1
    # of the epoch's order on any number of ranks (DistributedSampler deals them out in turn)
    progress["step_in_epoch"] = progress["samples_in_epoch"] // config["global_batch"]
    return progress


def main(args):
    caught = preemption.catch()  # SIGUSR1 (a time-limit warning), SIGTERM: stop after a step, saved
    env = setup(args)  # DDP: fashion_ddp's: join the process group
    rank, world_size = dist.get_rank(), dist.get_world_size()  # DDP: who am I, how many are we?
    device, stop = env.device, partial(world.stop, env)  # DDP: stop(why): rank 0 says it, all exit
    batch, global_batch = training.batch_sizes(args.batch_size, args.global_batch_size,
                                               world_size, stop)  # DDP: × world size
    training.check_options(world_size, batch, stop, args.no_eval, args.target_accuracy,
                           no_ddp=args.no_ddp)  # DDP: --no-ddp refused on several ranks
    dtype = training.deterministic(args.deterministic)  # float64 and fixed kernels, or float32
    torch.manual_seed(args.seed)  # the same initial weights every run
    data = load_data(args, device, batch, rank, world_size)  # DDP: this rank's shard
    steps_per_epoch = len(data.sampler) // batch

    model = FashionCNN(args.width, args.norm).to(device, dtype, memory_format=torch.channels_last)
    # DCP: what a resume must match: the model and the order of the data, not the world size
    config = {**model.config, "global_batch": global_batch, "seed": args.seed,
              "train_images": len(data.train_set)}
    if not args.no_ddp:  # DDP: --no-ddp: one process, and its checkpoint is the same
        model = DDP(model, device_ids=[device] if device.type == "cuda" else None)  # DDP: the wrap
    lr = optim.scaled_lr(args.lr, global_batch, args.lr_scaling, REFERENCE_BATCH)
    sgd = {"lr": lr, "momentum": 0.9, "nesterov": True, "weight_decay": args.weight_decay}
    if args.zero:  # ZeRO: each rank steps, and keeps the momentum of, its share of the parameters
        if (tensors := len(list(model.parameters()))) < world_size:  # a rank would own none
            stop(f"--zero: {tensors} parameter tensors cannot be shared by {world_size} ranks; "
                 f"train on at most {tensors} ranks, or without --zero.")
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, **sgd)
    else:
        opt = torch.optim.SGD(model.parameters(), **sgd)
    # ZeRO: the optimizer a checkpoint saves and loads: its share's on this rank, or the whole
    held = opt.optim if args.zero else opt
    total = args.epochs * steps_per_epoch
    warmup = max(1, round(args.warmup_epochs * steps_per_epoch))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, optim.warmup_then_decay(total, warmup))
    progress = {"epoch": 0, "step": 0, "step_in_epoch": 0, "samples_in_epoch": 0,
                "elapsed_s": 0.0, "global_batch": global_batch, "finished": None}
    newest = [(complete(args.checkpoint_dir) or [None])[-1] if args.checkpoint_dir else None]
    dist.broadcast_object_list(newest, src=0)  # DCP: rank 0's look: every rank loads the same
    if newest[0] and args.resume is None:
        stop(f"--checkpoint-dir {args.checkpoint_dir} holds another run's checkpoints: "
             "--resume auto to go on from its newest, or give an empty --checkpoint-dir.")
    # DCP: --resume auto: the newest complete checkpoint (a requeued job, a torchrun restart)
    checkpoint = newest[0] if args.resume == "auto" else args.resume
    if checkpoint:
        progress = resume(checkpoint, model, held, sched, config, progress, stop)
        if args.zero:  # ZeRO: its own groups get the lr its share's were loaded with
            copy_lr(held, opt)
    if done := training.finished(progress, args.epochs, args.max_steps):
        if rank == 0:  # DDP: one rank talks
            print(f"{checkpoint} is the checkpoint of a finished run (step {progress['step']}, "
                  f"stopped by {done}): nothing to do. Give another --checkpoint-dir to train "
                  "afresh.", flush=True)
        return cleanup()  # DDP: leave the group here too
    # --fail in a run's first attempt only: a restart or a resume goes on
    first = (not checkpoint  # DCP: and not a torchrun restart (it counts them for its workers)
             and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0")
    if args.fail and args.fail.rank >= world_size:
        stop(f"--fail {args.fail.rank}:{args.fail.step}:{args.fail.kind}: there is no rank "
             f"{args.fail.rank} among {world_size}; give a rank from 0 to {world_size - 1}.")

    log = training.open_log(args.log_json if rank == 0 else None,  # DDP: rank 0 logs, no one else
                            progress, steps_per_epoch, checkpoint, world_size=world_size,
                            global_batch=global_batch, peak_lr=lr, loader=args.loader,
                            ddp=not args.no_ddp, threads=torch.get_num_threads())
    if rank == 0:  # DDP: one rank talks
        resumed = (f", resumed at step {progress['step']} ({progress['samples_in_epoch']:,} "
                   f"images into epoch {progress['epoch']})" if checkpoint else "")
        print(f"{world_size} × {batch} = global batch {global_batch}, lr {lr:g}, "
              f"{steps_per_epoch} steps per epoch, {env.backend} on {device}{resumed}", flush=True)
        if args.fail and not first:
            print("--fail left out: this run goes on from a checkpoint", flush=True)
    # DCP: --async-save's writing thread needs a group of its own, gloo even on GPUs (not NCCL)
    io_group = (dist.new_group(backend="gloo", timeout=timedelta(seconds=args.timeout))
                if args.async_save else None)
    trainer = ElasticTrainer(args, device, model, opt, sched, data,
                             training.Run(progress, config, log, caught),
                             held=held, fail=args.fail if first else None, io_group=io_group)
    reason = None  # why training stops early: a step limit, a target accuracy, a signal
    while progress["epoch"] < args.epochs and reason is None:
        reason = trainer.run_epoch(progress["epoch"])
    trainer.finish(reason or "epochs")
    cleanup()  # DDP: leave the group


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=options.Defaults)
    options.common_options(p, REFERENCE_BATCH, checkpoints=(  # every training lab's: --epochs, ...
        "every rank writes its part of step-NNNNNNN/ here", "CHECKPOINT_DIR's newest complete one"))
    options.fashion_options(p)  # the FashionMNIST labs': --width, --train-images, --amp, ...
    options.loader_options(p)  # --loader memory or torchvision (notebook 06)
    options.ddp_options(p, timeout=60)  # DDP: --backend, --timeout, --no-ddp
    p.add_argument("--fail", type=options.fail_spec, default=None, metavar="RANK:STEP:KIND",
                   help="hit rank RANK before step STEP in a first attempt: KIND SIGKILL, "
                        "SIGTERM or exception")
    p.add_argument("--zero", action="store_true",
                   help="ZeRO-1 (ZeroRedundancyOptimizer): each rank keeps its share's momentum")
    p.add_argument("--async-save", action="store_true",
                   help="dcp.async_save: training goes on while a thread writes the checkpoint")
    return p.parse_args(argv)


if __name__ == "__main__":
    main(parse_args())
