"""What a data-parallel step will cost on another network, from what its compute costs here: the
α-β cost of each collective (links.py) laid over the measured forward, backward and optimizer
step (notebook 16; slow_network.py --bench measures the inputs).

A DDP step is a forward, then a backward during which each bucket of gradients is all-reduced as
soon as it is full, the buckets one after another on the one link; then the optimizer's step.
Where the transfers end before backward does, communication is hidden; the rest is exposed and
adds to the step. Two assumptions, each said where it is made: backward takes ``BACKWARD_SHARE``
of forward-and-backward (the usual rule of thumb: backward computes two products for forward's
one), and its time is spread over the gradients as their bytes are, so that a bucket is full
after its share of backward. A method whose hook computes and sends before it returns (this
course's top-k and sign: ``blocking``) holds backward up instead: none of its time is hidden.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

BACKWARD_SHARE = 2 / 3  # of forward and backward; an assumption, not a measurement


@dataclass(frozen=True)
class Measured:
    """What a step costs here, without communication: forward and backward (under no_sync),
    the optimizer's step, and DDP's buckets (bytes each, in the order backward fills them)."""
    compute_s: float
    update_s: float
    bucket_bytes: tuple[int, ...]


def messages(method: str, nbytes: int, world_size: int, tensors: int = 1,
             ratio: float = 0.001) -> list[tuple[str, int]]:
    """The collectives ``method`` makes for one bucket of ``nbytes`` bytes of float32 gradients,
    as (collective, bytes handed to it): DDP's all-reduce; top-k's all-gathers of k values
    (4 bytes) and k indices (8); sign's of one bit an entry and one scale per tensor."""
    n, P = nbytes // 4, world_size
    if method == "ddp":
        return [("all_reduce", nbytes)]
    if method == "topk":
        k = max(1, int(ratio * n))
        return [("all_gather", P * k * 4), ("all_gather", P * k * 8)]
    if method == "sign":
        return [("all_gather", P * math.ceil(n / 8)), ("all_gather", P * 4 * tensors)]
    raise ValueError(f"no plan for {method!r}: ddp, topk or sign")


def step(measured: Measured, link, method: str = "ddp", blocking: bool | None = None,
         **kwargs) -> dict:
    """The predicted step on ``link`` (an EmulatedLink: its ``seconds(op, nbytes)``): seconds
    of the step, of communication in all, of it exposed, and the ratio of communication to
    backward (at most 1: it can hide). ``blocking`` (default: every method but DDP's): the hook
    holds backward up while it sends. ``kwargs``: ``messages``' ``tensors`` and ``ratio``."""
    blocking = method != "ddp" if blocking is None else blocking
    backward = BACKWARD_SHARE * measured.compute_s
    forward = measured.compute_s - backward
    total = sum(measured.bucket_bytes)
    done = free = comm = 0.0
    for nbytes in measured.bucket_bytes:
        done += nbytes
        cost = sum(link.seconds(op, n)
                   for op, n in messages(method, nbytes, link.world_size, **kwargs))
        ready = forward + backward * done / total  # the bucket is full
        free = max(ready, free) + cost  # its transfer starts when the link is free too
        comm += cost
    end = measured.compute_s + comm if blocking else max(measured.compute_s, free)
    return {"step_s": end + measured.update_s, "comm_s": comm,
            "exposed_s": end - measured.compute_s, "comm_to_backward": comm / backward}


def local_step(measured: Measured, link, every: int) -> dict:
    """Local SGD and DiLoCo: steps with no communication, and every ``every`` steps one
    all-reduce of the weights (as many bytes as the gradients), which nothing hides."""
    comm = link.seconds("all_reduce", sum(measured.bucket_bytes))
    return {"step_s": measured.compute_s + measured.update_s + comm / every,
            "comm_s": comm / every, "exposed_s": comm / every, "comm_to_backward": 0.0}
