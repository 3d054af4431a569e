"""Train a ResNet on ImageNet (or an ImageFolder tree, or its tar shards) with DDP.

    source .venv/bin/activate                                      # the course's Python
    python -m dpcourse.lab.data make-imagefolder data/imagenet-mini  # no ImageNet? a small tree
    torchrun --standalone --nproc-per-node 2 solutions/labs/imagenet_ddp.py \\
        --data-root data/imagenet-mini --arch resnet18 --image-size 64 --batch-size 16 --epochs 4
    torchrun --standalone --nproc-per-node 8 solutions/labs/imagenet_ddp.py \\
        --data-root /shared/imagenet --stage-to "$TMPDIR/imagenet" # one GPU node, ImageNet
    torchrun --standalone --nproc-per-node 1 solutions/labs/imagenet_ddp.py \\
        --synthetic --max-steps 200                                # the GPU's speed alone
    sbatch slurm/imagenet.sbatch                                   # several nodes

The recipe of Goyal et al., "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour": SGD with
momentum, the learning rate scaled linearly with the global batch (0.1 per 256 images) after a
gradual warm-up, no weight decay on BatchNorm and bias parameters, the last BatchNorm of each
residual block starting at zero; plus label smoothing and a cosine decay. On GPUs: mixed
precision (bf16 or fp16) and channels_last. Validation is exact: every validation image is
counted once, top-1 and top-5. Rank 0 prints, logs (--log-json) and checkpoints. Every line that
exists because of distribution is marked `# DDP:`. First reading: main() at the bottom tells the
whole story; Trainer.run_step() is one step, where DDP averages the gradients; Trainer.save() is
where rank 0 saves; Trainer.after_step() is where all ranks agree to stop. The sampler that splits
the data is made in main(); make_datasets() and dpcourse.lab.images only read the images.
"""
import argparse
import time
from datetime import timedelta
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import BatchSampler, DistributedSampler
from tqdm.auto import tqdm

from dpcourse.lab import options, preemption, training, world
from dpcourse.lab.images import batch_loader, image_dataset, normalize, stage, to_device
from dpcourse.lab.metrics import peak_tflops, train_flops
from dpcourse.lab.models import torchvision_model
from dpcourse.lab.optim import scaled_lr, warmup_then_decay

REFERENCE_BATCH = 256  # the global batch --lr is for (Goyal et al.: 0.1 per 256); --lr-scaling


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


def param_groups(model, weight_decay):
    """Two groups for the optimiser: weight decay on the conv and linear weights only.

    Goyal et al. leave BatchNorm's scale and shift out of the weight decay; later recipes leave the
    biases out too (Jia et al., 2018; T. He et al., "Bag of Tricks", 2019)."""
    ### BEGIN SOLUTION (hint: a parameter with one dimension (p.ndim == 1) is a BatchNorm weight or bias, or a layer's bias: put those in a group with "weight_decay": 0.0, every other parameter in a group with weight_decay; return [dict(params=..., weight_decay=...), dict(...)])
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]
    ### END SOLUTION


def correct_topk(logits, labels, ks=(1, 5)):
    """How many rows of ``logits`` have their label among their k highest scores, for each k."""
    ### BEGIN SOLUTION (hint: logits.topk(max(ks), dim=1).indices holds each row's best classes, best first; compare them with labels[:, None] and count the rows whose label is among the first k)
    top = logits.topk(max(ks), dim=1).indices
    hit = top == labels[:, None]
    return [hit[:, :k].any(dim=1).sum().item() for k in ks]
    ### END SOLUTION


def make_datasets(args, env):
    """(train, val) datasets, or (None, None) with --synthetic; staged to node-local disk first."""
    if args.synthetic:
        return None, None
    root = args.data_root
    if not root:
        world.stop(env, "--data-root is missing: give the folder that holds train/ and val/ "
                   "(ImageFolder or shards), or train on --synthetic images. To practise "
                   "without ImageNet:\n"
                   "    .venv/bin/python -m dpcourse.lab.data make-imagefolder "
                   "data/imagenet-mini")
    if args.stage_to:
        with world.rank0_first(local=True):  # DDP: one copy per node, by its local rank 0
            root = stage(root, args.stage_to)
    decode = args.decode_on == "workers"
    with world.rank0_first():  # DDP: a missing folder is said once, by rank 0
        train = image_dataset(Path(root) / "train", True, args.image_size, args.seed, decode)
        val = image_dataset(Path(root) / "val", False, args.image_size, args.seed, decode)
    return train, val


def evaluate(args, model, val_set, env, fmt, amp):
    """Loss, top-1 and top-5 accuracy over the whole validation set, each image counted once."""
    model.eval()
    # DDP: rank r takes images r, r+K, r+2K, ...: no padding (DistributedSampler would repeat some).
    mine = range(env.rank, len(val_set), env.world_size)
    batches = BatchSampler(mine, args.batch_size_eval, drop_last=False)
    totals = torch.zeros(4, dtype=torch.float64, device=env.device)  # loss sum, top-1, top-5, count
    with torch.no_grad(), amp:
        for batch in batch_loader(val_set, batches, args.workers, args.decode_on, env.device,
                                  preemption.ignore_in_worker):
            x, y = to_device(val_set, batch, args.decode_on, env.device, fmt)
            out = model(x).float()
            top1, top5 = correct_topk(out, y, (1, min(5, out.shape[1])))
            loss = F.cross_entropy(out, y, reduction="sum").item()
            totals += totals.new_tensor([loss, top1, top5, len(y)])  # the same dtype and device
    dist.all_reduce(totals)  # DDP: the sums over every rank's share
    model.train()
    loss, top1, top5, count = totals.tolist()
    return {"test_loss": round(loss / count, 5), "test_accuracy": round(top1 / count, 5),
            "test_top5": round(top5 / count, 5), "test_images": int(count)}


def unwrap(model):
    """The plain module inside a DDP wrapper (what a checkpoint stores, what evaluation runs)."""
    return model.module if isinstance(model, DDP) else model


class Trainer:
    """One rank's training loop: every rank runs the same steps on its own batches; rank 0 also
    logs and saves. A checkpoint resumes ``progress`` (epoch, step, step in the epoch, seconds)."""

    def __init__(self, args, env, model, opt, sched, *, precision, sampler, batch, data, config,
                 progress, log, caught):
        self.args, self.env, self.model, self.opt, self.sched = args, env, model, opt, sched
        self.amp, self.scaler, self.fmt, _ = precision  # autocast, loss scaling, layout; (name)
        self.sampler, self.batch, self.config = sampler, batch, config
        self.progress, self.log, self.caught = progress, log, caught
        self.train_set, self.val_set, self.fake = data  # (None, None, a random batch): --synthetic
        self.steps_per_epoch = len(sampler) // batch if sampler else args.synthetic_steps
        self.flops = train_flops(unwrap(model), args.image_size)  # per image, forward and backward
        self.peak = peak_tflops(env.device, args.peak_tflops)
        self.window, self.tested = training.Window(env.device), {}  # since the last record; a test
        self.bar = tqdm(total=args.epochs * self.steps_per_epoch, initial=progress["step"],
                        unit="step", desc="train", disable=world.bar_off(env.rank))  # DDP: 0's

    def batches(self, epoch):
        """This rank's batches of the epoch, from where a resumed run left off (--synthetic: one
        batch, again and again)."""
        if self.train_set is None:
            return (self.fake for _ in range(self.progress["step_in_epoch"], self.steps_per_epoch))
        self.sampler.set_epoch(epoch)  # DDP: a new order each epoch, the same on every rank
        self.train_set.set_epoch(epoch)  # new random crops each epoch
        batches = BatchSampler(self.sampler, self.batch, drop_last=True)
        batches = list(batches)[self.progress["step_in_epoch"]:]
        args, device = self.args, self.env.device
        data = batch_loader(self.train_set, batches, args.workers, args.decode_on, device,
                            preemption.ignore_in_worker)  # signals: the main process acts on them
        return (to_device(self.train_set, b, args.decode_on, device, self.fmt) for b in data)

    def run_epoch(self, epoch):
        """One pass over this rank's shard; why training stops, or None to go on."""
        p, ready = self.progress, time.perf_counter()
        self.start = ready  # the window's clock: evaluations and checkpoints in between don't count
        for i, (x, y) in enumerate(self.batches(epoch), start=p["step_in_epoch"]):
            if self.train_set is None:
                x = normalize(x).contiguous(memory_format=self.fmt)
            data_s = time.perf_counter() - ready  # waiting for the input pipeline
            self.window.add(self.run_step(x, y), self.batch, data_s=data_s)
            p.update(step=p["step"] + 1, step_in_epoch=i + 1)
            self.bar.update()
            if stop := self.after_step(i):
                return stop
            ready = time.perf_counter()
        p.update(epoch=epoch + 1, step_in_epoch=0)
        if not (self.args.no_eval or self.args.synthetic):
            self.tested = evaluate(self.args, unwrap(self.model), self.val_set, self.env, self.fmt,
                                   self.amp)
        rec = self.record("epoch")
        if self.env.rank == 0:  # DDP: one line per epoch, also where there is no bar (logs, CI)
            print(f"epoch {p['epoch']}: {training.top5_summary(rec)}, {rec['elapsed_s']:.1f} s",
                  flush=True)
        self.save()
        target = self.args.target_accuracy
        reached = target and self.tested and self.tested["test_accuracy"] >= target
        return "target_accuracy" if reached else None

    def run_step(self, x, y):
        """One optimizer step on this rank's batch."""
        with self.amp:
            loss = F.cross_entropy(self.model(x), y, label_smoothing=self.args.label_smoothing)
        self.opt.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()  # DDP: the gradients are averaged during backward
        self.scaler.step(self.opt)
        self.scaler.update()
        self.sched.step()
        return loss.detach().float()

    def after_step(self, i):
        """A log record and a checkpoint, when one is due; why training stops, or None."""
        args, step = self.args, self.progress["step"]
        if step % args.log_every == 0 or i + 1 == self.steps_per_epoch:
            if self.env.device.type == "cuda":
                torch.cuda.synchronize()  # the window's images are really done
            self.window.seconds += time.perf_counter() - self.start
            self.start = time.perf_counter()
            if i + 1 < self.steps_per_epoch:
                rec = self.record("train")
                self.bar.set_postfix(img_s=rec["samples_per_s"], loss=rec["train_loss"])
        if args.checkpoint_every and step % args.checkpoint_every == 0:
            self.save()
        votes = training.stop_votes(self.log.elapsed(), args.time_budget, self.caught,
                                    self.env.device, clock=self.env.rank == 0)
        dist.all_reduce(votes, op=dist.ReduceOp.MAX)  # DDP: one vote stops every rank, here
        return training.stop_reason(votes, self.caught, step, args.max_steps)

    def record(self, event, **fields):
        """Rank 0's log line: loss averaged over ranks and steps; throughput since the last record
        (the final record: of the whole run), and the model FLOP utilisation (MFU) on a GPU."""
        loss_sum = self.window.loss.clone()
        dist.all_reduce(loss_sum)  # DDP: the sum of every rank's losses
        step = self.progress["step"]
        figures = self.window.take(loss_sum.item(), self.env.world_size, whole_run=event == "done",
                                   data_wait=True)
        per_worker, peak = figures["samples_per_s_per_worker"], self.peak
        mfu = round(per_worker * self.flops / (peak * 1e12), 4) if per_worker and peak else None
        return self.log.write(event, epoch=round(step / self.steps_per_epoch, 4), step=step,
                              **figures, mfu=mfu, lr=round(self.sched.get_last_lr()[0], 7),
                              **(self.tested if event in ("epoch", "done") else {}), **fields)

    def save(self):
        """CHECKPOINT_DIR/last.pt (--checkpoint-dir): everything a resumed run needs."""
        if not self.args.checkpoint_dir:
            return
        self.progress["elapsed_s"] = self.log.elapsed()  # every rank: the clock a resume goes on
        if self.env.rank == 0:  # DDP: one writer; every replica holds the same weights
            training.save_checkpoint(f"{self.args.checkpoint_dir}/last.pt", self.config,
                                     model=unwrap(self.model), optimizer=self.opt,
                                     scheduler=self.sched, scaler=self.scaler,
                                     progress=self.progress)

    def finish(self, stop):
        """The last evaluation, log record and checkpoint; rank 0 reports."""
        args, env = self.args, self.env
        self.bar.close()
        if self.window.steps:
            self.window.seconds += time.perf_counter() - self.start
        testing = not (args.no_eval or args.synthetic)  # and stopped mid-epoch: test what we have
        if stop not in ("epochs", "signal") and self.progress["step_in_epoch"] and testing:
            self.tested = evaluate(args, unwrap(self.model), self.val_set, env, self.fmt, self.amp)
        final = self.record("done", stop=stop, flops_per_image=self.flops)
        if env.rank == 0:  # DDP: rank 0 reports and saves; the others hold the same weights
            print(f"step {final['step']}: {training.top5_summary(final)}, "
                  f"{final['elapsed_s']:.1f} s ({stop})", flush=True)
            if args.save_model:
                torch.save(unwrap(self.model).state_dict(), args.save_model)
        self.save()
        if env.rank == 0 and stop == "signal":
            last = args.checkpoint_dir
            print(preemption.stopped_message(self.caught, final["step"], last), flush=True)
        if stop == "signal":  # the first rank to exit may end the job: none before rank 0 has saved
            dist.barrier()  # DDP: wait for rank 0's checkpoint


def main(args):
    caught = preemption.catch()  # SIGUSR1 (a time-limit warning), SIGTERM: stop after a step, saved
    env = setup(args)
    rank, world_size = dist.get_rank(), dist.get_world_size()  # DDP: who am I, how many are we?
    device, stop = env.device, partial(world.stop, env)  # stop(why): rank 0 says it, all exit
    batch, global_batch = training.batch_sizes(args.batch_size, args.global_batch_size,
                                               world_size, stop)  # DDP: × world size
    training.check_options(world_size, batch, stop, args.no_eval, args.target_accuracy,
                           no_ddp=args.no_ddp)  # e.g. --no-ddp on two ranks
    training.deterministic(args.deterministic, warn_only=True)  # resumed = uninterrupted
    torch.backends.cudnn.benchmark = not args.deterministic  # else: the fastest kernel per shape
    torch.manual_seed(args.seed)  # the same initial weights everywhere (DDP copies rank 0's anyway)
    precision = training.mixed_precision(args.amp, args.channels_last, device)  # --amp, ...

    train_set, val_set = make_datasets(args, env)
    sampler, fake = None, None
    if train_set is not None:
        sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank,  # DDP: my shard
                                     shuffle=True, seed=args.seed, drop_last=True)
        steps_per_epoch, classes = len(sampler) // batch, len(train_set.classes)
        if steps_per_epoch == 0:
            stop(f"{len(train_set)} training images make no step of {world_size} × {batch}: "
                 "give a smaller --batch-size, or more images.")
    else:  # --synthetic: one random batch, made on the device, used again and again
        steps_per_epoch, classes = args.synthetic_steps, args.classes
        size = (batch, 3, args.image_size, args.image_size)
        fake = (torch.randint(0, 256, size, dtype=torch.uint8, device=device),
                torch.randint(0, classes, (batch,), device=device))

    # a torchvision model, the last BatchNorm of each residual block starting at zero (Goyal et al.)
    model = torchvision_model(args.arch, classes, stop)
    model = model.to(device, memory_format=precision.memory_format)
    lr = scaled_lr(args.lr, global_batch, args.lr_scaling, REFERENCE_BATCH)  # DDP: of all ranks
    opt = torch.optim.SGD(param_groups(model, args.weight_decay), lr=lr, momentum=0.9)
    total, warmup = args.epochs * steps_per_epoch, round(args.warmup_epochs * steps_per_epoch)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_then_decay(total, warmup, decay="cosine"))
    config = {"arch": args.arch, "classes": classes, "image_size": args.image_size,
              "world_size": world_size, "global_batch": global_batch}  # what a resume must match
    # DDP: every rank loads the same checkpoint (--resume), so that the replicas go on alike
    checkpoint = training.resume_path(args.resume, args.checkpoint_dir)  # or None: from step 0
    progress = training.resume(checkpoint, config, stop, device, args.epochs, args.max_steps,
                               model=model, optimizer=opt, scheduler=sched, scaler=precision.scaler)
    if progress is None:  # --resume names the checkpoint of a finished run: nothing to do
        return cleanup()
    if not args.no_ddp:
        model = DDP(model, device_ids=[device] if device.type == "cuda" else None)  # DDP: the wrap

    log = training.open_log(args.log_json if rank == 0 else None,  # DDP: rank 0 logs, no one else
                            progress, steps_per_epoch, checkpoint, world_size=world_size,
                            global_batch=global_batch, arch=args.arch, image_size=args.image_size,
                            peak_lr=lr, amp=precision.amp,
                            channels_last=precision.memory_format == torch.channels_last,
                            data="synthetic" if args.synthetic else type(train_set).__name__,
                            decode_on=args.decode_on, workers=args.workers, device=str(device))
    if rank == 0:  # DDP: one rank talks
        resumed = f", resumed at step {progress['step']}" if progress["step"] else ""
        print(f"{args.arch}: {world_size} × {batch} = global batch {global_batch}, lr {lr:g}, "
              f"{steps_per_epoch} steps per epoch, {env.backend} on {device}, amp "
              f"{log.common['amp']}, channels_last {log.common['channels_last']}{resumed}",
              flush=True)
        training.warmup_note(args.warmup_epochs, args.epochs, lr)  # warm-up not below --epochs
    trainer = Trainer(args, env, model, opt, sched, precision=precision, sampler=sampler,
                      batch=batch, data=(train_set, val_set, fake), config=config,
                      progress=progress, log=log, caught=caught)
    reason = None  # why training stops early: a step limit, a target accuracy, a signal
    while progress["epoch"] < args.epochs and reason is None:
        reason = trainer.run_epoch(progress["epoch"])
    trainer.finish(reason or "epochs")
    cleanup()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=options.Defaults)
    # every training lab's (dpcourse/lab/options.py) --epochs, --lr, ..., with Goyal et al.'s recipe
    options.common_options(p, REFERENCE_BATCH, epochs=90, global_batch_size=256, lr=0.1,
                           lr_scaling="linear", warmup_epochs=5, weight_decay=1e-4, log_every=20)
    options.ddp_options(p, timeout=120)  # the DDP labs': --backend, --timeout, --no-ddp
    options.imagenet_options(p)  # --arch, --image-size, --amp, --synthetic, --stage-to, ...
    return p.parse_args(argv)


if __name__ == "__main__":
    main(parse_args())
