"""The emulated links (dpcourse/lab/links.py) measured from inside a run, as JSON on rank 0
(tests/test_links.py).

    torchrun --standalone --nproc-per-node 2 tests/helpers/link_probe.py

Prints one JSON object: for each preset probed, a ping-pong's one-way times over message sizes
with the link emulated (rank 1 waits for the link after each receive, rank 0 after each) and
without, and α, β fitted from each; and a DDP run of a few steps with the link's comm hook
against one without: the largest weight difference, the seconds the link added and the bytes
it counted.
"""
import json
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from dpcourse.lab import allreduce, links, world

world.setup(backend="gloo", device="cpu")
rank, P = dist.get_rank(), dist.get_world_size()
SIZES = [8, 64, 512, 2**22, 2**23, 2**24]


def ping_pong(nbytes, link=None, repeats=3):
    t = torch.zeros(nbytes // 4 or 1)
    times = []
    for _ in range(repeats + 1):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(t, 1)
            dist.recv(t, 1)
            link and link.wait("send", nbytes)
        else:
            dist.recv(t, 0)
            link and link.wait("send", nbytes)
            dist.send(t, 0)
        times.append((time.perf_counter() - start) / 2)
    return statistics.median(times[1:])


out = {}
for name in ("wan", "1gbe"):
    link = links.EmulatedLink(links.PRESETS[name], P)
    with_link = [ping_pong(n, link) for n in SIZES]
    alone = [ping_pong(n) for n in SIZES]
    out[name] = {"set": [link.link.alpha, link.link.beta],
                 "fit": allreduce.fit_alpha_beta(SIZES, with_link, small=512, large=2**23),
                 "machine": allreduce.fit_alpha_beta(SIZES, alone, small=512, large=2**23)}


def train(link=None, steps=3):
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                    torch.nn.Linear(256, 10)), bucket_cap_mb=0.1)
    if link:
        model.register_comm_hook(None, link.hook())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1 + rank)
    start = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 256)).square().mean().backward()
        opt.step()
    return model.module.state_dict(), time.perf_counter() - start


link = links.EmulatedLink(links.PRESETS["wan"], P)
plain, plain_s = train()
slow, slow_s = train(link)
out["ddp"] = {"max_abs_diff": max((plain[k] - slow[k]).abs().max().item() for k in plain),
              "seconds": [plain_s, slow_s], "added": link.added, "bytes": dict(link.bytes),
              "params_bytes": sum(v.numel() * v.element_size() for v in plain.values())}
if rank == 0:
    print(json.dumps(out))
dist.destroy_process_group()
