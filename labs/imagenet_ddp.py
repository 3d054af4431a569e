"""Train a ResNet on ImageNet (or any ImageFolder tree, or its tar shards) with DistributedDataParallel.

    python -m dpcourse.data make-imagefolder data/imagenet-mini        # no ImageNet here? a small tree
    torchrun --standalone --nproc-per-node 2 labs/imagenet_ddp.py \\
        --data-root data/imagenet-mini --arch resnet18 --image-size 64 --batch-size 16 --epochs 4
    torchrun --standalone --nproc-per-node 8 labs/imagenet_ddp.py \\
        --data-root /shared/imagenet --stage-to "$TMPDIR/imagenet"     # one GPU node, ImageNet
    torchrun --standalone --nproc-per-node 1 labs/imagenet_ddp.py --synthetic --max-steps 200
    sbatch slurm/imagenet.sbatch                                       # several nodes

(Activate the course's environment first: source .venv/bin/activate.)

The recipe of Goyal et al., "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour": SGD with
momentum, the learning rate scaled linearly with the global batch (0.1 per 256 images) after a
gradual warm-up, no weight decay on BatchNorm and bias parameters, the last BatchNorm of each
residual block starting at zero; plus label smoothing and a cosine decay. On GPUs: mixed
precision (bf16 or fp16) and channels_last. Validation is exact: every validation image is
counted once, top-1 and top-5. Rank 0 prints, logs (--log-json) and checkpoints.
Every line that exists because of distribution is marked `# DDP:`.
"""
import argparse
import multiprocessing as mp
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler
from tqdm.auto import tqdm

from dpcourse import dist as ddp_env, preemption
from dpcourse.images import collate_bytes, decode_batch, image_dataset, normalize, stage
from dpcourse.metrics import JsonLog
from dpcourse.optim import warmup_then_decay
from dpcourse.options import Defaults  # --help with each option's default, once

# DataLoader workers start from a clean server process, not as forks of this one: a fork copies a
# process whose other threads (gloo's, PyTorch's) may hold a lock that the child then waits on forever.
WORKER_START = mp.get_context("forkserver")
WORKER_START.set_forkserver_preload(["torch", "torchvision", "dpcourse.images"])  # imported once, not per worker
REFERENCE_BATCH = 256  # --lr is the learning rate for this global batch (Goyal et al.: 0.1 per 256)
# Dense bf16/fp16 tensor-core peaks in TFLOP/s, for the model FLOP utilisation (MFU) in the log.
PEAK_TFLOPS = {"H200": 989, "H100 SXM": 989, "H100 80GB HBM3": 989, "H100 PCIe": 756, "H100": 756,
               "A100": 312, "L40S": 362, "A40": 150, "A10": 125, "V100": 125, "RTX 4090": 165}


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


def param_groups(model, weight_decay):
    """Two groups for the optimiser: weight decay on the conv and linear weights only.

    Goyal et al. leave BatchNorm's scale and shift out of the weight decay; later recipes leave the
    biases out too (Jia et al., 2018; T. He et al., "Bag of Tricks", 2019)."""
    # YOUR CODE HERE
    # Hint: a parameter with one dimension (p.ndim == 1) is a BatchNorm weight or bias,
    #       or a layer's bias: put those in a group with "weight_decay": 0.0, every
    #       other parameter in a group with weight_decay;
    #       return [dict(params=..., weight_decay=...), dict(...)]
    raise NotImplementedError("Exercise: see the hint above")


def correct_topk(logits, labels, ks=(1, 5)):
    """How many rows of ``logits`` have their label among their k highest scores, for each k."""
    # YOUR CODE HERE
    # Hint: logits.topk(max(ks), dim=1).indices holds each row's best classes, best
    #       first;
    #       compare them with labels[:, None] and count the rows whose label is among
    #       the first k
    raise NotImplementedError("Exercise: see the hint above")


def make_datasets(args, env):
    """(train, val) datasets, or (None, None) with --synthetic; staged to node-local disk first."""
    if args.synthetic:
        return None, None
    root = args.data_root
    if not root:
        ddp_env.stop(env, "--data-root is missing: give the folder that holds train/ and val/ (ImageFolder "
                     "or shards), or train on --synthetic images. To practise without ImageNet:\n"
                     "    .venv/bin/python -m dpcourse.data make-imagefolder data/imagenet-mini")
    if args.stage_to:
        with ddp_env.rank0_first(local=True):  # DDP: one copy per node: local rank 0 copies, the rest wait
            root = stage(root, args.stage_to)
    decode = args.decode_on == "workers"
    with ddp_env.rank0_first():  # DDP: a missing folder is said once, by rank 0
        train = image_dataset(Path(root) / "train", True, args.image_size, args.seed, decode)
        val = image_dataset(Path(root) / "val", False, args.image_size, args.seed, decode)
    return train, val


def loader(args, dataset, batches, device):
    """A DataLoader over ``batches`` (lists of indices); decoding happens in its worker processes."""
    return DataLoader(dataset, batch_sampler=batches, num_workers=args.workers,
                      multiprocessing_context=WORKER_START if args.workers else None,
                      worker_init_fn=preemption.ignore_in_worker,  # the stop signal is the main process's to act on
                      pin_memory=device.type == "cuda", prefetch_factor=4 if args.workers else None,
                      collate_fn=None if args.decode_on == "workers" else collate_bytes)


def to_device(args, dataset, batch, device, fmt):
    """A batch from the loader as normalised float images on the device, and its labels."""
    if args.decode_on == "device":  # JPEG bytes: decoded and cropped on the GPU (nvJPEG)
        data, y, index = batch
        x = decode_batch(dataset, data, index, device)
    else:
        x, y = batch
    x = normalize(x.to(device, non_blocking=True)).contiguous(memory_format=fmt)
    return x, y.to(device, non_blocking=True)


def evaluate(args, model, val_set, env, fmt, amp):
    """Loss, top-1 and top-5 accuracy over the whole validation set, each image counted once."""
    model.eval()
    # DDP: rank r takes images r, r+K, r+2K, ...: no padding (DistributedSampler would repeat some).
    mine = range(env.rank, len(val_set), env.world_size)
    batches = BatchSampler(mine, args.batch_size_eval, drop_last=False)
    totals = torch.zeros(4, dtype=torch.float64, device=env.device)  # loss sum, top-1, top-5, count
    with torch.no_grad(), amp:
        for batch in loader(args, val_set, batches, env.device):
            x, y = to_device(args, val_set, batch, env.device, fmt)
            out = model(x).float()
            top1, top5 = correct_topk(out, y, (1, min(5, out.shape[1])))
            totals += torch.tensor([F.cross_entropy(out, y, reduction="sum").item(), top1, top5, len(y)],
                                   dtype=torch.float64, device=env.device)
    dist.all_reduce(totals)  # DDP: the sums over every rank's share
    model.train()
    loss, top1, top5, count = totals.tolist()
    return {"test_loss": round(loss / count, 5), "test_accuracy": round(top1 / count, 5),
            "test_top5": round(top5 / count, 5), "test_images": int(count)}


def save_checkpoint(path, model, opt, sched, scaler, progress, config):
    """Rank 0 writes everything a resumed run needs, atomically (never half a file)."""
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
             "scaler": scaler.state_dict(), "progress": progress, "config": config}
    tmp = Path(f"{path}.tmp")
    tmp.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(path, model, opt, sched, scaler, config, env):
    """Load a checkpoint of save_checkpoint, refusing one of another run."""
    try:
        state = torch.load(path, map_location=env.device, weights_only=True)
    except FileNotFoundError:
        ddp_env.stop(env, f"--resume {path}: no such checkpoint. Give a last.pt that --checkpoint-dir "
                     "wrote, or leave out --resume.")
    except Exception as err:  # noqa: BLE001 - any unreadable file gets the same advice
        ddp_env.stop(env, f"--resume {path}: not a readable checkpoint ({type(err).__name__}). Delete it, "
                     "or resume from another one.")
    if state["config"] != config:
        diff = ", ".join(f"{k} {state['config'].get(k)} (this run: {v})" for k, v in config.items()
                         if state["config"].get(k) != v)
        ddp_env.stop(env, f"--resume {path} was written by another run: {diff}. Resume with the same "
                     "settings, or start afresh without --resume.")
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    scaler.load_state_dict(state["scaler"])
    return state["progress"]


def main(args):
    caught = preemption.catch()  # SIGUSR1 (a job's time-limit warning) and SIGTERM: stop after a step, saved
    env = setup(args)
    rank, world_size = dist.get_rank(), dist.get_world_size()  # DDP: who am I, how many are we?
    device = env.device
    batch, global_batch = batch_sizes(args, env)
    if args.no_ddp and world_size > 1:
        ddp_env.stop(env, "--no-ddp trains without DistributedDataParallel: launch one process.")
    if args.deterministic:  # the same kernels every run: a resumed run equals an uninterrupted one
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)  # CUDA's avg-pool backward has no such kernel
    torch.backends.cudnn.benchmark = not args.deterministic  # else: the fastest convolution per shape
    torch.manual_seed(args.seed)  # the same initial weights on every rank (DDP copies rank 0's anyway)
    amp_dtype = {"auto": torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else None,
                 "off": None, "bf16": torch.bfloat16, "fp16": torch.float16}[args.amp]
    amp = torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None)
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)  # fp16 needs loss scaling
    channels_last = device.type == "cuda" if args.channels_last is None else args.channels_last
    fmt = torch.channels_last if channels_last else torch.contiguous_format

    train_set, val_set = make_datasets(args, env)
    if train_set is not None:
        sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank,  # DDP: my shard
                                     shuffle=True, seed=args.seed, drop_last=True)
        steps_per_epoch = len(sampler) // batch
        if steps_per_epoch == 0:
            ddp_env.stop(env, f"{len(train_set)} training images make no step of {world_size} × {batch}: "
                         "give a smaller --batch-size, or more images.")
        classes = len(train_set.classes)
    else:  # --synthetic: one random batch, made on the device, used again and again
        steps_per_epoch, classes = args.synthetic_steps, args.classes
        fake = (torch.randint(0, 256, (batch, 3, args.image_size, args.image_size), dtype=torch.uint8, device=device),
                torch.randint(0, classes, (batch,), device=device))

    if args.arch not in torchvision.models.list_models(torchvision.models):
        ddp_env.stop(env, f"--arch {args.arch}: torchvision has no such model. Try resnet18, resnet50, "
                     "resnext50_32x4d, ... (the names of torchvision.models.list_models()).")
    extra = {"zero_init_residual": True} if args.arch.startswith(("resnet", "resnext", "wide_resnet")) else {}
    model = torchvision.models.get_model(args.arch, weights=None, num_classes=classes, **extra)
    model = model.to(device, memory_format=fmt)
    lr = {"none": args.lr, "linear": args.lr * global_batch / REFERENCE_BATCH,  # --lr is REFERENCE_BATCH's rate
          "sqrt": args.lr * (global_batch / REFERENCE_BATCH) ** 0.5}[args.lr_scaling]
    opt = torch.optim.SGD(param_groups(model, args.weight_decay), lr=lr, momentum=0.9)
    total, warmup = args.epochs * steps_per_epoch, round(args.warmup_epochs * steps_per_epoch)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_then_decay(total, warmup, decay="cosine"))
    config = {"arch": args.arch, "classes": classes, "image_size": args.image_size,
              "world_size": world_size, "global_batch": global_batch}
    progress = {"epoch": 0, "step": 0, "step_in_epoch": 0, "elapsed_s": 0.0}
    resume = args.resume
    if resume == "auto":  # a requeued job: go on from the last checkpoint, if there is one
        resume = str(Path(args.checkpoint_dir or ".") / "last.pt")
        resume = resume if Path(resume).exists() else None
    if resume:
        progress = load_checkpoint(resume, model, opt, sched, scaler, config, env)
        if progress["epoch"] >= args.epochs or (args.max_steps and progress["step"] >= args.max_steps):
            if rank == 0:  # DDP: one rank talks
                print(f"{resume} is the checkpoint of a finished run (step {progress['step']}): nothing to do.",
                      flush=True)
            cleanup()
            return
    flops = train_flops(model, args.image_size, device)  # per image, forward and backward
    if not args.no_ddp:
        model = DDP(model, device_ids=[device] if device.type == "cuda" else None)  # DDP: averaged gradients

    peak = peak_tflops(args, device)
    log = JsonLog(args.log_json if rank == 0 else None, append=bool(resume),  # DDP: rank 0 logs
                  elapsed_before=progress["elapsed_s"], world_size=world_size, global_batch=global_batch,
                  arch=args.arch, image_size=args.image_size, peak_lr=lr, amp=str(amp_dtype or "off").replace("torch.", ""),
                  channels_last=channels_last, data="synthetic" if args.synthetic else type(train_set).__name__,
                  decode_on=args.decode_on, workers=args.workers, device=str(device))
    if resume:
        log.write("resume", epoch=round(progress["step"] / steps_per_epoch, 4), step=progress["step"])
    if rank == 0:  # DDP: one rank talks
        print(f"{args.arch}: {world_size} × {batch} = global batch {global_batch}, lr {lr:g}, {steps_per_epoch} "
              f"steps per epoch, {env.backend} on {device}, amp {log.common['amp']}, channels_last {channels_last}"
              + (f", resumed at step {progress['step']}" if resume else ""), flush=True)
        if args.warmup_epochs >= args.epochs:
            print(f"note: --warmup-epochs {args.warmup_epochs:g} is not below --epochs {args.epochs}: the rate climbs "
                  f"all the run towards {lr:g} and never decays. Give fewer warm-up epochs (Goyal et al.: 5 of 90).",
                  flush=True)

    step, epoch = progress["step"], progress["epoch"]
    window = {"images": 0, "seconds": 0.0, "data_s": 0.0, "loss": torch.zeros((), device=device), "steps": 0}
    run = {"images": 0, "seconds": 0.0, "data_s": 0.0}  # the whole run, for the final record
    tested, stop_reason = {}, None
    bar = tqdm(total=args.epochs * steps_per_epoch, initial=step, unit="step", desc="train",
               disable=ddp_env.bar_off(rank))  # DDP: a bar on rank 0 only

    def record(event, **fields):
        """Rank 0's log line: loss averaged over ranks and steps; throughput since the last record
        (the final record: of the whole run)."""
        loss = window["loss"].clone()
        dist.all_reduce(loss)  # DDP: the sum of every rank's losses
        for k in run:
            run[k] += window[k]
        timed = run if event == "done" else window
        per_worker = timed["images"] / timed["seconds"] if timed["seconds"] else None
        rec = log.write(event, epoch=round(step / steps_per_epoch, 4), step=step,
                        train_loss=round(loss.item() / (window["steps"] * world_size), 5) if window["steps"] else None,
                        samples_per_s=round(per_worker * world_size, 1) if per_worker else None,
                        samples_per_s_per_worker=round(per_worker, 1) if per_worker else None,
                        data_wait=round(timed["data_s"] / timed["seconds"], 4) if per_worker else None,
                        mfu=round(per_worker * flops / (peak * 1e12), 4) if per_worker and peak else None,
                        lr=round(sched.get_last_lr()[0], 7), **(tested if event in ("epoch", "done") else {}), **fields)
        window.update(images=0, seconds=0.0, data_s=0.0, loss=torch.zeros((), device=device), steps=0)
        return rec

    while epoch < args.epochs and stop_reason is None:
        if train_set is not None:
            sampler.set_epoch(epoch)  # DDP: a new order each epoch, the same on every rank
            train_set.set_epoch(epoch)  # new random crops each epoch
            batches = list(BatchSampler(sampler, batch, drop_last=True))[progress["step_in_epoch"]:]  # resumed mid-epoch: skip what was done
            batches_it = iter(loader(args, train_set, batches, device))
        start = ready = time.perf_counter()
        for i in range(progress["step_in_epoch"], steps_per_epoch):
            x, y = fake if train_set is None else to_device(args, train_set, next(batches_it), device, fmt)
            if train_set is None:
                x = normalize(x).contiguous(memory_format=fmt)
            window["data_s"] += time.perf_counter() - ready  # waiting for the input pipeline
            with amp:
                loss = F.cross_entropy(model(x), y, label_smoothing=args.label_smoothing)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()  # DDP: gradients are averaged across ranks while backward runs
            scaler.step(opt)
            scaler.update()
            sched.step()
            step += 1
            bar.update()
            window["loss"] += loss.detach().float()
            window["steps"] += 1
            window["images"] += batch
            progress.update(step=step, step_in_epoch=i + 1)
            if step % args.log_every == 0 or i + 1 == steps_per_epoch:
                if device.type == "cuda":
                    torch.cuda.synchronize()  # the window's images are really done
                window["seconds"] += time.perf_counter() - start
                start = time.perf_counter()
                if i + 1 < steps_per_epoch:
                    rec = record("train")
                    bar.set_postfix(img_s=rec["samples_per_s"], loss=rec["train_loss"])
            if args.checkpoint_dir and args.checkpoint_every and step % args.checkpoint_every == 0:
                progress["elapsed_s"] = log.elapsed()
                if rank == 0:  # DDP: one writer; every replica holds the same weights
                    save_checkpoint(Path(args.checkpoint_dir) / "last.pt", unwrap(model), opt, sched, scaler, progress, config)
            stop_reason = should_stop(args, step, log.elapsed(), caught, device)
            if stop_reason:
                break
            ready = time.perf_counter()
        else:  # the epoch ran to its end
            epoch += 1
            progress.update(epoch=epoch, step_in_epoch=0)
            if not (args.no_eval or args.synthetic):
                tested = evaluate(args, unwrap(model), val_set, env, fmt, amp)  # DDP: unwrapped: no collectives per batch
            rec = record("epoch")
            if rank == 0:  # DDP: one line per epoch, also where there is no bar (logs, CI)
                print(f"epoch {epoch}: {summary(rec)}, {rec['elapsed_s']:.1f} s", flush=True)
            if args.target_accuracy and tested and tested["test_accuracy"] >= args.target_accuracy:
                stop_reason = "target_accuracy"
            if args.checkpoint_dir:
                progress["elapsed_s"] = log.elapsed()
                if rank == 0:  # DDP: one writer
                    save_checkpoint(Path(args.checkpoint_dir) / "last.pt", unwrap(model), opt, sched, scaler, progress, config)
    bar.close()
    if window["steps"]:
        window["seconds"] += time.perf_counter() - start
    if stop_reason not in (None, "signal") and progress["step_in_epoch"] and not (args.no_eval or args.synthetic):
        tested = evaluate(args, unwrap(model), val_set, env, fmt, amp)  # stopped mid-epoch: test what we have
    final = record("done", stop=stop_reason or "epochs", flops_per_image=flops)
    if rank == 0:  # DDP: rank 0 reports and saves; the others hold the same weights
        print(f"step {step}: {summary(final)}, {final['elapsed_s']:.1f} s ({final['stop']})", flush=True)
        if args.save_model:
            torch.save(unwrap(model).state_dict(), args.save_model)
        if args.checkpoint_dir:
            progress["elapsed_s"] = log.elapsed()
            save_checkpoint(Path(args.checkpoint_dir) / "last.pt", unwrap(model), opt, sched, scaler, progress, config)
        if stop_reason == "signal":
            print(preemption.stopped_message(caught, step, args.checkpoint_dir and Path(args.checkpoint_dir) / "last.pt"), flush=True)
    if stop_reason == "signal":  # the first rank to exit may end the job: none before rank 0 has saved
        dist.barrier()  # DDP: wait for rank 0's checkpoint
    cleanup()


def batch_sizes(args, env):
    """(per-worker batch, global batch) from --batch-size or --global-batch-size."""
    if args.batch_size:
        return args.batch_size, args.batch_size * env.world_size
    if args.global_batch_size < env.world_size or args.global_batch_size % env.world_size:  # DDP: P equal shares
        ddp_env.stop(env, f"--global-batch-size {args.global_batch_size} does not split into {env.world_size} "
                     f"equal per-worker batches: use a multiple of {env.world_size}, or give --batch-size per worker.")
    return args.global_batch_size // env.world_size, args.global_batch_size


def summary(rec):
    """'top-1 0.7120, top-5 0.9810, 812 img/s' for a log record."""
    acc = (f"top-1 {rec['test_accuracy']:.4f}, top-5 {rec['test_top5']:.4f}, "
           if rec.get("test_accuracy") is not None else "")
    speed = f"{rec['samples_per_s']:.0f} img/s" if rec.get("samples_per_s") else "no steps"
    return acc + speed + (f", MFU {rec['mfu']:.1%}" if rec.get("mfu") else "")


def unwrap(model):
    """The plain module inside a DDP wrapper (what a checkpoint stores, what evaluation runs)."""
    return model.module if isinstance(model, DDP) else model


def train_flops(model, size, device):
    """FLOPs of one image's forward and backward, counted on a shape-only ("meta") copy."""
    from copy import deepcopy
    from torch.utils.flop_counter import FlopCounterMode

    meta = deepcopy(model).to("meta")
    with FlopCounterMode(display=False) as counter:  # 2 images: BatchNorm refuses to train on one
        meta(torch.empty(2, 3, size, size, device="meta")).sum().backward()
    return counter.get_total_flops() // 2


def peak_tflops(args, device):
    """This GPU's dense tensor-core peak (--peak-tflops, else the table above); None on a CPU."""
    if args.peak_tflops or device.type != "cuda":
        return args.peak_tflops
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


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


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=Defaults)
    p.add_argument("--data-root", default=None, help="the folder with train/ and val/ (ImageFolder or shards)")
    p.add_argument("--stage-to", default=None, help="copy --data-root here first, once per node (node-local disk)")
    p.add_argument("--synthetic", action="store_true", help="random images made on the device: compute throughput only")
    p.add_argument("--synthetic-steps", type=int, default=100, help="steps per epoch with --synthetic")
    p.add_argument("--classes", type=int, default=1000, help="classes with --synthetic")
    p.add_argument("--arch", default="resnet50", help="a torchvision model name (resnet18, resnet50, ...)")
    p.add_argument("--image-size", type=int, default=224, help="training crop (validation: the central crop)")
    p.add_argument("--epochs", type=int, default=90, help="passes over the training set")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps")
    p.add_argument("--time-budget", type=float, default=None, help="stop after this many seconds of training")
    p.add_argument("--batch-size", type=int, default=None, help="per worker (global = this × world size)")
    p.add_argument("--global-batch-size", type=int, default=256, help="split between the workers")
    p.add_argument("--batch-size-eval", type=int, default=100, help="validation batch per worker")
    p.add_argument("--lr", type=float, default=0.1, help=f"learning rate at global batch {REFERENCE_BATCH}")
    p.add_argument("--lr-scaling", default="linear", choices=["none", "linear", "sqrt"],
                   help=f"linear: --lr × global batch / {REFERENCE_BATCH} (Goyal et al.); sqrt: its square root")
    p.add_argument("--warmup-epochs", type=float, default=5, help="linear warm-up, then cosine decay to 0")
    p.add_argument("--weight-decay", type=float, default=1e-4, help="on conv and linear weights only")
    p.add_argument("--label-smoothing", type=float, default=0.1, help="of the cross-entropy loss")
    p.add_argument("--amp", default="auto", choices=["auto", "off", "bf16", "fp16"],
                   help="mixed precision; auto: bf16 on GPUs that have it, off on CPUs")
    p.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=None,
                   help="NHWC memory layout (default: on GPUs)")
    p.add_argument("--workers", type=int, default=4, help="DataLoader worker processes per rank")
    p.add_argument("--decode-on", default="workers", choices=["workers", "device"],
                   help="decode JPEGs in the loader's workers, or batched on the GPU (nvJPEG)")
    p.add_argument("--seed", type=int, default=0, help="initial weights and the sampler's shuffling")
    p.add_argument("--deterministic", action="store_true", help="deterministic kernels: bit-identical reruns and resumes")
    p.add_argument("--target-accuracy", type=float, default=None, help="stop once top-1 reaches this")
    p.add_argument("--no-eval", action="store_true", help="never validate (throughput runs)")
    p.add_argument("--log-every", type=int, default=20, help="log throughput and loss every N steps")
    p.add_argument("--checkpoint-dir", default=None, help="rank 0 writes last.pt here after each epoch")
    p.add_argument("--checkpoint-every", type=int, default=None, help="also checkpoint every N steps")
    p.add_argument("--resume", default=None, help="a checkpoint to resume from, or 'auto': CHECKPOINT_DIR/last.pt if there")
    p.add_argument("--log-json", default=None, help="rank 0 writes one JSON object per line here")
    p.add_argument("--save-model", default=None, help="rank 0 saves the final weights here")
    p.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"], help="auto: NCCL with a GPU per process, else gloo")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: cuda:LOCAL_RANK when there are GPUs")
    p.add_argument("--no-ddp", action="store_true", help="one process without the DDP wrapper (overhead baseline)")
    p.add_argument("--peak-tflops", type=float, default=None, help="the GPU's peak, for MFU (default: from a table)")
    p.add_argument("--timeout", type=float, default=120, help="seconds a collective may wait for a peer")
    return p.parse_args(argv)


if __name__ == "__main__":
    main(parse_args())
