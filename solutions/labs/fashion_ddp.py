"""Train the course CNN on FashionMNIST with DistributedDataParallel (DDP).

    python solutions/labs/fashion_ddp.py                                     # one process
    torchrun --standalone --nproc-per-node 2 solutions/labs/fashion_ddp.py   # two processes here
    srun --ntasks 2 python solutions/labs/fashion_ddp.py                     # two Slurm tasks
    mpirun -np 2 python solutions/labs/fashion_ddp.py                        # two Open MPI ranks

(Activate the course's environment first: source .venv/bin/activate.)

Every rank trains a replica of the model on its own shard of each global batch; DDP averages
the gradients during backward, so the replicas stay identical. Rank 0 prints, writes the
JSON-lines log (--log-json) and the checkpoints; the test set is split between the ranks and
their counts are summed, so every one of the 10,000 test images is counted exactly once.
Every line that exists because of distribution is marked `# DDP:`.
"""
import argparse
import math
import os
import time
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.distributed.algorithms.model_averaging import averagers
from torch.distributed.algorithms.model_averaging.utils import average_parameters
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler
from tqdm.auto import tqdm

from dpcourse import dist as ddp_env, preemption
from dpcourse.data import InMemoryFashionMNIST, torchvision_fashion_mnist
from dpcourse.metrics import JsonLog, StepTimer
from dpcourse.models import FashionCNN
from dpcourse.optim import LARS, REFERENCE_BATCH, warmup_then_decay
from dpcourse.options import Defaults  # --help with each option's default, once


def setup(args):
    # DDP: rank and world size from torchrun, srun or mpirun; MASTER_ADDR/PORT set and checked.
    env = ddp_env.prepare(backend=args.backend, device=args.device)
    if env.device.type == "cuda":
        torch.cuda.set_device(env.device)  # DDP: one GPU per process, cuda:LOCAL_RANK
    dist.init_process_group(env.backend, rank=env.rank, world_size=env.world_size,  # DDP: join
                            timeout=timedelta(seconds=args.timeout))
    ddp_env.gpu_roll_call(env)  # on GPUs: rank 0 lists each rank's GPU; two ranks on one GPU stop here
    return env


def cleanup():
    dist.destroy_process_group()  # DDP: leave the group so every rank exits cleanly


def batch_sizes(args, env):
    """(per-worker batch, global batch) from --batch-size or --global-batch-size."""
    if args.batch_size:
        return args.batch_size, args.batch_size * env.world_size
    if args.global_batch_size < env.world_size or args.global_batch_size % env.world_size:
        ddp_env.stop(env, f"--global-batch-size {args.global_batch_size} does not split into "  # DDP: P equal shares
                     f"{env.world_size} equal per-worker batches: use a multiple of {env.world_size}"
                     f" (e.g. {max(1, round(args.global_batch_size / env.world_size)) * env.world_size}),"
                     " or give --batch-size per worker.")
    return args.global_batch_size // env.world_size, args.global_batch_size


def scaled_lr(args, batch, world_size):
    """The learning rate for this run: --lr is tuned for a batch of REFERENCE_BATCH (notebook 08)."""
    if args.lr_scaling == "none":
        return args.lr
    ### BEGIN SOLUTION (hint: "linear" (Goyal et al.) multiplies args.lr by how many times larger than REFERENCE_BATCH the batch is that one optimizer step averages over; "sqrt" by the square root of that. batch is one worker's.)
    ratio = batch * world_size / REFERENCE_BATCH  # DDP: the step averages ALL workers' gradients
    return args.lr * (ratio if args.lr_scaling == "linear" else math.sqrt(ratio))
    ### END SOLUTION


def make_optimizer(args, model, batch, world_size, steps_per_epoch):
    """The optimiser and a warm-up-then-linear-decay schedule (one cycle over all epochs)."""
    lr = scaled_lr(args, batch, world_size)
    if args.optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True,
                              weight_decay=args.weight_decay)
    elif args.optimizer == "lars":  # a rate per layer, for very large batches (dpcourse/optim.py)
        opt = LARS(model.parameters(), lr=lr, momentum=0.9, weight_decay=args.weight_decay, eta=args.lars_eta)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=args.weight_decay)
    total, warmup = args.epochs * steps_per_epoch, max(1, round(args.warmup_epochs * steps_per_epoch))
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, warmup_then_decay(total, warmup)), lr


def train_batches(args, train_set, sampler, batch, device):
    """This rank's batches for the current epoch, in the order ``sampler`` gives.

    ``memory``: one indexing operation per batch on a tensor that holds the whole split;
    ``torchvision``: DataLoader workers turn one PIL image at a time into a tensor.
    """
    if args.loader == "memory":
        for idx in BatchSampler(sampler, batch, drop_last=True):
            yield train_set[torch.as_tensor(idx, device=device)]
    else:
        yield from train_set  # a DataLoader built on the same sampler


def evaluate(model, test_set, env, dtype=torch.float32, batch=1000):
    """Loss and accuracy over the whole test set, each image counted exactly once."""
    model.eval()
    # DDP: rank r takes images r, r+K, r+2K, ...: no padding, unlike DistributedSampler's.
    shard = torch.arange(env.rank, len(test_set), env.world_size, device=env.device)
    totals = torch.zeros(3, dtype=torch.float64, device=env.device)  # loss sum, correct, count
    with torch.no_grad():
        for idx in shard.split(batch):
            x, y = test_set[idx]
            out = model(x.to(dtype).contiguous(memory_format=torch.channels_last))
            totals += torch.stack([F.cross_entropy(out.float(), y, reduction="sum").double(),
                                   (out.argmax(1) == y).sum().double(), torch.tensor(len(y), device=env.device).double()])
    ### BEGIN SOLUTION (hint: sum the three totals over all ranks, in place, with one collective)
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)  # DDP: every rank now holds the global sums
    ### END SOLUTION
    model.train()
    loss_sum, correct, count = totals.tolist()
    return loss_sum / count, correct / count, int(count)


def save_checkpoint(path, model, opt, sched, progress, args, env):
    """Rank 0 writes everything a resumed run needs; a crash mid-write never leaves half a file."""
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
             "progress": progress, "rng": torch.get_rng_state(),
             "config": {**model.config, "world_size": env.world_size, "global_batch": progress["global_batch"]}}
    tmp = Path(f"{path}.tmp")
    tmp.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, tmp)
    os.replace(tmp, path)  # atomic: readers see the old file or the new one


def load_checkpoint(path, model, opt, sched, env, global_batch):
    """Load a checkpoint written by save_checkpoint, refusing one that does not fit this run."""
    try:
        state = torch.load(path, map_location=env.device, weights_only=True)
    except FileNotFoundError:
        ddp_env.stop(env, f"--resume {path}: no such checkpoint. Give the path of a .pt file "
                     "that --checkpoint-dir wrote, or leave out --resume.")
    except Exception as err:  # noqa: BLE001 - any unreadable file gets the same advice
        ddp_env.stop(env, f"--resume {path}: not a readable checkpoint ({type(err).__name__}); "
                     "it may be truncated or from another program. Delete it, or resume from an "
                     "earlier one.")
    config = state["config"]
    ours = {**model.config, "world_size": env.world_size, "global_batch": global_batch}
    if config != ours:
        diff = ", ".join(f"{k} {config.get(k)} (this run: {ours.get(k)})" for k in ours if config.get(k) != ours[k])
        ddp_env.stop(env, f"--resume {path} was written by another run: {diff}. Resume with the "
                     "same model, world size and global batch, or start afresh without --resume.")
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"].cpu())
    return state["progress"]


def main(args):
    caught = preemption.catch()  # SIGUSR1 (a job's time-limit warning) and SIGTERM: stop after a step, saved
    env = setup(args)
    rank, world_size = dist.get_rank(), dist.get_world_size()  # DDP: who am I, how many are we?
    batch, global_batch = batch_sizes(args, env)
    if args.no_eval and args.target_accuracy:
        ddp_env.stop(env, "--target-accuracy needs evaluations: leave out --no-eval.")
    if args.no_ddp and world_size > 1:
        ddp_env.stop(env, "--no-ddp trains without DistributedDataParallel: launch one process.")
    if batch % args.accumulate:
        ddp_env.stop(env, f"--accumulate {args.accumulate} does not split the per-worker batch {batch} "
                     f"into equal micro-batches: use a batch that is a multiple of {args.accumulate}.")
    # --deterministic: the same kernels every run, and float64, because in float32 a rounding
    # difference of 1e-7 can flip a ReLU or a max-pool choice, and such flips grow step by step.
    dtype = torch.float64 if args.deterministic else torch.float32
    if args.deterministic:
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    torch.manual_seed(args.seed)  # the same initial weights on every rank (DDP would copy rank 0's anyway)
    device = env.device

    # Data. Rank 0 stages the files first; the others wait, then read the same verified copy.
    with ddp_env.rank0_first():  # DDP: one download, not one per rank
        train_set = InMemoryFashionMNIST(args.data_root, train=True, device=device, first=args.train_images)
        test_set = InMemoryFashionMNIST(args.data_root, train=False, device=device)
    ### BEGIN SOLUTION (hint: a DistributedSampler over train_set for this rank of world_size, shuffled with args.seed, dropping the uneven tail)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank,  # DDP: my shard
                                 shuffle=True, seed=args.seed, drop_last=True)
    ### END SOLUTION
    if args.loader == "torchvision":  # the classic per-sample pipeline, fed by the same sampler
        ### BEGIN SOLUTION (hint: loader = a DataLoader over torchvision_fashion_mnist(args.data_root, train=True): batches of this rank's batch size, in the order the sampler gives, args.workers worker processes, the uneven tail dropped)
        loader = DataLoader(torchvision_fashion_mnist(args.data_root, train=True), batch_size=batch,
                            sampler=sampler,  # DDP: the sampler decides the order, not shuffle=True
                            num_workers=args.workers, drop_last=True, worker_init_fn=preemption.ignore_in_worker,
                            pin_memory=device.type == "cuda", persistent_workers=args.workers > 0)
        ### END SOLUTION
    steps_per_epoch = len(sampler) // batch

    model = FashionCNN(width=args.width, norm=args.norm).to(device, dtype, memory_format=torch.channels_last)
    config = model.config
    opt, sched, lr = make_optimizer(args, model, batch, world_size, steps_per_epoch)
    progress = {"epoch": 0, "step": 0, "step_in_epoch": 0, "elapsed_s": 0.0, "global_batch": global_batch}
    resume = args.resume
    if resume == "auto":  # e.g. a torchrun --max-restarts restart: go on from the last checkpoint
        last = Path(args.checkpoint_dir or ".") / "last.pt"
        resume = str(last) if last.exists() else None
    if resume:
        progress = load_checkpoint(resume, model, opt, sched, env, global_batch)
        done = progress.get("finished") or ("epochs" if progress["epoch"] >= args.epochs else
                                            "max_steps" if args.max_steps and progress["step"] >= args.max_steps else None)
        if done:  # e.g. the same command run again after the run finished
            if rank == 0:  # DDP: one rank talks
                print(f"{resume} is the checkpoint of a finished run (step {progress['step']}, stopped by "
                      f"{done}): nothing to do. Delete it, or give another --checkpoint-dir, to train afresh.",
                      flush=True)
            cleanup()
            return
    timer = StepTimer(device, enabled=args.time_split)  # where the time goes (notebook 07); off: no-ops
    averager = None
    if not args.no_ddp:
        ddp_options = dict(bucket_cap_mb=args.bucket_cap_mb, gradient_as_bucket_view=args.grad_as_bucket_view)
        ### BEGIN SOLUTION (hint: wrap model in DDP with **ddp_options; on a GPU, give it this rank's device)
        model = DDP(model, device_ids=[device] if device.type == "cuda" else None,  # DDP: averaged gradients
                    **ddp_options)
        ### END SOLUTION
        state, hook = comm_hook(args, env)
        if hook or args.time_split:  # DDP: what DDP does with each bucket of gradients (notebook 08)
            model.register_comm_hook(state, timer.timed(hook or default_hooks.allreduce_hook))
        if args.local_sgd:  # DDP: post-local SGD: after warm-up, average the weights every N steps
            averager = averagers.PeriodicModelAverager(period=args.local_sgd, warmup_steps=args.local_sgd_warmup)
            averager.step = progress["step"]
    model.config = config

    log = JsonLog(args.log_json if rank == 0 else None, append=bool(resume),  # DDP: rank 0 logs
                  elapsed_before=progress["elapsed_s"], world_size=world_size, global_batch=global_batch,
                  peak_lr=lr, loader=args.loader, ddp=not args.no_ddp, threads=torch.get_num_threads())
    if resume:  # a restart shows in the log: training went on from this step
        log.write("resume", epoch=round(progress["step"] / steps_per_epoch, 4), step=progress["step"], checkpoint=str(resume))
    if rank == 0:  # DDP: one rank talks
        print(f"{world_size} × {batch} = global batch {global_batch}, lr {lr:g}, {steps_per_epoch} steps "
              f"per epoch, {env.backend} on {device}" + (f", resumed at step {progress['step']}" if resume else ""),
              flush=True)
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.amp)
    profiler = trace_profiler(args.profile_trace if rank == 0 else None)  # a Chrome trace of a few steps
    step, epoch = progress["step"], progress["epoch"]
    last_eval = {"test_accuracy": None, "test_loss": None}
    seen, train_s, loss_sum, loss_n = 0, 0.0, torch.zeros((), device=device), 0
    bar = tqdm(total=args.epochs * steps_per_epoch, initial=step, unit="step", desc="train",
               disable=ddp_env.bar_off(rank))  # DDP: a bar on rank 0 only
    stop_reason = None

    def record(event, **fields):
        """Rank 0's log line; the train loss is averaged over ranks and steps since the last one."""
        nonlocal seen, train_s, loss_sum, loss_n
        mean_loss = loss_sum.clone()
        dist.all_reduce(mean_loss)  # DDP: sum of every rank's losses
        mean_loss = mean_loss.item() / max(1, loss_n * world_size)
        tested = last_eval if event in ("eval", "epoch", "done") else {}  # fresh test figures only
        rec = log.write(event, epoch=round(step / steps_per_epoch, 4), step=step,
                        train_loss=round(mean_loss, 5) if loss_n else None,
                        samples_per_s=round(seen / train_s, 1) if train_s else None,
                        lr=round(sched.get_last_lr()[0], 7), **timer.report(), **tested, **fields)
        seen, train_s, loss_sum, loss_n = 0, 0.0, torch.zeros((), device=device), 0
        return rec

    def evaluate_now():
        if args.no_eval:
            return None
        if averager:  # DDP: local SGD let the replicas drift apart: test their average
            average_parameters(model.parameters(), dist.group.WORLD)
        loss, acc, count = evaluate(model, test_set, env, dtype)
        last_eval.update(test_loss=round(loss, 5), test_accuracy=round(acc, 5))
        return count

    test_images = None
    while epoch < args.epochs and stop_reason is None:
        ### BEGIN SOLUTION (hint: tell the sampler which epoch this is, so that each epoch is shuffled anew)
        sampler.set_epoch(epoch)  # DDP: a new order each epoch, the same on every rank
        ### END SOLUTION
        batches = train_batches(args, train_set if args.loader == "memory" else loader, sampler, batch, device)
        start = time.perf_counter()  # a step's time includes waiting for its batch
        timer.start()
        for i, (x, y) in enumerate(batches):
            if i < progress["step_in_epoch"]:  # resumed mid-epoch: these batches were done
                start = time.perf_counter()
                continue
            x = x.to(device, dtype, non_blocking=True).contiguous(memory_format=torch.channels_last)
            y = y.to(device, non_blocking=True)
            timer.lap("data")
            if i == 0 and rank == 0:
                log.write("epoch_start", epoch=epoch, step=step, first_labels=y[:8].tolist())  # epoch = step / steps per epoch
            opt.zero_grad(set_to_none=True)
            local = averager is not None and step >= args.local_sgd_warmup  # post-local SGD phase
            for j, (xm, ym) in enumerate(zip(x.chunk(args.accumulate), y.chunk(args.accumulate))):
                sync = j == args.accumulate - 1 and not local  # DDP: all-reduce on the last micro-batch only
                with nullcontext() if sync or args.no_ddp else model.no_sync():  # DDP: no_sync = no all-reduce
                    with amp:
                        loss = F.cross_entropy(model(xm), ym) / args.accumulate  # the mean over the whole batch
                    timer.lap("forward")
                    loss.backward()  # DDP: gradients are averaged across ranks while backward runs
                timer.lap("backward")
            opt.step()
            sched.step()
            timer.lap("optimizer")
            if averager:
                averager.average_parameters(model.parameters())  # DDP: every --local-sgd steps
                timer.lap("allreduce")
            timer.stop()
            if profiler:
                profiler.step()
            step += 1
            bar.update()
            train_s += time.perf_counter() - start
            seen += global_batch
            loss_sum += loss.detach().float() * args.accumulate
            loss_n += 1
            progress.update(epoch=epoch, step=step, step_in_epoch=i + 1)
            if args.checkpoint_dir and args.checkpoint_every and step % args.checkpoint_every == 0:
                progress["elapsed_s"] = log.elapsed()
                if rank == 0:  # DDP: one writer; every replica holds the same weights
                    save_checkpoint(Path(args.checkpoint_dir) / "last.pt", unwrap(model), opt, sched, progress, args, env)
            if args.eval_every and step % args.eval_every == 0 and i + 1 < steps_per_epoch:
                evaluate_now()
                bar.set_postfix(acc=last_eval["test_accuracy"])
                record("eval")
                if args.target_accuracy and last_eval["test_accuracy"] >= args.target_accuracy:
                    stop_reason = "target_accuracy"
            elif step % args.log_every == 0:
                record("train")
            if stop_reason is None:
                stop_reason = should_stop(args, step, log.elapsed(), caught, device)
            if stop_reason:
                break
            start = time.perf_counter()
            timer.start()
        else:  # the epoch ran to its end
            epoch += 1
            progress.update(epoch=epoch, step_in_epoch=0)
            test_images = evaluate_now()
            bar.set_postfix(acc=last_eval["test_accuracy"])
            rec = record("epoch", test_images=test_images)
            if rank == 0:  # DDP: one line per epoch, also where there is no bar (logs, CI)
                print(f"epoch {epoch}: {tested(rec)}, {rec['elapsed_s']:.1f} s", flush=True)
            if args.target_accuracy and last_eval["test_accuracy"] >= args.target_accuracy:
                stop_reason = "target_accuracy"
            if args.checkpoint_dir:
                progress["elapsed_s"] = log.elapsed()
                if rank == 0:  # DDP: one writer
                    save_checkpoint(Path(args.checkpoint_dir) / "last.pt", unwrap(model), opt, sched, progress, args, env)
    bar.close()
    if profiler:
        profiler.stop()

    if stop_reason != "signal" and not args.no_eval and (last_eval["test_accuracy"] is None or progress["step_in_epoch"]):
        test_images = evaluate_now()  # stopped mid-epoch: evaluate what we have (not in a time-limit warning's last seconds)
    final = record("done", test_images=test_images, stop=stop_reason or "epochs",
                   replicas_max_diff=replica_spread(model, device))
    if rank == 0:  # DDP: rank 0 reports and saves; the others hold the same weights
        print(f"step {step}: {tested(final)}, {final['elapsed_s']:.1f} s ({final['stop']})", flush=True)
        if args.save_model:
            torch.save(unwrap(model).state_dict(), args.save_model)
        if args.checkpoint_dir:
            progress.update(elapsed_s=log.elapsed(), finished=final["stop"] if final["stop"] == "target_accuracy" else None)
            save_checkpoint(Path(args.checkpoint_dir) / "last.pt", unwrap(model), opt, sched, progress, args, env)
        if stop_reason == "signal":
            print(preemption.stopped_message(caught, step, args.checkpoint_dir and Path(args.checkpoint_dir) / "last.pt"), flush=True)
    timer.close()  # torch.distributed's own collectives back, were a timed step left open
    if stop_reason == "signal":  # the first rank to exit may end the job: none before rank 0 has saved
        dist.barrier()  # DDP: wait for rank 0's checkpoint
    cleanup()


def tested(record):
    """'test accuracy 0.9030, test loss 0.2712' for a log record, or 'not evaluated' (--no-eval)."""
    if record.get("test_accuracy") is None:
        return "not evaluated"
    return f"test accuracy {record['test_accuracy']:.4f}, test loss {record['test_loss']:.4f}"


def unwrap(model):
    """The plain module inside a DDP wrapper (what a checkpoint stores)."""
    return model.module if isinstance(model, DDP) else model


def comm_hook(args, env):
    """(state, hook) for --comm-hook: how DDP sends each bucket of gradients; (None, None): built in."""
    if args.comm_hook == "powersgd" and env.device.type == "cpu" and torch.cuda.is_available():
        ddp_env.stop(env, "--comm-hook powersgd on the CPU where a GPU is visible: PyTorch's PowerSGD hook would "
                     "synchronize that GPU and fail. Hide the GPUs from this run: CUDA_VISIBLE_DEVICES= torchrun ...")
    if args.comm_hook == "powersgd":  # low-rank gradients; plain all-reduce for the first steps
        return powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=args.powersgd_rank,
                                           start_powerSGD_iter=args.powersgd_start), powerSGD_hook.powerSGD_hook
    return None, {"none": None, "allreduce": default_hooks.allreduce_hook,
                  "fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}[args.comm_hook]


def trace_profiler(path, wait=5, active=3):
    """torch.profiler over ``active`` steps after ``wait``, saved as a Chrome trace at ``path``
    (open it at https://ui.perfetto.dev or chrome://tracing); None without a path."""
    if not path:
        return None
    prof = torch.profiler.profile(schedule=torch.profiler.schedule(wait=wait, warmup=1, active=active, repeat=1),
                                  on_trace_ready=lambda p: p.export_chrome_trace(path))
    prof.start()
    return prof


def should_stop(args, step, elapsed, caught, device):
    """'max_steps', 'time_budget', 'signal' or None: the same on every rank, which stop after the same step.
    Rank 0's clock decides the time budget; a signal caught on any rank stops them all."""
    if args.max_steps and step >= args.max_steps:
        return "max_steps"
    flags = torch.tensor([float(dist.get_rank() == 0 and args.time_budget is not None and elapsed >= args.time_budget),
                          float(caught.number)], device=device)  # DDP: rank 0's clock; the signal's number, 0 if none
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # DDP: one collective a step; the largest flag wins
    over, signum = flags.tolist()
    caught.number = caught.number or int(signum)  # every rank now knows which signal stops the run
    return "time_budget" if over else "signal" if signum else None


def replica_spread(model, device):
    """Largest difference between any rank's weights and rank 0's: 0.0 when DDP kept them in sync."""
    spread = torch.zeros((), device=device)
    for p in unwrap(model).parameters():
        ref = p.detach().clone()
        dist.broadcast(ref, src=0)  # DDP: rank 0's copy
        spread = torch.maximum(spread, (p.detach() - ref).abs().max())
    dist.all_reduce(spread, op=dist.ReduceOp.MAX)  # DDP: the worst rank
    return spread.item()


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
    p.add_argument("--optimizer", default="sgd", choices=["sgd", "adamw", "lars"], help="SGD with Nesterov momentum 0.9, AdamW or LARS")
    p.add_argument("--weight-decay", type=float, default=5e-4, help="L2 penalty of the optimizer")
    p.add_argument("--width", type=int, default=16, help="channels of the first conv layer")
    p.add_argument("--norm", default="group", choices=["group", "batch", "none"], help="normalisation layers of the CNN")
    p.add_argument("--seed", type=int, default=0, help="initial weights and the sampler's shuffling")
    p.add_argument("--deterministic", action="store_true",
                   help="deterministic kernels in float64: bit-identical reruns and resumes")
    p.add_argument("--target-accuracy", type=float, default=None, help="stop once the test accuracy reaches this")
    p.add_argument("--eval-every", type=int, default=None, help="also evaluate every N steps (default: each epoch)")
    p.add_argument("--no-eval", action="store_true", help="never evaluate (weight comparisons, throughput runs)")
    p.add_argument("--log-every", type=int, default=50, help="log the train loss every N steps")
    p.add_argument("--checkpoint-dir", default=None, help="rank 0 writes last.pt here")
    p.add_argument("--checkpoint-every", type=int, default=None, help="also checkpoint every N steps")
    p.add_argument("--resume", default=None, help="a checkpoint to resume from, or 'auto': CHECKPOINT_DIR/last.pt if there")
    p.add_argument("--log-json", default=None, help="rank 0 writes one JSON object per line here")
    p.add_argument("--save-model", default=None, help="rank 0 saves the final weights here")
    p.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"], help="auto: NCCL with a GPU per process, else gloo")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: cuda:LOCAL_RANK when there are GPUs")
    p.add_argument("--amp", action="store_true", help="bfloat16 autocast (GPUs with bf16, and CPUs)")
    p.add_argument("--no-ddp", action="store_true", help="one process without the DDP wrapper (overhead baseline)")
    p.add_argument("--loader", default="memory", choices=["memory", "torchvision"], help="the whole split in memory, or a DataLoader of PIL images")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers per rank (--loader torchvision)")
    p.add_argument("--timeout", type=float, default=60, help="seconds a collective may wait for a peer")
    # notebooks 07-08: where the time goes, and how to send less
    p.add_argument("--time-split", action="store_true",
                   help="log each step's time split (data, forward, backward, all-reduce, optimizer) and bytes sent")
    p.add_argument("--profile-trace", default=None, help="rank 0 writes a Chrome trace of steps 6-8 here")
    p.add_argument("--bucket-cap-mb", type=float, default=25, help="DDP's gradient bucket size")
    p.add_argument("--grad-as-bucket-view", action="store_true", help="gradients are views into DDP's buckets (no copy)")
    p.add_argument("--comm-hook", default="none", choices=["none", "allreduce", "fp16", "bf16", "powersgd"],
                   help="how DDP sends gradients: built in (none), or a torch.distributed hook")
    p.add_argument("--powersgd-rank", type=int, default=1, help="PowerSGD's matrix approximation rank")
    p.add_argument("--powersgd-start", type=int, default=10, help="PowerSGD: plain all-reduce for this many steps")
    p.add_argument("--accumulate", type=int, default=1,
                   help="split each worker's batch into N micro-batches; all-reduce once per step (no_sync)")
    p.add_argument("--local-sgd", type=int, default=None, metavar="N",
                   help="post-local SGD: after --local-sgd-warmup steps, no all-reduce; average the weights every N steps")
    p.add_argument("--local-sgd-warmup", type=int, default=50, help="steps of plain DDP before local SGD")
    p.add_argument("--lars-eta", type=float, default=0.001, help="LARS trust coefficient (--optimizer lars)")
    return p.parse_args(argv)


if __name__ == "__main__":
    main(parse_args())
