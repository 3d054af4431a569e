"""A parameter that forward did not use: DDP's error, its two switches, and what each costs.

    torchrun --standalone --nproc-per-node 2 solutions/labs/unused_parameters.py      # the error
    torchrun --standalone --nproc-per-node 2 solutions/labs/unused_parameters.py --ddp find-unused
    torchrun --standalone --nproc-per-node 2 solutions/labs/unused_parameters.py --ddp static-graph
    torchrun --standalone --nproc-per-node 2 solutions/labs/unused_parameters.py --aux-every 2 \
        --ddp static-graph               # the head used in some steps only: static_graph fails
    torchrun --standalone --nproc-per-node 2 solutions/labs/unused_parameters.py --bench

(Activate the course's environment first: source .venv/bin/activate.)

The course CNN with a second head beside its classifier: an auxiliary loss (is the image flipped
upside down?) that is on every --aux-every steps (0: never, as when it is switched off for a
run). DDP sends a bucket of gradients once every gradient in it is ready, so it waits for the
auxiliary head's, which never come in a step that does not call the head: at the next forward
DDP raises "Expected to have finished reduction in the prior iteration", on every rank.

    --ddp plain          DistributedDataParallel(model): the error, as soon as a step leaves the
                         head out
    --ddp find-unused    find_unused_parameters=True: after each forward, DDP walks the autograd
                         graph from the outputs and marks what it does not reach as ready
    --ddp static-graph   static_graph=True: DDP learns in the first step which parameters are
                         unused and takes the same set as unused in every step; a set that
                         changes (--aux-every 2) ends in the same error

--bench: what the search costs. The fastest forward (DDP searches there) without and with it, of
the model with its head in use (nothing unused: the search by itself) and of stacks of --layers
small layers (10, 100 and 1,000), since the search walks every node of the autograd graph; and the
collectives of a step, as torch.profiler records them: the search adds one, an all-reduce of one
number per parameter, which tells every rank which parameters any rank used.
PyTorch's notes on DDP's design say of the search: "traversing the autograd graph introduces extra
overheads, so applications should only set find_unused_parameters to True when necessary"
(https://docs.pytorch.org/docs/stable/notes/ddp.html).
Lines there because of distribution: `# DDP:`.
"""
import argparse
import copy
import math
import os
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from dpcourse.lab import world
from dpcourse.lab.data import InMemoryFashionMNIST
from dpcourse.lab.metrics import JsonLog
from dpcourse.lab.models import FashionCNN


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


class TwoHeads(nn.Module):
    """The course CNN's features, its classifier, and an auxiliary head: is the image flipped?"""

    def __init__(self):
        super().__init__()
        cnn = FashionCNN()
        self.features, self.classify = nn.Sequential(*list(cnn)[:-1]), cnn[-1]
        self.flipped = nn.Linear(cnn[-1].in_features, 2)

    def forward(self, x, aux):
        h = self.features(x)
        return self.classify(h), (self.flipped(h) if aux else None)


def wrap(module, how, device):
    ids = [device] if device.type == "cuda" else None
    # DDP: plain; or look for unused parameters after each forward; or learn them once
    return DDP(module, device_ids=ids, find_unused_parameters=how == "find-unused",
               static_graph=how == "static-graph")


def step(model, opt, x, y, aux):
    """One step; with ``aux``, half the batch flipped upside down and the auxiliary loss added."""
    flip = torch.arange(len(x), device=x.device) % 2
    if aux:
        x = torch.where(flip.bool()[:, None, None, None], x.flip(-2), x)
    opt.zero_grad(set_to_none=True)
    logits, flipped = model(x, aux)
    loss = F.cross_entropy(logits, y)
    if aux:
        loss = loss + F.cross_entropy(flipped, flip)
    loss.backward()  # DDP: gradients averaged over the ranks in here, bucket by bucket
    opt.step()
    return loss.item()


def train(args, env, log, train_set):
    torch.manual_seed(args.seed)
    model = wrap(TwoHeads().to(env.device), args.ddp, env.device)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    batches = torch.Generator(device=env.device).manual_seed(1000 * args.seed + env.rank)
    for i in range(args.steps):
        x, y = train_set[torch.randint(len(train_set), (args.batch_size,), generator=batches,
                                       device=env.device)]
        loss = step(model, opt, x, y, aux=args.aux_every > 0 and i % args.aux_every == 0)
    if env.rank == 0:  # DDP: one rank reports
        aux = f"every {args.aux_every} step(s)" if args.aux_every else "in no step"
        print(f"--ddp {args.ddp}, the auxiliary head {aux}: {args.steps} steps ran, last loss "
              f"{loss:.3f}", flush=True)
    log.write("done", ddp=args.ddp, aux_every=args.aux_every, steps=args.steps, loss=loss)


def graph_nodes(output):
    """How many nodes the autograd graph behind ``output`` has: what DDP's search walks."""
    seen, todo = set(), [output.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and node not in seen:
            seen.add(node)
            todo += [fn for fn, _ in node.next_functions]
    return len(seen)


def fastest(runs, repeats, work):
    """For each run, the fastest of ``repeats`` calls of ``work(run)``, which returns the
    milliseconds of what it times, after two calls to warm up. The runs take turns, so that a
    busy machine slows each of them alike."""
    times = {key: [] for key in runs}
    for _ in range(repeats + 2):
        for key, run in runs.items():
            dist.barrier()  # DDP: every rank starts the timed call together
            times[key].append(work(run))
    return {key: min(t[2:]) for key, t in times.items()}


def total(out):
    """The sum of a model's outputs (one tensor, or a tuple with None for a head not called)."""
    return sum(o.sum() for o in (out if isinstance(out, tuple) else (out,)) if o is not None)


def stack(layers):
    """``layers`` small layers, one after the other: a graph of many nodes and little work."""
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(16, 16), nn.Tanh())])


def collectives(model, inputs):
    """The collectives of one forward and backward, as torch.profiler records them: (name, how
    many numbers) each, such as ("gloo:all_reduce", 20538)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                record_shapes=True) as prof:
        total(model(*inputs)).backward()
    return [(e.name, math.prod(e.input_shapes[0])) for e in prof.events()
            if e.name.split(":")[0] in ("gloo", "nccl", "mpi")]


def bench(args, env, log, train_set):
    """The forward of the course model (its head in use: nothing unused, so the search finds
    nothing) and of deeper and deeper stacks, without and with the search."""
    x = train_set[:args.batch_size][0]
    models = [("course CNN, two heads", TwoHeads(), (x, True)),
              *[(f"{n} small layers", stack(n), (torch.randn(args.batch_size, 16,
                                                              device=env.device),))
                for n in args.layers]]
    for name, module, inputs in models:
        module = module.to(env.device)
        # DDP: a wrap of its own for each setting
        runs = {how: wrap(copy.deepcopy(module), how, env.device)
                for how in ("plain", "find-unused")}

        def forward(model):
            tick = time.perf_counter()
            out = model(*inputs)  # DDP: with find_unused_parameters, the search is in here
            ms = 1000 * (time.perf_counter() - tick)
            total(out).backward()  # DDP: the gradients averaged, as the next forward expects
            return ms
        ms = fastest(runs, args.repeats, forward)
        nodes = graph_nodes(total(module(*inputs)))
        sent = {how: collectives(model, inputs) for how, model in runs.items()}
        if env.rank == 0:  # DDP: one rank prints
            print(f"{name:22} {nodes:5} autograd nodes: a forward {ms['plain']:6.2f} ms, "
                  f"with the search {ms['find-unused']:6.2f} ms; collectives a step "
                  f"{len(sent['plain'])}, with the search {len(sent['find-unused'])}", flush=True)
        log.write("bench", model=name, nodes=nodes, plain_ms=round(ms["plain"], 3),
                  find_unused_ms=round(ms["find-unused"], 3), batch_size=args.batch_size,
                  repeats=args.repeats, collectives=sent,
                  parameters=sum(1 for _ in module.parameters()))


def main(args):
    os.environ.setdefault("KINETO_LOG_LEVEL", "99")  # torch.profiler without its start/stop lines
    # find_unused_parameters=True with nothing unused is what --bench times: no warning each rank
    warnings.filterwarnings("ignore", message=".*find_unused_parameters=True.*")
    env = setup(args)
    rank, world_size = dist.get_rank(), dist.get_world_size()  # DDP: who am I, how many are we?
    log = JsonLog(args.log_json if rank == 0 else None, world_size=world_size)  # DDP: rank 0 logs
    train_set = InMemoryFashionMNIST(args.data_root, train=True, device=env.device)
    (bench if args.bench else train)(args, env, log, train_set)
    cleanup()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ddp", default="plain", choices=["plain", "find-unused", "static-graph"])
    parser.add_argument("--aux-every", type=int, default=0,
                        help="the auxiliary head's loss every N steps (0: never)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=64, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bench", action="store_true", help="time a step of each setting")
    parser.add_argument("--repeats", type=int, default=20, help="--bench: timed forwards of each")
    parser.add_argument("--layers", type=int, nargs="*", default=[10, 100, 1000],
                        help="--bench: the stacks' numbers of layers")
    parser.add_argument("--data-root", default=None)
    parser.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl", "mpi"])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--timeout", type=float, default=60, help="seconds a collective may wait")
    parser.add_argument("--log-json", default=None, help="rank 0 writes JSON lines here")
    main(parser.parse_args())
