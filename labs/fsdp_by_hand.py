"""FSDP built by hand (ZeRO-3): every rank keeps a shard of every weight, and a layer's whole
weight exists only while that layer computes.

    torchrun --standalone --nproc-per-node 2 labs/fsdp_by_hand.py         # check it
    torchrun --standalone --nproc-per-node 3 labs/fsdp_by_hand.py         # padded shards
    torchrun --standalone --nproc-per-node 2 labs/fsdp_by_hand.py --compute-dtype bfloat16
    torchrun --standalone --nproc-per-node 2 labs/fsdp_by_hand.py --prefetch      # beyond

``shard_model(model)`` replaces every module that has weights of its own by a ``ShardedLayer``:

- at start, each of the layer's weights is flattened, padded to a multiple of P, and cut in P
  pieces; rank r keeps piece r (a ``Parameter``: the optimizer steps only that) and the whole
  weight is dropped;
- just before the layer computes, ``Gather`` all-gathers the pieces into the whole weight, and
  the layer computes with it; it is freed as soon as the forward is over: autograd would keep it
  for backward, but ``saved_tensors_hooks`` store *how to get it back* instead, and
- in backward, the hook all-gathers it again, just before the layer's backward needs it;
- ``Gather``'s backward reduce-scatters the whole weight's gradient: rank r gets the average over
  the ranks of piece r only, the gradient of its own shard (exercise).

With --prefetch, the step beyond: in forward, a layer starts the next layer's all-gathers
(``async_op=True``) before it computes, and the next layer waits for them instead of gathering.
The network works while the processor computes, at the price of two layers' whole weights alive at
once. (FSDP2 does the same in backward, for the layer before.) The check trains the model that way
too, and prints how many numbers were whole at most, and how far its weights end from the others'.

With --compute-dtype bfloat16, the pieces are cast before they are sent and the layer computes in
bfloat16, while the shards the optimizer steps (the master weights) and the gradients' reduction
stay in float32: what FSDP2's ``MixedPrecisionPolicy(param_dtype=torch.bfloat16,
reduce_dtype=torch.float32)`` does.

The check: the course CNN, in float64, from the same weights on the same FashionMNIST batches,
trained --steps steps of SGD with momentum three ways: in one process on the whole global batch,
with ``shard_model`` on every rank's share of it, and with FSDP2's ``fully_shard``. Rank 0 prints
how far each one's weights end from the one process's and what each rank holds; the verdict is
ok, or WRONG with the reason (exit 1 on every rank).

(Activate the course's environment first: source .venv/bin/activate.)
"""
import argparse
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from dpcourse.lab import world
from dpcourse.lab.data import InMemoryFashionMNIST
from dpcourse.lab.metrics import JsonLog
from dpcourse.lab.models import FashionCNN


class Gather(torch.autograd.Function):
    """Forward: the whole weight, from every rank's piece. Backward: this rank's piece of the
    whole weight's gradient, averaged over the ranks."""

    @staticmethod
    def forward(ctx, shard, shape, dtype, started=None):
        ctx.shard_dtype = shard.dtype
        whole = finish(started, shard, dtype)
        return whole[:shape.numel()].view(shape)  # the padding at the end is not the weight's

    @staticmethod
    def backward(ctx, grad):
        world_size = dist.get_world_size()  # FSDP: P pieces
        flat = grad.to(ctx.shard_dtype).flatten()  # the reduction in the master weights' dtype
        per_rank = -(-flat.numel() // world_size)  # the piece's length: numel / P, rounded up
        flat = F.pad(flat, (0, per_rank * world_size - flat.numel()))  # the padding's zeros
        # YOUR CODE HERE
        # Hint: every rank holds the whole weight's gradient
        #       (flat, P pieces of per_rank numbers);
        #       rank r needs the average over the ranks of piece r only:
        #       dist.reduce_scatter_single into a new tensor of per_rank numbers, then
        #       divide by world_size
        raise NotImplementedError("Exercise: see the hint above")
        return piece, None, None, None  # the gradient of the shard; the rest have none


def gather_flat(shard, dtype, async_op=False):
    """All the ranks' pieces, one after the other: the whole weight, flattened and padded (with
    async_op, started: (the collective's Work, the tensor it fills))."""
    # FSDP: cast before sending (bfloat16: half the bytes); a copy when the gather runs on while
    # the program goes on: the optimizer may change the shard before gloo has read it
    piece = shard.detach().to(dtype, copy=async_op)
    whole = piece.new_empty(piece.numel() * dist.get_world_size())  # FSDP: room for P pieces
    work = dist.all_gather_single(whole, piece, async_op=async_op)  # FSDP: every rank's piece
    return (work, whole) if async_op else whole


def finish(started, shard, dtype):
    """The whole weight: from a gather started earlier (--prefetch, or None), once it has
    arrived; gathered now if none was started, or if the optimizer has changed the shard since
    (a gather that no layer took in time: its numbers are the step before's)."""
    if started is not None:
        work, whole, version = started
        work.wait()  # FSDP: prefetch: it has usually arrived while the layer before computed
        if version == shard._version:  # the shard as it was sent: not stepped since
            return whole
    return gather_flat(shard, dtype)


class ShardedLayer(nn.Module):
    """One layer whose own weights are kept in P pieces; whole only while it computes."""

    def __init__(self, layer, compute_dtype=None):
        super().__init__()
        rank, world_size = dist.get_rank(), dist.get_world_size()  # FSDP: my piece of P
        self.layer, self.shapes, self.shards = layer, {}, nn.ParameterDict()
        self.dtype = compute_dtype
        for name, p in list(layer.named_parameters(recurse=False)):
            per_rank = -(-p.numel() // world_size)
            flat = F.pad(p.detach().flatten(), (0, per_rank * world_size - p.numel()))
            # FSDP: keep piece `rank` only, as the parameter that the optimizer steps
            self.shards[name] = nn.Parameter(flat[rank * per_rank:(rank + 1) * per_rank].clone())
            self.shapes[name] = p.shape
            del layer._parameters[name]  # FSDP: the whole weight is gone from the layer
        self.whole = {}  # the whole weights while the layer computes
        # the layer that computes next in forward, if it is prefetched (--prefetch): in a tuple,
        # which nn.Module does not register (it is not this layer's submodule)
        self.after = ()
        # gathers the layer before started for this one: name → (Work, tensor, the shard's version)
        self.started = {}

    def prefetch(self):
        """Start this layer's gathers without waiting for them (called by the layer before)."""
        for name, shard in self.shards.items():
            if name in self.started:  # one started earlier that this layer never took: let it
                self.started.pop(name)[0].wait()  # land before its tensor is dropped
            # FSDP: prefetch: the gather runs while the layer before this one computes
            work, whole = gather_flat(shard, self.dtype or shard.dtype, async_op=True)
            self.started[name] = work, whole, shard._version

    def forward(self, *inputs):
        dtype = self.dtype or next(iter(self.shards.values())).dtype
        inputs = [x.to(dtype) if x.is_floating_point() else x for x in inputs]
        # FSDP: autograd keeps, for backward, a way to gather the weight again, not the weight
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            for name, shard in self.shards.items():
                # FSDP: all-gather the whole weight just before it is needed
                self.whole[name] = Gather.apply(shard, self.shapes[name], dtype,
                                                self.started.pop(name, None))
                setattr(self.layer, name, self.whole[name])
            for after in self.after:
                after.prefetch()  # FSDP: prefetch: the next layer's gathers start now
            out = self.layer(*inputs)
        for name in self.shards:  # FSDP: free the whole weights: nothing refers to them now
            setattr(self.layer, name, None)
        self.whole.clear()
        return out

    def pack(self, saved):
        """What autograd keeps for backward: a whole weight (or a view of it, such as the
        transposed matrix a linear layer saves) is kept as (its name, how to view it)."""
        for name, whole in self.whole.items():
            if saved.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr():
                return name, saved.dtype, saved.size(), saved.stride(), saved.storage_offset()
        return saved  # an input or an activation: kept as it is

    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        name, dtype, size, stride, offset = packed
        with torch.no_grad():  # FSDP: all-gather it again, just before this layer's backward
            return gather_flat(self.shards[name], dtype).as_strided(size, stride, offset)


def shard_model(model, compute_dtype=None, prefetch=False):
    """Every module with weights of its own, replaced by a ShardedLayer around it; with prefetch,
    each one told the layer that computes after it (in a Sequential, the next one registered)."""
    for name, child in list(model.named_children()):
        if any(True for _ in child.parameters(recurse=False)):
            setattr(model, name, ShardedLayer(child, compute_dtype))
        else:
            shard_model(child, compute_dtype)
    if prefetch:
        layers = [m for m in model.modules() if isinstance(m, ShardedLayer)]
        for first, second in zip(layers, layers[1:]):
            first.after = (second,)
    return model


def whole_weights(model):
    """Every weight whole, on every rank, under the names of the model before it was sharded."""
    state = {}
    for prefix, module in model.named_modules():
        if isinstance(module, ShardedLayer):
            for name, shard in module.shards.items():
                shape = module.shapes[name]
                # FSDP: the pieces gathered, for the comparison (every rank calls it)
                whole = gather_flat(shard, shard.dtype)[:shape.numel()].view(shape)
                state[f"{prefix}.{name}" if prefix else name] = whole
    return state


# ---------------------------------------------------------------- the check
def train(model, data, args, rank, world_size, lr):
    """--steps steps of SGD with momentum on this rank's rows of each global batch."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    G = args.global_batch_size
    for step in range(args.steps):
        x, y = data[torch.arange(step * G, (step + 1) * G)[rank::world_size]]  # FSDP: my rows
        x = x.to(next(model.parameters()).dtype)  # the model's own dtype (float64 here)
        optimizer.zero_grad()
        F.cross_entropy(model(x).to(torch.float64), y).backward()
        optimizer.step()
    return model


def max_diff(a, b):
    diffs = [(a[k].to(torch.float64) - b[k]).abs().max() for k in b]
    return torch.stack(diffs).max().nan_to_num(torch.inf).item()


def why_off(state, one, args, wrong):
    """The reason the hand-made weights ended elsewhere, from what they match instead."""
    if max_diff(state, wrong["sum"]) <= args.tolerance:
        return ("its weights are those of a step P times too large: the gradient was summed over "
                "the ranks, not averaged (divide the reduce-scatter's result by world_size)")
    if max_diff(state, one) > 1e3 or not all(torch.isfinite(v).all() for v in state.values()):
        return "its weights blew up: the gradient is far too large"
    return ("it did not end on the one process's weights: each rank must step the average over "
            "the ranks of its own piece of each gradient (piece r of reduce_scatter_single)")


def check(args):
    rank, world_size = dist.get_rank(), dist.get_world_size()  # FSDP: who am I, how many are we?
    first = args.steps * args.global_batch_size  # the images the steps use
    data = InMemoryFashionMNIST(args.data_root, train=True, first=first)

    def fresh(dtype=torch.float64):  # the same initial weights on every rank
        torch.manual_seed(args.seed)
        return FashionCNN().to(dtype)

    one = train(fresh(), data, args, 0, 1, args.lr).state_dict()  # one process, whole batches
    wrong = {"sum": train(fresh(), data, args, 0, 1, args.lr * world_size).state_dict()}
    hand = shard_model(fresh())
    whole_at_most = {"plain": most_whole(hand)}  # filled as it trains
    hand = train(hand, data, args, rank, world_size, args.lr)
    all_reduced = calls_all_reduce(hand, data, args, rank, world_size)  # one more step's backward
    held = sum(p.numel() for p in hand.parameters())
    state = whole_weights(hand)
    fsdp_state = fsdp2_weights(fresh(), data, args, rank, world_size)
    diffs = torch.tensor([max_diff(state, one), max_diff(fsdp_state, one),
                          max_diff(state, fsdp_state)], dtype=torch.float64)
    dist.all_reduce(diffs, op=dist.ReduceOp.MAX)  # FSDP: the worst rank's, on every rank
    ok = diffs[0].item() <= args.tolerance
    why = None if ok else why_off(state, one, args, wrong)
    if ok and all_reduced:  # the right numbers, at twice the traffic
        ok, why = False, ("the right weights, through an all_reduce: every rank gets the whole "
                          "sum to keep 1/P of it. reduce_scatter_single asks for this rank's piece "
                          "only: on NCCL, half an all-reduce's traffic (an all-reduce is a "
                          "reduce-scatter, then an all-gather: notebook 04)")
    mixed = args.compute_dtype and mixed_precision(fresh, data, args, rank, world_size, one)
    if args.prefetch:  # the same steps, each layer's gathers started by the layer before it
        ahead = shard_model(fresh(), prefetch=True)
        whole_at_most["prefetch"] = most_whole(ahead)
        ahead_diff = max_diff(whole_weights(train(ahead, data, args, rank, world_size, args.lr)),
                              state)
        prefetch = {"vs_plain": ahead_diff,
                    "whole_at_most": {k: v[0] for k, v in whole_at_most.items()}}
        if ok and ahead_diff != 0.0:  # the same numbers, gathered sooner: the same weights
            ok, why = False, f"with --prefetch the weights end {ahead_diff:.1e} from without it"
    total = sum(v.numel() for v in one.values())
    log = JsonLog(args.log_json if rank == 0 else None, world_size=world_size)  # FSDP: rank 0 logs
    log.write("check", steps=args.steps, hand_vs_one=diffs[0].item(),
              fsdp2_vs_one=diffs[1].item(), hand_vs_fsdp2=diffs[2].item(), params=total,
              held_by_rank0=held, tolerance=args.tolerance, ok=ok, why=why, mixed=mixed,
              prefetch=args.prefetch and prefetch)
    if rank == 0:  # FSDP: one rank prints
        print(f"{args.steps} steps of SGD, float64, {world_size} ranks, max |Δweight|:")
        print(f"  by hand vs one process  {diffs[0].item():.1e}")
        print(f"  FSDP2   vs one process  {diffs[1].item():.1e}")
        print(f"  by hand vs FSDP2        {diffs[2].item():.1e}")
        print(f"rank 0 holds {held:,} of the model's {total:,} numbers (padding included)")
        if mixed:
            print(f"--compute-dtype {args.compute_dtype}: max |Δweight| vs one process in "
                  f"float64 {mixed['hand']:.1e} (FSDP2 with the same policy: {mixed['fsdp2']:.1e})")
        if args.prefetch:
            most = prefetch["whole_at_most"]
            print(f"--prefetch: max |Δweight| vs without it {prefetch['vs_plain']:.1e}; weight "
                  f"numbers whole at once in a forward, at most: {most['prefetch']:,} (without: "
                  f"{most['plain']:,})")
        print("ok" if ok else f"WRONG — {why}")
    return ok


def calls_all_reduce(model, data, args, rank, world_size):
    """Whether one forward and backward of ``model`` on this rank's rows calls dist.all_reduce.
    The check watches the call itself: gloo builds reduce_scatter_single from an all-reduce
    inside, so neither the weights nor a profile of gloo's work can tell the two apart."""
    seen, real = [], dist.all_reduce
    dist.all_reduce = lambda *a, **k: (seen.append(1), real(*a, **k))[1]
    try:
        x, y = data[torch.arange(args.global_batch_size)[rank::world_size]]  # FSDP: my rows
        x = x.to(next(model.parameters()).dtype)
        F.cross_entropy(model(x).to(torch.float64), y).backward()
    finally:
        dist.all_reduce = real
    model.zero_grad()
    return bool(seen)


def most_whole(model):
    """[the most weight numbers whole at once while a layer computes its forward], filled as the
    model runs: this layer's whole weights, and those it started gathering for the next
    (--prefetch); padding not counted."""
    most = [0]

    def count(sharded):
        coming = [after.shapes[name].numel() for after in sharded.after for name in after.started]
        most[0] = max(most[0], sum(w.numel() for w in sharded.whole.values()) + sum(coming))

    for module in model.modules():
        if isinstance(module, ShardedLayer):
            module.layer.register_forward_pre_hook(lambda _, __, m=module: count(m))
    return most


def fsdp2_weights(model, data, args, rank, world_size, policy=None):
    """The same steps under FSDP2's fully_shard (with a MixedPrecisionPolicy, if given); the
    final weights, whole, on every rank."""
    mesh = init_device_mesh("cpu", (world_size,))  # FSDP: the ranks that share the weights
    mixed = {"mp_policy": policy} if policy else {}
    for layer in model.modules():
        if isinstance(layer, (nn.Conv2d, nn.Linear)):
            fully_shard(layer, mesh=mesh, **mixed)  # FSDP: FSDP2's own, layer by layer
    fully_shard(model, mesh=mesh, **mixed)  # FSDP: the rest (GroupNorm's weights) at the root
    trained = train(model, data, args, rank, world_size, args.lr).state_dict()
    return {k: v.full_tensor() if isinstance(v, DTensor) else v  # FSDP: gathered
            for k, v in trained.items()}


def mixed_precision(fresh, data, args, rank, world_size, one):
    """The same run with --compute-dtype, by hand and with FSDP2's MixedPrecisionPolicy: how far
    from the one process in float64 the float32 master weights end."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dtype = getattr(torch, args.compute_dtype)
    hand = train(shard_model(fresh(torch.float32), dtype), data, args, rank, world_size, args.lr)
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    fsdp_state = fsdp2_weights(fresh(torch.float32), data, args, rank, world_size, policy)
    diffs = torch.tensor([max_diff(whole_weights(hand), one), max_diff(fsdp_state, one)],
                         dtype=torch.float64)
    dist.all_reduce(diffs, op=dist.ReduceOp.MAX)  # FSDP: the worst rank's, on every rank
    return {"hand": diffs[0].item(), "fsdp2": diffs[1].item()}


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
    ok = check(args)
    cleanup()
    if not ok:
        raise SystemExit(1)  # every rank knows the verdict, so every rank exits non-zero


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--global-batch-size", type=int, default=48, help="split over the ranks")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--compute-dtype", default=None, choices=["bfloat16", "float16"],
                        help="also train with weights cast to this dtype for communication and "
                             "compute, float32 master weights")
    # In float64, the same sums in another order differ in the last bits only (about 1e-16 of a
    # weight); a gradient summed instead of averaged, or a piece another rank's, ends 1e-3 or
    # more away after the default 4 steps.
    parser.add_argument("--tolerance", type=float, default=1e-10,
                        help="the largest max |Δweight| vs one process that passes")
    parser.add_argument("--prefetch", action="store_true",
                        help="also train (in float64) with each layer's gathers started by the "
                             "layer before it")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-root", default=None, help="the folder that holds FashionMNIST/")
    parser.add_argument("--backend", default="gloo", choices=["gloo"],
                        help="this check runs on the CPU (gloo), float64 throughout")
    parser.add_argument("--device", default="cpu", choices=["cpu"])
    parser.add_argument("--timeout", type=float, default=60, help="seconds a collective may wait")
    parser.add_argument("--log-json", default=None, help="rank 0 writes its verdict here")
    main(parser.parse_args())
