"""Train the course CNN on FashionMNIST with Horovod: the DDP lab, line for line, in its form.

    horovodrun -np 2 python labs/fashion_horovod.py         # two processes (gloo or MPI)
    horovodrun --gloo -np 2 python labs/fashion_horovod.py  # gloo: no MPI needed
    mpirun -np 2 python labs/fashion_horovod.py             # Open MPI (root: see below)
    srun --mpi=pmix python labs/fashion_horovod.py          # Slurm (slurm/horovod.sbatch)
    python labs/fashion_horovod.py                          # one process

labs/fashion_ddp.py with Horovod's lines in place of DDP's, each marked `# Horovod:`
(notebook 11 shows the diff; `make horovod` builds Horovod): the same model, data, checkpoints
and log records. DDP wraps the model, Horovod the optimizer: hvd.DistributedOptimizer averages
each gradient across the ranks (Tensor Fusion: in fused batches) while backward runs, and step()
waits for them. Horovod's own: its set-up and collectives, rank 0's checkpoint shared by
broadcasts, NCHW weights, options (--no-hvd, --accumulate, --compression, --adasum,
--fusion-threshold-mb), log fields. As root, mpirun needs --allow-run-as-root. First reading:
main() (the rate, the optimizer's wrap, the broadcasts), load_data(), run_step(), save().
"""
# Horovod: os for its environment variables, dataclasses to copy a DistEnv
import argparse
import dataclasses
import os
import time
from typing import NamedTuple

# Horovod: its PyTorch API, and the same sampler as DDP's
import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torch.utils.data import BatchSampler, DistributedSampler
from tqdm.auto import tqdm

from dpcourse.lab import optim, options, preemption, training, world
from dpcourse.lab.data import InMemoryFashionMNIST  # Horovod: in memory only: no --loader here
from dpcourse.lab.errors import CourseError  # Horovod: the device check's refusal, said once
from dpcourse.lab.models import FashionCNN

# The batch-and-rate policy: --lr is the rate tuned for a global batch of REFERENCE_BATCH images;
# --lr-scaling says how it follows another global batch (none; linear, Goyal et al.; sqrt).
REFERENCE_BATCH = 128


class Data(NamedTuple):
    train_set: InMemoryFashionMNIST  # the whole split, on the device
    test_set: InMemoryFashionMNIST
    sampler: DistributedSampler  # Horovod: the indices of this rank, as in the DDP lab
    batch: int  # Horovod: this rank's share of each global batch (no --loader: in memory only)


def stop(message):
    # Horovod: world.stop with Horovod's rank: rank 0 says it, all exit
    world.stop(world.DistEnv(rank=hvd.rank(), world_size=hvd.size()), message)


def largest(tensor, name="largest"):  # Horovod: the elementwise maximum over the ranks
    return hvd.allreduce(tensor.cpu(), op=hvd.Max, name=name)  # Horovod: one collective


def setup(args):  # Horovod: its own set-up, instead of a process group
    """The device of this process, after Horovod has found its peers."""
    if args.fusion_threshold_mb is not None:
        # Horovod: Tensor Fusion's buffer for ready gradients (DDP: bucket_cap_mb), read by init
        os.environ["HOROVOD_FUSION_THRESHOLD"] = str(int(args.fusion_threshold_mb * 1024 * 1024))
    hvd.init()  # Horovod: rank and size from horovodrun (gloo) or MPI (mpirun, srun --mpi=pmix)
    world.explain_errors()  # Horovod: an error in one line from rank 0, not a traceback per rank
    # Horovod: this process's ranks and sizes, as Horovod found them
    where = world.DistEnv(hvd.rank(), hvd.local_rank(), hvd.size(), hvd.local_size(),
                          world.env_info().launcher)
    # Horovod: cuda:LOCAL_RANK, or cuda:0 when srun bound one GPU each ("gloo": no NCCL check)
    try:
        placed = world.placement("gloo", args.device, where)
    except CourseError as err:
        stop(err.message)
    if placed.note and hvd.local_rank() == 0:  # Horovod: one note per node, from its first rank
        print(f"[rank {hvd.rank()}] {placed.note}", flush=True)  # Horovod: says which rank
    if placed.device.type == "cuda":
        torch.cuda.set_device(placed.device)  # Horovod: one GPU per process
    # Horovod: rank 0 lists each rank's GPU (gathered by Horovod); two ranks on one GPU stop here
    world.gpu_roll_call(dataclasses.replace(where, device=placed.device),
                        gather=hvd.allgather_object)
    return placed.device


def load_data(args, device, batch, rank, world_size):  # Horovod: hvd.rank(), hvd.size()
    """The two splits on ``device`` and the order of the training images."""
    if rank != 0:
        hvd.barrier()  # Horovod: rank 0 stages the files first; the others wait, then read them
    # Horovod: between two barriers, as DDP's rank0_first() has it
    train_set = InMemoryFashionMNIST(args.data_root, train=True, device=device,
                                     first=args.train_images)
    test_set = InMemoryFashionMNIST(args.data_root, train=False, device=device)
    if rank == 0:
        hvd.barrier()  # Horovod: the data is there; let the others in
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank,  # Horovod: my shard
                                 shuffle=True, seed=args.seed, drop_last=True)
    return Data(train_set, test_set, sampler, batch)  # Horovod: no DataLoader


def evaluate(model, test_set, device, dtype=torch.float32, batch=1000):
    """Loss and accuracy over the whole test set, each image counted exactly once."""
    model.eval()
    # Horovod: rank r takes images r, r+K, r+2K, ...: no padding, unlike DistributedSampler's.
    shard = torch.arange(hvd.rank(), len(test_set), hvd.size(), device=device)
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
    with torch.no_grad():
        for idx in shard.split(batch):
            x, y = test_set[idx]
            out = model(x.to(dtype))  # Horovod: contiguous, as the weights (see main)
            totals += torch.stack([F.cross_entropy(out.float(), y, reduction="sum").double(),
                                   (out.argmax(1) == y).sum().double(),
                                   torch.tensor(len(y), device=device).double()])
    # YOUR CODE HERE
    # Hint: sum the three totals over all ranks with one Horovod collective;
    #       it returns a new tensor
    raise NotImplementedError("Exercise: see the hint above")
    model.train()
    loss_sum, correct, count = totals.tolist()
    return loss_sum / count, correct / count, int(count)


class Trainer:
    """This rank's training loop: every rank runs the same steps on its own batches. ``data``:
    load_data's; ``run``: a training.Run, what a checkpoint resumes and where the records go."""

    def __init__(self, args, device, model, opt, sched, data, run):
        self.args, self.device, self.model, self.opt, self.sched = args, device, model, opt, sched
        self.data, self.batch = data, data.batch
        self.progress, self.config, self.log, self.caught = run
        self.rank, self.world_size = hvd.rank(), hvd.size()  # Horovod: this rank of K
        self.steps_per_epoch = len(data.sampler) // self.batch
        self.dtype = next(model.parameters()).dtype
        self.amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.amp)
        self.window = training.Window(device)  # loss and throughput since the last log record
        self.last_eval, self.test_images = {"test_accuracy": None, "test_loss": None}, None
        self.bar = tqdm(total=args.epochs * self.steps_per_epoch, initial=self.progress["step"],
                        unit="step", desc="train",
                        disable=world.bar_off(self.rank))  # Horovod: rank 0's bar only

    def batches(self, epoch):
        """This epoch's batches, in the sampler's order."""
        # YOUR CODE HERE
        # Hint: tell the sampler which epoch this is, so that each epoch is shuffled
        #       anew
        raise NotImplementedError("Exercise: see the hint above")
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
            y = y.to(self.device, non_blocking=True)
            if i == 0 and self.rank == 0:  # Horovod: rank 0 logs the epoch's first labels
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
        if self.rank == 0:  # Horovod: rank 0 alone prints the epoch's line
            print(f"epoch {p['epoch']}: {training.tested(rec)}, {rec['elapsed_s']:.1f} s",
                  flush=True)
        self.save()
        return stop

    def run_step(self, x, y, step):
        """One optimizer step on the batch (``step``: the steps done before it)."""
        self.opt.zero_grad()  # Horovod: 0.28's wrapper takes no set_to_none (None is the default)
        n = self.args.accumulate  # Horovod: --accumulate, its backward_passes_per_step
        for xm, ym in zip(x.chunk(n), y.chunk(n)):  # Horovod: n micro-batches, one average
            with self.amp:
                loss = F.cross_entropy(self.model(xm), ym) / n  # Horovod: the mean of the n
            loss.backward()  # Horovod: the n-th pass starts each gradient's allreduce when ready
        self.opt.step()  # Horovod: waits for the averaged gradients, then steps
        self.sched.step()
        return loss.detach().float() * n  # Horovod: the last micro-batch's mean loss

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
        # Horovod: every rank stops after the same step; only rank 0's clock counts
        votes = training.stop_votes(self.log.elapsed(), args.time_budget, self.caught,
                                    self.device, clock=self.rank == 0)
        votes = largest(votes, name="stop")  # Horovod: MAX: one rank's vote stops them all
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
        # Horovod: the sum of every rank's losses (hvd.allreduce returns a new tensor)
        loss_sum = hvd.allreduce(self.window.loss, op=hvd.Sum, name="train_loss")
        window = self.window.take(loss_sum.item(), self.world_size)  # Horovod: all ranks' images
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
        if self.rank == 0:  # Horovod: one writer; every replica holds the same weights
            training.save_checkpoint(f"{self.args.checkpoint_dir}/last.pt", self.config,
                                     model=self.model, optimizer=self.opt,  # Horovod: unwrapped
                                     scheduler=self.sched, progress=self.progress,
                                     rng=torch.get_rng_state())

    def finish(self, stop):
        """The last evaluation, log record and checkpoint; the report."""
        args = self.args
        self.bar.close()
        untested = self.last_eval["test_accuracy"] is None or self.progress["step_in_epoch"]
        if stop != "signal" and untested:  # not in a time-limit warning's last seconds
            self.test()  # stopped mid-epoch: test what we have
        spread = training.replicas_max_diff(  # Horovod: a check, with Horovod's collectives
            self.model, lambda t, name: hvd.broadcast(t.cpu(), root_rank=0, name=name).to(t.device),
            largest)
        final = self.record("done", test_images=self.test_images, stop=stop,
                            replicas_max_diff=spread)  # Horovod: the check, in the done record
        if self.rank == 0:  # Horovod: rank 0 reports and writes --save-model: the others alike
            print(f"step {final['step']}: {training.tested(final)}, {final['elapsed_s']:.1f} s "
                  f"({stop})", flush=True)
            if args.save_model:
                torch.save(self.model.state_dict(), args.save_model)  # Horovod: no wrapper
        self.progress["finished"] = stop if stop == "target_accuracy" else None
        self.save()
        if self.rank == 0 and stop == "signal":  # Horovod: rank 0 says where to resume
            last = args.checkpoint_dir
            print(preemption.stopped_message(self.caught, final["step"], last), flush=True)
        if stop == "signal":  # the first rank to exit may end the job: none before rank 0 has saved
            hvd.barrier()  # Horovod: wait for rank 0's checkpoint


def main(args):
    caught = preemption.catch()  # SIGUSR1 (a time-limit warning), SIGTERM: stop after a step, saved
    device = setup(args)  # Horovod: hvd.init(), this rank's device
    rank, world_size = hvd.rank(), hvd.size()  # Horovod: who am I, how many are we?
    batch, global_batch = training.batch_sizes(args.batch_size, args.global_batch_size,
                                               world_size, stop)  # Horovod: per rank and in all
    training.check_options(world_size, batch, stop, args.no_eval, args.target_accuracy,
                           accumulate=args.accumulate, no_hvd=args.no_hvd)  # Horovod: its own
    if args.adasum and not hvd.mpi_enabled():  # Horovod: Adasum needs its MPI controller
        stop("--adasum needs Horovod's MPI controller: launch with mpirun or horovodrun --mpi (and "
             "a Horovod built with MPI: horovodrun --check-build lists it).")
    dtype = training.deterministic(args.deterministic)  # float64 and fixed kernels, or float32
    torch.manual_seed(args.seed)  # the same initial weights every run
    data = load_data(args, device, batch, rank, world_size)  # Horovod: with who I am
    steps_per_epoch = len(data.sampler) // batch

    # Horovod: NCHW weights: Horovod's collectives refuse channels_last tensors
    model = FashionCNN(args.width, args.norm).to(device, dtype)
    # Horovod: one step averages the gradients of the GLOBAL batch: its size sets the rate
    lr = optim.scaled_lr(args.lr, global_batch, args.lr_scaling, REFERENCE_BATCH)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True,
                          weight_decay=args.weight_decay)
    total = args.epochs * steps_per_epoch
    warmup = max(1, round(args.warmup_epochs * steps_per_epoch))
    if not args.no_hvd:  # Horovod: --no-hvd measures the wrapper's cost (notebook 11)
        compression = hvd.Compression.fp16 if args.compression == "fp16" else hvd.Compression.none
        # YOUR CODE HERE
        # Hint: wrap opt in Horovod's DistributedOptimizer: give it the model's named
        #       parameters, compression, args.accumulate backward passes per step, and
        #       hvd.Adasum as op when args.adasum, else hvd.Average
        raise NotImplementedError("Exercise: see the hint above")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, optim.warmup_then_decay(total, warmup))
    # Horovod: a resume must match the world size and the global batch too
    config = {**model.config, "world_size": world_size, "global_batch": global_batch}
    # Horovod: rank 0 alone reads the checkpoint (--resume); the broadcasts below share it
    checkpoint = training.resume_path(args.resume, args.checkpoint_dir)  # or None: from step 0
    progress = {"epoch": 0, "step": 0, "step_in_epoch": 0, "elapsed_s": 0.0,
                "global_batch": global_batch}
    if checkpoint and rank == 0:
        progress = training.load_checkpoint(checkpoint, config, stop, "cpu", model=model,
                                            optimizer=opt, scheduler=sched)
    # YOUR CODE HERE
    # Hint: every rank starts from rank 0's optimizer state, then from rank 0's weights
    #       (the model's state_dict): in that order
    raise NotImplementedError("Exercise: see the hint above")
    progress = hvd.broadcast_object(progress, root_rank=0, name="progress")  # Horovod: rank 0's
    # Horovod: rank 0's schedule (a resumed one) to every rank
    sched.load_state_dict(hvd.broadcast_object(sched.state_dict(), root_rank=0, name="schedule"))
    if done := checkpoint and training.finished(progress, args.epochs, args.max_steps):
        if rank == 0:  # Horovod: one rank says so (the same command run twice)
            print(f"{checkpoint} is the checkpoint of a finished run (step {progress['step']}, "
                  f"stopped by {done}): nothing to do. Delete it, or give another "
                  "--checkpoint-dir, to train afresh.", flush=True)
        return hvd.shutdown()  # Horovod: stop the background thread before returning

    log = training.open_log(args.log_json if rank == 0 else None,  # Horovod: rank 0 logs
                            progress, steps_per_epoch, checkpoint, world_size=world_size,
                            global_batch=global_batch, peak_lr=lr, loader="memory",
                            framework="horovod", horovod=not args.no_hvd,  # Horovod: its own
                            compression=args.compression, op="adasum" if args.adasum else "average",
                            threads=torch.get_num_threads(),
                            controller="mpi" if hvd.mpi_enabled() else "gloo")
    if rank == 0:  # Horovod: one rank talks
        resumed = f", resumed at step {progress['step']}" if progress["step"] else ""
        controller = "MPI" if hvd.mpi_enabled() else "gloo"  # Horovod: its controller
        print(f"{world_size} × {batch} = global batch {global_batch}, lr {lr:g}, "
              f"{steps_per_epoch} steps per epoch, Horovod ({controller}) on {device}{resumed}",
              flush=True)
    trainer = Trainer(args, device, model, opt, sched, data,
                      training.Run(progress, config, log, caught))
    reason = None  # why training stops early: a step limit, a target accuracy, a signal
    while progress["epoch"] < args.epochs and reason is None:
        reason = trainer.run_epoch(progress["epoch"])
    trainer.finish(reason or "epochs")
    hvd.shutdown()  # Horovod: stop the background thread, so that every rank exits cleanly


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=options.Defaults)
    options.common_options(p, REFERENCE_BATCH)  # every training lab's: --epochs, --lr, --resume...
    options.fashion_options(p)  # the FashionMNIST labs': --width, --train-images, --amp, ...
    options.horovod_options(p)  # Horovod: --no-hvd, --accumulate, --compression, --adasum, ...
    return p.parse_args(argv)


if __name__ == "__main__":
    main(parse_args())
