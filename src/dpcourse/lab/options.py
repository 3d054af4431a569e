"""``--help`` that shows each option's default once: a lab's ``formatter_class``.

argparse's ArgumentDefaultsHelpFormatter adds "(default: …)" only to options with a help text,
and also to those whose text already says what happens by default ("(default: None)" after
"(default: each epoch)"). This one adds it to every option that has a real default, once.
"""
import argparse
from typing import NamedTuple


class Defaults(argparse.HelpFormatter):
    def _get_help_string(self, action):
        text = action.help or ""
        # `is`, not `in`: a default of 0 (--seed) is a real default, though 0 == False
        if ("default" in text or any(action.default is v for v in (None, False, argparse.SUPPRESS))
                or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)".lstrip()


def common_options(p: argparse.ArgumentParser, reference_batch: int,
                   checkpoints: tuple[str, str] = ("rank 0 writes last.pt here",
                                                   "CHECKPOINT_DIR/last.pt if there"),
                   **defaults) -> None:
    """The options every training lab takes, with the same names, kinds and choices
    (tests/test_skeleton.py).

    ``defaults`` are a recipe's own (``epochs=90``, ``lr=0.1``, ...); ``reference_batch`` is the
    global batch that --lr is tuned for; ``checkpoints``, what --checkpoint-dir holds and which
    checkpoint --resume auto takes.
    The lab adds its own options after these.
    """
    d = {"epochs": 3, "global_batch_size": 128, "lr": 0.15, "lr_scaling": "none",
         "warmup_epochs": 0.75, "weight_decay": 5e-4, "log_every": 50, **defaults}
    p.add_argument("--data-root", default=None,
                   help="the data's folder (default: $DPCOURSE_DATA or data/)")
    p.add_argument("--epochs", type=int, default=d["epochs"], help="passes over the training set")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps")
    p.add_argument("--time-budget", type=float, default=None,
                   help="stop after this many seconds of training")
    p.add_argument("--batch-size", type=int, default=None,
                   help="per worker (global = this × world size)")
    p.add_argument("--global-batch-size", type=int, default=d["global_batch_size"],
                   help="split between the workers")
    p.add_argument("--lr", type=float, default=d["lr"],
                   help=f"learning rate at global batch {reference_batch}")
    p.add_argument("--lr-scaling", default=d["lr_scaling"], choices=["none", "linear", "sqrt"],
                   help=f"linear: --lr × global batch / {reference_batch} (Goyal et al.); "
                        "sqrt: its square root")
    p.add_argument("--warmup-epochs", type=float, default=d["warmup_epochs"],
                   help="linear warm-up, then decay to 0")
    p.add_argument("--weight-decay", type=float, default=d["weight_decay"],
                   help="L2 penalty of the optimizer")
    p.add_argument("--seed", type=int, default=0,
                   help="initial weights and the sampler's shuffling")
    p.add_argument("--deterministic", action="store_true",
                   help="deterministic kernels: bit-identical reruns and resumes")
    p.add_argument("--target-accuracy", type=float, default=None,
                   help="stop once the test accuracy reaches this")
    p.add_argument("--no-eval", action="store_true",
                   help="never evaluate (weight comparisons, throughput runs)")
    p.add_argument("--log-every", type=int, default=d["log_every"],
                   help="log the train loss every N steps")
    p.add_argument("--checkpoint-dir", default=None, help=checkpoints[0])
    p.add_argument("--checkpoint-every", type=int, default=None,
                   help="also checkpoint every N steps")
    p.add_argument("--resume", default=None,
                   help=f"a checkpoint to resume from, or 'auto': {checkpoints[1]}")
    p.add_argument("--log-json", default=None, help="rank 0 writes one JSON object per line here")
    p.add_argument("--save-model", default=None, help="rank 0 saves the final weights here")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto: cuda:LOCAL_RANK when there are GPUs")


def ddp_options(p: argparse.ArgumentParser, timeout: float) -> None:
    """The DDP labs' (FashionMNIST's and ImageNet's): the backend, how long a collective may wait
    (``timeout`` seconds by default), and the one-process baseline without the wrapper."""
    p.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"],
                   help="auto: NCCL with a GPU per process, else gloo")
    p.add_argument("--timeout", type=float, default=timeout,
                   help="seconds a collective may wait for a peer")
    p.add_argument("--no-ddp", action="store_true",
                   help="one process without the DDP wrapper (overhead baseline)")


def fashion_options(p: argparse.ArgumentParser) -> None:
    """The options of the FashionMNIST training labs (one process's, DDP's, the study's and
    Horovod's): the same model, data and steps."""
    p.add_argument("--train-images", type=int, default=None,
                   help="train on the first N images only (the test set stays whole)")
    p.add_argument("--width", type=int, default=16, help="channels of the first conv layer")
    p.add_argument("--norm", default="group", choices=["group", "batch", "none"],
                   help="normalisation layers of the CNN")
    p.add_argument("--eval-every", type=int, default=None,
                   help="also evaluate every N steps (default: each epoch)")
    p.add_argument("--amp", action="store_true",
                   help="bfloat16 autocast (GPUs with bf16, and CPUs)")


def loader_options(p: argparse.ArgumentParser) -> None:
    """The FashionMNIST training's two input pipelines (notebook 06): the whole split in memory,
    or torchvision's per-image DataLoader."""
    p.add_argument("--loader", default="memory", choices=["memory", "torchvision"],
                   help="the whole split in memory, or a DataLoader of PIL images")
    p.add_argument("--workers", type=int, default=2,
                   help="DataLoader workers per rank (--loader torchvision)")


def accumulate_option(p: argparse.ArgumentParser) -> None:
    """--accumulate: micro-batches, one gradient average per step (the study lab's, Horovod's)."""
    p.add_argument("--accumulate", type=int, default=1,
                   help="split each worker's batch into N micro-batches; all-reduce once per step")


def horovod_options(p: argparse.ArgumentParser) -> None:
    """The Horovod lab's (notebook 11): its one-process baseline, backward passes per step, and the
    knobs it passes to Horovod (compression, Adasum, Tensor Fusion's buffer)."""
    p.add_argument("--no-hvd", action="store_true", help="one process with the plain optimizer, "
                   "no hvd.DistributedOptimizer (overhead baseline)")
    accumulate_option(p)
    p.add_argument("--compression", default="none", choices=["none", "fp16"],
                   help="gradients sent as fp16")
    p.add_argument("--adasum", action="store_true",
                   help="combine gradients with Adasum, not averaging (MPI; a power of 2 "
                        "ranks on the CPU, of nodes on GPUs)")
    p.add_argument("--fusion-threshold-mb", type=float, default=None,
                   help="Tensor Fusion buffer (default: Horovod's, 128 MB, or "
                   "$HOROVOD_FUSION_THRESHOLD)")


def scaling_options(p: argparse.ArgumentParser) -> None:
    """Notebooks 07-08's options (fashion_study.py): where the time goes, DDP's buckets, how to
    send less, micro-batches, and the optimizer for large batches."""
    p.add_argument("--time-split", action="store_true",
                   help="log each step's time split (data, forward, backward, all-reduce, "
                        "optimizer) and bytes sent")
    p.add_argument("--profile-trace", default=None,
                   help="rank 0 writes a Chrome trace of steps 6-8 here")
    p.add_argument("--bucket-cap-mb", type=float, default=25, help="DDP's gradient bucket size")
    p.add_argument("--grad-as-bucket-view", action="store_true",
                   help="gradients are views into DDP's buckets (no copy)")
    p.add_argument("--comm-hook", default="none",
                   choices=["none", "allreduce", "fp16", "bf16", "powersgd"],
                   help="how DDP sends gradients: built in (none), or a torch.distributed hook")
    p.add_argument("--powersgd-rank", type=int, default=1,
                   help="PowerSGD's matrix approximation rank")
    p.add_argument("--powersgd-start", type=int, default=10,
                   help="PowerSGD: plain all-reduce for this many steps")
    p.add_argument("--local-sgd", type=int, default=None, metavar="N",
                   help="post-local SGD: after --local-sgd-warmup steps, no all-reduce; "
                        "average the weights every N steps")
    p.add_argument("--local-sgd-warmup", type=int, default=50,
                   help="steps of plain DDP before local SGD")
    p.add_argument("--lars-eta", type=float, default=0.001,
                   help="LARS trust coefficient (--optimizer lars)")
    p.add_argument("--optimizer", default="sgd", choices=["sgd", "adamw", "lars"],
                   help="SGD with Nesterov momentum 0.9, AdamW or LARS")
    accumulate_option(p)


def imagenet_options(p: argparse.ArgumentParser) -> None:
    """The ImageNet lab's own options: the data and its staging, the model, precision and the
    input pipeline."""
    p.add_argument("--stage-to", default=None,
                   help="copy --data-root here first, once per node (node-local disk)")
    p.add_argument("--synthetic", action="store_true",
                   help="random images made on the device: compute throughput only")
    p.add_argument("--synthetic-steps", type=int, default=100,
                   help="steps per epoch with --synthetic")
    p.add_argument("--classes", type=int, default=1000, help="classes with --synthetic")
    p.add_argument("--arch", default="resnet50",
                   help="a torchvision model name (resnet18, resnet50, ...)")
    p.add_argument("--image-size", type=int, default=224,
                   help="training crop (validation: the central crop)")
    p.add_argument("--batch-size-eval", type=int, default=100, help="validation batch per worker")
    p.add_argument("--label-smoothing", type=float, default=0.1, help="of the cross-entropy loss")
    p.add_argument("--amp", default="auto", choices=["auto", "off", "bf16", "fp16"],
                   help="mixed precision; auto: bf16 on GPUs that have it, off on CPUs")
    p.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=None,
                   help="NHWC memory layout (default: on GPUs)")
    p.add_argument("--workers", type=int, default=4, help="DataLoader worker processes per rank")
    p.add_argument("--decode-on", default="workers", choices=["workers", "device"],
                   help="decode JPEGs in the loader's workers, or batched on the GPU (nvJPEG)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="the GPU's peak, for MFU (default: from a table)")


class Fail(NamedTuple):
    """--fail RANK:STEP:KIND (notebook 14): end rank ``rank`` before step ``step``."""
    rank: int
    step: int
    kind: str  # SIGKILL, SIGTERM or exception


FAIL_KINDS = ("SIGKILL", "SIGTERM", "exception")


def fail_spec(text: str) -> Fail:
    """--fail's value, checked: RANK:STEP:KIND (argparse's ``type``)."""
    parts = text.split(":")
    if len(parts) != 3 or not all(x.isdigit() for x in parts[:2]) or parts[2] not in FAIL_KINDS:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give RANK:STEP:KIND, e.g. 1:12:SIGKILL (KIND: {', '.join(FAIL_KINDS)})")
    return Fail(int(parts[0]), int(parts[1]), parts[2])
