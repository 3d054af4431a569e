"""Train the course CNN on FashionMNIST with DistributedDataParallel (DDP).

    source .venv/bin/activate                                                # the course's Python
    python labs/fashion_ddp.py                                     # one process
    torchrun --standalone --nproc-per-node 2 labs/fashion_ddp.py   # two processes here
    srun --ntasks 2 python labs/fashion_ddp.py                     # two Slurm tasks
    mpirun -np 2 python labs/fashion_ddp.py                        # two Open MPI ranks

Each rank trains a replica of the model on its own shard of each global batch; DDP averages the
gradients during backward, so the replicas stay identical. Rank 0 prints, logs (--log-json) and
checkpoints; the ranks split the test set and sum their counts: each test image counts once. Every
line there because of distribution is marked `# DDP:`. First reading: main() splits the data and
scales the learning rate (scaled_lr); Trainer.run_step(): DDP averages the gradients; .save(): rank
0 saves; .after_step(): all ranks agree to stop; skip send_less().
"""
import argparse
import math
import time
from contextlib import nullcontext
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.model_averaging import averagers
from torch.distributed.algorithms.model_averaging.utils import average_parameters
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler
from tqdm.auto import tqdm

from dpcourse.lab import options, preemption, training, world
from dpcourse.lab.data import InMemoryFashionMNIST, torchvision_fashion_mnist
from dpcourse.lab.metrics import StepTimer, trace_profiler
from dpcourse.lab.models import FashionCNN
from dpcourse.lab.optim import REFERENCE_BATCH, optimizer_by_name, warmup_then_decay


def setup(args):
    # DDP: rank and world size from torchrun, srun or mpirun; MASTER_ADDR/PORT set and checked.
    env = world.prepare(backend=args.backend, device=args.device)
    if env.device.type == "cuda":
        torch.cuda.set_device(env.device)  # DDP: one GPU per process, cuda:LOCAL_RANK
    dist.init_process_group(env.backend, rank=env.rank, world_size=env.world_size,  # DDP: join
                            timeout=timedelta(seconds=args.timeout))
    world.gpu_roll_call(env)  # GPUs: rank 0 lists each rank's GPU; two ranks on one GPU stop
    return env


def cleanup():
    dist.destroy_process_group()  # DDP: leave the group so every rank exits cleanly


def scaled_lr(args, batch, world_size):
    """The learning rate of this run: --lr is tuned for a batch of REFERENCE_BATCH (notebook 08)."""
    if args.lr_scaling == "none":
        return args.lr
    # YOUR CODE HERE
    # Hint: "linear" (Goyal et al.) multiplies args.lr by how many times larger than
    #       REFERENCE_BATCH the batch is that one optimizer step averages over;
    #       "sqrt" by the square root of that. batch is one worker's.
    raise NotImplementedError("Exercise: see the hint above")


def evaluate(model, test_set, env, dtype=torch.float32, batch=1000):
    """Loss and accuracy over the whole test set, each image counted exactly once."""
    model.eval()
    # DDP: rank r of K takes images r, r+K, r+2K, ...: no padding, unlike DistributedSampler's.
    shard = torch.arange(env.rank, len(test_set), env.world_size, device=env.device)
    totals = torch.zeros(3, dtype=torch.float64, device=env.device)  # loss sum, correct, count
    with torch.no_grad():
        for idx in shard.split(batch):
            x, y = test_set[idx]
            out = model(x.to(dtype).contiguous(memory_format=torch.channels_last))
            totals += torch.stack([F.cross_entropy(out.float(), y, reduction="sum").double(),
                                   (out.argmax(1) == y).sum().double(),
                                   torch.tensor(len(y), device=env.device).double()])
    # YOUR CODE HERE
    # Hint: sum the three totals over all ranks, in place, with one collective
    raise NotImplementedError("Exercise: see the hint above")
    model.train()
    loss_sum, correct, count = totals.tolist()
    return loss_sum / count, correct / count, int(count)


def unwrap(model):  # the plain module inside a DDP wrapper (what a checkpoint stores)
    return model.module if isinstance(model, DDP) else model


class Trainer:
    """One rank's training loop: every rank runs the same steps on its own batches; rank 0 also
    logs and saves. A checkpoint resumes ``progress``; ``timer``, ``averager``: notebooks 07-08."""

    def __init__(self, args, env, model, opt, sched, *, sampler, batch, data, test_set, config,
                 progress, log, caught, timer, averager):
        self.args, self.env, self.model, self.opt, self.sched = args, env, model, opt, sched
        self.sampler, self.batch, self.data, self.test_set = sampler, batch, data, test_set
        self.config, self.progress, self.log, self.caught = config, progress, log, caught
        self.timer, self.averager = timer, averager
        self.steps_per_epoch = len(sampler) // batch
        self.dtype = next(model.parameters()).dtype
        self.amp = torch.autocast(env.device.type, dtype=torch.bfloat16, enabled=args.amp)
        self.window = training.Window(env.device)  # loss and throughput since the last log record
        self.last_eval, self.test_images = {"test_accuracy": None, "test_loss": None}, None
        self.bar = tqdm(total=args.epochs * self.steps_per_epoch, initial=progress["step"],
                        unit="step", desc="train", disable=world.bar_off(env.rank))  # DDP: 0's
        self.profiler = trace_profiler(args.profile_trace if env.rank == 0 else None)  # Chrome's

    def run_epoch(self, epoch):
        """One pass over this rank's shard; why training stops, or None to go on."""
        p, device = self.progress, self.env.device
        # YOUR CODE HERE
        # Hint: tell the sampler which epoch this is, so that each epoch is shuffled
        #       anew
        raise NotImplementedError("Exercise: see the hint above")
        batches = self.data  # --loader torchvision: a DataLoader on the same sampler
        if self.args.loader == "memory":  # a batch: one indexing of the whole split's tensors
            batches = (self.data[torch.as_tensor(idx, device=device)]
                       for idx in BatchSampler(self.sampler, self.batch, drop_last=True))
        start = time.perf_counter()  # a step's time includes waiting for its batch
        self.timer.start()
        for i, (x, y) in enumerate(batches):
            if i < p["step_in_epoch"]:  # resumed mid-epoch: these batches were done
                start = time.perf_counter()
                continue
            x = x.to(device, self.dtype, non_blocking=True)
            x = x.contiguous(memory_format=torch.channels_last)
            y = y.to(device, non_blocking=True)
            self.timer.lap("data")
            if i == 0 and self.env.rank == 0:  # the epoch's first labels: set_epoch's new order
                self.log.write("epoch_start", epoch=epoch, step=p["step"],
                               first_labels=y[:8].tolist())
            loss = self.run_step(x, y, p["step"])
            self.window.add(loss, self.batch, time.perf_counter() - start)
            p.update(epoch=epoch, step=p["step"] + 1, step_in_epoch=i + 1)
            self.bar.update()
            if stop := self.after_step(i):
                return stop
            start = time.perf_counter()
            self.timer.start()
        p.update(epoch=epoch + 1, step_in_epoch=0)
        stop = self.test()
        rec = self.record("epoch", test_images=self.test_images)
        if self.env.rank == 0:  # DDP: one line per epoch, also where there is no bar (logs, CI)
            print(f"epoch {p['epoch']}: {training.tested(rec)}, {rec['elapsed_s']:.1f} s",
                  flush=True)
        self.save()
        return stop

    def run_step(self, x, y, step):
        """One optimizer step on this rank's batch; --accumulate splits it into micro-batches."""
        args, model, timer = self.args, self.model, self.timer
        self.opt.zero_grad(set_to_none=True)
        local = self.averager is not None and step >= args.local_sgd_warmup  # post-local SGD phase
        for j, (xm, ym) in enumerate(zip(x.chunk(args.accumulate), y.chunk(args.accumulate))):
            quiet = (j < args.accumulate - 1 or local) and not args.no_ddp  # not the last one
            with model.no_sync() if quiet else nullcontext():  # DDP: no all-reduce yet
                with self.amp:  # (below, / accumulate: the mean over the whole batch)
                    loss = F.cross_entropy(model(xm), ym) / args.accumulate
                timer.lap("forward")
                loss.backward()  # DDP: gradients are averaged across ranks while backward runs
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
        return loss.detach().float() * args.accumulate

    def after_step(self, i):
        """A checkpoint, evaluation or log record when one is due; why training stops, or None."""
        args, step = self.args, self.progress["step"]
        if args.checkpoint_every and step % args.checkpoint_every == 0:
            self.save()
        stop = None
        if args.eval_every and step % args.eval_every == 0 and i + 1 < self.steps_per_epoch:
            stop = self.test()
            self.record("eval")
        elif step % args.log_every == 0:
            self.record("train")
        votes = training.stop_votes(self.env, self.log.elapsed(), args.time_budget, self.caught)
        dist.all_reduce(votes, op=dist.ReduceOp.MAX)  # DDP: one vote stops every rank, here
        return stop or training.stop_reason(votes, self.caught, step, args.max_steps)

    def test(self):
        """Test the model (not with --no-eval): 'target_accuracy' once it reaches the target."""
        if self.args.no_eval:
            return None
        if self.averager:  # DDP: local SGD let the replicas drift apart: test their average
            average_parameters(self.model.parameters(), dist.group.WORLD)
        loss, acc, self.test_images = evaluate(self.model, self.test_set, self.env, self.dtype)
        self.last_eval.update(test_loss=round(loss, 5), test_accuracy=round(acc, 5))
        self.bar.set_postfix(acc=self.last_eval["test_accuracy"])
        target = self.args.target_accuracy
        return "target_accuracy" if target and acc >= target else None

    def record(self, event, **fields):
        """Rank 0's log line; the train loss is averaged over ranks and steps since the last one."""
        loss_sum = self.window.loss.clone()
        dist.all_reduce(loss_sum)  # DDP: the sum of every rank's losses
        step = self.progress["step"]
        return self.log.write(event, epoch=round(step / self.steps_per_epoch, 4), step=step,
                              **self.window.take(loss_sum.item(), self.env.world_size),
                              lr=round(self.sched.get_last_lr()[0], 7), **self.timer.report(),
                              **(self.last_eval if event in ("eval", "epoch", "done") else {}),
                              **fields)

    def save(self):
        """CHECKPOINT_DIR/last.pt (--checkpoint-dir): everything a resumed run needs."""
        if not self.args.checkpoint_dir:
            return
        self.progress["elapsed_s"] = self.log.elapsed()  # every rank: the clock a resume goes on
        if self.env.rank == 0:  # DDP: one writer; every replica holds the same weights
            training.save_checkpoint(f"{self.args.checkpoint_dir}/last.pt", self.config,
                                     model=unwrap(self.model), optimizer=self.opt,
                                     scheduler=self.sched, progress=self.progress,
                                     rng=torch.get_rng_state())

    def finish(self, stop):
        """The last evaluation, log record and checkpoint; rank 0 reports."""
        args, env = self.args, self.env
        self.bar.close()
        if self.profiler:
            self.profiler.stop()
        untested = self.last_eval["test_accuracy"] is None or self.progress["step_in_epoch"]
        if stop != "signal" and untested:  # not in a time-limit warning's last seconds
            self.test()  # stopped mid-epoch: test what we have
        spread = training.replicas_max_diff(  # DDP: 0.0: alike (rank 0's broadcast, then a MAX)
            unwrap(self.model), training.broadcast_from_rank0, training.max_over_ranks)
        final = self.record("done", test_images=self.test_images, stop=stop,
                            replicas_max_diff=spread)
        if env.rank == 0:  # DDP: rank 0 reports and saves; the others hold the same weights
            print(f"step {final['step']}: {training.tested(final)}, {final['elapsed_s']:.1f} s "
                  f"({stop})", flush=True)
            if args.save_model:
                torch.save(unwrap(self.model).state_dict(), args.save_model)
        self.progress["finished"] = stop if stop == "target_accuracy" else None
        self.save()
        if env.rank == 0 and stop == "signal":
            last = args.checkpoint_dir and f"{args.checkpoint_dir}/last.pt"
            print(preemption.stopped_message(self.caught, final["step"], last), flush=True)
        self.timer.close()  # torch.distributed's own collectives back, were a timed step left open
        if stop == "signal":  # the first rank to exit may end the job: none before rank 0 has saved
            dist.barrier()  # DDP: wait for rank 0's checkpoint


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
    env = setup(args)
    rank, world_size = dist.get_rank(), dist.get_world_size()  # DDP: who am I, how many are we?
    device, stop = env.device, partial(world.stop, env)  # stop(why): rank 0 says it, all exit
    batch, global_batch = training.batch_sizes(args.batch_size, args.global_batch_size,
                                               world_size, stop)  # DDP: × world size
    training.check_options(world_size, batch, stop, args.no_eval, args.target_accuracy,  # e.g.
                           args.comm_hook, args.accumulate, device, no_ddp=args.no_ddp)  # --no-ddp
    dtype = training.deterministic(args.deterministic)  # float64 and fixed kernels, or float32
    torch.manual_seed(args.seed)  # the same initial weights everywhere (DDP copies rank 0's anyway)

    # Data. Rank 0 stages the files first; the others wait, then read the same verified copy.
    with world.rank0_first():  # DDP: one download, not one per rank
        train_set = InMemoryFashionMNIST(args.data_root, train=True, device=device,
                                         first=args.train_images)
        test_set = InMemoryFashionMNIST(args.data_root, train=False, device=device)
    # YOUR CODE HERE
    # Hint: a DistributedSampler over train_set for this rank of world_size, shuffled
    #       with args.seed, dropping the uneven tail
    raise NotImplementedError("Exercise: see the hint above")
    data = train_set  # --loader memory: each batch is cut from the tensors by the sampler's indices
    if args.loader == "torchvision":  # the classic per-sample pipeline, fed by the same sampler
        # YOUR CODE HERE
        # Hint: loader = a DataLoader over
        #       torchvision_fashion_mnist(args.data_root, train=True): batches of this
        #       rank's batch size, in the order the sampler gives, args.workers worker
        #       processes, the uneven tail dropped
        raise NotImplementedError("Exercise: see the hint above")
        data = loader
    steps_per_epoch = len(sampler) // batch

    model = FashionCNN(args.width, args.norm).to(device, dtype, memory_format=torch.channels_last)
    lr = scaled_lr(args, batch, world_size)
    opt = optimizer_by_name(args.optimizer, model.parameters(), lr, args.weight_decay,
                            args.lars_eta)
    total = args.epochs * steps_per_epoch
    warmup = max(1, round(args.warmup_epochs * steps_per_epoch))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_then_decay(total, warmup))  # then to 0
    config = {**model.config, "world_size": world_size, "global_batch": global_batch}  # to resume
    # DDP: every rank loads the same checkpoint (--resume), so that the replicas go on alike
    checkpoint = training.resume_path(args.resume, args.checkpoint_dir)  # or None: from step 0
    progress = training.resume(checkpoint, config, stop, device, args.epochs, args.max_steps,
                               model=model, optimizer=opt, scheduler=sched)
    if progress is None:  # --resume names the checkpoint of a finished run: nothing to do
        return cleanup()
    timer = StepTimer(device, enabled=args.time_split)  # where the time goes (notebook 07)
    averager = None
    if not args.no_ddp:
        ddp_options = dict(bucket_cap_mb=args.bucket_cap_mb,
                           gradient_as_bucket_view=args.grad_as_bucket_view)
        # YOUR CODE HERE
        # Hint: wrap model in DDP with **ddp_options;
        #       on a GPU, give it this rank's device
        raise NotImplementedError("Exercise: see the hint above")
        averager = send_less(args, model, timer, progress["step"])  # notebook 08

    log = training.open_log(args.log_json if rank == 0 else None,  # DDP: rank 0 logs, no one else
                            progress, steps_per_epoch, checkpoint, world_size=world_size,
                            global_batch=global_batch, peak_lr=lr, loader=args.loader,
                            ddp=not args.no_ddp, threads=torch.get_num_threads())
    if rank == 0:  # DDP: one rank talks
        resumed = f", resumed at step {progress['step']}" if progress["step"] else ""
        print(f"{world_size} × {batch} = global batch {global_batch}, lr {lr:g}, "
              f"{steps_per_epoch} steps per epoch, {env.backend} on {device}{resumed}", flush=True)
    trainer = Trainer(args, env, model, opt, sched, sampler=sampler, batch=batch, data=data,
                      test_set=test_set, config=config, progress=progress, log=log, caught=caught,
                      timer=timer, averager=averager)
    reason = None  # why training stops early: a step limit, a target accuracy, a signal
    while progress["epoch"] < args.epochs and reason is None:
        reason = trainer.run_epoch(progress["epoch"])
    trainer.finish(reason or "epochs")
    cleanup()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=options.Defaults)
    options.common_options(p, REFERENCE_BATCH)  # every training lab's: --epochs, --lr, --resume...
    options.ddp_options(p, timeout=60)  # the DDP labs': --backend, --timeout, --no-ddp
    options.fashion_options(p)  # the FashionMNIST labs': --width, --train-images, --amp, ...
    options.scaling_options(p)  # notebooks 07-08: --time-split, --comm-hook, --loader, ...
    return p.parse_args(argv)


if __name__ == "__main__":
    main(parse_args())
