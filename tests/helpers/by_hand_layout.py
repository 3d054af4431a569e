"""What ddp_by_hand's classes build and do inside one backward, as JSON (tests/test_ddp_by_hand.py).

    python tests/helpers/by_hand_layout.py LAB.py     # one process, a private gloo group

Prints one JSON object: the names of the parameters each class looks after, BucketDDP's
buckets for several caps, and how many all-reduces OverlapDDP and BucketDDP had started when
backward() returned (before finish_gradient_synchronization).
"""
import importlib.util
import json
import sys

import torch
import torch.nn.functional as F

from dpcourse.lab import world
from dpcourse.lab.checks import TinyNet  # the model --check trains (the lab's referee)

spec = importlib.util.spec_from_file_location("lab", sys.argv[1])
lab = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lab)

world.setup(backend="gloo", device="cpu")
torch.manual_seed(0)
names = {id(p): n for n, p in TinyNet().named_parameters()}  # tied: listed once


def named(params):
    return [names[id(p)] for p in params]


def started_in_backward(model, extra):
    x, y = torch.randn(6, 8), torch.randint(4, (6,))
    F.cross_entropy(model(x, extra=extra), y).backward()
    if isinstance(model, lab.OverlapDDP):
        started = len(model.works)
    else:
        started = sum(b.work is not None for b in model.buckets)
    model.finish_gradient_synchronization()
    return started


out = {"parameters": list(names.values()), "buckets": {}, "started": {}}
for cap in (100, 0.0012, 0, None):
    torch.manual_seed(0)
    model = lab.BucketDDP(TinyNet(), bucket_cap_mb=cap)
    names = {id(p): n for n, p in model.module.named_parameters()}
    out["buckets"][str(cap)] = [named(b.params) for b in model.buckets]
    out["started"][f"BucketDDP {cap}"] = [started_in_backward(model, extra)
                                          for extra in (True, False, True)]
torch.manual_seed(0)
model = lab.OverlapDDP(TinyNet())
names = {id(p): n for n, p in model.module.named_parameters()}
out["overlap_params"] = named(model.params)
out["started"]["OverlapDDP"] = [started_in_backward(model, extra) for extra in (True, False, True)]
world.cleanup()
print(json.dumps(out))
