"""all_reduce built from two other collectives: reduce_scatter, then all_gather.

    torchrun --standalone --nproc-per-node 3 labs/compose_allreduce.py --check

(Activate the course's environment first: source .venv/bin/activate.) --check runs
all_reduce_by_parts on tensors of awkward sizes (1 element, sizes that the world size does not
divide, a 2-D tensor) in float32 and float64, and compares every rank's result with
dist.all_reduce. Rank 0 prints one verdict line and, with --log-json, writes it as JSON.

Why it matters: this is how the bandwidth-optimal ring all-reduce works (notebook 04), and how
sharded data parallelism (ZeRO, FSDP, notebook 13) splits the same all-reduce in two halves.
"""
import argparse
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from dpcourse.lab import world
from dpcourse.lab.metrics import JsonLog


def all_reduce_by_parts(t):
    """Sum ``t`` over all ranks, in place, like ``dist.all_reduce(t)``, with one reduce_scatter
    and one all_gather. Works for any shape and any number of elements."""
    world_size = dist.get_world_size()  # DDP: P, the number of chunks
    # YOUR CODE HERE
    # Hint: reduce_scatter needs P equal chunks: copy t, flattened, into a zero-padded
    #       buffer whose length P divides;
    #       dist.reduce_scatter_single leaves rank r the sum of chunk r;
    #       dist.all_gather_single then collects the P summed chunks on every rank;
    #       write the first t.numel() values back into t
    raise NotImplementedError("Exercise: see the hint above")


# ---------------------------------------------------------------- the check
COUNTED = ("reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor",
           "all_gather", "all_gather_single", "all_gather_into_tensor")


class Calls:
    """Count the collectives all_reduce_by_parts calls, and refuse dist.all_reduce inside it."""

    def __init__(self):
        self.counts = dict.fromkeys(COUNTED, 0)

    def __enter__(self):
        self.saved = {name: getattr(dist, name) for name in (*COUNTED, "all_reduce")}
        for name in COUNTED:
            setattr(dist, name, self._counting(name, self.saved[name]))
        dist.all_reduce = self._refuse
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(dist, name, fn)

    def _counting(self, name, fn):
        def wrapper(*args, **kwargs):
            self.counts[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    @staticmethod
    def _refuse(*args, **kwargs):
        raise AssertionError("it calls dist.all_reduce itself: "
                             "compose it from reduce_scatter and all_gather")

    def used(self, prefix):
        return sum(n for name, n in self.counts.items() if name.startswith(prefix))


def cases(world_size):
    """(shape, dtype): sizes P does and does not divide, one element, fewer elements than ranks."""
    sizes = sorted({1, world_size - 1, world_size, world_size + 1, 7, 1000, 1001, 4099} - {0})
    shapes = [(n,) for n in sizes] + [(3, 5)]
    return [(shape, dtype) for dtype in (torch.float32, torch.float64) for shape in shapes]


def diagnose(got, before, expected, world_size):
    """What went wrong on this rank, in words (None: right)."""
    if got.shape != expected.shape:
        return f"shape {tuple(got.shape)} instead of {tuple(expected.shape)}"
    if torch.allclose(got, expected, rtol=1e-6, atol=1e-6):
        return None
    if torch.equal(got, before):
        return ("t still holds this rank's own values: did the summed chunks come back "
                "(all_gather), and go into t itself, in place (t.copy_(...))?")
    if torch.allclose(got * world_size, expected, rtol=1e-6, atol=1e-6):
        return "the average, not the sum (all_reduce's default op is SUM)"
    wrong = (~torch.isclose(got, expected, rtol=1e-6, atol=1e-6)).nonzero()
    first = wrong[0].tolist()
    return (f"{len(wrong)} of {got.numel()} values differ from dist.all_reduce's, the first at "
            f"index {first}: {got[tuple(first)].item():.4g} "
            f"instead of {expected[tuple(first)].item():.4g}")


def check(args, env, log):
    """Every case on every rank against dist.all_reduce; rank 0 prints one verdict. True if
    right."""
    rank, world_size = dist.get_rank(), dist.get_world_size()  # DDP: who am I, how many are we?
    gen = torch.Generator().manual_seed(args.seed + rank)  # DDP: different data on each rank
    todo, problem = cases(world_size), None
    with Calls() as calls:
        for i, (shape, dtype) in enumerate(todo):
            t = torch.randn(shape, generator=gen, dtype=dtype).to(env.device)
            before, expected = t.clone(), t.clone()
            calls.saved["all_reduce"](expected)  # DDP: the reference: torch's own all_reduce
            try:
                all_reduce_by_parts(t)
                why = diagnose(t, before, expected, world_size)
            except NotImplementedError as err:  # the learner's stub: every rank meets it
                line = traceback.extract_tb(err.__traceback__)[-1].lineno
                if rank == 0:
                    print(f"all_reduce_by_parts: not done yet — NotImplementedError: {err} "
                          f"(line {line})", flush=True)
                return False
            except (RuntimeError, ValueError, AssertionError) as err:  # the same on every rank
                why = f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:160]}"
                if t.numel() % world_size:  # the usual cause: chunks of unequal sizes
                    why += (f" ({t.numel()} values do not split evenly over {world_size} ranks: "
                            f"pad t to a multiple of {world_size} first, and cut the padding off "
                            "at the end)")
                problem = (i, why)
                break
            # DDP: the first rank (if any) that got this case wrong, known to every rank
            bad = torch.tensor([rank if why else world_size], device=env.device)
            calls.saved["all_reduce"](bad, op=dist.ReduceOp.MIN)
            if bad.item() < world_size:
                why_all = [None] * world_size
                dist.all_gather_object(why_all, why)  # DDP: rank 0 learns the words
                problem = (i, f"rank {bad.item()}: {why_all[bad.item()]}")
                break
        if problem is None and (calls.used("reduce_scatter") == 0 or calls.used("all_gather") == 0):
            missing = " and ".join(n for n in ("reduce_scatter", "all_gather")
                                   if calls.used(n) == 0)
            problem = (None, f"right values, but no {missing} call: "
                             "compose it from reduce_scatter and all_gather")
    per_call = {n: c // len(todo) for n, c in calls.counts.items() if c}
    if problem is None:
        verdict = (f"ok — {len(todo)} cases (sizes 1 to 4099, a 2-D tensor; float32 and float64) "
                   f"equal dist.all_reduce on {world_size} rank{'s' * (world_size > 1)}; per call: "
                   + ", ".join(f"{n} ×{c}" for n, c in per_call.items()))
    else:
        i, why = problem
        where = ("" if i is None else
                 f"shape {tuple(todo[i][0])}, {str(todo[i][1]).removeprefix('torch.')}: ")
        verdict = f"WRONG — {where}{why}"
    if rank == 0:  # DDP: one rank prints and logs
        print(f"all_reduce_by_parts: {verdict}", flush=True)
    log.write("check", ok=problem is None, verdict=verdict, cases=len(todo), calls=per_call)
    return problem is None


# ---------------------------------------------------------------- set-up and main
def setup(args):
    # DDP: rank and world size from torchrun, srun or mpirun; MASTER_ADDR/PORT set and checked.
    env = world.prepare(backend=args.backend, device="cpu" if args.backend == "gloo" else "auto")
    if env.device.type == "cuda":
        torch.cuda.set_device(env.device)  # DDP: one GPU per process, cuda:LOCAL_RANK
    dist.init_process_group(env.backend, rank=env.rank, world_size=env.world_size,  # DDP: join
                            timeout=timedelta(seconds=args.timeout))  # DDP: no endless waits
    return env


def cleanup():
    dist.destroy_process_group()  # DDP: leave the process group so every rank exits cleanly.


def main(args):
    env = setup(args)
    # DDP: rank 0 logs
    log = JsonLog(args.log_json if env.rank == 0 else None, world_size=env.world_size)
    ok = check(args, env, log)
    cleanup()
    if not ok:
        raise SystemExit(1)  # DDP: every rank knows the verdict, so every rank exits non-zero


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="compare with dist.all_reduce (the default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl", "auto"],
                        help="gloo on CPU tensors (default); nccl needs one GPU per rank")
    parser.add_argument("--timeout", type=float, default=30, help="seconds a collective may wait")
    parser.add_argument("--log-json", default=None, help="rank 0 writes its verdict here")
    main(parser.parse_args())
