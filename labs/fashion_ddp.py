"""Train the course CNN on FashionMNIST with DistributedDataParallel (DDP).

    source .venv/bin/activate                                                # the course's Python
    python labs/fashion_ddp.py                                     # one process
    torchrun --standalone --nproc-per-node 2 labs/fashion_ddp.py   # two processes here
    srun --ntasks 2 python labs/fashion_ddp.py                     # two Slurm tasks
    mpirun -np 2 python labs/fashion_ddp.py                        # two Open MPI ranks

This file is fashion_single.py, the same training in one process, plus the lines data parallelism
needs, each marked `# DDP:` with its reason (notebook 05 shows the diff). Each rank trains a
replica of the model on its own shard of each global batch; DDP averages the gradients during
backward, so the replicas stay identical. Rank 0 prints, logs (--log-json) and checkpoints; the
ranks split the test set and sum their counts: each test image counts once. Notebooks 07-08's
instruments (the time split, communication hooks, local SGD, LARS) are in fashion_study.py.

First reading: main() top to bottom, then where it leads. load_data(): the DistributedSampler
splits the data; main(): the learning rate for the global batch (optim.scaled_lr) and the DDP
wrap; Trainer.run_step(): backward averages the gradients; Trainer.save(): rank 0 alone writes
the checkpoint; Trainer.after_step(): all ranks agree to stop.
"""
# DDP: a timeout for the collectives, world.stop bound to this rank (partial)
import argparse
import time
from datetime import timedelta
from functools import partial
from typing import NamedTuple

# DDP: the process group and its collectives, the wrapper, the sampler that shards the data
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler
from tqdm.auto import tqdm

from dpcourse.lab import optim, options, preemption, training, world
from dpcourse.lab.data import InMemoryFashionMNIST, torchvision_fashion_mnist
from dpcourse.lab.models import FashionCNN

# The batch-and-rate policy: --lr is the rate tuned for a global batch of REFERENCE_BATCH images;
# --lr-scaling says how it follows another global batch (none; linear, Goyal et al.; sqrt).
REFERENCE_BATCH = 128


class Data(NamedTuple):
    train_set: InMemoryFashionMNIST  # the whole split, on the device
    test_set: InMemoryFashionMNIST
    sampler: DistributedSampler  # DDP: the indices of this rank, epoch by epoch
    loader: DataLoader | None  # --loader torchvision; None: batches cut from train_set
    batch: int  # DDP: this rank's share of each global batch


def setup(args):
    # DDP: rank and world size from torchrun, srun or mpirun; MASTER_ADDR/PORT set and checked.
    env = world.prepare(backend=args.backend, device=args.device)
    if env.device.type == "cuda":
        torch.cuda.set_device(env.device)  # DDP: one GPU per process, cuda:LOCAL_RANK
    dist.init_process_group(env.backend, rank=env.rank, world_size=env.world_size,  # DDP: join
                            timeout=timedelta(seconds=args.timeout))
    world.gpu_roll_call(env)  # DDP: rank 0 lists each rank's GPU; two ranks on one GPU stop
    return env  # DDP: rank, world size, device and backend


def cleanup():
    dist.destroy_process_group()  # DDP: leave the group so every rank exits cleanly


def load_data(args, device, batch, rank, world_size):  # DDP: which rank of how many
    """The two splits on ``device`` and the order of the training images (--loader)."""
    with world.rank0_first():  # DDP: rank 0 stages the files; the others wait, then read them
        train_set = InMemoryFashionMNIST(args.data_root, train=True, device=device,
                                         first=args.train_images)
        test_set = InMemoryFashionMNIST(args.data_root, train=False, device=device)
    # YOUR CODE HERE
    # Hint: a DistributedSampler over train_set for this rank of world_size, shuffled
    #       with args.seed, dropping the uneven tail
    raise NotImplementedError("Exercise: see the hint above")
    loader = None  # --loader memory: each batch is cut from the tensors by the sampler's indices
    if args.loader == "torchvision":  # the classic per-sample pipeline, fed by the same sampler
        # YOUR CODE HERE
        # Hint: loader = a DataLoader over
        #       torchvision_fashion_mnist(args.data_root, train=True): batches of this
        #       rank's batch size, in the order the sampler gives, args.workers worker
        #       processes, the uneven tail dropped
        raise NotImplementedError("Exercise: see the hint above")
    return Data(train_set, test_set, sampler, loader, batch)


def evaluate(model, test_set, device, dtype=torch.float32, batch=1000):
    """Loss and accuracy over the whole test set, each image counted exactly once."""
    model.eval()
    # DDP: rank r of K takes images r, r+K, r+2K, ...: no padding, unlike DistributedSampler's.
    shard = torch.arange(dist.get_rank(), len(test_set), dist.get_world_size(), device=device)
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
    with torch.no_grad():
        for idx in shard.split(batch):
            x, y = test_set[idx]
            out = model(x.to(dtype).contiguous(memory_format=torch.channels_last))
            totals += torch.stack([F.cross_entropy(out.float(), y, reduction="sum").double(),
                                   (out.argmax(1) == y).sum().double(),
                                   torch.tensor(len(y), device=device).double()])
    # YOUR CODE HERE
    # Hint: sum the three totals over all ranks, in place, with one collective
    raise NotImplementedError("Exercise: see the hint above")
    model.train()
    loss_sum, correct, count = totals.tolist()
    return loss_sum / count, correct / count, int(count)


def unwrap(model):  # DDP: the plain module inside the wrapper (what a checkpoint stores)
    return model.module if isinstance(model, DDP) else model


class Trainer:
    """This rank's training loop: every rank runs the same steps on its own batches. ``data``:
    load_data's; ``run``: a training.Run, what a checkpoint resumes and where the records go."""

    def __init__(self, args, device, model, opt, sched, data, run):
        self.args, self.device, self.model, self.opt, self.sched = args, device, model, opt, sched
        self.data, self.batch = data, data.batch
        self.progress, self.config, self.log, self.caught = run
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()  # DDP: this rank of K
        self.steps_per_epoch = len(data.sampler) // self.batch
        self.dtype = next(model.parameters()).dtype
        self.amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.amp)
        self.window = training.Window(device)  # loss and throughput since the last log record
        self.last_eval, self.test_images = {"test_accuracy": None, "test_loss": None}, None
        self.bar = tqdm(total=args.epochs * self.steps_per_epoch, initial=self.progress["step"],
                        unit="step", desc="train",
                        disable=world.bar_off(self.rank))  # DDP: rank 0's bar only

    def batches(self, epoch):
        """This epoch's batches, in the sampler's order."""
        # YOUR CODE HERE
        # Hint: tell the sampler which epoch this is, so that each epoch is shuffled
        #       anew
        raise NotImplementedError("Exercise: see the hint above")
        if self.data.loader is not None:  # --loader torchvision
            return self.data.loader
        return (self.data.train_set[torch.as_tensor(idx, device=self.device)]  # one indexing each
                for idx in BatchSampler(self.data.sampler, self.batch, drop_last=True))

    def run_epoch(self, epoch):
        """One pass over the training data; why training stops, or None to go on."""
        p = self.progress
        start = time.perf_counter()  # a step's time includes waiting for its batch
        for i, (x, y) in enumerate(self.batches(epoch)):
            if i < p["step_in_epoch"]:  # resumed mid-epoch: these batches were done
                start = time.perf_counter()
                continue
            x = x.to(self.device, self.dtype, non_blocking=True)
            x = x.contiguous(memory_format=torch.channels_last)
            y = y.to(self.device, non_blocking=True)
            if i == 0 and self.rank == 0:  # DDP: rank 0 logs the epoch's first labels
                self.log.write("epoch_start", epoch=epoch, step=p["step"],
                               first_labels=y[:8].tolist())
            loss = self.run_step(x, y, p["step"])
            self.window.add(loss, self.batch, time.perf_counter() - start)
            p.update(epoch=epoch, step=p["step"] + 1, step_in_epoch=i + 1)
            self.bar.update()
            if stop := self.after_step(i):
                return stop
            start = time.perf_counter()
        p.update(epoch=epoch + 1, step_in_epoch=0)
        stop = self.test()
        rec = self.record("epoch", test_images=self.test_images)
        if self.rank == 0:  # DDP: rank 0 alone prints the epoch's line
            print(f"epoch {p['epoch']}: {training.tested(rec)}, {rec['elapsed_s']:.1f} s",
                  flush=True)
        self.save()
        return stop

    def run_step(self, x, y, step):
        """One optimizer step on the batch (``step``: the steps done before it)."""
        self.opt.zero_grad(set_to_none=True)
        with self.amp:
            loss = F.cross_entropy(self.model(x), y)
        loss.backward()  # DDP: gradients are averaged across ranks while backward runs
        self.opt.step()
        self.sched.step()
        return loss.detach().float()

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
        # DDP: every rank stops after the same step: the votes on the device, for the all-reduce;
        # only rank 0's clock counts (the ranks' clocks differ)
        votes = training.stop_votes(self.log.elapsed(), args.time_budget, self.caught,
                                    self.device, clock=self.rank == 0)
        dist.all_reduce(votes, op=dist.ReduceOp.MAX)  # DDP: MAX: one rank's vote stops them all
        return stop or training.stop_reason(votes, self.caught, step, args.max_steps)

    def test(self):
        """Test the model (not with --no-eval): 'target_accuracy' once it reaches the target."""
        if self.args.no_eval:
            return None
        loss, acc, self.test_images = evaluate(self.model, self.data.test_set, self.device,
                                               self.dtype)
        self.last_eval.update(test_loss=round(loss, 5), test_accuracy=round(acc, 5))
        self.bar.set_postfix(acc=self.last_eval["test_accuracy"])
        target = self.args.target_accuracy
        return "target_accuracy" if target and acc >= target else None

    def record(self, event, **fields):
        """The log line; the train loss is averaged over the steps since the last one."""
        loss_sum = self.window.loss.clone()
        dist.all_reduce(loss_sum)  # DDP: the sum of every rank's losses
        window = self.window.take(loss_sum.item(), self.world_size)  # DDP: all ranks' images
        step = self.progress["step"]
        return self.log.write(event, epoch=round(step / self.steps_per_epoch, 4), step=step,
                              **window,
                              lr=round(self.sched.get_last_lr()[0], 7),
                              **(self.last_eval if event in ("eval", "epoch", "done") else {}),
                              **fields)

    def save(self):
        """CHECKPOINT_DIR/last.pt (--checkpoint-dir): everything a resumed run needs."""
        if not self.args.checkpoint_dir:
            return
        self.progress["elapsed_s"] = self.log.elapsed()  # the clock a resume goes on
        if self.rank == 0:  # DDP: one writer; every replica holds the same weights
            training.save_checkpoint(f"{self.args.checkpoint_dir}/last.pt", self.config,
                                     model=unwrap(self.model), optimizer=self.opt,
                                     scheduler=self.sched, progress=self.progress,
                                     rng=torch.get_rng_state())

    def finish(self, stop):
        """The last evaluation, log record and checkpoint; the report."""
        args = self.args
        self.bar.close()
        untested = self.last_eval["test_accuracy"] is None or self.progress["step_in_epoch"]
        if stop != "signal" and untested:  # not in a time-limit warning's last seconds
            self.test()  # stopped mid-epoch: test what we have
        spread = training.replicas_max_diff(  # DDP: a check: how far from rank 0's (0.0: in sync)
            unwrap(self.model), training.broadcast_from_rank0, training.max_over_ranks)
        final = self.record("done", test_images=self.test_images, stop=stop,
                            replicas_max_diff=spread)  # DDP: the check, in the done record
        if self.rank == 0:  # DDP: rank 0 reports and writes --save-model: the others are alike
            print(f"step {final['step']}: {training.tested(final)}, {final['elapsed_s']:.1f} s "
                  f"({stop})", flush=True)
            if args.save_model:
                torch.save(unwrap(self.model).state_dict(), args.save_model)
        self.progress["finished"] = stop if stop == "target_accuracy" else None
        self.save()
        if self.rank == 0 and stop == "signal":  # DDP: rank 0 says where to resume
            last = args.checkpoint_dir
            print(preemption.stopped_message(self.caught, final["step"], last), flush=True)
        if stop == "signal":  # the first rank to exit may end the job: none before rank 0 has saved
            dist.barrier()  # DDP: wait for rank 0's checkpoint


def main(args):
    caught = preemption.catch()  # SIGUSR1 (a time-limit warning), SIGTERM: stop after a step, saved
    env = setup(args)  # DDP: the launcher's variables, this rank's device, the process group
    rank, world_size = dist.get_rank(), dist.get_world_size()  # DDP: who am I, how many are we?
    device, stop = env.device, partial(world.stop, env)  # DDP: stop(why): rank 0 says it, all exit
    batch, global_batch = training.batch_sizes(args.batch_size, args.global_batch_size,
                                               world_size, stop)  # DDP: per rank and in all
    training.check_options(world_size, batch, stop, args.no_eval, args.target_accuracy,
                           no_ddp=args.no_ddp)  # DDP: --no-ddp refused on several ranks
    dtype = training.deterministic(args.deterministic)  # float64 and fixed kernels, or float32
    torch.manual_seed(args.seed)  # the same initial weights every run
    data = load_data(args, device, batch, rank, world_size)  # DDP: with who I am
    steps_per_epoch = len(data.sampler) // batch

    model = FashionCNN(args.width, args.norm).to(device, dtype, memory_format=torch.channels_last)
    # DDP: one step averages the gradients of the GLOBAL batch: its size sets the rate
    lr = optim.scaled_lr(args.lr, global_batch, args.lr_scaling, REFERENCE_BATCH)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True,
                          weight_decay=args.weight_decay)
    total = args.epochs * steps_per_epoch
    warmup = max(1, round(args.warmup_epochs * steps_per_epoch))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, optim.warmup_then_decay(total, warmup))
    # DDP: a resume must match the world size and the global batch too
    config = {**model.config, "world_size": world_size, "global_batch": global_batch}
    # DDP: every rank loads the same checkpoint (--resume), so that the replicas go on alike
    checkpoint = training.resume_path(args.resume, args.checkpoint_dir)  # or None: from step 0
    progress = training.resume(checkpoint, config, stop, device, args.epochs, args.max_steps,
                               model=model, optimizer=opt, scheduler=sched)
    if progress is None:  # --resume names the checkpoint of a finished run: nothing to do
        return cleanup()  # DDP: leave the group here too
    if not args.no_ddp:  # DDP: --no-ddp measures the wrapper's cost (notebook 11)
        # YOUR CODE HERE
        # Hint: wrap model in DDP;
        #       on a GPU, give it this rank's device
        raise NotImplementedError("Exercise: see the hint above")

    log = training.open_log(args.log_json if rank == 0 else None,  # DDP: rank 0 logs, no one else
                            progress, steps_per_epoch, checkpoint, world_size=world_size,
                            global_batch=global_batch, peak_lr=lr, loader=args.loader,
                            ddp=not args.no_ddp, threads=torch.get_num_threads())
    if rank == 0:  # DDP: one rank talks
        resumed = f", resumed at step {progress['step']}" if progress["step"] else ""
        print(f"{world_size} × {batch} = global batch {global_batch}, lr {lr:g}, "
              f"{steps_per_epoch} steps per epoch, {env.backend} on {device}{resumed}", flush=True)
    trainer = Trainer(args, device, model, opt, sched, data,
                      training.Run(progress, config, log, caught))
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
    return p.parse_args(argv)


if __name__ == "__main__":
    main(parse_args())
