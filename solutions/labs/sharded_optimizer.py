"""ZeRO-1 by hand: each rank keeps the optimizer state of its own share of the parameters only.

    torchrun --standalone --nproc-per-node 2 solutions/labs/sharded_optimizer.py   # check it
    torchrun --standalone --nproc-per-node 3 solutions/labs/sharded_optimizer.py   # on 3 ranks

Adam keeps two numbers for every parameter (its moments), twice the model's size, and plain
data parallelism keeps them on every rank. ``ShardedOptimizer(params, optimizer_cls, **kwargs)``
gives each parameter one owner (largest first, to the least loaded rank); each rank builds
``optimizer_cls`` over the parameters it owns only. After the usual all-reduce of the
gradients, every rank steps its own parameters, and each parameter is then broadcast from its
owner, so that every rank goes on with the whole, updated model. This is ZeRO stage 1
(Rajbhandari et al., 2020), torch's ``ZeroRedundancyOptimizer``.

The check: a model with parameters of very different sizes, the same initial weights on every
rank, trained for --steps steps of AdamW on each rank's share of a global batch, with the
gradients averaged as DDP does; once with AdamW, once with SGD with momentum, each with two
parameter groups (the weight matrices; the biases at half the rate, without weight decay). After
every step, every rank's parameters must equal those of the unsharded optimizer given the same
gradients (torch.allclose), and at the end each rank's AdamW state must be within 10 % of the
unsharded AdamW's divided by the number of ranks, and each rank's optimizer must keep the two
groups. Rank 0 prints one line for each, and logs them with --log-json.

(Activate the course's environment first: source .venv/bin/activate.)
"""
import argparse
import copy
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dpcourse.lab import world
from dpcourse.lab.metrics import JsonLog


class ShardedOptimizer(torch.optim.Optimizer):
    """``optimizer_cls`` over this rank's share of ``params``; ``step()`` updates all of them.

    A ``torch.optim.Optimizer``, as torch's ``ZeroRedundancyOptimizer`` is: parameter groups,
    ``param_groups`` that a learning-rate scheduler changes, ``step(closure)``, ``zero_grad()``, and
    ``state_dict()`` / ``load_state_dict()`` of this rank's shard (save one file per rank)."""

    def __init__(self, params, optimizer_cls, **kwargs):
        super().__init__(params, kwargs)  # self.param_groups: every parameter, in its group
        self.params = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        rank, world_size = dist.get_rank(), dist.get_world_size()  # DDP: who am I, how many are we?
        if len(self.params) < world_size:  # a rank without a share would build an empty optimizer
            raise ValueError(f"{len(self.params)} parameter tensors cannot be shared by "
                             f"{world_size} ranks")
        # ZeRO: an owner for each parameter, the same on every rank: the largest parameter first,
        # each to the rank that owns the fewest numbers so far (shares of nearly equal size).
        self.owner, load = {}, [0] * world_size
        for p in sorted(self.params, key=lambda p: p.numel(), reverse=True):  # a stable sort
            self.owner[p] = load.index(min(load))
            load[self.owner[p]] += p.numel()
        # ZeRO: my share, group by group (a group may hold none of mine; its options still count)
        self.mine = [{**group, "params": [p for p in group["params"] if self.owner.get(p) == rank]}
                     for group in self.param_groups]
        ### BEGIN SOLUTION (hint: build optimizer_cls with **kwargs over this rank's own parameters only, as self.local)
        self.local = optimizer_cls(self.mine, **kwargs)  # ZeRO: state for my share only
        ### END SOLUTION
        # its defaults (betas, ...) shown too
        self._options_to(self.param_groups, self.local.param_groups)
        self.state = self.local.state  # what this rank holds: its share's state

    @staticmethod
    def _options_to(groups, sources):
        """Every option but the parameters, from each source group to its group (lr, betas, ...)."""
        for group, source in zip(groups, sources):
            group.update({key: value for key, value in source.items() if key != "params"})

    @torch.no_grad()
    def step(self, closure=None):
        """Call it where you would call ``optimizer.step()``: after the gradients are averaged."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._options_to(self.local.param_groups, self.param_groups)  # e.g. a scheduler's new lr
        ### BEGIN SOLUTION (hint: step this rank's own optimizer, then send every parameter from its owner to all ranks with dist.broadcast)
        self.local.step()  # ZeRO: update my share of the parameters
        for p in self.params:  # mine and the others': every rank sends what it owns
            dist.broadcast(p, src=self.owner[p])  # ZeRO: from its owner to every rank
        ### END SOLUTION
        return loss

    def add_param_group(self, param_group):
        if hasattr(self, "local"):  # after __init__: the owners are shared out already
            raise NotImplementedError("ShardedOptimizer shares out its parameters "
                                      "when it is built: give it every parameter group then")
        super().add_param_group(param_group)  # torch.optim.Optimizer.__init__ adds the groups so

    def state_dict(self):
        """This rank's shard of the state: each rank saves its own (e.g. to last-rank{rank}.pt)."""
        # a scheduler's lr since the last step
        self._options_to(self.local.param_groups, self.param_groups)
        return {"rank": dist.get_rank(), "world_size": dist.get_world_size(),  # ZeRO: whose shard
                "local": self.local.state_dict()}

    def load_state_dict(self, state_dict):
        # ZeRO: a shard belongs to one rank of one layout
        here = (dist.get_rank(), dist.get_world_size())
        if (state_dict["rank"], state_dict["world_size"]) != here:
            raise ValueError(f"this shard was saved by rank {state_dict['rank']} of "
                             f"{state_dict['world_size']}, not rank {here[0]} of {here[1]}: "
                             "load each rank's own file, with as many ranks")
        self.local.load_state_dict(state_dict["local"])
        self._options_to(self.param_groups, self.local.param_groups)
        self.state = self.local.state

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (Adam: its two moments and a step count per
        parameter)."""
        return state_bytes(self.local)


def state_bytes(optimizer) -> int:
    """Bytes of the tensors in an optimizer's state."""
    return sum(t.numel() * t.element_size() for state in optimizer.state.values()
               for t in state.values() if torch.is_tensor(t))


class UnevenNet(nn.Sequential):
    """An MLP whose parameters range from 8 numbers to 2,560: no two shares come out equal by
    luck."""

    def __init__(self, sizes=(20, 64, 40, 48, 36, 56, 8)):
        layers = []
        for a, b in zip(sizes, sizes[1:]):
            layers += [nn.Linear(a, b), nn.Tanh()]
        super().__init__(*layers[:-1])


def groups(model, lr):
    """Two parameter groups, as a project often has: the weight matrices; the biases at half the
    rate, without weight decay."""
    return [{"params": [p for p in model.parameters() if p.dim() > 1]},
            {"params": [p for p in model.parameters() if p.dim() == 1], "lr": lr / 2,
             "weight_decay": 0.0}]


def compare(args, env, optimizer_cls, **hyper):
    """ShardedOptimizer(optimizer_cls) against the unsharded optimizer, given the same gradients
    step after step; (max |Δ| over the steps, this rank's state bytes, the unsharded state bytes,
    whether this rank's optimizer kept the groups)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()  # DDP: who am I, how many are we?
    G, gen = 8 * world_size, torch.Generator().manual_seed(args.seed)  # DDP: same batches on all
    batches = [(torch.randn(G, 20, generator=gen), torch.randint(8, (G,), generator=gen))
               for _ in range(args.steps)]
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = UnevenNet().to(env.device)
    reference = copy.deepcopy(model)  # the unsharded optimizer, given the very same gradients
    full = optimizer_cls(groups(reference, hyper["lr"]), **hyper)
    sharded = ShardedOptimizer(groups(model, hyper["lr"]), optimizer_cls, **hyper)
    worst = 0.0
    for x, y in batches:
        x, y = x.to(env.device), y.to(env.device)
        sharded.zero_grad()
        F.cross_entropy(model(x[rank::world_size]), y[rank::world_size]).backward()  # DDP: my rows
        for p in model.parameters():
            dist.all_reduce(p.grad)  # DDP: the sum of the ranks' gradients ...
            p.grad /= world_size  # ... and their average, as DDP leaves it
        for p, q in zip(model.parameters(), reference.parameters()):
            q.grad = p.grad.clone()
        sharded.step()
        full.step()
        for p, q in zip(model.parameters(), reference.parameters()):
            if not torch.allclose(p, q):
                worst = max(worst, (p - q).abs().max().item())
    return (worst, sharded.state_bytes(), state_bytes(full),
            len(sharded.local.param_groups) == len(full.param_groups))


def check(args, env):
    """ShardedOptimizer against AdamW and SGD with momentum, unsharded; True if it matches and
    shards."""
    rank, world_size = dist.get_rank(), dist.get_world_size()  # DDP: who am I, how many are we?
    # with one rank there is nothing to shard, and a missing broadcast goes unseen
    if world_size < 2:
        world.stop(env, "the check needs at least 2 ranks: "
                   "torchrun --standalone --nproc-per-node 2 labs/sharded_optimizer.py")
    optimizers = {"AdamW": (torch.optim.AdamW, {"lr": args.lr, "weight_decay": 0.01}),
                  "SGD": (torch.optim.SGD, {"lr": 10 * args.lr, "momentum": 0.9})}
    results = {name: compare(args, env, cls, **hyper) for name, (cls, hyper) in optimizers.items()}
    worst = torch.tensor([diff for diff, _, _, _ in results.values()], device=env.device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # DDP: the worst rank decides, everywhere
    differs = [name for name, diff in zip(results, worst.tolist()) if diff != 0.0]
    _, mine, full, _ = results["AdamW"]
    kept = torch.tensor(float(all(k for _, _, _, k in results.values())), device=env.device)
    dist.all_reduce(kept, op=dist.ReduceOp.MIN)  # ZeRO: kept on every rank?
    shares = [None] * world_size
    dist.all_gather_object(shares, mine)  # ZeRO: every rank's optimizer state, on every rank
    ratios = [b / (full / world_size) for b in shares]
    sharded_ok = all(0.9 <= r <= 1.1 for r in ratios)
    log = JsonLog(args.log_json if rank == 0 else None, world_size=world_size)  # DDP: rank 0 logs
    log.write("check", steps=args.steps, max_abs_diff=worst.max().item(), equal=not differs,
              differs=differs, state_bytes=shares, full_state_bytes=full,
              ratios=[round(r, 4) for r in ratios], groups_kept=bool(kept.item()))
    if rank == 0:  # DDP: one rank prints
        n = sum(p.numel() for p in UnevenNet().parameters())
        print(f"{n:,} parameters in {len(list(UnevenNet().parameters()))} tensors, "
              f"{world_size} ranks, {args.steps} steps each of AdamW and of SGD with momentum")
        for name, diff in zip(results, worst.tolist()):
            print(f"parameters, {name}: "
                  + (f"ok, equal to the unsharded optimizer after every step on every rank "
                     f"(max |Δ| {diff:.1e})" if diff == 0 else
                     f"WRONG, they differ from the unsharded optimizer's (max |Δ| {diff:.1e})"))
        print(f"AdamW's state per rank: {', '.join(f'{b:,} B' for b in shares)}; "
              f"unsharded {full:,} B / {world_size} = {full / world_size:,.0f} B: "
              f"{', '.join(f'{r:.2f}' for r in ratios)} of it: "
              f"{'ok' if sharded_ok else 'WRONG, not 1/P'}")
        print("parameter groups: "
              + ("ok, each rank's optimizer keeps both" if kept.item() else
                 "WRONG, a rank's optimizer lost them: build it over self.mine"))
    return not differs and sharded_ok and bool(kept.item())


def setup(args):
    # DDP: rank and world size from torchrun, srun or mpirun; MASTER_ADDR/PORT set and checked.
    env = world.prepare(backend=args.backend, device=args.device)
    if env.device.type == "cuda":
        torch.cuda.set_device(env.device)  # DDP: one GPU per process, cuda:LOCAL_RANK
    dist.init_process_group(env.backend, rank=env.rank, world_size=env.world_size,  # DDP: join
                            timeout=timedelta(seconds=args.timeout))  # DDP: no endless waits
    return env


def cleanup():
    dist.destroy_process_group()  # DDP: leave the process group so every rank exits cleanly.


def main(args):
    env = setup(args)
    ok = check(args, env)
    cleanup()
    if not ok:
        raise SystemExit(1)  # DDP: every rank knows the verdict, so every rank exits non-zero


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5, help="steps to compare, per optimizer")
    parser.add_argument("--lr", type=float, default=0.01,
                        help="AdamW's learning rate (SGD's: 10 times it)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the weights and the batches")
    parser.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl", "mpi"])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--timeout", type=float, default=60, help="seconds a collective may wait")
    parser.add_argument("--log-json", default=None, help="rank 0 writes the check's record here")
    main(parser.parse_args())
