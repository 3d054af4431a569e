"""StepTimer on 2 gloo ranks, for tests/test_lab_instruments.py: collectives before, in, between
and after two timed steps, one of them paused.

    torchrun --nproc-per-node 2 tests/helpers/step_timer.py  # rank 0 prints REPORT {...}
"""
import json

import torch
import torch.distributed as dist

from dpcourse.lab import world
from dpcourse.lab.metrics import StepTimer


def main():
    world.setup(backend="gloo", device="cpu")
    timer = StepTimer("cpu")
    dist.broadcast(torch.zeros(100), src=0)  # before the first step: not counted
    timer.start()
    dist.all_reduce(torch.ones(10))
    with timer.paused():
        dist.all_reduce(torch.ones(1000))  # paused: not counted
    dist.all_reduce(torch.ones(6))
    timer.lap("forward")
    timer.stop()
    dist.all_reduce(torch.ones(500))  # between steps: not counted
    timer.start()
    dist.all_reduce(torch.ones(3, dtype=torch.float64))
    dist.all_gather_into_tensor(torch.zeros(4, dtype=torch.int64), torch.ones(2, dtype=torch.int64))
    timer.lap("forward")
    timer.stop()
    report = timer.report()
    if dist.get_rank() == 0:
        print("REPORT", json.dumps(report), flush=True)
    world.cleanup()


if __name__ == "__main__":
    main()
