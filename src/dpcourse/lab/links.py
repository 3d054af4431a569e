"""A slower network than this machine's, emulated: every collective a run makes waits, after the
real one, for what the chosen link would add by the α-β model (notebook 04): α seconds per message
and β seconds per byte, per direction.

What it emulates: the latency and the bandwidth of one link, shared by the transfers of one
process, one after the other. What it does not: contention between links or between ranks, the
topology (a switch, nodes of several GPUs), NCCL's channels and protocols, a link *faster* than
this machine's own (it can only add time: the real transfer is still made, and paid, first).

    link = EmulatedLink(PRESETS["wan"], world_size)
    ddp.register_comm_hook(None, link.hook())  # DDP's gradient all-reduce pays the link
    dist.all_reduce(t); link.wait("all_reduce", t)  # an explicit collective pays it too

The numbers a run computes do not change: only when each collective returns.
"""
from __future__ import annotations

import math
import threading
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from dpcourse.lab import allreduce


@dataclass(frozen=True)
class Link:
    """One link: ``alpha`` seconds per message, ``bandwidth`` bytes per second per direction;
    ``source``: where the figures come from."""
    name: str
    alpha: float
    bandwidth: float
    source: str

    @property
    def beta(self) -> float:
        """Seconds per byte."""
        return 1.0 / self.bandwidth


# 1 Gb/s = 0.125 GB/s. The bandwidths are per direction.
PRESETS = {
    "wan": Link("wide-area link between data centres, 1 Gb/s, 30 ms one way", 30e-3, 0.125e9,
                "a round trip of 60 ms, inside the range Yuan et al. measured between AWS regions: "
                "'the delay is 10-70 ms and the bandwidth is 1.0-1.3 Gbps' (Decentralized "
                "Training of Foundation Models in Heterogeneous Environments, NeurIPS 2022, "
                "arXiv 2206.01288; their delay is ping's round trip: 'Delay is tested by ping', "
                "github.com/BinhangYuan/tc_cluster_setting)"),
    "1gbe": Link("1 Gb Ethernet", 50e-6, 0.125e9,
                 "1 Gb/s by definition; the latency is an assumption of the course (TCP over "
                 "commodity Ethernet: tens of microseconds one way)"),
    "25gbe": Link("25 Gb Ethernet", 25e-6, 3.125e9,
                  "25 Gb/s by definition; the latency is an assumption of the course (kernel TCP "
                  "on a faster link: its latency barely follows the link's rate)"),
    "100gbe": Link("100 Gb Ethernet", 20e-6, 12.5e9,
                   "100 Gb/s by definition; the latency is an assumption of the course (kernel "
                   "TCP, tuned: tens of microseconds one way)"),
    "ib_hdr": Link("InfiniBand HDR, 200 Gb/s", 1.2e-6, 24e9,
                   "Microsoft Azure, HBv3-series performance (200 Gb/s HDR InfiniBand): 'RDMA "
                   "latency & bandwidth: 1.2 microseconds (1-byte), 192 Gb/s (one-way)'"),
    "ib_ndr": Link("InfiniBand NDR, 400 Gb/s", 2e-6, 50e9,
                   "Microsoft Azure, HBv4-series performance (400 Gb/s NDR InfiniBand): 'RDMA "
                   "latency & bandwidth: < 2 microseconds (1 byte), 400 Gb/s (one-way)'; the "
                   "course takes the bound, 2 µs"),
    "pcie5": Link("PCIe 5.0 x16", 2e-6, 63e9,
                  "63.0 GB/s per direction for x16 (the PCI-SIG rate, 32 GT/s with 128b/130b "
                  "coding); the latency is an assumption of the course (a GPU's remote read of "
                  "128 bytes over PCIe 5.0: 'Min latency: 4.10 us' there and back, "
                  "github.com/lukealonso/p2pmark)"),
    "nvlink4": Link("NVLink 4 (H100 SXM), per GPU", 3e-6, 450e9,
                    "NVIDIA: '900 gigabytes per second (GB/s) bidirectional per GPU' for "
                    "fourth-generation NVLink, so 450 GB/s each way; the latency is what users "
                    "report nccl-tests to show on H100s, 'the expected latency (~3us)' "
                    "(github.com/NVIDIA/nccl/issues/1487)"),
}

# No link emulated: nothing is added, the bytes are still counted.
NONE = Link("none: this machine's own", 0.0, math.inf, "nothing emulated")


def emulable(link: Link, machine_alpha: float, machine_beta: float, margin: float = 10) -> bool:
    """Whether this machine can emulate ``link``: the emulator only adds time to what the
    machine's own network takes (``machine_alpha``, ``machine_beta``, fitted from a ping-pong),
    so a link is emulable where its α and β are each at least ``margin`` times the machine's,
    or its α is zero and its β is. Other links are for the planner: model only."""
    return ((link.alpha >= margin * machine_alpha or link.alpha == 0)
            and link.beta >= margin * machine_beta)


def link(name: str) -> Link:
    """The preset called ``name``, or NONE for "none"."""
    if name == "none":
        return NONE
    if name not in PRESETS:
        raise ValueError(f"no link called {name!r}: none, {', '.join(PRESETS)}")
    return PRESETS[name]


class EmulatedLink:
    """Makes this process's collectives pay ``link`` on ``world_size`` ranks, and counts the
    bytes each kind of collective carried. The link is one resource: a transfer starts when the
    one before it on this process has finished, so that buckets all-reduced at once (DDP's, on
    the backend's several threads) queue as they would on one wire."""

    def __init__(self, link: Link, world_size: int):
        self.link, self.world_size = link, world_size
        self.bytes: Counter[str] = Counter()  # bytes this rank sent, by kind of collective
        self.added = 0.0  # seconds the link added, in all
        self._free_at = 0.0  # when the link is done with what it was given
        self._lock = threading.Lock()
        self._off = False  # inside off(): nothing added, nothing counted

    def seconds(self, op: str, nbytes: int) -> float:
        """What ``op`` on ``nbytes`` costs on the link (ring algorithms, as NCCL's and gloo's):
        all_reduce 2(P−1)α + 2(P−1)/P·nβ; all_gather, reduce_scatter (n: the whole tensor)
        (P−1)α + (P−1)/P·nβ; broadcast ⌈log₂P⌉(α + nβ) (a binomial tree: the model's choice;
        NCCL pipelines its broadcast along a ring); send α + nβ."""
        P, a, b = self.world_size, self.link.alpha, self.link.beta
        if op == "send":
            return a + nbytes * b
        if P == 1:
            return 0.0
        if op == "all_reduce":
            return allreduce.cost("ring", P, nbytes, a, b, itemsize=1)
        if op in ("all_gather", "reduce_scatter"):
            return (P - 1) * a + (P - 1) / P * nbytes * b
        if op == "broadcast":
            return math.ceil(math.log2(P)) * (a + nbytes * b)
        raise ValueError(f"no model for {op!r}: all_reduce, all_gather, reduce_scatter, "
                         "broadcast or send")

    def sent(self, op: str, nbytes: int) -> float:
        """The bytes this rank sends for ``op`` on ``nbytes`` (the model's β term, over β): ring
        all_reduce 2(P−1)/P·n; all_gather, reduce_scatter (P−1)/P·n (n: the whole tensor);
        broadcast ⌈log₂P⌉·n; send n."""
        P = self.world_size
        factor = {"send": 1, "all_reduce": 2 * (P - 1) / P, "all_gather": (P - 1) / P,
                  "reduce_scatter": (P - 1) / P, "broadcast": math.ceil(math.log2(P))}
        if op not in factor:
            self.seconds(op, nbytes)  # says which collectives have a model
        return factor[op] * nbytes

    def wait(self, op: str, tensor_or_bytes: torch.Tensor | int) -> float:
        """Wait until the link has carried ``op`` on this tensor (or that many bytes), queued
        behind what it carries already; the seconds it added."""
        nbytes = (tensor_or_bytes if isinstance(tensor_or_bytes, int)
                  else tensor_or_bytes.numel() * tensor_or_bytes.element_size())
        if self._off:
            return 0.0
        cost = self.seconds(op, nbytes)
        with self._lock:
            self._free_at = max(time.perf_counter(), self._free_at) + cost
            done = self._free_at
            self.bytes[op] += round(self.sent(op, nbytes))
            self.added += cost
        if cost:
            time.sleep(max(0.0, done - time.perf_counter()))
        return cost

    @contextmanager
    def off(self):
        """Inside: the collectives take what this machine's own network takes, uncounted (to
        measure a step both ways, in turns). Every rank must enter and leave it at the same
        step: a rank that waits for the link while another does not is only slower, but the
        two then measure different things."""
        self._off = True
        try:
            yield
        finally:
            self._off = False

    def hook(self):
        """A DDP communication hook: DDP's own all-reduce of the bucket, then the link's time for
        it. Register it with ``ddp.register_comm_hook(None, link.hook())``. For CPU ranks
        (gloo): there the all-reduce's future completes when the transfer has ended, and the
        wait runs on gloo's thread while backward goes on. On NCCL the future completes when the
        work is queued on the GPU, so the wait would hold backward up instead: refused."""
        def emulated(state, bucket):
            if bucket.buffer().is_cuda:
                raise ValueError("the emulated link's hook is for CPU ranks (gloo): run with "
                                 "--device cpu, or without --link")
            nbytes = bucket.buffer().numel() * bucket.buffer().element_size()
            return default_hooks.allreduce_hook(state, bucket).then(
                lambda fut: (self.wait("all_reduce", nbytes), fut.value())[1])
        return emulated
