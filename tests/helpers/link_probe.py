"""The emulated links (dpcourse/lab/links.py) measured from inside a run, as JSON on rank 0
(tests/test_links.py).

    torchrun --standalone --nproc-per-node 2 tests/helpers/link_probe.py

Prints one JSON object: for each preset probed, ping-pongs over message sizes without the link
and with it (rank 1 waits for the link after each receive, rank 0 after each), in pairs, and α,
β fitted from what the link added to each pair and from the machine's own times; and a DDP
run of a few steps with the link's comm hook against one without: the largest weight
difference, the seconds the link added and the bytes it counted.
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


def ping_pong(nbytes, link=None):
    """One round trip of ``nbytes`` from rank 0 to rank 1 and back; half its seconds."""
    t = torch.zeros(nbytes // 4 or 1)
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
    return (time.perf_counter() - start) / 2


def paired(nbytes, link, repeats=5):
    """Without the link and with it, one after the other, ``repeats`` times (after one of each to
    warm up): the median time alone and the median of what the link added to each pair. Paired,
    a load that slows the machine for a while slows both halves of a pair alike."""
    alone, added = [], []
    for i in range(repeats + 1):
        plain, slow = ping_pong(nbytes), ping_pong(nbytes, link)
        if i:
            alone.append(plain)
            added.append(slow - plain)
    return statistics.median(alone), statistics.median(added)


out = {}
for name in ("wan", "1gbe"):
    link = links.EmulatedLink(links.PRESETS[name], P)
    alone, added = zip(*(paired(n, link) for n in SIZES))
    out[name] = {"set": [link.link.alpha, link.link.beta],
                 "added": allreduce.fit_alpha_beta(SIZES, added, small=512, large=2**23),
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
