"""Train the course CNN on FashionMNIST with Horovod: the DDP lab, line for line, in Horovod's form.

    horovodrun -np 2 python solutions/labs/fashion_horovod.py          # two processes here (gloo or MPI)
    horovodrun --gloo -np 2 python solutions/labs/fashion_horovod.py   # gloo: no MPI needed
    mpirun -np 2 python solutions/labs/fashion_horovod.py              # two Open MPI ranks (as root: --allow-run-as-root)
    srun --mpi=pmix python solutions/labs/fashion_horovod.py           # Slurm tasks (slurm/horovod.sbatch)
    python solutions/labs/fashion_horovod.py                           # one process

(Activate the course's environment first: source .venv/bin/activate; `make horovod` builds Horovod.)

The same model, options, checkpoints and JSON log as solutions/labs/fashion_ddp.py, so the two
runs can be plotted together (notebook 11). Where DDP wraps the model, Horovod wraps the
optimizer: hvd.DistributedOptimizer averages each gradient across the ranks (in fused batches,
Tensor Fusion) while backward runs, and optimizer.step() waits for them. Every line that exists
because of distribution is marked `# Horovod:`.
"""
import argparse
import dataclasses
import math
import os
import time
from pathlib import Path

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torch.utils.data import BatchSampler, DistributedSampler
from tqdm.auto import tqdm

from dpcourse import CourseError, dist as ddp_env, preemption
from dpcourse.data import InMemoryFashionMNIST
from dpcourse.metrics import JsonLog
from dpcourse.models import FashionCNN
from dpcourse.optim import REFERENCE_BATCH, warmup_then_decay
from dpcourse.options import Defaults  # --help with each option's default, once


def setup(args):
    """The device of this process, after Horovod has found its peers."""
    if args.fusion_threshold_mb is not None:
        # Horovod: Tensor Fusion packs ready gradients into one buffer of up to this many bytes
        # (DDP: bucket_cap_mb); hvd.init() reads it once.
        os.environ["HOROVOD_FUSION_THRESHOLD"] = str(int(args.fusion_threshold_mb * 1024 * 1024))
    hvd.init()  # Horovod: rank and size from horovodrun (gloo) or from MPI (mpirun, srun --mpi=pmix)
    ddp_env.explain_errors()  # an unfinished exercise, a lost peer: one line, not a traceback per rank
    # cuda:LOCAL_RANK when this process sees all of the node's GPUs, cuda:0 when srun bound it one (--gpus-per-task=1)
    # Horovod: this process's ranks and sizes, as Horovod found them
    where = ddp_env.DistEnv(hvd.rank(), hvd.local_rank(), hvd.size(), hvd.local_size(), ddp_env.env_info().launcher)
    try:
        placed = ddp_env.placement("gloo", args.device, where)  # (the backend is Horovod's: only the device counts)
    except CourseError as err:
        stop(err.message)
    if placed.note and hvd.local_rank() == 0:  # Horovod: one note per node, from its first rank
        print(f"[rank {hvd.rank()}] {placed.note}", flush=True)  # Horovod: says which rank
    if placed.device.type == "cuda":
        torch.cuda.set_device(placed.device)  # Horovod: one GPU per process
    # on GPUs: rank 0 lists each rank's GPU (gathered by Horovod); two ranks on one GPU stop here
    ddp_env.gpu_roll_call(dataclasses.replace(where, device=placed.device), gather=hvd.allgather_object)
    return placed.device


def stop(message):
    """End the run with one line from rank 0; the other ranks exit quietly (dpcourse.dist.stop)."""
    ddp_env.stop(ddp_env.DistEnv(rank=hvd.rank(), world_size=hvd.size()), message)  # Horovod: rank 0 says it


def batch_sizes(args):
    """(per-worker batch, global batch) from --batch-size or --global-batch-size."""
    if args.batch_size:
        return args.batch_size, args.batch_size * hvd.size()  # Horovod: per worker × workers
    if args.global_batch_size < hvd.size() or args.global_batch_size % hvd.size():  # Horovod: one equal share each
        # Horovod: rank 0 says it, naming the world size
        stop(f"--global-batch-size {args.global_batch_size} does not split into {hvd.size()} equal "
             f"per-worker batches: use a multiple of {hvd.size()}, or give --batch-size per worker.")
    return args.global_batch_size // hvd.size(), args.global_batch_size  # Horovod: one worker's share


def scaled_lr(args, global_batch):
    """The learning rate for this run: --lr is tuned for a batch of REFERENCE_BATCH (notebook 08)."""
    if args.lr_scaling == "none":
        return args.lr
    ratio = global_batch / REFERENCE_BATCH  # Horovod: its examples scale by hvd.size(): the same rule
    return args.lr * (ratio if args.lr_scaling == "linear" else math.sqrt(ratio))


def make_optimizer(args, model, lr, steps_per_epoch):
    """The optimiser and a warm-up-then-linear-decay schedule (one cycle over all epochs)."""
    if args.optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True,
                              weight_decay=args.weight_decay)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=args.weight_decay)
    total, warmup = args.epochs * steps_per_epoch, max(1, round(args.warmup_epochs * steps_per_epoch))
    return opt, warmup_then_decay(total, warmup)


def evaluate(model, test_set, device, dtype=torch.float32, batch=1000):
    """Loss and accuracy over the whole test set, each image counted exactly once."""
    model.eval()
    # Horovod: rank r takes images r, r+K, r+2K, ...: no padding, unlike DistributedSampler's.
    shard = torch.arange(hvd.rank(), len(test_set), hvd.size(), device=device)
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
    with torch.no_grad():
        for idx in shard.split(batch):
            x, y = test_set[idx]
            out = model(x.to(dtype))
            totals += torch.stack([F.cross_entropy(out.float(), y, reduction="sum").double(),
                                   (out.argmax(1) == y).sum().double(), torch.tensor(len(y), device=device).double()])
    ### BEGIN SOLUTION (hint: sum the three totals over all ranks with one Horovod collective; it returns a new tensor)
    totals = hvd.allreduce(totals, op=hvd.Sum, name="eval_totals")  # Horovod: the global sums
    ### END SOLUTION
    model.train()
    loss_sum, correct, count = totals.tolist()
    return loss_sum / count, correct / count, int(count)


def save_checkpoint(path, model, opt, sched, progress):
    """Rank 0 writes everything a resumed run needs; a crash mid-write never leaves half a file."""
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
             "progress": progress, "rng": torch.get_rng_state(),  # Horovod: a resume must match hvd.size() below
             "config": {**model.config, "world_size": hvd.size(), "global_batch": progress["global_batch"]}}
    tmp = Path(f"{path}.tmp")
    tmp.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, tmp)
    os.replace(tmp, path)  # atomic: readers see the old file or the new one


def load_checkpoint(path, model, opt, sched, global_batch):
    """Rank 0 reads a checkpoint written by save_checkpoint, refusing one that does not fit this run."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        stop(f"--resume {path}: no such checkpoint. Give the path of a .pt file that --checkpoint-dir "
             "wrote, or leave out --resume.")
    ours = {**model.config, "world_size": hvd.size(), "global_batch": global_batch}  # Horovod: resume on as many ranks
    if state["config"] != ours:
        diff = ", ".join(f"{k} {state['config'].get(k)} (this run: {ours[k]})" for k in ours if state["config"].get(k) != ours[k])
        stop(f"--resume {path} was written by another run: {diff}. Resume with the same model, world "
             "size and global batch, or start afresh without --resume.")
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"])
    return state["progress"]


def main(args):
    caught = preemption.catch()  # SIGUSR1 (a job's time-limit warning) and SIGTERM: stop after a step, saved
    device = setup(args)
    rank, world_size = hvd.rank(), hvd.size()  # Horovod: who am I, how many are we?
    batch, global_batch = batch_sizes(args)
    if args.no_hvd and world_size > 1:
        stop("--no-hvd trains without hvd.DistributedOptimizer: launch one process.")
    if args.adasum and not hvd.mpi_enabled():  # Horovod: Adasum needs its MPI controller
        stop("--adasum needs Horovod's MPI controller: launch with mpirun or horovodrun --mpi "
             "(and a Horovod built with MPI: horovodrun --check-build lists it).")
    if batch % args.accumulate:
        stop(f"--accumulate {args.accumulate} does not split the per-worker batch {batch} into equal "
             f"micro-batches: use a batch that is a multiple of {args.accumulate}.")
    dtype = torch.float64 if args.deterministic else torch.float32  # as in the DDP lab
    if args.deterministic:
        torch.use_deterministic_algorithms(True)
    torch.manual_seed(args.seed)  # the same initial weights as the DDP lab's (and rank 0's are broadcast)

    # Data. Rank 0 stages the files first; the others wait, then read the same verified copy.
    if rank != 0:
        hvd.barrier()  # Horovod: wait for rank 0's copy: one download, not one per rank
    train_set = InMemoryFashionMNIST(args.data_root, train=True, device=device, first=args.train_images)
    test_set = InMemoryFashionMNIST(args.data_root, train=False, device=device)
    if rank == 0:
        hvd.barrier()  # Horovod: the data is there; let the others in
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank,  # Horovod: my shard
                                 shuffle=True, seed=args.seed, drop_last=True)
    steps_per_epoch = len(sampler) // batch

    # Horovod: the weights stay contiguous (NCHW): its collectives refuse channels_last tensors,
    # which the DDP lab uses.
    model = FashionCNN(width=args.width, norm=args.norm).to(device, dtype)
    lr = scaled_lr(args, global_batch)
    opt, ramp = make_optimizer(args, model, lr, steps_per_epoch)
    if not args.no_hvd:
        compression = hvd.Compression.fp16 if args.compression == "fp16" else hvd.Compression.none
        ### BEGIN SOLUTION (hint: wrap opt in Horovod's DistributedOptimizer: give it the model's named parameters, compression, args.accumulate backward passes per step, and hvd.Adasum as op when args.adasum, else hvd.Average)
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),  # Horovod: averaged gradients
                                       compression=compression, backward_passes_per_step=args.accumulate,
                                       op=hvd.Adasum if args.adasum else hvd.Average)
        ### END SOLUTION
    sched = torch.optim.lr_scheduler.LambdaLR(opt, ramp)
    progress = {"epoch": 0, "step": 0, "step_in_epoch": 0, "elapsed_s": 0.0, "global_batch": global_batch}
    resume = args.resume
    if resume == "auto":  # e.g. a requeued Slurm job: go on from the last checkpoint
        last = Path(args.checkpoint_dir or ".") / "last.pt"
        resume = str(last) if last.exists() else None
    if resume and rank == 0:  # Horovod: rank 0 reads the checkpoint; the broadcasts below share it
        progress = load_checkpoint(resume, model, opt, sched, global_batch)
    ### BEGIN SOLUTION (hint: every rank starts from rank 0's optimizer state, then from rank 0's weights (the model's state_dict): in that order)
    hvd.broadcast_optimizer_state(opt, root_rank=0)  # Horovod: rank 0's momentum (after a resume: the loaded one)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)  # Horovod: then rank 0's weights everywhere
    ### END SOLUTION
    progress = hvd.broadcast_object(progress, root_rank=0, name="progress")  # Horovod: where training stands
    # Horovod: rank 0's schedule (a resumed one) to every rank
    sched.load_state_dict(hvd.broadcast_object(sched.state_dict(), root_rank=0, name="schedule"))
    if resume and (progress.get("finished") or progress["epoch"] >= args.epochs
                   or (args.max_steps and progress["step"] >= args.max_steps)):
        if rank == 0:  # Horovod: one rank talks
            print(f"{resume} is the checkpoint of a finished run (step {progress['step']}): nothing to do. "
                  "Delete it, or give another --checkpoint-dir, to train afresh.", flush=True)
        hvd.shutdown()  # Horovod: stop the background thread before returning
        return

    log = JsonLog(args.log_json if rank == 0 else None, append=bool(resume),  # Horovod: rank 0 logs
                  elapsed_before=progress["elapsed_s"], world_size=world_size, global_batch=global_batch,
                  peak_lr=lr, loader="memory", framework="horovod", horovod=not args.no_hvd,
                  compression=args.compression, op="adasum" if args.adasum else "average",
                  controller="mpi" if hvd.mpi_enabled() else "gloo", threads=torch.get_num_threads())
    if resume:
        log.write("resume", epoch=round(progress["step"] / steps_per_epoch, 4), step=progress["step"], checkpoint=str(resume))
    if rank == 0:  # Horovod: one rank talks
        print(f"{world_size} × {batch} = global batch {global_batch}, lr {lr:g}, {steps_per_epoch} steps per "
              f"epoch, Horovod ({'MPI' if hvd.mpi_enabled() else 'gloo'}) on {device}"  # Horovod: its controller
              + (f", resumed at step {progress['step']}" if resume else ""), flush=True)
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.amp)
    step, epoch = progress["step"], progress["epoch"]
    last_eval = {"test_accuracy": None, "test_loss": None}
    seen, train_s, loss_sum, loss_n = 0, 0.0, torch.zeros((), device=device), 0
    bar = tqdm(total=args.epochs * steps_per_epoch, initial=step, unit="step", desc="train",
               disable=ddp_env.bar_off(rank))  # Horovod: a bar on rank 0 only
    stop_reason = None

    def record(event, **fields):
        """Rank 0's log line; the train loss is averaged over ranks and steps since the last one."""
        nonlocal seen, train_s, loss_sum, loss_n
        # Horovod: the mean over the ranks of their loss sums, divided by the steps
        mean_loss = hvd.allreduce(loss_sum, op=hvd.Average, name="train_loss").item() / max(1, loss_n)
        tested = last_eval if event in ("eval", "epoch", "done") else {}  # fresh test figures only
        rec = log.write(event, epoch=round(step / steps_per_epoch, 4), step=step,
                        train_loss=round(mean_loss, 5) if loss_n else None,
                        samples_per_s=round(seen / train_s, 1) if train_s else None,
                        lr=round(sched.get_last_lr()[0], 7), **tested, **fields)
        seen, train_s, loss_sum, loss_n = 0, 0.0, torch.zeros((), device=device), 0
        return rec

    def evaluate_now():
        if args.no_eval:
            return None
        loss, acc, count = evaluate(model, test_set, device, dtype)
        last_eval.update(test_loss=round(loss, 5), test_accuracy=round(acc, 5))
        return count

    test_images = None
    while epoch < args.epochs and stop_reason is None:
        ### BEGIN SOLUTION (hint: tell the sampler which epoch this is, so that each epoch is shuffled anew)
        sampler.set_epoch(epoch)  # Horovod: a new order each epoch, the same on every rank
        ### END SOLUTION
        start = time.perf_counter()
        for i, idx in enumerate(BatchSampler(sampler, batch, drop_last=True)):
            if i < progress["step_in_epoch"]:  # resumed mid-epoch: these batches were done
                start = time.perf_counter()
                continue
            x, y = train_set[torch.as_tensor(idx, device=device)]
            x = x.to(device, dtype)
            if i == 0 and rank == 0:
                log.write("epoch_start", epoch=epoch, step=step, first_labels=y[:8].tolist())
            opt.zero_grad()  # (Horovod 0.28 takes no set_to_none; None is torch 2's default)
            for xm, ym in zip(x.chunk(args.accumulate), y.chunk(args.accumulate)):
                with amp:
                    loss = F.cross_entropy(model(xm), ym) / args.accumulate  # the mean over the whole batch
                loss.backward()  # Horovod: each gradient's allreduce starts as soon as it is ready
            opt.step()  # Horovod: waits for the averaged gradients, then steps
            sched.step()
            step += 1
            bar.update()
            train_s += time.perf_counter() - start
            seen += global_batch
            loss_sum += loss.detach().float() * args.accumulate
            loss_n += 1
            progress.update(epoch=epoch, step=step, step_in_epoch=i + 1)
            if args.checkpoint_dir and args.checkpoint_every and step % args.checkpoint_every == 0:
                progress["elapsed_s"] = log.elapsed()
                if rank == 0:  # Horovod: one writer; every replica holds the same weights
                    save_checkpoint(Path(args.checkpoint_dir) / "last.pt", model, opt, sched, progress)
            if args.eval_every and step % args.eval_every == 0 and i + 1 < steps_per_epoch:
                evaluate_now()
                bar.set_postfix(acc=last_eval["test_accuracy"])
                record("eval")
                if args.target_accuracy and last_eval["test_accuracy"] >= args.target_accuracy:
                    stop_reason = "target_accuracy"
            elif step % args.log_every == 0:
                record("train")
            if stop_reason is None:
                stop_reason = should_stop(args, step, log.elapsed(), caught)
            if stop_reason:
                break
            start = time.perf_counter()
        else:  # the epoch ran to its end
            epoch += 1
            progress.update(epoch=epoch, step_in_epoch=0)
            test_images = evaluate_now()
            bar.set_postfix(acc=last_eval["test_accuracy"])
            rec = record("epoch", test_images=test_images)
            if rank == 0:  # Horovod: one line per epoch, also where there is no bar (logs, CI)
                print(f"epoch {epoch}: {tested(rec)}, {rec['elapsed_s']:.1f} s", flush=True)
            if args.target_accuracy and last_eval["test_accuracy"] >= args.target_accuracy:
                stop_reason = "target_accuracy"
            if args.checkpoint_dir:
                progress["elapsed_s"] = log.elapsed()
                if rank == 0:  # Horovod: one writer
                    save_checkpoint(Path(args.checkpoint_dir) / "last.pt", model, opt, sched, progress)
    bar.close()

    if stop_reason != "signal" and not args.no_eval and (last_eval["test_accuracy"] is None or progress["step_in_epoch"]):
        test_images = evaluate_now()  # stopped mid-epoch: evaluate what we have (not in a time-limit warning's last seconds)
    final = record("done", test_images=test_images, stop=stop_reason or "epochs",
                   replicas_max_diff=replica_spread(model))
    if rank == 0:  # Horovod: rank 0 reports and saves; the others hold the same weights
        print(f"step {step}: {tested(final)}, {final['elapsed_s']:.1f} s ({final['stop']})", flush=True)
        if args.save_model:
            torch.save(model.state_dict(), args.save_model)
        if args.checkpoint_dir:
            progress.update(elapsed_s=log.elapsed(), finished=final["stop"] if final["stop"] == "target_accuracy" else None)
            save_checkpoint(Path(args.checkpoint_dir) / "last.pt", model, opt, sched, progress)
        if stop_reason == "signal":
            print(preemption.stopped_message(caught, step, args.checkpoint_dir and Path(args.checkpoint_dir) / "last.pt"), flush=True)
    if stop_reason == "signal":  # the first rank to exit may end the job: none before rank 0 has saved
        hvd.barrier()  # Horovod: wait for rank 0's checkpoint
    hvd.shutdown()  # Horovod: stop the background thread, so that every rank exits cleanly


def tested(record):
    """'test accuracy 0.9030, test loss 0.2712' for a log record, or 'not evaluated' (--no-eval)."""
    if record.get("test_accuracy") is None:
        return "not evaluated"
    return f"test accuracy {record['test_accuracy']:.4f}, test loss {record['test_loss']:.4f}"


def should_stop(args, step, elapsed, caught):
    """'max_steps', 'time_budget', 'signal' or None: the same on every rank, which stop after the same step.
    Rank 0's clock decides the time budget; a signal caught on any rank stops them all."""
    if args.max_steps and step >= args.max_steps:
        return "max_steps"
    flags = torch.tensor([float(hvd.rank() == 0 and args.time_budget is not None and elapsed >= args.time_budget),
                          float(caught.number)])  # Horovod: rank 0's clock; the signal's number, 0 if none
    over, signum = hvd.allreduce(flags, op=hvd.Max, name="should_stop").tolist()  # Horovod: one collective a step
    caught.number = caught.number or int(signum)  # every rank now knows which signal stops the run
    return "time_budget" if over else "signal" if signum else None


def replica_spread(model):
    """Largest difference between any rank's weights and rank 0's: 0.0 when Horovod kept them in sync."""
    spread = torch.zeros(())
    for name, p in model.named_parameters():
        ref = hvd.broadcast(p.detach().cpu(), root_rank=0, name=f"spread.{name}")  # Horovod: rank 0's copy
        spread = torch.maximum(spread, (p.detach().cpu() - ref).abs().max().float())
    return hvd.allreduce(spread, op=hvd.Max, name="spread").item()  # Horovod: the worst rank


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=Defaults)
    p.add_argument("--data-root", default=None, help="FashionMNIST folder (default: $DPCOURSE_DATA or data/)")
    p.add_argument("--epochs", type=int, default=3, help="passes over the training set")
    p.add_argument("--train-images", type=int, default=None, help="train on the first N images only (quick checks; the test set stays whole)")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps")
    p.add_argument("--time-budget", type=float, default=None, help="stop after this many seconds of training")
    p.add_argument("--batch-size", type=int, default=None, help="per worker (global = this × world size)")
    p.add_argument("--global-batch-size", type=int, default=128, help="split between the workers")
    p.add_argument("--lr", type=float, default=0.15, help=f"learning rate at global batch {REFERENCE_BATCH}")
    p.add_argument("--lr-scaling", default="none", choices=["none", "linear", "sqrt"],
                   help=f"scale --lr by (global batch / {REFERENCE_BATCH}) or its square root")
    p.add_argument("--warmup-epochs", type=float, default=0.75, help="linear warm-up, then linear decay to 0")
    p.add_argument("--optimizer", default="sgd", choices=["sgd", "adamw"], help="SGD with Nesterov momentum 0.9, or AdamW")
    p.add_argument("--weight-decay", type=float, default=5e-4, help="L2 penalty of the optimizer")
    p.add_argument("--width", type=int, default=16, help="channels of the first conv layer")
    p.add_argument("--norm", default="group", choices=["group", "batch", "none"], help="normalisation layers of the CNN")
    p.add_argument("--seed", type=int, default=0, help="initial weights and the sampler's shuffling")
    p.add_argument("--deterministic", action="store_true", help="deterministic kernels in float64")
    p.add_argument("--target-accuracy", type=float, default=None, help="stop once the test accuracy reaches this")
    p.add_argument("--eval-every", type=int, default=None, help="also evaluate every N steps (default: each epoch)")
    p.add_argument("--no-eval", action="store_true", help="never evaluate (weight comparisons, throughput runs)")
    p.add_argument("--log-every", type=int, default=50, help="log the train loss every N steps")
    p.add_argument("--checkpoint-dir", default=None, help="rank 0 writes last.pt here")
    p.add_argument("--checkpoint-every", type=int, default=None, help="also checkpoint every N steps")
    p.add_argument("--resume", default=None, help="a checkpoint to resume from, or 'auto': CHECKPOINT_DIR/last.pt if there")
    p.add_argument("--log-json", default=None, help="rank 0 writes one JSON object per line here")
    p.add_argument("--save-model", default=None, help="rank 0 saves the final weights here")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: cuda:LOCAL_RANK when there are GPUs")
    p.add_argument("--amp", action="store_true", help="bfloat16 autocast (GPUs with bf16, and CPUs)")
    p.add_argument("--accumulate", type=int, default=1,
                   help="split each worker's batch into N micro-batches; allreduce once per step "
                        "(Horovod: backward_passes_per_step)")
    # Horovod: its own knobs
    p.add_argument("--no-hvd", action="store_true",
                   help="one process with the plain optimizer, no hvd.DistributedOptimizer (overhead baseline)")
    p.add_argument("--compression", default="none", choices=["none", "fp16"], help="gradients sent as fp16")
    p.add_argument("--adasum", action="store_true",
                   help="combine gradients with Adasum instead of averaging (MPI; a power of 2 ranks)")
    p.add_argument("--fusion-threshold-mb", type=float, default=None,
                   help="Tensor Fusion buffer (default: Horovod's, 128 MB, or $HOROVOD_FUSION_THRESHOLD)")
    return p.parse_args(argv)


if __name__ == "__main__":
    main(parse_args())
