"""fashion_ddp.py's training with checkpoints that every rank writes at once, that a run of any
world size resumes, and a fault you can aim.

    torchrun --standalone --nproc-per-node 2 labs/fashion_elastic.py \\
        --checkpoint-dir ck --checkpoint-every 5 --max-steps 13
    torchrun --standalone --nproc-per-node 3 labs/fashion_elastic.py \\
        --checkpoint-dir ck --resume auto                             # 2 ranks' run, on 3
    torchrun --standalone --nproc-per-node 2 --max-restarts 1 labs/fashion_elastic.py \\
        --checkpoint-dir ck --checkpoint-every 5 --resume auto --fail 1:12:SIGKILL

The lesson is fashion_ddp.py: this file takes its data, setup and Trainer and changes what a
checkpoint is. There, rank 0 writes one torch.save file that only a run of the same world size
resumes. Here every rank writes its part of one distributed checkpoint (DCP,
torch.distributed.checkpoint): a folder, step-NNNNNNN/, with a file per rank and a .metadata that
says which piece is where. Its state comes from get_state_dict: the same keys for DDP, FSDP2 or
one process, no `module.` prefix. A run of any world size reads the pieces it needs: DCP re-cuts
them. The checkpoint says where the run is in the data in samples, not in steps, so that a resume
on another number of ranks, with the same global batch, trains on the same batches: none
repeated, none skipped. --fail RANK:STEP:KIND ends one rank before that step (SIGKILL, SIGTERM or
an exception) in a run that starts afresh, for torchrun --max-restarts (or a requeued Slurm job)
to show a run that outlives it: the restart resumes, and goes on. Lines there because of this are
marked `# DCP:`; DDP's, `# DDP:`.
"""
import argparse
import os
import signal
import sys
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

# DCP: a checkpoint written by every rank, its keys the same whatever wraps the model
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the fashion_ddp.py beside this file
from dpcourse.lab import optim, options, preemption, training, world
from dpcourse.lab.models import FashionCNN
from fashion_ddp import REFERENCE_BATCH, Trainer, cleanup, load_data, setup

# what a resume keeps (the world size may change)
SAME = "model, global batch, seed and training images, on any number of ranks that divides it"


def latest(checkpoint_dir):
    """The newest complete checkpoint in ``checkpoint_dir`` (a step-NNNNNNN/ folder whose .metadata
    was written: DCP writes it last, once every rank's file is there), or None."""
    done = sorted(Path(checkpoint_dir).glob("step-*/.metadata")) if checkpoint_dir else []
    return str(done[-1].parent) if done else None


def fail_here(fail, rank, step):
    """--fail RANK:STEP:KIND: end this rank before ``step`` if it is RANK."""
    if fail is None or (fail.rank, fail.step) != (rank, step):
        return
    print(f"[rank {rank}] --fail: {fail.kind} before step {step}", flush=True)
    if fail.kind == "exception":
        raise RuntimeError(f"--fail: an exception on rank {rank} before step {step}")
    os.kill(os.getpid(), getattr(signal, fail.kind))


class ElasticTrainer(Trainer):
    """fashion_ddp's Trainer, saving through DCP on every rank, with --fail's fault."""

    def __init__(self, *lesson, fail):
        super().__init__(*lesson)
        self.fail = fail
        self.saved = self.progress["step"]  # the step of the last save: a resume's is its own

    def run_step(self, x, y, step):
        fail_here(self.fail, self.rank, step)
        return super().run_step(x, y, step)

    def save(self):
        """CHECKPOINT_DIR/step-NNNNNNN/: each rank's part of the model, the optimizer, the
        schedule and where the run is in the data."""
        p = self.progress
        if not self.args.checkpoint_dir or self.saved == p["step"]:  # this step is saved already
            return
        p["elapsed_s"] = self.log.elapsed()
        # DCP: where the run is in the data, in samples: a run of another world size goes on there
        p["samples_in_epoch"] = p["step_in_epoch"] * self.batch * self.world_size
        # YOUR CODE HERE
        # Hint: the model's and the optimizer's state through get_state_dict, then one
        #       dcp.save of them with the schedule, progress and config, to
        #       CHECKPOINT_DIR/step-NNNNNNN
        raise NotImplementedError("Exercise: see the hint above")
        self.saved = p["step"]


def resume(path, model, opt, sched, config, progress, stop):
    """The progress of the checkpoint at ``path``, loaded into ``model``, ``opt`` and ``sched`` on
    every rank, whatever the world size that wrote it; each mismatch ends the run in one line.
    ``config`` and ``progress``: this run's, whose keys say what to read."""
    if not (Path(path) / ".metadata").is_file():  # DCP: written last, once every part is there
        stop(training.unreadable_dcp(path))
    head = {"config": dict(config), "progress": dict(progress)}  # filled in place by dcp.load
    try:  # DCP: its config and progress first: a checkpoint of another run stops here
        dcp.load(head, checkpoint_id=path)  # DCP: every rank reads them
    except (Exception, dcp.CheckpointException) as err:  # noqa: BLE001 - a file missing, damaged
        stop(training.unreadable_dcp(path, err))
    if head["config"] != config:  # DCP: another model, or another order of the data
        stop(training.other_run(path, head["config"], config, SAME))
    progress = head["progress"]
    # YOUR CODE HERE
    # Hint: the model's and optimizer's state dicts from get_state_dict as the shapes to
    #       fill, dcp.load them with the schedule, then set_state_dict and
    #       sched.load_state_dict
    raise NotImplementedError("Exercise: see the hint above")
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
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True,
                          weight_decay=args.weight_decay)
    total = args.epochs * steps_per_epoch
    warmup = max(1, round(args.warmup_epochs * steps_per_epoch))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, optim.warmup_then_decay(total, warmup))
    progress = {"epoch": 0, "step": 0, "step_in_epoch": 0, "samples_in_epoch": 0,
                "elapsed_s": 0.0, "global_batch": global_batch}
    # DCP: --resume auto: the newest complete checkpoint (a requeued job, a torchrun restart)
    checkpoint = latest(args.checkpoint_dir) if args.resume == "auto" else args.resume
    if checkpoint:
        progress = resume(checkpoint, model, opt, sched, config, progress, stop)
    if training.finished(progress, args.epochs, args.max_steps):
        if rank == 0:  # DDP: one rank talks
            print(f"{checkpoint} is the checkpoint of a finished run (step {progress['step']}): "
                  "nothing to do.", flush=True)
        return cleanup()  # DDP: leave the group here too

    log = training.open_log(args.log_json if rank == 0 else None,  # DDP: rank 0 logs, no one else
                            progress, steps_per_epoch, checkpoint, world_size=world_size,
                            global_batch=global_batch, peak_lr=lr, ddp=not args.no_ddp,
                            threads=torch.get_num_threads())
    if rank == 0:  # DDP: one rank talks
        resumed = (f", resumed at step {progress['step']} ({progress['samples_in_epoch']:,} "
                   f"images into epoch {progress['epoch']})" if checkpoint else "")
        print(f"{world_size} × {batch} = global batch {global_batch}, lr {lr:g}, "
              f"{steps_per_epoch} steps per epoch, {env.backend} on {device}{resumed}", flush=True)
    trainer = ElasticTrainer(args, device, model, opt, sched, data,
                             training.Run(progress, config, log, caught),
                             fail=None if checkpoint else args.fail)  # the restart goes on
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
                   help="end rank RANK before step STEP: KIND SIGKILL, SIGTERM or exception")
    return p.parse_args(argv)


if __name__ == "__main__":
    main(parse_args())
