"""Beyond data parallelism: split the model itself, by layer (tensor) or by layer groups (pipeline).

    torchrun --standalone --nproc-per-node 2 solutions/labs/beyond_dp.py  # both parts
    torchrun --standalone --nproc-per-node 2 solutions/labs/beyond_dp.py --part pipeline \
        --micro-batches 1 2 4 8

Tensor parallelism (Megatron-LM's MLP, Shoeybi et al. 2019): the MLP ``Linear(d, 4d) → GELU →
Linear(4d, d)`` split over P ranks. Rank r holds a block of the first layer's output features
(rows of its weight matrix: a "column-parallel" layer, named after the columns of the output it
splits), so 4d/P of the hidden units, whole; and the same block of the second layer's input
features (columns of its weight: "row-parallel"), so a partial sum of every output number. One
all-reduce of the [batch, d] output in forward, and one of the input's gradient in backward: the
weights never travel. The check: the output, the input's gradient and every shard's weight gradient
equal the whole MLP's (torch.allclose).

Pipeline parallelism (GPipe, Huang et al. 2019): the layers in P groups, one per rank; the
batch in --micro-batches pieces. Each stage computes a micro-batch's forward as soon as the
stage before it sends the activations, and the backward in reverse order; the gradients of the
micro-batches add up. A stage waits while the pipeline fills and drains: the bubble,
(P - 1) / (M + P - 1) of the step in theory. Each rank times its own compute; rank 0 prints the
bubble each rank measured for each M, checks that the gradients equal one process's on the
whole batch, and logs every forward and backward interval (--log-json) for a timeline.

(Activate the course's environment first: source .venv/bin/activate.)
"""
import argparse
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dpcourse.lab import world
from dpcourse.lab.metrics import JsonLog


# ---------------------------------------------------------------- tensor parallelism
class CopyToRanks(torch.autograd.Function):
    """Megatron's f: forward, the input as it is (every rank has it); backward, the sum of the
    ranks' gradients of it (each rank's shard of the layer contributed a part)."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)  # DDP: every shard's part of the input's gradient, summed
        return grad


class SumOverRanks(torch.autograd.Function):
    """Megatron's g: forward, the sum of the ranks' partial outputs; backward, the gradient as it
    is (the sum passes it on to every part unchanged)."""

    @staticmethod
    def forward(ctx, partial):
        ### BEGIN SOLUTION (hint: return the sum of every rank's partial output, on every rank: one collective)
        total = partial.clone()  # a function should not change its input in place
        dist.all_reduce(total)  # DDP: the partial sums of the row-parallel layer, added up
        return total
        ### END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        return grad


class TensorParallelMLP(nn.Module):
    """This rank's shard of ``full`` (Linear(d, 4d), GELU, Linear(4d, d)): a block of about 4d/P
    hidden units."""

    def __init__(self, full, rank, world_size):
        super().__init__()
        up, down = full[0], full[2]
        bounds = [round(i * up.out_features / world_size) for i in range(world_size + 1)]
        mine = slice(bounds[rank], bounds[rank + 1])  # DDP: my block of the hidden units
        rows = mine.stop - mine.start
        self.up = nn.Linear(up.in_features, rows)  # column-parallel: my hidden units, whole
        self.down = nn.Linear(rows, down.out_features, bias=False)  # row-parallel: a partial sum
        with torch.no_grad():
            self.up.weight.copy_(up.weight[mine])
            self.up.bias.copy_(up.bias[mine])
            self.down.weight.copy_(down.weight[:, mine])
        self.bias = nn.Parameter(down.bias.detach().clone())  # added once, after the sum
        self.mine = mine

    def forward(self, x):
        x = CopyToRanks.apply(x)  # DDP: backward all-reduces the input's gradient
        partial = self.down(F.gelu(self.up(x)))
        return SumOverRanks.apply(partial) + self.bias  # DDP: forward all-reduces the output


def tensor_part(args, env, log):
    # DDP: which shard is mine, of how many
    rank, world_size = dist.get_rank(), dist.get_world_size()
    d = args.width
    torch.manual_seed(args.seed)  # the whole MLP, the same on every rank: the reference
    full = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)).to(env.device)
    shard = TensorParallelMLP(full, rank, world_size).to(env.device)
    gen = torch.Generator().manual_seed(args.seed)  # DDP: the same input on every rank
    x = torch.randn(args.batch_size, d, generator=gen).to(env.device)
    x_full, x_tp = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_full, y_tp = full(x_full), shard(x_tp)
    y_full.square().mean().backward()
    y_tp.square().mean().backward()
    checks = {
        "output": (y_tp, y_full),
        "input's gradient": (x_tp.grad, x_full.grad),
        "first weight's gradient (my rows)": (shard.up.weight.grad,
                                              full[0].weight.grad[shard.mine]),
        "second weight's gradient (my columns)": (shard.down.weight.grad,
                                                  full[2].weight.grad[:, shard.mine]),
        "output bias's gradient": (shard.bias.grad, full[2].bias.grad),
    }
    mine = [name for name, (a, b) in checks.items()
            if not torch.allclose(a, b, rtol=1e-4, atol=1e-6)]
    everyone = [None] * world_size
    dist.all_gather_object(everyone, mine)  # DDP: what differs on each rank, on every rank
    wrong = [f"{name} (rank {r})" for r, names in enumerate(everyone) for name in names]
    params = sum(p.numel() for p in full.parameters())
    sent = 2 * args.batch_size * d  # one all-reduce of [batch, d] forward, one backward
    log.write("tensor", width=d, batch=args.batch_size, params=params,
              shard_params=sum(p.numel() for p in shard.parameters()),
              wrong=wrong, allreduce_numbers_tp=sent, allreduce_numbers_dp=params)
    if rank == 0:  # DDP: one rank prints
        print(f"tensor parallel MLP {d} → {4 * d} → {d} on {world_size} ranks: each holds "
              f"{sum(p.numel() for p in shard.parameters()):,} of {params:,} weights")
        print(f"  all-reduced per step: {sent:,} numbers (activations), against {params:,} "
              "(the gradients) under data parallelism")
        if wrong:
            print(f"  WRONG: {', '.join(wrong)} differ from the whole MLP's")
        print(f"  output and gradients equal to the whole MLP's on every rank: "
              f"{'ok' if not wrong else 'WRONG'}")
    return not wrong


# ---------------------------------------------------------------- pipeline parallelism
def stage_layers(args, rank, world_size, device):
    """The whole model's layers (seeded: every rank builds the same), and this rank's group of
    them."""
    torch.manual_seed(args.seed)
    layers = [nn.Sequential(nn.Linear(args.width, args.width), nn.Tanh())
              for _ in range(args.layers)]
    per = args.layers // world_size  # DDP: my group of consecutive layers
    return (nn.Sequential(*layers).to(device),
            nn.Sequential(*layers[rank * per:(rank + 1) * per]).to(device))


def gpipe_step(stage, x, y, M, rank, world_size, clock):
    """One GPipe step: M micro-batches forward through the stages, then backward in reverse.
    Returns this stage's compute intervals (kind, micro-batch, start, end), on ``clock``."""
    first, last = rank == 0, rank == world_size - 1
    xs, ys = x.chunk(M), y.chunk(M)
    inputs, outputs, intervals = [], [], []
    for m in range(M):  # forward: fill the pipeline
        if first:
            h = xs[m]
        else:
            h = torch.empty_like(xs[m])
            dist.recv(h, src=rank - 1)  # DDP: the activations of the stage before
            h.requires_grad_()
        start = clock()
        out = stage(h)
        if last:
            out = F.mse_loss(out, ys[m]) / M  # the micro-batches' losses add up to the batch's mean
        intervals.append(("F", m, start, clock()))
        if not last:
            dist.send(out.detach(), dst=rank + 1)  # DDP: on to the next stage
        inputs.append(h)
        outputs.append(out)
    for m in reversed(range(M)):  # backward: drain it
        if last:
            grad = None
        else:
            grad = torch.empty_like(outputs[m])
            dist.recv(grad, src=rank + 1)  # DDP: the gradient of my output, from the stage after
        start = clock()
        outputs[m].backward(grad)  # the stage's weight gradients add up over the micro-batches
        intervals.append(("B", m, start, clock()))
        if not first:
            dist.send(inputs[m].grad, dst=rank - 1)  # DDP: my input's gradient, to the stage before
    return intervals


def pipeline_part(args, env, log):
    rank, world_size = dist.get_rank(), dist.get_world_size()  # DDP: which stage am I, of how many
    if args.layers % world_size:
        world.stop(env, f"--layers {args.layers} does not split into {world_size} equal stages")
    whole, stage = stage_layers(args, rank, world_size, env.device)
    gen = torch.Generator().manual_seed(args.seed)
    x = torch.randn(args.batch_size, args.width, generator=gen).to(env.device)
    y = torch.randn(args.batch_size, args.width, generator=gen).to(env.device)
    F.mse_loss(whole(x), y).backward()  # one process, the whole batch: the gradients to match
    ok, rows = True, []
    for M in [1] + args.micro_batches:  # the first run warms up (and is not reported)
        stage.zero_grad()
        dist.barrier()  # DDP: every stage starts the step together
        t0 = time.perf_counter()
        intervals = gpipe_step(stage, x, y, M, rank, world_size, lambda: time.perf_counter() - t0)
        dist.barrier()  # DDP: the step ends when the last stage is done
        step_s = time.perf_counter() - t0
        busy = sum(end - start for _, _, start, end in intervals)
        mine = [p.grad for p in stage.parameters()]
        per = args.layers // world_size
        ref = [p.grad for p in whole[rank * per:(rank + 1) * per].parameters()]
        same = all(torch.allclose(a, b, rtol=1e-4, atol=1e-7) for a, b in zip(mine, ref))
        everyone = [None] * world_size
        # DDP: every stage's timings and verdict, on every rank
        dist.all_gather_object(everyone, {"rank": rank, "busy_s": busy, "intervals": intervals,
                                          "same": same})
        ok = ok and all(r["same"] for r in everyone)
        rows.append((M, step_s, everyone))
    for M, step_s, everyone in rows[1:]:
        bubble = [1 - r["busy_s"] / step_s for r in everyone]
        theory = (world_size - 1) / (M + world_size - 1)
        log.write("pipeline", micro_batches=M, stages=world_size, step_s=round(step_s, 5),
                  bubble=[round(b, 4) for b in bubble], bubble_theory=round(theory, 4),
                  intervals=[r["intervals"] for r in everyone])
        if rank == 0:  # DDP: one rank prints
            print(f"pipeline, {world_size} stages, {M} micro-batch{'es' if M > 1 else ''}: step "
                  f"{step_s * 1000:6.1f} ms; idle {', '.join(f'{b:.0%}' for b in bubble)} of it "
                  f"(stage 0, 1, ...); GPipe's bubble (P-1)/(M+P-1) = {theory:.0%}")
    if rank == 0:
        print(f"  gradients equal to one process's on the whole batch, for every M: "
              f"{'ok' if ok else 'WRONG'}")
    return ok


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
    env = setup(args)
    if env.world_size < 2:
        world.stop(env, "split a model over at least 2 ranks: "
                   "torchrun --standalone --nproc-per-node 2 labs/beyond_dp.py")
    # DDP: rank 0 logs
    log = JsonLog(args.log_json if env.rank == 0 else None, world_size=env.world_size)
    ok = True
    if args.part in ("tensor", "both"):
        ok = tensor_part(args, env, log) and ok
    if args.part in ("pipeline", "both"):
        ok = pipeline_part(args, env, log) and ok
    cleanup()
    if not ok:
        raise SystemExit(1)  # DDP: every rank knows the verdict, so every rank exits non-zero


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", default="both", choices=["tensor", "pipeline", "both"],
                        help="which to run")
    parser.add_argument("--width", type=int, default=1024,
                        help="d: the MLP's (and each layer's) width")
    parser.add_argument("--layers", type=int, default=8,
                        help="pipeline: layers, split into equal stages")
    parser.add_argument("--batch-size", type=int, default=512, help="the whole batch")
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4, 8],
                        help="pipeline: M to try")
    parser.add_argument("--seed", type=int, default=0, help="seeds the weights and the data")
    parser.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl", "mpi"])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--timeout", type=float, default=60, help="seconds a collective may wait")
    parser.add_argument("--log-json", default=None,
                        help="rank 0 writes one JSON line per part and M")
    main(parser.parse_args())
