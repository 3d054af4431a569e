"""The checks of the course's labs that are too long to read beside the lesson: the grader of
``labs/ddp_by_hand.py --check`` (notebook 05), which trains each hand-made DDP on a model built to
trip one and compares it with one process on the whole global batch; and the referee of a lab's
``evaluate`` (notebook 05's exercise 3), which shows what every rank, not only rank 0, got.

The lab keeps the lesson (its three DDPs, and the lines that launch them); this module keeps the
referee: the model with a frozen weight, a tied weight and a skipped layer, the watch that notices
an all-reduce that would stall backward, and the verdict that rank 0 prints.
"""
from __future__ import annotations

import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dpcourse.lab import world


def label(name, model):
    """'BucketDDP (4 buckets)': a variant's name in the table and in --check's lines."""
    if not hasattr(model, "buckets"):
        return name
    n = len(model.buckets)
    each = ", 1 parameter each" if 1 < n == len(model.params) else ""
    return f"{name} ({n} bucket{'s' if n > 1 else ''}{each})"


def max_abs_diff(a, b):
    """The largest |a - b| over two state dicts (parameters and buffers); NaN counts as inf."""
    return torch.stack([(a[k] - b[k]).abs().max() for k in a]).max().nan_to_num(torch.inf).item()


class TinyNet(nn.Module):
    """Built to trip a hand-made DDP: a frozen weight, one weight used by two layers, a layer
    that ``forward(x, extra=False)`` skips (no gradient in that step), and a buffer."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.frozen = nn.Linear(16, 16)
        self.frozen.weight.requires_grad_(False)  # no gradient: no hook, no all-reduce
        self.hidden = nn.Linear(16, 16)
        self.again = nn.Linear(16, 16, bias=False)
        self.again.weight = self.hidden.weight  # tied: one Parameter, one .grad, two layers
        self.extra = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)
        self.register_buffer("scale", torch.rand(16) + 0.5)

    def forward(self, x, extra=True):
        h = torch.tanh(self.frozen(torch.tanh(self.embed(x) * self.scale)))
        h = torch.tanh(self.again(torch.tanh(self.hidden(h))))
        if extra:
            h = h + torch.tanh(self.extra(h))
        return self.head(h)


class StallWatch:
    """Notes what would stall backward in the hooks: an all-reduce without ``async_op=True``,
    or a ``wait()`` on one before backward has finished (the check wraps ``dist.all_reduce``)."""

    def __init__(self):
        self.in_backward, self.stalls, self.real = False, set(), dist.all_reduce

    def __enter__(self):
        def all_reduce(tensor, *args, async_op=False, **kwargs):
            if not async_op:
                if self.in_backward:
                    self.stalls.add("a blocking all_reduce in a hook (it returns no work, and "
                                    "backward waits for it): use async_op=True")
                return self.real(tensor, *args, **kwargs)
            return Watched(self.real(tensor, *args, async_op=True, **kwargs), self)
        dist.all_reduce = all_reduce
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self.real


class Watched:
    """An all-reduce's work handle that tells its StallWatch when it is waited for too early."""

    def __init__(self, work, watch):
        self.work, self.watch = work, watch

    def wait(self, *args):
        if self.watch.in_backward:
            self.watch.stalls.add("wait() on an all-reduce inside backward (backward then waits "
                                  "for every sum): leave the waiting to "
                                  "finish_gradient_synchronization")
        return self.work.wait(*args)

    def __getattr__(self, name):
        return getattr(self.work, name)


def hand_made_ddp(variants, env, seed=0, steps=4, lr=0.2, tolerance=1e-5) -> bool:
    """Each hand-made DDP of ``variants`` ([(name, wrap)], ``wrap(module)`` the wrapped module)
    against one process trained on the whole global batch; rank 0 prints one line per variant (ok,
    WRONG and why, or not done yet); True, on every rank, if all of them agree."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if world_size < 2:  # with one rank, a sum, a mean and doing nothing all look right
        world.stop(env, "--check needs at least 2 ranks (with 1, a missing all-reduce goes "
                   "unseen): torchrun --standalone --nproc-per-node 2 "
                   "labs/ddp_by_hand.py --check")
    G, gen = 6 * world_size, torch.Generator().manual_seed(seed)  # the same batches on every rank
    batches = [(torch.randn(G, 8, generator=gen).to(env.device),
                torch.randint(4, (G,), generator=gen).to(env.device)) for _ in range(steps)]
    torch.manual_seed(seed)  # rank 0's initial weights, which every rank can rebuild
    one = TinyNet().to(env.device)
    optimizer, after = torch.optim.SGD(one.parameters(), lr=lr), []
    for step, (x, y) in enumerate(batches):  # one process, the whole global batch
        optimizer.zero_grad()
        F.cross_entropy(one(x, extra=step % 2 == 1), y).backward()
        optimizer.step()
        after.append({k: v.clone() for k, v in one.state_dict().items()})

    all_ok = True
    for name, wrap in variants:
        torch.manual_seed(seed + rank)  # a different init on each rank, on purpose
        model = wrap(TinyNet().to(env.device))
        name = label(name, model)
        optimizer, diff, idle = torch.optim.SGD(model.parameters(), lr=lr), 0.0, set()
        try:
            with StallWatch() as watch:
                for step, (x, y) in enumerate(batches):
                    optimizer.zero_grad()
                    shard = slice(rank, None, world_size)  # this rank's rows of the global batch
                    watch.in_backward = True
                    F.cross_entropy(model(x[shard], extra=step % 2 == 1), y[shard]).backward()
                    watch.in_backward = False
                    for i, b in enumerate(getattr(model, "buckets", [])):  # full, yet not sent?
                        if b.work is None and all(p.grad is not None for p in b.params):
                            idle.add(i)
                    model.finish_gradient_synchronization()  # .grad = the average
                    optimizer.step()
                    diff = max(diff, max_abs_diff(model.module.state_dict(), after[step]))
        except NotImplementedError as err:  # a stub in the learner's copy: every rank meets it
            line = traceback.extract_tb(err.__traceback__)[-1].lineno
            if rank == 0:
                print(f"{name}: not done yet — NotImplementedError: {err} (line {line})",
                      flush=True)
            all_ok = False
            continue
        worst = torch.tensor([diff, len(idle)], device=env.device)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # the worst rank decides, everywhere
        diff, n_idle = worst[0].item(), int(worst[1].item())
        if watch.stalls:  # every rank runs the same code, so every rank saw the same stalls
            why = "; ".join(sorted(watch.stalls))
        elif n_idle:
            why = (f"{n_idle} full bucket(s) had no all-reduce work when backward ended: start a "
                   "bucket's all-reduce with async_op=True in the hook that fills it, and keep "
                   "its work in bucket.work")
        elif not diff <= tolerance:
            why = f"weights differ from one process by up to {diff:.2g} (tolerance {tolerance:g})"
        else:
            why = None
        all_ok = all_ok and why is None
        if rank == 0:  # one rank prints
            verdict = f"ok (max |Δ| {diff:.0e})" if why is None else f"WRONG — {why}"
            print(f"{name}: {verdict}", flush=True)
    return all_ok


def evaluate_on_every_rank(lab_path: str, log_json: str | None = None) -> list:
    """Notebook 05's referee of a lab's ``evaluate(model, test_set, device)``: every rank calls it
    on the same model (seed 0, width 4) and the whole FashionMNIST test set, and rank 0 logs what
    each rank got, [loss, accuracy, images], in one record (``{"event": "evaluate", "ranks":
    [...]}``). A lab that sums the totals onto rank 0 only (a reduce, not an all-reduce) leaves the
    other ranks with numbers of their own: an accuracy that only rank 0 can trust."""
    import importlib.util

    from dpcourse.lab.data import InMemoryFashionMNIST
    from dpcourse.lab.metrics import JsonLog
    from dpcourse.lab.models import FashionCNN

    env = world.setup(backend="gloo", device="cpu")
    spec = importlib.util.spec_from_file_location("lab_under_test", lab_path)
    lab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lab)
    torch.manual_seed(0)
    model = FashionCNN(4, "none")
    got = [float(v) for v in lab.evaluate(model, InMemoryFashionMNIST(train=False), env.device)]
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, got)  # what each rank's evaluate returned, on every rank
    if env.rank == 0:
        JsonLog(log_json).write("evaluate", ranks=seen)
    world.cleanup()
    return seen


if __name__ == "__main__":  # torchrun .../dpcourse/lab/checks.py evaluate LAB [--log-json PATH]
    import argparse

    p = argparse.ArgumentParser(description="the referees of the course's labs")
    p.add_argument("what", choices=["evaluate"])
    p.add_argument("lab", help="the lab file whose evaluate() every rank calls")
    p.add_argument("--log-json", default=None, help="rank 0 writes its record here")
    a = p.parse_args()
    evaluate_on_every_rank(a.lab, a.log_json)
