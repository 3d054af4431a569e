"""Train the course CNN on FashionMNIST in one process: the training a learner already knows.

    source .venv/bin/activate                     # the course's Python
    python solutions/labs/fashion_single.py       # one process, on a GPU when there is one

fashion_ddp.py is this file plus the lines data parallelism needs, each marked `# DDP:` with its
reason: notebook 05 shows the diff. Run with the same options, the two give the same weights on one
process (tests/test_twin.py).
"""
import argparse
import sys
import time
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.data import BatchSampler, DataLoader, RandomSampler
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
    sampler: RandomSampler  # the order of the training images, an epoch at a time
    loader: DataLoader | None  # --loader torchvision; None: batches cut from train_set
    batch: int


def setup(args):
    """The device: --device, or auto: the GPU when there is one."""
    if args.device != "auto":
        return torch.device(args.device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_data(args, device, batch):
    """The two splits on ``device`` and the order of the training images (--loader)."""
    train_set = InMemoryFashionMNIST(args.data_root, train=True, device=device,
                                     first=args.train_images)
    test_set = InMemoryFashionMNIST(args.data_root, train=False, device=device)
    sampler = RandomSampler(train_set, generator=torch.Generator())  # shuffled: batches()
    loader = None  # --loader memory: each batch is cut from the tensors by the sampler's indices
    if args.loader == "torchvision":  # the classic per-sample pipeline, fed by the same sampler
        loader = DataLoader(torchvision_fashion_mnist(args.data_root, train=True), batch_size=batch,
                            shuffle=True, generator=sampler.generator,  # reseeded by batches()
                            num_workers=args.workers, drop_last=True,
                            worker_init_fn=preemption.ignore_in_worker,
                            pin_memory=device.type == "cuda", persistent_workers=args.workers > 0)
    return Data(train_set, test_set, sampler, loader, batch)


def evaluate(model, test_set, device, dtype=torch.float32, batch=1000):
    """Loss and accuracy over the whole test set, each image counted exactly once."""
    model.eval()
    shard = torch.arange(len(test_set), device=device)
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
    with torch.no_grad():
        for idx in shard.split(batch):
            x, y = test_set[idx]
            out = model(x.to(dtype).contiguous(memory_format=torch.channels_last))
            totals += torch.stack([F.cross_entropy(out.float(), y, reduction="sum").double(),
                                   (out.argmax(1) == y).sum().double(),
                                   torch.tensor(len(y), device=device).double()])
    model.train()
    loss_sum, correct, count = totals.tolist()
    return loss_sum / count, correct / count, int(count)


class Trainer:
    """The training loop. ``data``: load_data's; ``run``: a training.Run, what a checkpoint
    resumes and where the records go."""

    def __init__(self, args, device, model, opt, sched, data, run):
        self.args, self.device, self.model, self.opt, self.sched = args, device, model, opt, sched
        self.data, self.batch = data, data.batch
        self.progress, self.config, self.log, self.caught = run
        self.steps_per_epoch = len(data.sampler) // self.batch
        self.dtype = next(model.parameters()).dtype
        self.amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.amp)
        self.window = training.Window(device)  # loss and throughput since the last log record
        self.last_eval, self.test_images = {"test_accuracy": None, "test_loss": None}, None
        self.bar = tqdm(total=args.epochs * self.steps_per_epoch, initial=self.progress["step"],
                        unit="step", desc="train", disable=world.bar_off())

    def batches(self, epoch):
        """This epoch's batches, in the sampler's order."""
        self.data.sampler.generator.manual_seed(self.args.seed + epoch)  # a resume: the same order
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
            if i == 0:  # the epoch's first labels: a new order each epoch
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
        print(f"epoch {p['epoch']}: {training.tested(rec)}, {rec['elapsed_s']:.1f} s", flush=True)
        self.save()
        return stop

    def run_step(self, x, y, step):
        """One optimizer step on the batch (``step``: the steps done before it)."""
        self.opt.zero_grad(set_to_none=True)
        with self.amp:
            loss = F.cross_entropy(self.model(x), y)
        loss.backward()
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
        votes = training.stop_votes(self.log.elapsed(), args.time_budget, self.caught)
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
        window = self.window.take(loss_sum.item(), 1)  # the images of 1 process
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
        training.save_checkpoint(f"{self.args.checkpoint_dir}/last.pt", self.config,
                                 model=self.model, optimizer=self.opt, scheduler=self.sched,
                                 progress=self.progress, rng=torch.get_rng_state())

    def finish(self, stop):
        """The last evaluation, log record and checkpoint; the report."""
        args = self.args
        self.bar.close()
        untested = self.last_eval["test_accuracy"] is None or self.progress["step_in_epoch"]
        if stop != "signal" and untested:  # not in a time-limit warning's last seconds
            self.test()  # stopped mid-epoch: test what we have
        final = self.record("done", test_images=self.test_images, stop=stop)
        print(f"step {final['step']}: {training.tested(final)}, {final['elapsed_s']:.1f} s "
              f"({stop})", flush=True)
        if args.save_model:
            torch.save(self.model.state_dict(), args.save_model)
        self.progress["finished"] = stop if stop == "target_accuracy" else None
        self.save()
        if stop == "signal":
            last = args.checkpoint_dir
            print(preemption.stopped_message(self.caught, final["step"], last), flush=True)


def main(args):
    caught = preemption.catch()  # SIGUSR1 (a time-limit warning), SIGTERM: stop after a step, saved
    device, stop = setup(args), sys.exit  # stop(why): the message, and exit
    batch = args.batch_size or args.global_batch_size
    training.check_options(1, batch, stop, args.no_eval, args.target_accuracy)
    dtype = training.deterministic(args.deterministic)  # float64 and fixed kernels, or float32
    torch.manual_seed(args.seed)  # the same initial weights every run
    data = load_data(args, device, batch)
    steps_per_epoch = len(data.sampler) // batch

    model = FashionCNN(args.width, args.norm).to(device, dtype, memory_format=torch.channels_last)
    lr = optim.scaled_lr(args.lr, batch, args.lr_scaling, REFERENCE_BATCH)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True,
                          weight_decay=args.weight_decay)
    total = args.epochs * steps_per_epoch
    warmup = max(1, round(args.warmup_epochs * steps_per_epoch))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, optim.warmup_then_decay(total, warmup))
    config = {**model.config, "global_batch": batch}  # what a resume must match
    checkpoint = training.resume_path(args.resume, args.checkpoint_dir)  # or None: from step 0
    progress = training.resume(checkpoint, config, stop, device, args.epochs, args.max_steps,
                               model=model, optimizer=opt, scheduler=sched)
    if progress is None:  # --resume names the checkpoint of a finished run: nothing to do
        return

    log = training.open_log(args.log_json, progress, steps_per_epoch, checkpoint,
                            global_batch=batch, peak_lr=lr, loader=args.loader,
                            threads=torch.get_num_threads())
    resumed = f", resumed at step {progress['step']}" if progress["step"] else ""
    print(f"batch {batch}, lr {lr:g}, {steps_per_epoch} steps per epoch on {device}{resumed}",
          flush=True)
    trainer = Trainer(args, device, model, opt, sched, data,
                      training.Run(progress, config, log, caught))
    reason = None  # why training stops early: a step limit, a target accuracy, a signal
    while progress["epoch"] < args.epochs and reason is None:
        reason = trainer.run_epoch(progress["epoch"])
    trainer.finish(reason or "epochs")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=options.Defaults)
    options.common_options(p, REFERENCE_BATCH)  # every training lab's: --epochs, --lr, --resume...
    options.fashion_options(p)  # the FashionMNIST labs': --width, --train-images, --amp, ...
    options.loader_options(p)  # --loader memory or torchvision (notebook 06)
    return p.parse_args(argv)


if __name__ == "__main__":
    main(parse_args())
