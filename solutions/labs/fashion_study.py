"""Notebooks 07-08's lab: fashion_ddp.py's training, timed and changed for large batches.

    torchrun --standalone --nproc-per-node 2 solutions/labs/fashion_study.py --time-split
    torchrun --standalone --nproc-per-node 2 solutions/labs/fashion_study.py \\
        --batch-size 512 --lr-scaling linear --optimizer lars
    torchrun --standalone --nproc-per-node 2 solutions/labs/fashion_study.py --comm-hook powersgd

The lesson is fashion_ddp.py: this file takes its data, setup and Trainer and adds what notebooks
07 and 08 study, in a subclass of its Trainer (StudyTrainer: the step timed, micro-batches, local
SGD) and a main() of its own (the lesson's, with the instruments set up). Notebook 07: where a
step's time goes (--time-split, --profile-trace) and DDP's gradient buckets (--bucket-cap-mb,
--grad-as-bucket-view). Notebook 08: the learning rate for a larger global batch (--lr-scaling,
scaled_lr: its exercise 1), LARS (--optimizer lars), and sending less: micro-batches under no_sync
(--accumulate), compressed or low-rank gradients (--comm-hook fp16, bf16, powersgd) and post-local
SGD (--local-sgd). Lines there because of distribution are marked `# DDP:`.
"""
import argparse
import math
import os
import sys
from contextlib import nullcontext
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.model_averaging import averagers
from torch.distributed.algorithms.model_averaging.utils import average_parameters
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the fashion_ddp.py beside this file
from dpcourse.lab import options, preemption, training, world
from dpcourse.lab.metrics import StepTimer, trace_profiler
from dpcourse.lab.models import FashionCNN
from dpcourse.lab.optim import optimizer_by_name, warmup_then_decay
from fashion_ddp import REFERENCE_BATCH, Trainer, cleanup, load_data, setup


def scaled_lr(lr, batch, world_size, rule):
    """The learning rate of this run, by --lr-scaling ``rule``: ``lr`` is tuned for a global batch
    of REFERENCE_BATCH, and ``batch`` is one worker's (notebook 08, exercise 1). The lesson labs
    call dpcourse.lab.optim.scaled_lr(lr, global_batch, rule, reference_batch): here you write
    its rules yourself."""
    if rule == "none":
        return lr
    ### BEGIN SOLUTION (hint: "linear" (Goyal et al.) multiplies lr by how many times larger than REFERENCE_BATCH the batch is that one optimizer step averages over; "sqrt" by the square root of that. batch is one worker's.)
    ratio = batch * world_size / REFERENCE_BATCH  # DDP: the step averages ALL workers' gradients
    return lr * (ratio if rule == "linear" else math.sqrt(ratio))
    ### END SOLUTION


class StudyTrainer(Trainer):
    """fashion_ddp's Trainer, timed in phases (``timer``), with --accumulate's micro-batches,
    post-local SGD's ``averager`` (or None) and rank 0's --profile-trace."""

    def __init__(self, *lesson, timer, averager):
        super().__init__(*lesson)
        self.timer, self.averager = timer, averager
        trace = self.args.profile_trace if self.rank == 0 else None  # DDP: rank 0's trace only
        self.profiler = trace_profiler(trace)  # torch.profiler's Chrome trace, or None

    def run_epoch(self, epoch):
        self.timer.start()  # the first step's time includes waiting for its batch
        return super().run_epoch(epoch)

    def run_step(self, x, y, step):
        """The lesson's step, timed; --accumulate splits it into micro-batches, and local SGD
        (after --local-sgd-warmup steps) leaves the gradients unaveraged."""
        args, model, timer, n = self.args, self.model, self.timer, self.args.accumulate
        timer.lap("data")
        self.opt.zero_grad(set_to_none=True)
        local = self.averager is not None and step >= args.local_sgd_warmup  # post-local SGD phase
        for j, (xm, ym) in enumerate(zip(x.chunk(n), y.chunk(n))):
            quiet = (j < n - 1 or local) and not args.no_ddp  # not the last one
            with model.no_sync() if quiet else nullcontext():  # DDP: no all-reduce yet
                with self.amp:  # (below, / n: the mean over the whole batch)
                    loss = F.cross_entropy(model(xm), ym) / n
                timer.lap("forward")
                loss.backward()  # DDP: averaged across ranks after the last micro-batch only
            timer.lap("backward")
        self.opt.step()
        self.sched.step()
        timer.lap("optimizer")
        if self.averager:
            self.averager.average_parameters(model.parameters())  # DDP: weights, not gradients
            timer.lap("allreduce")
        timer.stop()
        if self.profiler:
            self.profiler.step()
        return loss.detach().float() * n

    def after_step(self, i):
        stop = super().after_step(i)
        if not stop:
            self.timer.start()  # the next step's time, from here
        return stop

    def test(self):
        with self.timer.paused():  # the evaluation's collectives are not a step's
            if self.averager and not self.args.no_eval:  # DDP: local SGD's replicas drift apart:
                average_parameters(self.model.parameters(), dist.group.WORLD)  # test the average
            return super().test()

    def record(self, event, **fields):
        split = self.timer.report()  # the time split of the steps since the last record, if on
        with self.timer.paused():  # nor is the log's all-reduce
            return super().record(event, **split, **fields)

    def finish(self, stop):
        if self.profiler:
            self.profiler.stop()
        super().finish(stop)


def send_less(args, model, timer, step):
    """(notebook 08) How DDP sends each bucket (--comm-hook); local SGD's averager, or None."""
    state, hook = training.comm_hook(args.comm_hook, args.powersgd_rank, args.powersgd_start)
    if hook or args.time_split:  # DDP: what DDP does with each bucket of gradients
        model.register_comm_hook(state, timer.timed(hook or default_hooks.allreduce_hook))
    if not args.local_sgd:
        return None
    # DDP: post-local SGD: after warm-up, average the weights every N steps
    averager = averagers.PeriodicModelAverager(args.local_sgd, args.local_sgd_warmup)
    averager.step = step
    return averager


def main(args):
    caught = preemption.catch()  # SIGUSR1 (a time-limit warning), SIGTERM: stop after a step, saved
    # DDP: PyTorch's flight recorder keeps this process's last 2,000 collectives (set before the
    # group exists); --time-split counts each step's bytes from it
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
    env = setup(args)  # DDP: fashion_ddp's: join the process group
    rank, world_size = dist.get_rank(), dist.get_world_size()  # DDP: who am I, how many are we?
    device, stop = env.device, partial(world.stop, env)  # DDP: stop(why): rank 0 says it, all exit
    batch, global_batch = training.batch_sizes(args.batch_size, args.global_batch_size,
                                               world_size, stop)  # DDP: × world size
    training.check_options(world_size, batch, stop, args.no_eval, args.target_accuracy,
                           args.comm_hook, args.accumulate, device, no_ddp=args.no_ddp)
    dtype = training.deterministic(args.deterministic)  # float64 and fixed kernels, or float32
    torch.manual_seed(args.seed)  # the same initial weights every run
    data = load_data(args, device, batch, rank, world_size)  # DDP: this rank's shard
    steps_per_epoch = len(data.sampler) // batch

    model = FashionCNN(args.width, args.norm).to(device, dtype, memory_format=torch.channels_last)
    lr = scaled_lr(args.lr, batch, world_size, args.lr_scaling)  # exercise 1 of notebook 08
    opt = optimizer_by_name(args.optimizer, model.parameters(), lr, args.weight_decay,
                            args.lars_eta)
    total = args.epochs * steps_per_epoch
    warmup = max(1, round(args.warmup_epochs * steps_per_epoch))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_then_decay(total, warmup))
    config = {**model.config, "world_size": world_size, "global_batch": global_batch}  # to resume
    # DDP: every rank loads the same checkpoint (--resume), so that the replicas go on alike
    checkpoint = training.resume_path(args.resume, args.checkpoint_dir)  # or None: from step 0
    progress = training.resume(checkpoint, config, stop, device, args.epochs, args.max_steps,
                               model=model, optimizer=opt, scheduler=sched)
    if progress is None:  # --resume names the checkpoint of a finished run: nothing to do
        return cleanup()  # DDP: leave the group here too
    timer = StepTimer(device, enabled=args.time_split)  # where the time goes (notebook 07)
    averager = None
    if not args.no_ddp:
        model = DDP(model, device_ids=[device] if device.type == "cuda" else None,  # DDP: the wrap
                    bucket_cap_mb=args.bucket_cap_mb,  # notebook 07: DDP's gradient buckets
                    gradient_as_bucket_view=args.grad_as_bucket_view)
        averager = send_less(args, model, timer, progress["step"])  # notebook 08

    log = training.open_log(args.log_json if rank == 0 else None,  # DDP: rank 0 logs, no one else
                            progress, steps_per_epoch, checkpoint, world_size=world_size,
                            global_batch=global_batch, peak_lr=lr, loader=args.loader,
                            ddp=not args.no_ddp, threads=torch.get_num_threads())
    if rank == 0:  # DDP: one rank talks
        resumed = f", resumed at step {progress['step']}" if progress["step"] else ""
        print(f"{world_size} × {batch} = global batch {global_batch}, lr {lr:g}, "
              f"{steps_per_epoch} steps per epoch, {env.backend} on {device}{resumed}", flush=True)
    trainer = StudyTrainer(args, device, model, opt, sched, data,
                           training.Run(progress, config, log, caught),
                           timer=timer, averager=averager)
    reason = None  # why training stops early: a step limit, a target accuracy, a signal
    while progress["epoch"] < args.epochs and reason is None:
        reason = trainer.run_epoch(progress["epoch"])
    trainer.finish(reason or "epochs")
    cleanup()  # DDP: leave the group


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=options.Defaults)
    options.common_options(p, REFERENCE_BATCH)  # every training lab's: --epochs, --lr, --resume...
    options.fashion_options(p)  # the FashionMNIST labs': --width, --train-images, --amp, ...
    options.loader_options(p)  # --loader memory or torchvision (notebook 06)
    options.ddp_options(p, timeout=60)  # DDP: --backend, --timeout, --no-ddp
    options.scaling_options(p)  # notebooks 07-08: --time-split, --comm-hook, --accumulate, ...
    return p.parse_args(argv)


if __name__ == "__main__":
    main(parse_args())
