"""Run under torchrun (2 or 3 ranks, gloo): labs/sharded_optimizer.py's ShardedOptimizer used as a
learner would use any torch optimizer in a project. Against the unsharded AdamW given the same
gradients, with two parameter groups (weight decay on the weight matrices only) and a StepLR: equal
parameters after every step, the scheduler's rate in the optimizer each rank steps, step(closure);
each rank saves its own shard, a fresh model and optimizer load it and go on as the original does;
another rank's shard is refused. Rank 0 prints "ok: ..." and the process exits 0 only if every part
holds on every rank. A group added after it was built is refused (its parameters would have no
owner)."""
import copy
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "solutions" / "labs"))
from sharded_optimizer import ShardedOptimizer, UnevenNet


def groups(model):
    return [{"params": [p for p in model.parameters() if p.dim() > 1], "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.dim() == 1], "weight_decay": 0.0}]


def train(model, opt, sched, batches, rank, world_size):
    """One step per batch on this rank's rows, the gradients averaged as DDP leaves them."""
    for x, y in batches:
        def closure():
            opt.zero_grad()
            loss = F.cross_entropy(model(x[rank::world_size]), y[rank::world_size])
            loss.backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world_size
            return loss
        if isinstance(opt, ShardedOptimizer):
            opt.step(closure)
        else:
            closure()
            opt.step()
        sched.step()


def main():
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8 * world_size, 20, generator=gen),
                torch.randint(8, (8 * world_size,), generator=gen)) for _ in range(6)]
    torch.manual_seed(0)
    model = UnevenNet()
    reference, restart = copy.deepcopy(model), None
    opt = ShardedOptimizer(groups(model), torch.optim.AdamW, lr=0.01)
    full = torch.optim.AdamW(groups(reference), lr=0.01)
    assert isinstance(opt, torch.optim.Optimizer), "not a torch.optim.Optimizer"
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0], opt.param_groups
    assert opt.param_groups[0]["betas"] == full.param_groups[0]["betas"], \
        "AdamW's defaults missing from param_groups"
    try:  # the owners are shared out when it is built: a group added later would never be stepped
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
        raise AssertionError("a parameter group added after the owners were shared out was taken")
    except NotImplementedError as err:
        assert "give it every parameter group then" in str(err), err
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    full_sched = torch.optim.lr_scheduler.StepLR(full, step_size=1, gamma=0.5)
    worst = 0.0
    for i, batch in enumerate(batches):
        if i == 3:  # each rank saves its shard; a fresh model and optimizer load it
            folder = Path(tempfile.gettempdir()) / f"sharded-api-{dist.get_rank()}-{id(opt)}"
            folder.mkdir(exist_ok=True)
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict()}, folder / f"shard{rank}.pt")
            saved = torch.load(folder / f"shard{rank}.pt", weights_only=False)
            restart = UnevenNet()
            restart.load_state_dict(saved["model"])
            restart_opt = ShardedOptimizer(groups(restart), torch.optim.AdamW, lr=0.01)
            restart_opt.load_state_dict(saved["opt"])
            restart_sched = torch.optim.lr_scheduler.StepLR(restart_opt, step_size=1, gamma=0.5)
            restart_sched.load_state_dict(saved["sched"])
            other = dict(saved["opt"], rank=(rank + 1) % world_size)
            try:
                restart_opt.load_state_dict(other)
                raise AssertionError("another rank's shard was loaded")
            except ValueError as err:
                assert "load each rank's own file" in str(err), err
        used = full.param_groups[0]["lr"]  # this step's rate, before the schedulers step
        train(model, opt, sched, [batch], rank, world_size)
        train(reference, full, full_sched, [batch], rank, world_size)
        if restart is not None:
            train(restart, restart_opt, restart_sched, [batch], rank, world_size)
        assert all(local["lr"] == used for local in opt.local.param_groups), \
            "this rank stepped with another rate"
        assert all(g["lr"] == full.param_groups[0]["lr"] for g in opt.param_groups), \
            "the scheduler's rate is not shown"
        for p, q in zip(model.parameters(), reference.parameters()):
            worst = max(worst, (p - q).abs().max().item())
        if restart is not None:
            for p, q in zip(model.parameters(), restart.parameters()):
                assert torch.equal(p, q), f"step {i}: the reloaded shard went on otherwise"
    assert worst < 1e-6, f"ShardedOptimizer differs from AdamW by {worst:.1e}"
    mine = sum(t.numel() for s in opt.state.values() for t in s.values()
               if torch.is_tensor(t) and t.dim())
    everything = sum(2 * p.numel() for p in model.parameters())  # AdamW's two moments, unsharded
    shares = [None] * world_size
    dist.all_gather_object(shares, mine)
    assert sum(shares) == everything and max(shares) < everything, (shares, everything)
    if rank == 0:
        print(f"ok: {world_size} ranks, 2 parameter groups, StepLR, step(closure), "
              f"max |Δ| vs AdamW {worst:.1e}, shards of {shares} moments, save/load per rank")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
