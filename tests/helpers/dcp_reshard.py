"""The course CNN with AdamW under FSDP2 (fully_shard), DDP or one plain process, saved and resumed
through get_state_dict / set_state_dict and torch.distributed.checkpoint, for tests/test_elastic.py:

    torchrun --nproc-per-node 2 dcp_reshard.py save fsdp CK     # steps 1-3, saved; steps 4-5
    torchrun --nproc-per-node 3 dcp_reshard.py load fsdp CK     # CK's step 3, steps 4-5

Every run trains on the same global batches (GLOBAL rows, cut between the ranks), so the weights
after step 5 depend only on what the checkpoint restored. Rank 0 prints one JSON line: the full
weights' digest of a run (its step-5 weights, gathered, in float64), and of the checkpoint's
optimizer state, how many numbers this rank holds (1/P of Adam's moments under FSDP2)."""
import json
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from dpcourse.lab import world
from dpcourse.lab.models import FashionCNN

GLOBAL = 12  # images a step, cut evenly between 1, 2, 3 or 4 ranks


def wrapped(kind):
    torch.manual_seed(0)
    model = FashionCNN(4, "group").double()
    if kind == "fsdp":
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model.modules():
            if isinstance(layer, (nn.Conv2d, nn.Linear)):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif kind == "ddp":
        model = DDP(model)
    return model


def step(model, opt, n):
    g = torch.Generator().manual_seed(n)  # step n's global batch, the same on any world size
    x = torch.randn(GLOBAL, 1, 28, 28, generator=g, dtype=torch.float64)
    y = torch.randint(0, 10, (GLOBAL,), generator=g)
    rank, size = dist.get_rank(), dist.get_world_size()
    mine = slice(rank * GLOBAL // size, (rank + 1) * GLOBAL // size)
    opt.zero_grad()
    F.cross_entropy(model(x[mine]), y[mine]).backward()
    opt.step()


def main(action, kind, path):
    env = world.setup(backend="gloo", device="cpu")
    model = wrapped(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if action == "save":
        for n in (1, 2, 3):
            step(model, opt, n)
        model_state, optim_state = get_state_dict(model, opt)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    else:
        model_state, optim_state = get_state_dict(model, opt)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
    held = sum(s.to_local().numel() if hasattr(s, "to_local") else s.numel()
               for st in opt.state.values() for s in st.values() if torch.is_tensor(s) and s.dim())
    for n in (4, 5):
        step(model, opt, n)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    if env.rank == 0:
        print(json.dumps({"world_size": env.world_size, "held": held,
                          "weights": {k: v.flatten().tolist() for k, v in full.items()}}))
    world.cleanup()


if __name__ == "__main__":
    main(*sys.argv[1:4])
