"""The equivalence matrix: every data-parallel strategy of the course, after the same steps from
the same weights on the same data, in float64, against one process on the whole global batch.

    python labs/equivalence.py                                             # 1 rank
    torchrun --standalone --nproc-per-node 2 labs/equivalence.py
    torchrun --standalone --nproc-per-node 4 labs/equivalence.py           # HSDP too
    torchrun --standalone --nproc-per-node 2 labs/equivalence.py --mutants # and 4 wrong

Data parallelism promises one thing: K ranks, each on its rows of a global batch, end where one
process on the whole batch ends. Every strategy below keeps that promise in its own way (the
labs of notebooks 05 and 13 build four of them), so every one must end on the same
weights, up to the last bits that adding the same numbers in another order changes. Each rank
builds the course CNN from weights of its own (a seed per rank, on purpose: a strategy that forgets
to start every rank from rank 0's weights is caught), trains --steps steps of SGD with momentum
on its rows of the same FashionMNIST batches, and the weights it ends with are compared with the
one process's. Rank 0 prints one line per strategy: the largest |Δweight| over every rank and every
tensor, the seconds it took, and the verdict: ok, or WRONG with the reason, found by what the
weights match instead (a step P times too large, each rank's rows alone, replicas apart).

--mutants adds four strategies that break the promise the way real code does: an accumulation
that skips the last sync, a sum where a mean belongs, a missing broadcast of the first weights, and
a compiled model that never syncs. Their rows must come out WRONG, each for its reason; the run
fails (exit 1 on every rank) when a strategy of the course is WRONG or a mutant passes.
--save-weights writes every rank's final weights of every strategy (one file, by rank 0).

(Activate the course's environment first: source .venv/bin/activate.)
"""
import argparse
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from dpcourse.lab import world
from dpcourse.lab.data import InMemoryFashionMNIST
from dpcourse.lab.metrics import JsonLog
from dpcourse.lab.models import FashionCNN

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the labs beside this file
from ddp_by_hand import BucketDDP, NaiveDDP, OverlapDDP
from ddp_compile import CNN, GraphRecorder
from fsdp_by_hand import shard_model, whole_weights
from sharded_optimizer import ShardedOptimizer


# ---------------------------------------------------------------- the strategies
# Each takes a fresh model (this rank's own initial weights) and the run's settings, trains it,
# and returns this rank's weights, whole. `sgd(params)` is the one optimizer they all use.
def start_together(model):
    for tensor in [*model.parameters(), *model.buffers()]:
        dist.broadcast(tensor.data, src=0)  # DDP: every rank starts from rank 0's weights
    return model


def by_hand(wrap):
    def strategy(model, run):
        model = wrap(model)  # it broadcasts rank 0's weights itself, as torch's DDP does
        return run.train(model, run.sgd(model.parameters()),
                         after_backward=model.finish_gradient_synchronization).module.state_dict()
    return strategy


def ddp(model, run):
    model = DDP(model)  # DDP: broadcasts rank 0's weights, all-reduces in backward
    return run.train(model, run.sgd(model.parameters())).module.state_dict()


def ddp_no_sync(model, run, last_sync=True):
    """Two micro-batches a step: the first one's gradient kept local (no_sync), the second's
    backward all-reduces the sum of both."""
    model = DDP(model)  # DDP: gradients averaged in backward
    optimizer = run.sgd(model.parameters())
    for x, y in run.batches:
        optimizer.zero_grad()
        for i, (xs, ys) in enumerate(zip(run.mine(x).chunk(2), run.mine(y).chunk(2))):
            if i == 0 or not last_sync:
                with model.no_sync():  # DDP: accumulate locally, no all-reduce
                    (F.cross_entropy(model(xs), ys) / 2).backward()
            else:  # DDP: this backward all-reduces the accumulated gradient
                (F.cross_entropy(model(xs), ys) / 2).backward()
        optimizer.step()
    return model.module.state_dict()


def zero1_by_hand(model, run):
    model = DDP(model)  # DDP: averaged gradients, rank 0's weights
    # ZeRO: each rank keeps the momentum of its share of the parameters (notebook 13)
    optimizer = ShardedOptimizer(model.parameters(), torch.optim.SGD, lr=run.lr, momentum=0.9)
    return run.train(model, optimizer).module.state_dict()


def zero_redundancy(model, run):
    model = DDP(model)  # DDP: averaged gradients, rank 0's weights
    # ZeRO: torch's own ZeRO-1
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD,
                                        lr=run.lr, momentum=0.9)
    return run.train(model, optimizer).module.state_dict()


def fsdp_by_hand(model, run):
    model = shard_model(start_together(model))  # FSDP: ZeRO-3 by hand (notebook 13)
    run.train(model, run.sgd(model.parameters()))
    return whole_weights(model)  # FSDP: the pieces gathered, on every rank


def fsdp2(model, run, mesh_shape=None):
    """FSDP2's fully_shard over all ranks, or, with a 2-D mesh, HSDP: each weight sharded over
    the mesh's second dimension and replicated over its first."""
    mesh_shape = mesh_shape or (dist.get_world_size(),)  # FSDP: one dimension, every rank
    names = ("replicate", "shard")[-len(mesh_shape):]
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)  # FSDP: who shares what
    model = start_together(model)  # FSDP: fully_shard does not broadcast: start alike
    for layer in model.modules():
        if isinstance(layer, (torch.nn.Conv2d, torch.nn.Linear)):
            fully_shard(layer, mesh=mesh)  # FSDP: its weights in shards
    fully_shard(model, mesh=mesh)  # FSDP: the rest at the root
    run.train(model, run.sgd(model.parameters()))
    return {k: v.full_tensor() if isinstance(v, DTensor) else v  # FSDP: whole, gathered
            for k, v in model.state_dict().items()}


class NothingCompiled(Exception):
    """torch.compile handed no graph to its backend: the row ran eager, and proved nothing."""


def compiled(model, run, inner=False):
    """torch.compile of the DDP model (DDPOptimizer cuts its graph at the buckets); the mutant
    compiles the module inside DDP and calls that, so DDP's forward never runs. The model is
    ddp_compile.py's CNN, FashionCNN with a forward of its own: behind DDP's forward, Dynamo
    skips torch's own files, and FashionCNN's forward is nn.Sequential's, so nothing would be
    compiled and the row would test eager DDP. The recorder makes sure something was."""
    torch._dynamo.reset()  # each row compiles afresh
    own = CNN().double()
    own.load_state_dict(model.state_dict())  # this rank's first weights
    model = DDP(own)  # DDP: rank 0's weights, gradients averaged in backward
    recorder = GraphRecorder(run.compile_backend)
    fast = torch.compile(model.module if inner else model, backend=recorder)
    run.train(fast, run.sgd(model.parameters()))
    if not recorder.graphs:
        raise NothingCompiled("torch.compile handed no graph to its backend: this was eager DDP")
    return model.module.state_dict()


def local_sgd(model, run, diloco=False):
    """H = 1 inner step on this rank's rows, then the models averaged (local SGD), or the
    pseudo-gradient (start - now) averaged and applied by an outer SGD step of lr 1 (DiLoCo)."""
    model = start_together(model)
    inner = run.sgd(model.parameters())
    outer = torch.optim.SGD(model.parameters(), lr=1.0)  # the outer step of DiLoCo, no momentum
    for x, y in run.batches:
        start = [p.detach().clone() for p in model.parameters()]
        inner.zero_grad()
        F.cross_entropy(model(run.mine(x)), run.mine(y)).backward()
        inner.step()  # DDP: no all-reduce: this rank's own step
        with torch.no_grad():
            for p, p0 in zip(model.parameters(), start):
                if diloco:
                    p.grad = p0 - p  # the pseudo-gradient, averaged below
                    p.copy_(p0)
                dist.all_reduce(p.grad if diloco else p)  # DDP: summed over the ranks ...
                (p.grad if diloco else p).div_(dist.get_world_size())  # DDP: ... and averaged
        if diloco:
            outer.step()
    return model.state_dict()


class SummedDDP(NaiveDDP):
    """Mutant: the ranks' gradients summed, the mean forgotten."""

    def finish_gradient_synchronization(self):
        super().finish_gradient_synchronization()
        for p in self.params:
            if p.grad is not None:
                p.grad *= dist.get_world_size()  # DDP: the mean undone: the sum


class UnbroadcastDDP(NaiveDDP):
    """Mutant: DDP by hand whose ranks keep their own first weights."""

    def __init__(self, module):
        torch.nn.Module.__init__(self)
        self.module, self.params = module, [p for p in module.parameters() if p.requires_grad]


STRATEGIES = {
    "NaiveDDP (05)": by_hand(NaiveDDP),
    "OverlapDDP (05)": by_hand(OverlapDDP),
    "BucketDDP (05)": by_hand(BucketDDP),
    "DistributedDataParallel": ddp,
    "DDP, no_sync accumulation": ddp_no_sync,
    "ZeRO-1 by hand (13)": zero1_by_hand,
    "ZeroRedundancyOptimizer": zero_redundancy,
    "FSDP by hand (13)": fsdp_by_hand,
    "FSDP2 fully_shard": fsdp2,
    "HSDP, 2 × 2 mesh": lambda model, run: fsdp2(model, run, mesh_shape=(2, 2)),
    "DDP under torch.compile": compiled,
    "local SGD, H = 1": local_sgd,
    "DiLoCo, H = 1, outer lr 1": lambda model, run: local_sgd(model, run, diloco=True),
}
MUTANTS = {
    "mutant: no_sync on the last micro-batch too": lambda m, run: ddp_no_sync(m, run, False),
    "mutant: a sum, not a mean": by_hand(SummedDDP),
    "mutant: no broadcast of the first weights": by_hand(UnbroadcastDDP),
    "mutant: compiled module inside DDP": lambda m, run: compiled(m, run, inner=True),
}


# ---------------------------------------------------------------- the run and its verdicts
class Run:
    """What every strategy shares: the batches, the optimizer's settings and the training loop."""

    def __init__(self, args, batches, rank, world_size):
        self.batches, self.lr, self.rank, self.world_size = batches, args.lr, rank, world_size
        self.compile_backend = args.compile_backend

    def mine(self, rows):
        return rows[self.rank::self.world_size]  # DDP: this rank's rows of the global batch

    def sgd(self, params):
        return torch.optim.SGD(params, lr=self.lr, momentum=0.9)

    def train(self, model, optimizer, after_backward=None):
        for x, y in self.batches:
            optimizer.zero_grad()
            F.cross_entropy(model(self.mine(x)), self.mine(y)).backward()
            if after_backward:
                after_backward()
            optimizer.step()
        return model


def one_process(args, batches, rows=slice(None), lr=None):
    """The reference: rank 0's first weights, trained in one process on `rows` of each batch."""
    torch.manual_seed(args.seed)
    model = FashionCNN().double()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr or args.lr, momentum=0.9)
    for x, y in batches:
        optimizer.zero_grad()
        F.cross_entropy(model(x[rows]), y[rows]).backward()
        optimizer.step()
    return model.state_dict()


def max_abs_diff(a, b):
    """The largest |a - b| over every tensor of two state dicts; NaN counts as inf."""
    return torch.stack([(a[k] - b[k]).abs().max() for k in b]).max().nan_to_num(torch.inf).item()


def diagnose(state, refs, tolerance):
    """(max |Δ| vs one process, the reason it is WRONG or None), the same on every rank."""
    flat = torch.cat([state[k].flatten() for k in refs["one"]])
    lowest, highest = flat.clone(), flat.clone()
    dist.all_reduce(lowest, op=dist.ReduceOp.MIN)  # DDP: the replicas compared, element by element
    dist.all_reduce(highest, op=dist.ReduceOp.MAX)  # DDP: ... over every rank
    spread = (highest - lowest).max().nan_to_num(torch.inf)
    found = torch.tensor([max_abs_diff(state, refs[name]) for name in ("one", "sum", "alone")],
                         dtype=torch.float64)
    dist.all_reduce(found, op=dist.ReduceOp.MAX)  # DDP: the worst rank's, on every rank
    diff, as_sum, as_alone = found.tolist()
    if diff <= tolerance:
        return diff, None
    if as_sum <= tolerance:
        return diff, ("the weights of a step P times too large: the gradients were summed over "
                      "the ranks, not averaged")
    if as_alone <= tolerance:
        return diff, ("each rank's weights are those of its own rows alone: the gradients were "
                      "never averaged")
    if spread > tolerance:
        return diff, (f"the replicas differ from each other by up to {spread:.1g}: a rank kept "
                      "its own first weights, or a step's gradients were not all synchronised")
    return diff, f"the weights differ from one process's by up to {diff:.1g}"


def matrix(args, strategies):
    """Every strategy on this world size: one row each, logged; True when every verdict is right."""
    rank, world_size = dist.get_rank(), dist.get_world_size()  # DDP: who am I, how many are we?
    G = args.global_batch_size
    data = InMemoryFashionMNIST(args.data_root, train=True, first=args.steps * G)
    batches = [(x.double(), y) for x, y in (data[torch.arange(s * G, (s + 1) * G)]
                                            for s in range(args.steps))]
    refs = {"one": one_process(args, batches),  # the same on every rank
            "sum": one_process(args, batches, lr=args.lr * world_size),
            "alone": one_process(args, batches, rows=slice(rank, None, world_size))}
    log = JsonLog(args.log_json if rank == 0 else None, world_size=world_size,  # DDP: rank 0 logs
                  steps=args.steps, global_batch=G, tolerance=args.tolerance)
    run, rows, saved, right = Run(args, batches, rank, world_size), [], {}, True
    for name, strategy in strategies.items():
        if name.startswith("HSDP") and world_size != 4:
            continue  # a 2 × 2 mesh needs 4 ranks
        torch.manual_seed(args.seed + rank)  # DDP: each rank its own first weights, on purpose
        start = time.perf_counter()
        try:
            state = {k: v.detach().clone() for k, v in strategy(FashionCNN().double(), run).items()}
            diff, why = diagnose(state, refs, args.tolerance)
        except NotImplementedError as err:  # an exercise left in the learner's copy, every rank
            stub = traceback.extract_tb(err.__traceback__)[-1]  # the lab and line of the exercise
            state, diff, why = None, None, (f"not done yet — the exercise in labs/"
                                            f"{Path(stub.filename).name}, line {stub.lineno}")
        except NothingCompiled as err:  # every rank compiles alike: every rank is here
            state, diff, why = None, None, str(err)
        seconds = time.perf_counter() - start
        mutant = name.startswith("mutant")
        # a row not compared (an exercise not done, nothing compiled) is never right, a mutant's
        # neither: it was not caught, it did not run; on 1 rank the mutants end alike too
        right = right and state is not None and (why is not None) == (mutant and world_size > 1)
        rows.append((name, diff, seconds, why))
        log.write("cell", strategy=name, mutant=mutant, max_abs_diff=diff,
                  seconds=round(seconds, 3), ok=why is None, why=why)
        if args.save_weights and state is not None:
            every = [None] * world_size
            dist.all_gather_object(every, state)  # DDP: every rank's weights, for rank 0 to save
            saved[name] = every
    if rank == 0:  # DDP: one rank prints, and saves
        print(f"{world_size} rank(s), {args.steps} steps of SGD, global batch {G}, float64; "
              f"max |Δweight| vs one process (tolerance {args.tolerance:g}):")
        for name, diff, seconds, why in rows:
            shown = "—" if diff is None else f"{diff:.1e}"
            verdict = f"WRONG — {why}" if why else "ok"
            print(f"  {name:45} {shown:>8} {seconds:6.2f} s  {verdict}")
        if world_size == 1 and args.mutants:
            print("(one rank: nothing to average, so the mutants end on the same weights too)")
        if args.save_weights:
            torch.save({"reference": refs["one"], "strategies": saved}, args.save_weights)
    return right


# ---------------------------------------------------------------- set-up and main
def setup(args):
    # DDP: rank and world size from torchrun, srun or mpirun; MASTER_ADDR/PORT set and checked.
    env = world.prepare(backend=args.backend, device=args.device)
    if env.device.type == "cuda":
        torch.cuda.set_device(env.device)  # DDP: one GPU per process, cuda:LOCAL_RANK
    dist.init_process_group(env.backend, rank=env.rank, world_size=env.world_size,  # DDP: join
                            timeout=timedelta(seconds=args.timeout))
    return env


def cleanup():
    dist.destroy_process_group()  # DDP: leave the group so every rank exits cleanly


def main(args):
    setup(args)
    chosen = {**STRATEGIES, **(MUTANTS if args.mutants else {})}
    if args.only:
        chosen = {k: v for k, v in chosen.items() if any(w in k for w in args.only.split(","))}
    right = matrix(args, chosen)
    cleanup()
    if not right:
        raise SystemExit(1)  # DDP: every rank knows the verdicts, so every rank exits non-zero


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--global-batch-size", type=int, default=24,
                        help="split over the ranks (24: 1, 2, 3, 4 or 6 ranks, two micro-batches)")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--mutants", action="store_true", help="add the four wrong strategies")
    parser.add_argument("--only", default=None, help="strategies whose names hold one of these")
    parser.add_argument("--compile-backend", default="aot_eager",
                        help="torch.compile's backend for its rows (inductor: generated C++)")
    # The same average, added in another order, changes float64's last bits only: about 1e-16 of
    # a weight. A strategy that breaks the promise ends 1e-4 or more away after the default steps.
    parser.add_argument("--tolerance", type=float, default=1e-12,
                        help="the largest max |Δweight| vs one process that is still equal")
    parser.add_argument("--save-weights", default=None, help="rank 0 saves every rank's weights")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-root", default=None, help="the folder that holds FashionMNIST/")
    parser.add_argument("--backend", default="gloo", choices=["gloo"],
                        help="float64 on the CPU: gloo")
    parser.add_argument("--device", default="cpu", choices=["cpu"])
    parser.add_argument("--timeout", type=float, default=60, help="seconds a collective may wait")
    parser.add_argument("--log-json", default=None, help="rank 0 writes one JSON line per cell")
    main(parser.parse_args())
