"""DDP under torch.compile: the graphs that reach the compiler, where DDP's buckets cut them,
what compiled autograd changes, and what compiling costs and saves against eager DDP.

    python labs/ddp_compile.py                                               # 1 rank
    torchrun --standalone --nproc-per-node 2 labs/ddp_compile.py             # 2 ranks
    torchrun --standalone --nproc-per-node 2 labs/ddp_compile.py --bucket-cap-mb 25 1e-5

and with --compiled-autograd, --compile-backend inductor, --as-sequential (see below).

Eager DDP all-reduces a bucket of gradients from hooks that the autograd engine fires as each
gradient is ready, while backward still runs: that is the overlap. A compiled backward is one
autograd node: every gradient is ready at once, at its end. So Dynamo's DDPOptimizer
(torch/_dynamo/backends/distributed.py) cuts the forward graph where DDP's buckets end, counting
parameter bytes back from the output, and hands each piece to the backend: one graph per bucket,
each with a backward of its own, after which that bucket's all-reduce can start. It cuts between
operations, so a convolution's or a GroupNorm's parameters stay in one piece: with tiny buckets
DDP makes one bucket per parameter (8 here) but the compiler gets one graph per layer (5).

--compiled-autograd sets optimize_ddp = "python_reducer": DDP leaves its C++ reducer and puts a
hook on each parameter that all-reduces with functional collectives, and compiled autograd traces
the backward, those all-reduces inside it, into one graph (inductor's pass fuse_ddp_with_concat_op
then joins them into buckets of the cap). It traces a backward only while a compiled function
runs, so there the whole step is compiled.

Two traps, both silent. torch.compile(DDP(model)) breaks the graph at DDP's forward, and Dynamo
starts again at the module's own forward, but not in torch's own files: a model whose forward is
nn.Sequential's (FashionCNN's) gives no graph at all and runs eager (--as-sequential shows it).
The CNN below has a forward of its own, in this file. And compiling the module inside DDP, then
calling that (torch.compile(ddp.module)), skips DDP: no all-reduce, the replicas drift apart; the
equivalence matrix catches it (equivalence.py --mutants, "compiled module inside DDP").

Rank 0 prints, for each --bucket-cap-mb: DDP's buckets, the graphs the backend got (the
parameters in each), the compile seconds (the first step less a steady one), the median ms/step
eager and compiled, and the largest |Δweight| between them after the same steps from the same
weights on the same data. Times on a shared machine are noisy; the graphs are not.

(Activate the course's environment first: source .venv/bin/activate.)
"""
import argparse
import logging
import os
import shutil
import statistics
import tempfile
import time
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch._dynamo
import torch._inductor.config
import torch.distributed as dist
import torch.nn.functional as F
from torch._dynamo.backends.registry import lookup_backend
from torch.nn.parallel import DistributedDataParallel as DDP

from dpcourse.lab import world
from dpcourse.lab.data import InMemoryFashionMNIST
from dpcourse.lab.metrics import JsonLog
from dpcourse.lab.models import FashionCNN

# The DDP model's forward opens a profiler range (record_function), which Dynamo leaves out of
# the graph with a warning on every rank, once per process: true, harmless, and not this lesson
logging.getLogger("torch._dynamo.variables.ctx_manager").setLevel(logging.ERROR)


class CNN(FashionCNN):
    """The course CNN with a forward of its own, in a file Dynamo compiles: under DDP its graph
    starts here (FashionCNN's own forward is nn.Sequential's, in torch, which Dynamo skips)."""

    def forward(self, x):
        return super().forward(x)


class GraphRecorder:
    """A torch.compile backend that notes each graph it is handed (its parameters by name, its
    all-reduces), then hands it on to the real backend."""

    def __init__(self, backend):
        self.backend, self.graphs = backend, []

    def __call__(self, gm, example_inputs, **kwargs):
        nodes = list(gm.graph.nodes)
        self.graphs.append({
            "params": [param_name(n.target) for n in nodes if n.op == "placeholder"
                       and isinstance(n.meta.get("example_value"), torch.nn.Parameter)],
            "all_reduces": sum("all_reduce" in str(n.target) for n in nodes),
            "nodes": len(nodes)})
        return lookup_backend(self.backend)(gm, example_inputs, **kwargs)


def param_name(placeholder):
    """Dynamo's name for a parameter, 'L_self_modules_0_parameters_weight_', as '0.weight'."""
    return placeholder.split("_modules_")[-1].replace("_parameters_", ".").rstrip("_")


def compile_backend(args, env):
    """The backend to use, and why it is not the one asked for (None when it is). Inductor
    writes C++ for the CPU and builds it with $CXX or g++; without one it fails at the first
    step (InvalidCxxCompiler), so a machine without it gets aot_eager: the same graphs."""
    compiler = torch._inductor.config.cpp.cxx[-1]
    if args.compile_backend == "inductor" and env.device.type == "cpu" \
            and not shutil.which(compiler):
        return "aot_eager", (f"no C++ compiler ({compiler}: $CXX, or g++) on this machine: "
                             "aot_eager instead, the same graphs without generated code")
    return args.compile_backend, None


@contextmanager
def ddp_compile_settings(cap_mb, compiled_autograd):
    """DDPOptimizer's first piece the size of DDP's first bucket, and, with compiled autograd,
    DDP's Python reducer. Given bucket_cap_mb, DDP fills its first bucket to the cap like the
    others, but torch 2.14.1's DDPOptimizer takes DDP's default first bucket, 1 MiB, whatever
    the cap, and refuses a cap below it (AssertionError: First bucket should be smaller/equal to
    other buckets): the course CNN, 80 KB, would never be cut."""
    default_first = dist._DEFAULT_FIRST_BUCKET_BYTES  # DDP: its first bucket's default size
    # DDP: the compiler's first piece as large as DDP's first bucket (a private constant)
    dist._DEFAULT_FIRST_BUCKET_BYTES = max(1, int(cap_mb * 2**20))
    mode = "python_reducer" if compiled_autograd else "ddp_optimizer"  # DDP: who all-reduces
    try:
        with torch._dynamo.config.patch(optimize_ddp=mode, compiled_autograd=compiled_autograd):
            yield
    finally:
        dist._DEFAULT_FIRST_BUCKET_BYTES = default_first  # DDP: the default again


@contextmanager
def inductor_cache(keep):
    """Inductor's cache folder (keep: compiles found there are reused, the compile seconds of a
    second run), or an empty one, deleted after: the compile seconds of a first run."""
    if keep:
        yield
        return
    saved = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="ddp_compile_") as folder:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder
        try:
            yield
        finally:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR")
            if saved is not None:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = saved


def step_function(model, backend, compiled_autograd):
    """What a step runs before optimizer.step(): the loss and its backward, eager (no backend),
    with the DDP model compiled, or, with compiled autograd, the whole of it compiled."""
    if backend is None:
        return lambda x, y: F.cross_entropy(model(x), y).backward()
    if compiled_autograd:
        def step(x, y):
            F.cross_entropy(model(x), y).backward()  # DDP: all-reduces traced into the backward
        return torch.compile(step, backend=backend)
    fast = torch.compile(model, backend=backend)  # DDP: DDPOptimizer cuts it at the buckets
    return lambda x, y: F.cross_entropy(fast(x), y).backward()


def train(args, batches, model, backend, rank, world_size):
    """SGD with momentum over the batches; the seconds of each step."""
    step = step_function(model, backend, args.compiled_autograd)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    seconds = []
    for x, y in batches:
        start = time.perf_counter()
        optimizer.zero_grad()
        step(x[rank::world_size], y[rank::world_size])  # DDP: this rank's rows of the batch
        optimizer.step()
        seconds.append(time.perf_counter() - start)
    return seconds


def measure(args, batches, cap_mb, backend, device):
    """Eager DDP, then compiled DDP, from the same first weights on the same batches."""
    rank, world_size = dist.get_rank(), dist.get_world_size()  # DDP: who am I, how many are we?
    runs = {}
    for name in ("eager", "compiled"):
        recorder = GraphRecorder(backend) if name == "compiled" else None
        torch._dynamo.reset()  # every configuration compiles afresh
        with ddp_compile_settings(cap_mb, args.compiled_autograd and recorder is not None):
            torch.manual_seed(args.seed)
            net = (FashionCNN() if args.as_sequential else CNN()).to(device)
            model = DDP(net, bucket_cap_mb=cap_mb)  # DDP: rank 0's weights, buckets of cap_mb MiB
            seconds = train(args, batches, model, recorder, rank, world_size)
        runs[name] = model, seconds, recorder
    (eager, eager_s, _), (compiled, compiled_s, recorder) = runs["eager"], runs["compiled"]
    steady = statistics.median(compiled_s[args.warmup:])
    dweight = max((a - b).abs().max().item()
                  for a, b in zip(eager.parameters(), compiled.parameters()))
    numbers = torch.tensor([compiled_s[0] - steady, statistics.median(eager_s[args.warmup:]),
                            steady, dweight], dtype=torch.float64, device=device)
    dist.all_reduce(numbers, op=dist.ReduceOp.MAX)  # DDP: the slowest rank's times, largest Δ
    compile_s, eager_step, compiled_step, dweight = numbers.tolist()
    ddp_log = eager._get_ddp_logging_data()  # DDP: what DDP logs of itself: its buckets
    return {"bucket_cap_mb": cap_mb, "compile_backend": backend,
            "compiled_autograd": args.compiled_autograd, "as_sequential": args.as_sequential,
            "ddp_buckets": ddp_log.get("num_buckets_reduced"), "graphs": len(recorder.graphs),
            "graph_params": [g["params"] for g in recorder.graphs],
            "graph_all_reduces": [g["all_reduces"] for g in recorder.graphs],
            "compile_s": round(compile_s, 3), "eager_ms": round(eager_step * 1e3, 2),
            "compiled_ms": round(compiled_step * 1e3, 2), "max_abs_dweight": dweight}


def report(r):
    """Rank 0's lines for one configuration."""
    how = "compiled autograd" if r["compiled_autograd"] else "DDPOptimizer"
    print(f"bucket_cap_mb {r['bucket_cap_mb']:g}: {r['ddp_buckets']} DDP bucket(s); "
          f"{r['graphs']} graph(s) to {r['compile_backend']} ({how})", flush=True)
    for i, (params, reduces) in enumerate(zip(r["graph_params"], r["graph_all_reduces"]), 1):
        what = " ".join(params) or "no parameters (the backward)"
        print(f"  graph {i}: {what}" + (f", {reduces} all-reduces" if reduces else ""), flush=True)
    print(f"  compile {r['compile_s']:.1f} s; ms/step eager {r['eager_ms']:.1f}, compiled "
          f"{r['compiled_ms']:.1f}; max |Δweight| vs eager {r['max_abs_dweight']:.1e}", flush=True)


def setup(args):
    # DDP: rank and world size from torchrun, srun or mpirun; MASTER_ADDR/PORT set and checked.
    env = world.prepare(backend=args.backend, device=args.device)
    if env.device.type == "cuda":
        torch.cuda.set_device(env.device)  # DDP: one GPU per process, cuda:LOCAL_RANK
    dist.init_process_group(env.backend, rank=env.rank, world_size=env.world_size,  # DDP: join
                            timeout=timedelta(seconds=args.timeout))
    return env


def cleanup():
    dist.destroy_process_group()  # DDP: leave the process group so every rank exits cleanly.


def main(args):
    env = setup(args)
    rank, world_size = dist.get_rank(), dist.get_world_size()  # DDP: who am I, how many are we?
    backend, instead = compile_backend(args, env)
    if args.show_graphs and rank == 0:  # DDP: one rank prints DDPOptimizer's cut graphs
        torch._logging.set_logs(ddp_graphs=True)
    G = args.batch_size * world_size  # DDP: the global batch, split over the ranks
    steps = args.warmup + args.steps
    data = InMemoryFashionMNIST(args.data_root, train=True, device=env.device, first=steps * G)
    batches = [data[torch.arange(s * G, (s + 1) * G, device=env.device)] for s in range(steps)]
    log = JsonLog(args.log_json if rank == 0 else None, world_size=world_size,  # DDP: rank 0 logs
                  global_batch=G, warmup=args.warmup, steps=args.steps)
    if rank == 0:  # DDP: one rank prints
        print(f"{world_size} rank(s) × batch {args.batch_size}, {args.warmup} + {args.steps} "
              f"steps of SGD, {env.device}, backend {env.backend}", flush=True)
        if instead:
            print(f"{args.compile_backend}: {instead}", flush=True)
    log.write("setup", compile_backend=backend, asked=args.compile_backend, instead=instead,
              compiled_autograd=args.compiled_autograd, torch=torch.__version__)
    with inductor_cache(args.cache):
        for cap_mb in args.bucket_cap_mb:
            result = measure(args, batches, cap_mb, backend, env.device)
            log.write("config", **result)
            if rank == 0:  # DDP: one rank prints
                report(result)
    cleanup()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compile-backend", default="aot_eager",
                        choices=["eager", "aot_eager", "inductor"],
                        help="torch.compile's backend (inductor: generated C++ on the CPU)")
    parser.add_argument("--bucket-cap-mb", type=float, nargs="+", default=[25.0],
                        help="DDP's bucket cap, MiB; one configuration each (1e-5: a bucket a "
                             "parameter)")
    parser.add_argument("--compiled-autograd", action="store_true",
                        help="optimize_ddp='python_reducer' and compiled autograd, step compiled")
    parser.add_argument("--as-sequential", action="store_true",
                        help="compile DDP(FashionCNN()) as it is: no graph, eager")
    parser.add_argument("--show-graphs", action="store_true",
                        help="rank 0 prints DDPOptimizer's graphs (torch._logging ddp_graphs)")
    parser.add_argument("--cache", action="store_true",
                        help="reuse inductor's cache folder (off: an empty one, a first run)")
    parser.add_argument("--steps", type=int, default=20, help="steps timed, after the warm-up")
    parser.add_argument("--warmup", type=int, default=3, help="steps first, the compile among them")
    parser.add_argument("--batch-size", type=int, default=64, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-root", default=None, help="the folder that holds FashionMNIST/")
    parser.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl", "mpi"])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--timeout", type=float, default=60, help="seconds a collective may wait")
    parser.add_argument("--log-json", default=None, help="rank 0 writes one JSON line per config")
    args = parser.parse_args()
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup and --steps: at least 1 each (the first step is the compile)")
    main(args)
