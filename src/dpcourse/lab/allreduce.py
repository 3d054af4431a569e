"""AllReduce six ways, over ``torch.distributed`` send/recv only, and what each one costs.

    from dpcourse.lab.allreduce import ALGORITHMS, cost
    ALGORITHMS["ring"](t)   # sums t in place across the default group, like dist.all_reduce(t)
    cost("ring", P=4, nbytes=2**26, alpha=5e-5, beta=1e-9)   # seconds, by the α-β model

    torchrun --nproc-per-node 3 -m dpcourse.lab.allreduce bench --algo all --sizes 1KiB:64MiB:4 \
        --json out.jsonl
    torchrun --nproc-per-node 3 -m dpcourse.lab.allreduce check \
        # every algorithm against dist.all_reduce
    torchrun --nproc-per-node 4 -m dpcourse.lab.allreduce check --ranks-per-node 2
        # as 2 nodes of 2
    (on GPUs add --backend nccl; the module file also runs as a script: python .../allreduce.py)

The algorithms (P ranks, a message of M bytes):

    parameter_server  every rank sends its vector to rank 0, which adds them and sends the sum back
    naive_ring        the whole vector goes round the ring P − 1 times, each rank adding what comes
    ring              bandwidth-optimal: reduce-scatter of P chunks round the ring, then all-gather
    tree              binary tree (children 2r+1, 2r+2): reduce up to rank 0, broadcast down
    halving_doubling  the butterfly: reduce-scatter by recursive halving, all-gather by recursive
                      doubling; with P not a power of two, the first 2r ranks pair up first
    hierarchical      for N nodes of G ranks: ring reduce-scatter within each node, ring
                      all-reduce of each G-th across the nodes, ring all-gather within each node

The α-β(-γ) model: sending m bytes from one rank to another takes α + m·β (α: latency, β:
seconds per byte); adding m bytes into a vector takes m·γ (γ = 0: the plain α-β model). A rank
sends and receives at most one message at a time, both at once (full duplex).
``critical_path(algo, P, n, itemsize)`` counts the messages, bytes sent and bytes added on the
longest chain of dependent steps of *this* implementation; ``cost`` is α·messages + β·bytes +
γ·added. The node hierarchy: ``two_level_cost`` gives a transfer within a node one (α, β)
and a transfer between nodes another, for the ring and the hierarchical all-reduce.
The ``check`` command replays the transfers and additions the code really made
(``traced``, ``replay``) and compares them with those counts. ``bench`` fits α and β from a
ping-pong (by default the "exchange" one: every rank sends and receives at once, as in a ring
step) and γ from timed additions, then times every algorithm and ``dist.all_reduce``.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import statistics
import sys
import time
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

# ---------------------------------------------------------------- point-to-point, traced
# Every transfer goes through exchange(); a trace (a list) records each call as one "round":
# [("send", dst, nbytes), ("recv", src, nbytes)], whichever of the two it made.
_TRACE: list | None = None


@contextmanager
def traced():
    """Record this rank's rounds of transfers: ``with traced() as rounds: ALGORITHMS[a](t)``."""
    global _TRACE
    _TRACE = rounds = []
    try:
        yield rounds
    finally:
        _TRACE = None


def exchange(send: torch.Tensor | None = None, dst: int | None = None,
             recv: torch.Tensor | None = None, src: int | None = None) -> None:
    """Send ``send`` to rank ``dst`` while receiving ``recv`` from rank ``src``
    (either may be None).

    Both directions are posted before waiting, so two ranks that exchange with each other, or a
    ring of ranks, never deadlock, and the two transfers overlap. They are posted as one batch
    (``batch_isend_irecv``): NCCL needs a send and a receive with the same peer grouped, or
    each waits behind the other. Tensors must be contiguous: they are sent from their memory.
    """
    ops = []
    if recv is not None:
        ops.append(dist.P2POp(dist.irecv, recv, src))
    if send is not None:
        ops.append(dist.P2POp(dist.isend, send, dst))
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    if _TRACE is not None:
        _TRACE.append([(kind, peer, t.numel() * t.element_size())
                       for kind, peer, t in (("send", dst, send), ("recv", src, recv))
                       if t is not None])


def accumulate(total: torch.Tensor, incoming: torch.Tensor) -> None:
    """``total += incoming``, recorded in a trace as a local round ("add", None, bytes)."""
    total += incoming
    if _TRACE is not None:
        _TRACE.append([("add", None, incoming.numel() * incoming.element_size())])


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D view of ``tensor`` (a contiguous copy if it has none; the caller copies back)."""
    return tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)


_SCRATCH: dict = {}


def scratch(n: int, like: torch.Tensor) -> torch.Tensor:
    """A receive buffer of n elements, kept between calls: a fresh large tensor costs a page
    fault per 4 KiB the first time it is written, on every call."""
    key = (like.dtype, like.device)
    if key not in _SCRATCH or _SCRATCH[key].numel() < n:
        _SCRATCH[key] = torch.empty(n, dtype=like.dtype, device=like.device)
    return _SCRATCH[key][:n]


def _in_place(algorithm):
    """Let an algorithm written for a contiguous 1-D tensor take any tensor,
    like dist.all_reduce."""
    def run(tensor: torch.Tensor) -> None:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return
        flat = _flat(tensor)
        algorithm(flat, dist.get_rank(), dist.get_world_size())
        if flat.data_ptr() != tensor.data_ptr():  # it worked on a copy: write the sum back
            tensor.copy_(flat.view_as(tensor))
    run.__name__ = algorithm.__name__
    run.__doc__ = algorithm.__doc__
    return run


# ---------------------------------------------------------------- the algorithms
@_in_place
def parameter_server(flat, rank, P):
    """Rank 0 receives every other rank's vector in turn and adds it; then sends the sum to each."""
    if rank == 0:
        incoming = scratch(flat.numel(), flat)
        for r in range(1, P):
            exchange(recv=incoming, src=r)
            accumulate(flat, incoming)
        for r in range(1, P):
            exchange(send=flat, dst=r)
    else:
        exchange(send=flat, dst=0)
        exchange(recv=flat, src=0)


@_in_place
def naive_ring(flat, rank, P):
    """P − 1 steps: pass the vector that came from the left on to the right, add what arrives."""
    right, left = (rank + 1) % P, (rank - 1) % P
    outgoing, incoming = flat.clone(), scratch(flat.numel(), flat)
    for _ in range(P - 1):
        exchange(outgoing, right, incoming, left)
        accumulate(flat, incoming)
        outgoing, incoming = incoming, outgoing  # pass on what arrived, not the running sum


def ring_reduce_scatter(chunks, rank, P, on_step=None, members=None):
    """After P − 1 steps, ``chunks[(rank + 1) % P]`` holds the sum of that chunk over all ranks.

    At step s rank r sends chunk (r − s) mod P — its own at s = 0, afterwards the one it has
    just added to — and adds the chunk (r − s − 1) mod P arriving from the left into its own copy.
    ``members``: a ring of P of the group's ranks, ``rank`` being this rank's place in it
    (None: the whole group, in rank order).
    """
    right, left = _neighbours(rank, P, members)
    buffer = scratch(chunks[0].numel(), chunks[0])  # chunk 0 is the largest (tensor_split)
    for step in range(P - 1):
        send, recv = chunks[(rank - step) % P], chunks[(rank - step - 1) % P]
        incoming = buffer[:recv.numel()]
        exchange(send, right, incoming, left)
        accumulate(recv, incoming)
        if on_step:
            on_step("reduce-scatter", step)


def ring_all_gather(chunks, rank, P, on_step=None, members=None):
    """Each rank starts with the finished chunk (rank + 1) mod P; P − 1 steps pass them round,
    each received straight into its place. (``members`` as for ``ring_reduce_scatter``.)"""
    right, left = _neighbours(rank, P, members)
    for step in range(P - 1):
        exchange(chunks[(rank + 1 - step) % P], right, chunks[(rank - step) % P], left)
        if on_step:
            on_step("all-gather", step)


def _neighbours(place, P, members=None):
    """The ranks to the right and to the left of place ``place`` in a ring of P."""
    right, left = (place + 1) % P, (place - 1) % P
    return (right, left) if members is None else (members[right], members[left])


@_in_place
def ring(flat, rank, P):
    """Bandwidth-optimal ring: reduce-scatter, then all-gather, of P chunks
    (sizes differ by ≤ 1)."""
    chunks = flat.tensor_split(P)  # views into flat: contiguous, no copies
    ring_reduce_scatter(chunks, rank, P)
    ring_all_gather(chunks, rank, P)


def tree_children(rank: int, P: int) -> list[int]:
    """A binary tree in heap order: rank r's children are 2r+1 and 2r+2 (those below P)."""
    return [c for c in (2 * rank + 1, 2 * rank + 2) if c < P]


@_in_place
def tree(flat, rank, P):
    """Reduce up the binary tree to rank 0 (each parent adds its children's sums), broadcast down.

    Receives take the right child first (its subtree is never deeper, so it is ready first);
    sends serve the left child first (its subtree has further to go).
    """
    children = tree_children(rank, P)
    if children:
        incoming = scratch(flat.numel(), flat)
        for child in reversed(children):
            exchange(recv=incoming, src=child)
            accumulate(flat, incoming)
    if rank != 0:
        parent = (rank - 1) // 2
        exchange(send=flat, dst=parent)
        exchange(recv=flat, src=parent)
    for child in children:
        exchange(send=flat, dst=child)


@_in_place
def halving_doubling(flat, rank, P):
    """Recursive halving (reduce-scatter) then recursive doubling (all-gather) over P' = 2^⌊log₂P⌋
    ranks; with r = P − P' > 0, ranks 2i+1 < 2r first hand their vector to rank 2i and sit out."""
    P2 = 1 << (P.bit_length() - 1)  # the largest power of two ≤ P
    extra = P - P2
    if rank < 2 * extra:  # the remainder: fold the odd rank of each pair into the even one
        if rank % 2:
            exchange(send=flat, dst=rank - 1)
            exchange(recv=flat, src=rank - 1)  # the finished sum comes back at the end
            return
        incoming = scratch(flat.numel(), flat)
        exchange(recv=incoming, src=rank + 1)
        accumulate(flat, incoming)
    me = rank // 2 if rank < 2 * extra else rank - extra  # my place among the P' active ranks
    real = lambda v: 2 * v if v < extra else v + extra  # noqa: E731 - active place → rank
    lo, hi, spans = 0, flat.numel(), []
    buffer = scratch(flat.numel() - flat.numel() // 2, flat)
    distance = P2 // 2
    while distance:  # halving: keep one half of my span, send the other, add what comes back
        partner = real(me ^ distance)
        mid = (lo + hi) // 2
        keep, give = ((lo, mid), (mid, hi)) if me & distance == 0 else ((mid, hi), (lo, mid))
        incoming = buffer[:keep[1] - keep[0]]
        exchange(flat[give[0]:give[1]], partner, incoming, partner)
        accumulate(flat[keep[0]:keep[1]], incoming)
        spans.append((lo, hi))
        lo, hi = keep
        distance //= 2
    distance = 1
    while distance < P2:  # doubling: swap finished spans until everyone has the whole vector
        partner = real(me ^ distance)
        plo, phi = spans.pop()
        other = (hi, phi) if lo == plo else (plo, lo)
        exchange(flat[lo:hi], partner, flat[other[0]:other[1]], partner)
        lo, hi = plo, phi
        distance *= 2
    if rank < 2 * extra:
        exchange(send=flat, dst=rank + 1)


def ranks_per_node(P: int) -> int:
    """G, the ranks that share a node: ``DPCOURSE_RANKS_PER_NODE`` if set (to pretend, on one
    machine, that it is several), else what the launcher says (``dpcourse.lab.world.env_info``:
    torchrun's LOCAL_WORLD_SIZE, srun's tasks on this node, mpirun's local size), else P.
    G must divide P."""
    from dpcourse.lab.world import env_info

    info = env_info()
    G = int(os.environ.get("DPCOURSE_RANKS_PER_NODE") or 0) or (
        info.local_world_size if info.world_size == P
        else P)  # a group the launcher did not start: one node
    if G < 1 or P % G:
        raise ValueError(f"{G} ranks per node do not divide {P} ranks into whole nodes: set "
                         "DPCOURSE_RANKS_PER_NODE (or --ranks-per-node) to a divisor of the "
                         "world size")
    return G


@_in_place
def hierarchical(flat, rank, P):
    """Two levels, for N nodes of G ranks (ranks node·G … node·G + G − 1, as launchers place them):
    a ring reduce-scatter within the node leaves each local rank one G-th of the node's sum;
    the G ranks of the same local rank, one per node, all-reduce their G-th across the nodes
    (a ring of N, all G rings at once); a ring all-gather within the node brings it together.
    Each rank sends 2(N − 1) messages of M/P bytes to other nodes, every one of the node's G ranks
    on its own link; a flat ring sends all its 2(P − 1) through the link of the rank at the node's
    edge. Every rank must have the same G (as many ranks on every node)."""
    G = ranks_per_node(P)
    N, (node, local) = P // G, divmod(rank, G)
    in_node = [node * G + i for i in range(G)]
    across = [k * G + local for k in range(N)]
    chunks = flat.tensor_split(G)
    ring_reduce_scatter(chunks, local, G, members=in_node)
    mine = chunks[(local + 1) % G].tensor_split(N)  # this local rank's G-th, summed over the node
    ring_reduce_scatter(mine, node, N, members=across)
    ring_all_gather(mine, node, N, members=across)
    ring_all_gather(chunks, local, G, members=in_node)


ALGORITHMS = {
    "parameter_server": parameter_server,
    "naive_ring": naive_ring,
    "ring": ring,
    "tree": tree,
    "halving_doubling": halving_doubling,
    "hierarchical": hierarchical,
}
FLAT = tuple(a for a in ALGORITHMS if a != "hierarchical")  # one level: every link alike


# ---------------------------------------------------------------- the α-β cost model (pure)
TEXTBOOK = {  # the usual formulas, in units of (α + M·β) unless stated; see critical_path for ours
    "parameter_server": "2(α + Mβ)",
    "naive_ring": "(P−1)(α + Mβ)",
    "ring": "2(P−1)(α + Mβ/P)",
    "tree": "2·log₂P·(α + Mβ)",
    "halving_doubling": "log₂P·(α + Mβ)  (recursive doubling of whole vectors)",
    "hierarchical": "2(G−1)(α + Mβ/G) + 2(N−1)(α + Mβ/P), for N nodes of G ranks",
}
FORMULAS = {  # what critical_path computes, for M = n·itemsize bytes (n divisible as needed)
    "parameter_server": "2(P−1)(α + Mβ)",
    "naive_ring": "(P−1)(α + Mβ)",
    "ring": "2(P−1)(α + ⌈n/P⌉·itemsize·β)",
    "tree": "k(P)·(α + Mβ), k = 2, 4, 4, 6, 6, 8, 8 for P = 2…8, 12 for P = 16 (its critical path)",
    "halving_doubling": "2log₂P'·α + 2(P'−1)/P'·Mβ, + 2(α + Mβ) when P ≠ P' = 2^⌊log₂P⌋",
    "hierarchical": "2(G−1)(α + ⌈n/G⌉·itemsize·β) + 2(N−1)(α + ⌈⌈n/G⌉/N⌉·itemsize·β)",
}


def _tree_steps(P: int) -> tuple[int, int]:
    """Transfers on the critical path of ``tree`` for P ranks, one rank doing one at a time:
    (going up, each followed by an add; coming down).

    Walks the schedule the code follows: a parent takes its children's sums one after the
    other (right child first), then sends the total down (left child first).
    """
    ready = [0] * P  # when rank r's subtree sum is ready to go up
    for r in reversed(range(P)):
        t = 0
        for child in reversed(tree_children(r, P)):
            t = max(t, ready[child]) + 1
        ready[r] = t
    have = [0] * P  # how long after rank 0 has the total rank r has it
    for r in range(P):
        t = have[r]
        for child in tree_children(r, P):
            t += 1
            have[child] = t
    return ready[0], max(have)


def replay(traces: list[list], alpha: float, beta: float, gamma: float = 0.0,
           node_size: int | None = None, inter: tuple[float, float] | None = None) -> float:
    """Seconds the recorded rounds take under the α-β-γ model (the longest dependency chain).

    ``traces[r]`` is rank r's rounds, as ``traced()`` records them. A rank starts a round when
    its previous one has ended; a transfer starts once both its sender and its receiver have
    started the rounds it belongs to, and takes α + β·bytes; an add takes γ·bytes; a round
    ends with its last transfer. With ``node_size`` G and ``inter`` = (α', β'), ranks r // G
    are nodes, and a transfer between two nodes takes α' + β'·bytes instead.
    """
    P = len(traces)
    where = {}  # (src, dst, k) -> (rank, round) of the k-th send src→dst and of its recv
    for r, rounds in enumerate(traces):
        seen = {}
        for i, ops in enumerate(rounds):
            for kind, peer, _ in ops:
                if kind == "add":
                    continue
                key = (r, peer) if kind == "send" else (peer, r)
                k = seen[(kind, key)] = seen.get((kind, key), -1) + 1
                where[(kind, *key, k)] = (r, i)
    begin = [[None] * (len(t) + 1) for t in traces]
    for r in range(P):
        begin[r][0] = 0.0
    done = [0] * P  # rounds finished per rank
    progress = True
    while progress:
        progress = False
        for r in range(P):
            while done[r] < len(traces[r]):
                i, seen, end = done[r], {}, begin[r][done[r]]
                for kind, peer, nbytes in traces[r][i]:
                    if kind == "add":
                        end = begin[r][i] + gamma * nbytes
                        continue
                    key = (r, peer) if kind == "send" else (peer, r)
                    k = sum(1 for ops in traces[r][:i] for kd, pr, _ in ops
                            if kd == kind and pr == peer)
                    other = where.get(("recv" if kind == "send" else "send", *key, k))
                    if other is None:
                        raise RuntimeError(
                            f"rank {r}: {kind} to/from {peer} has no partner (deadlock)")
                    start = begin[other[0]][other[1]]
                    if start is None:
                        break
                    a, b = (inter if inter and node_size and r // node_size != peer // node_size
                            else (alpha, beta))
                    end = max(end, max(begin[r][i], start) + a + b * nbytes)
                else:
                    begin[r][i + 1] = end
                    done[r] += 1
                    progress = True
                    continue
                break
    if any(done[r] < len(traces[r]) for r in range(P)):
        raise RuntimeError("the recorded transfers wait on each other in a cycle (deadlock)")
    return max(b[-1] for b in begin)


def critical_path(algo: str, P: int, n: int, itemsize: int = 4,
                  G: int | None = None) -> tuple[int, int, int]:
    """(messages, bytes sent, bytes added) on the critical path of ``ALGORITHMS[algo]`` for n
    elements on P ranks. A transfer that sends and receives at once counts once, with the
    larger of its two sizes (full-duplex links). ``G``: ranks per node, for "hierarchical"
    (None: P, one node); the others do not look at it.
    """
    M = n * itemsize
    if P == 1:
        return 0, 0, 0
    if algo == "hierarchical":
        (m1, b1), (m2, b2), added = two_level_path(algo, P, G or P, n, itemsize)
        return m1 + m2, b1 + b2, added
    if algo == "parameter_server":  # rank 0 receives and adds P − 1 vectors, then sends P − 1
        return 2 * (P - 1), 2 * (P - 1) * M, (P - 1) * M
    if algo == "naive_ring":
        return P - 1, (P - 1) * M, (P - 1) * M
    if algo == "ring":  # every step someone moves one of the largest chunks
        chunk = math.ceil(n / P) * itemsize
        return 2 * (P - 1), 2 * (P - 1) * chunk, (P - 1) * chunk
    if algo == "tree":
        up, down = _tree_steps(P)
        return up + down, (up + down) * M, up * M
    if algo == "halving_doubling":
        P2 = 1 << (P.bit_length() - 1)
        steps = P2.bit_length() - 1
        # step k of the halving sends the larger half of a span of ⌈n/2^(k−1)⌉: ⌈n/2^k⌉ items
        halves = sum(math.ceil(n / 2 ** k) for k in range(1, steps + 1)) * itemsize
        fold = P != P2  # the remainder ranks' vector in (and added), the sum back out
        return 2 * steps + 2 * fold, 2 * halves + 2 * fold * M, halves + fold * M
    raise KeyError(f"unknown algorithm {algo!r}; choose from {', '.join(ALGORITHMS)}")


def cost(algo: str, P: int, nbytes: float, alpha: float, beta: float, gamma: float = 0.0,
         itemsize: int = 4, G: int | None = None) -> float:
    """Seconds for ``ALGORITHMS[algo]`` by the α-β-γ model: α per message, β per byte sent and
    γ per byte added on the critical path (γ = 0: the plain α-β model). ``G`` as for
    ``critical_path``."""
    messages, moved, added = critical_path(algo, P, max(1, round(nbytes / itemsize)), itemsize, G)
    return alpha * messages + beta * moved + gamma * added


# ---------------------------------------------------------------- two levels: the node hierarchy
def two_level_path(algo: str, P: int, G: int, n: int, itemsize: int = 4):
    """((messages, bytes) within a node, (messages, bytes) between nodes, bytes added) on the
    critical path of "ring" or "hierarchical", for P = N·G ranks placed G to a node in rank
    order, every rank with a link of its own within the node and one out of it.

    The flat ring: with N > 1 nodes, the rank at each node's edge sends all of its 2(P − 1)
    messages of M/P to the next node, one after the other: every step pays the network's price,
    on one link of the node. The hierarchical all-reduce pays it for 2(N − 1) steps, each of the
    G ranks on its own link. Exact for the hierarchical all-reduce at any length, and for the
    ring at lengths P divides (otherwise an upper bound: the largest chunk at every step).
    """
    if G < 1 or P % G:
        raise ValueError(f"G = {G} ranks per node must divide P = {P}")
    N = P // G
    if algo == "ring":
        chunk = math.ceil(n / P) * itemsize
        steps = 2 * (P - 1)
        level = (steps, steps * chunk)
        return ((0, 0), level, (P - 1) * chunk) if N > 1 else (level, (0, 0), (P - 1) * chunk)
    if algo == "hierarchical":
        part = math.ceil(n / G)  # elements of the largest G-th
        piece = math.ceil(part / N)  # … of the largest N-th of that
        return ((2 * (G - 1), 2 * (G - 1) * part * itemsize),
                (2 * (N - 1), 2 * (N - 1) * piece * itemsize),
                ((G - 1) * part + (N - 1) * piece) * itemsize)
    raise KeyError(f"the two-level model covers ring and hierarchical, not {algo!r}")


def two_level_cost(algo: str, P: int, G: int, nbytes: float, intra: tuple[float, float],
                   inter: tuple[float, float], gamma: float = 0.0, itemsize: int = 4) -> float:
    """Seconds for "ring" or "hierarchical" on N = P/G nodes of G ranks: (α, β) = ``intra``
    for a transfer within a node, ``inter`` for one between nodes."""
    (m1, b1), (m2, b2), added = two_level_path(
        algo, P, G, max(1, round(nbytes / itemsize)), itemsize)
    return intra[0] * m1 + intra[1] * b1 + inter[0] * m2 + inter[1] * b2 + gamma * added


def busbw_factor(P: int) -> float:
    """bus bandwidth = algbw · 2(P−1)/P: the bytes each rank must move in any all-reduce,
    as a multiple of M (NCCL's convention), so that busbw can be compared across P."""
    return 2 * (P - 1) / P


def fit_alpha_beta(nbytes, seconds, small: int = 1024,
                   large: int = 8 * 2**20) -> tuple[float, float]:
    """α, β of t = α + m·β from a ping-pong: α is the median time of the messages of at most
    ``small`` bytes (latency-bound), β the slope through those of at least ``large`` bytes
    (bandwidth-bound; the largest measured if none is that large), on relative error.
    (Without small messages: both by least squares.)

    Over loopback the time per byte grows once messages no longer fit in the caches, so one
    straight line through 4 B … 64 MiB fits neither end; the model is meant for each end, and
    the gradients an all-reduce carries are megabytes that come from memory, not from cache.
    """
    m = torch.tensor(nbytes, dtype=torch.float64)
    t = torch.tensor(seconds, dtype=torch.float64)
    lat, bw = m <= small, m >= min(large, m.max().item())
    if lat.any() and bw.any():
        alpha = t[lat].median().item()
        w = m[bw] / t[bw]  # minimise Σ((α + mβ − t)/t)² over β
        beta = ((w * (1 - alpha / t[bw])).sum() / (w * w).sum()).item()
        return alpha, max(beta, 0.0)
    A = torch.stack([1 / t, m / t], dim=1)  # (α + mβ)/t ≈ 1
    sol = torch.linalg.lstsq(A, torch.ones_like(t).unsqueeze(1)).solution.squeeze(1)
    return max(sol[0].item(), 0.0), max(sol[1].item(), 0.0)


def winner(P: int, nbytes: float, alpha: float, beta: float, gamma: float = 0.0) -> str:
    """The algorithm the model says is fastest (the explorer's answer), of the one-level five."""
    return min(FLAT, key=lambda a: cost(a, P, nbytes, alpha, beta, gamma))


def model_table(P: int, sizes, alpha: float, beta: float,
                gamma: float = 0.0) -> dict[str, list[float]]:
    """{algorithm: [model seconds for each size]}: what the explorer draws (the one-level five)."""
    return {a: [cost(a, P, m, alpha, beta, gamma) for m in sizes] for a in FLAT}


# ---------------------------------------------------------------- sizes
_UNITS = {"": 1, "B": 1, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30,
          "KB": 10**3, "MB": 10**6, "GB": 10**9}


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4096, 64KiB, 1MiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def parse_sizes(text: str) -> list[int]:
    """'1KiB,1MiB' or 'LO:HI[:FACTOR]' (LO, LO·4, … up to HI; factor 2 by default)."""
    sizes = []
    for part in text.split(","):
        if ":" in part:
            lo, hi, *factor = part.split(":")
            s, hi, f = parse_size(lo), parse_size(hi), int(factor[0]) if factor else 2
            while s <= hi:
                sizes.append(s)
                s *= f
        else:
            sizes.append(parse_size(part))
    return sizes


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n:g} B"


# ---------------------------------------------------------------- measuring (in a process group)
def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_allreduce(fn, nbytes: int, repeats: int, device, warmup: int = 1) -> float:
    """Median seconds of ``fn(t)`` on a float32 tensor of ``nbytes``,
    the slowest rank's each time."""
    t = torch.ones(max(1, nbytes // 4), device=device)
    times = []
    for i in range(warmup + repeats):
        t.fill_(1.0)  # the same numbers every time: no overflow, no denormals
        _sync(device)
        dist.barrier()
        start = time.perf_counter()
        fn(t)
        _sync(device)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
        # the all-reduce ends when its last rank does
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if i >= warmup:
            times.append(elapsed.item())
    return statistics.median(times)


def ping_pong(nbytes: int, repeats: int, device, both: bool = False, warmup: int = 1) -> float:
    """Seconds for one transfer of ``nbytes``.

    ``both=False``: the classic ping-pong: rank 0 sends, rank 1 sends it back (the other ranks
    wait); half the median round trip. ``both=True``: every rank sends to its right neighbour
    while receiving from its left, all at once: one step of a ring, with the load a ring puts
    on every rank (for P = 2, ranks 0 and 1 exchange). On a network with full-duplex links and
    a core per rank, the two agree; over loopback the CPU copies every byte, both directions
    of every rank, and an exchange costs more.
    """
    t, u = (torch.zeros(max(1, nbytes // 4), device=device),
            torch.zeros(max(1, nbytes // 4), device=device))
    rank, P = dist.get_rank(), dist.get_world_size()
    times = []
    for i in range(warmup + repeats):
        _sync(device)
        dist.barrier()
        start = time.perf_counter()
        if both:
            exchange(t, (rank + 1) % P, u, (rank - 1) % P)
        elif rank == 0:
            dist.send(t, 1)
            dist.recv(t, 1)
        elif rank == 1:
            dist.recv(t, 0)
            dist.send(t, 0)
        _sync(device)
        if i >= warmup:
            times.append((time.perf_counter() - start) / (1 if both else 2))
    median = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    # the slowest rank's (only 0 and 1 time a ping-pong)
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return median.item()


def add_time(nbytes: int, repeats: int, device) -> float:
    """Median seconds of ``a += b`` on float32 vectors of ``nbytes``, every rank at once (as in
    an all-reduce, where the ranks add at the same time on shared cores and memory)."""
    a, b = (torch.ones(max(1, nbytes // 4), device=device),
            torch.ones(max(1, nbytes // 4), device=device))
    times = []
    for _ in range(repeats):
        _sync(device)
        dist.barrier()
        start = time.perf_counter()
        a += b
        _sync(device)
        times.append(time.perf_counter() - start)
    median = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return median.item()


def fit_gamma(nbytes, seconds, large: int = 8 * 2**20) -> float:
    """γ, seconds per byte added: the slope through the origin of the adds of ≥ ``large`` bytes
    (the largest measured, if none is that large), on relative error."""
    large = min(large, max(nbytes))
    pairs = [(m, t) for m, t in zip(nbytes, seconds) if m >= large]
    return sum(m / t for m, t in pairs) / sum((m / t) ** 2 for m, t in pairs)


def repeats_for(nbytes: int, repeats: int) -> int:
    """More repeats for small messages: cheap, and a busy machine's scheduler stalls (a few ms)
    would otherwise decide their median."""
    return repeats if nbytes >= 2**20 else max(repeats, 25)


def _setup(args):
    from dpcourse.lab import world

    env = world.prepare(backend=args.backend, device=args.device)
    if env.device.type == "cuda":
        torch.cuda.set_device(env.device)
    dist.init_process_group(env.backend, rank=env.rank, world_size=env.world_size,
                            timeout=timedelta(seconds=args.timeout))
    return env


def _choose(names: str, extra=()) -> list[str]:
    """The algorithms named on the command line ("all": every one), checked before any process
    group exists: a typo, or ranks that do not divide into nodes, ends the run at once,
    said by rank 0."""
    from dpcourse.lab.world import env_info, stop

    algos = list(ALGORITHMS) + list(extra) if names == "all" else names.split(",")
    for a in algos:
        if a not in ALGORITHMS and a not in extra:
            stop(env_info(), f"unknown algorithm {a!r}: choose from all, "
                             f"{', '.join([*extra, *ALGORITHMS])}")
    try:
        ranks_per_node(env_info().world_size)
    except ValueError as e:
        stop(env_info(), str(e))
    return algos


def _agreed_ranks_per_node(P: int) -> int:
    """``ranks_per_node``, the same on every rank, or a stop: a launcher that put more ranks on one
    node than on another (srun with uneven tasks per node) has no G for the hierarchical
    all-reduce."""
    from dpcourse.lab.world import env_info, stop

    G = ranks_per_node(P)
    both = torch.tensor([G, -G], dtype=torch.int64)
    if dist.get_backend() == "nccl":
        both = both.cuda()
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    if both[0].item() != -both[1].item():
        stop(env_info(), "the nodes hold different numbers of ranks "
                         f"(from {-both[1].item()} to {both[0].item()}): "
                         "the hierarchical all-reduce needs the same number on every node "
                         "(e.g. srun --ntasks-per-node)")
    return G


def bench(args) -> int:
    """Ping-pong (α, β fitted), then every chosen algorithm over every size;
    rank 0 prints and logs."""
    from tqdm import tqdm

    from dpcourse.lab.metrics import JsonLog
    from dpcourse.lab.world import bar_off, env_info, stop

    algos = _choose(args.algo, extra=("native",))
    if env_info().world_size < 2:
        stop(env_info(), "bench needs at least 2 ranks: "
                         "torchrun --nproc-per-node 2 -m dpcourse.lab.allreduce bench")
    env = _setup(args)
    rank, P = dist.get_rank(), dist.get_world_size()
    log = JsonLog(args.json if rank == 0 else None, world_size=P, backend=env.backend,
                  device=env.device.type)
    say = print if rank == 0 else (lambda *a, **k: None)
    if args.check:  # a few cases first: right, and transfers as the model counts them
        _, failures = check_cases((1, P + 1, 1001, 65537), (torch.float32,), env.device, log,
                                  algos=[a for a in algos if a != "native"])
        if failures:
            raise SystemExit(1)
    G = _agreed_ranks_per_node(P) if "hierarchical" in algos else P
    say(f"{P} ranks{f' ({P // G} nodes of {G})' if G < P else ''}, {env.backend} on "
        f"{env.device.type}; ping-pong (ranks 0 ↔ 1), exchange (every rank → its right), adds ...",
        flush=True)
    pp_sizes = parse_sizes(args.pingpong_sizes)
    fits = {}
    for mode in ("oneway", "exchange"):
        pp = [ping_pong(m, repeats_for(m, args.repeats), env.device, both=mode == "exchange")
              for m in pp_sizes]
        for m, t in zip(pp_sizes, pp):
            log.write("pingpong", mode=mode, bytes=m, seconds=t)
        fits[mode] = fit_alpha_beta(pp_sizes, pp)
        a, b = fits[mode]
        log.write("fit", mode=mode, alpha_s=a, beta_s_per_byte=b, used=mode == args.fit)
        say(f"{mode:>8} ping-pong: α = {a * 1e6:6.1f} µs, β = {b * 1e9:.3f} ns/B "
            f"(1/β = {1 / b / 1e9 if b else float('inf'):.2f} GB/s)"
            f"{'  ← the model uses this' if mode == args.fit else ''}")
    alpha, beta = fits[args.fit]
    adds = [add_time(m, repeats_for(m, args.repeats), env.device) for m in pp_sizes]
    for m, t in zip(pp_sizes, adds):
        log.write("add", bytes=m, seconds=t)
    gamma = fit_gamma(pp_sizes, adds) if args.gamma else 0.0
    log.write("fit", mode="add", gamma_s_per_byte=gamma, used=args.gamma)
    say(f"     add (a += b): γ = {gamma * 1e9:.3f} ns/B"
        f"{'' if args.gamma else ' (not used: --no-gamma)'}")
    say(f"{'algorithm':<17} {'size':>10} {'time ms':>9} {'algbw GB/s':>10} {'busbw GB/s':>10} "
        f"{'model ms':>9} {'model err':>9}")
    jobs = [(a, m) for m in args.sizes for a in algos]
    for a, m in tqdm(jobs, desc="bench", disable=bar_off(rank), leave=False):
        fn = dist.all_reduce if a == "native" else ALGORITHMS[a]
        t = time_allreduce(fn, m, repeats_for(m, args.repeats), env.device)
        algbw = m / t / 1e9
        model = cost(a, P, m, alpha, beta, gamma, G=G) if a != "native" else None
        log.write("allreduce", algo=a, bytes=m, seconds=t, algbw_GBps=algbw,
                  busbw_GBps=algbw * busbw_factor(P), model_s=model,
                  repeats=repeats_for(m, args.repeats))
        err = f"{(model - t) / t:+9.0%}" if model else f"{'':>9}"
        say(f"{a:<17} {fmt_bytes(m):>10} {t * 1e3:9.3f} {algbw:10.3f} "
            f"{algbw * busbw_factor(P):10.3f} "
            f"{model * 1e3 if model else float('nan'):9.3f} {err}", flush=True)
    dist.destroy_process_group()
    return 0


CHECK_LENGTHS = (1, 2, 3, 5, 7, 64, 1000, 1001, 5040, 65537)  # 5040: every P ≤ 10 divides it


def check_cases(lengths, dtypes, device, log, verbose=False, algos=None) -> tuple[int, int]:
    """Every algorithm × length × dtype against dist.all_reduce, and the transfers and additions
    each made, replayed, against ``critical_path``; for ring and hierarchical, where P divides
    the length, also replayed on two levels (``ranks_per_node``) against ``two_level_cost``.
    ``algos``: a list of names (None: all). Returns (cases, failures); rank 0 prints failures."""
    rank, P = dist.get_rank(), dist.get_world_size()
    G = _agreed_ranks_per_node(P)
    cases = failures = 0
    for dtype in dtypes:
        for n in lengths:
            g = torch.Generator().manual_seed(1000 * rank + n)
            data = torch.randn(n, generator=g, dtype=dtype).to(device)
            expected = data.clone()
            dist.all_reduce(expected)
            for algo in ALGORITHMS if algos is None else algos:
                t, fn = data.clone(), ALGORITHMS[algo]
                with traced() as rounds:
                    fn(t)
                ok = torch.allclose(t, expected, rtol=1e-6, atol=1e-6 * P)
                # what this code did, replayed: messages (α=1), bytes sent (β=1), bytes added (γ=1)
                traces = [None] * P
                dist.all_gather_object(traces, rounds)
                counted = tuple(round(replay(traces, *w))
                                for w in ((1, 0, 0), (0, 1, 0), (0, 0, 1)))
                model = critical_path(algo, P, n, t.element_size(), G)
                counted_ok = counted == model
                two_level = None  # the node hierarchy: a link out of the node costs more
                if algo in ("ring", "hierarchical") and n % P == 0:
                    weights = dict(intra=(1.0, 1e-3), inter=(10.0, 0.1), gamma=1e-4)
                    replayed = replay(traces, *weights["intra"], weights["gamma"], node_size=G,
                                      inter=weights["inter"])
                    two_level = math.isclose(
                        replayed, two_level_cost(algo, P, G, n * t.element_size(), **weights,
                                                 itemsize=t.element_size()), rel_tol=1e-9)
                verdict = torch.tensor([int(ok and counted_ok and two_level is not False)],
                                       device=device)
                dist.all_reduce(verdict, op=dist.ReduceOp.MIN)  # right only if right on every rank
                good = bool(verdict.item())
                cases, failures = cases + 1, failures + (not good)
                err = (t - expected).abs().max().item()
                log.write("case", algo=algo, n=n, dtype=str(dtype).removeprefix("torch."), ok=good,
                          max_abs_err=err, counted=counted, model=model, counts_ok=bool(counted_ok),
                          ranks_per_node=G, two_level_ok=two_level)
                if rank == 0 and (not good or verbose):
                    print(f"{algo:<17} n={n:<9} {str(dtype)[6:]:<8} "
                          f"{'ok' if ok else 'WRONG'} (max |Δ| {err:.1e}); critical path "
                          f"(messages, bytes sent, bytes added) {counted} vs model {model}"
                          f"{'' if counted_ok else '  MISMATCH'}"
                          f"{'' if two_level is not False else '; two levels: MISMATCH'}",
                          flush=True)
    if rank == 0:
        print(f"{P} ranks ({P // G} node(s) of {G}): {cases - failures} of {cases} cases agree "
              "with dist.all_reduce and with the model's transfer counts", flush=True)
    return cases, failures


def check(args) -> int:
    """``check_cases`` over lengths 1 … 65537 in float32 and float64 (and --large in float32)."""
    from dpcourse.lab.metrics import JsonLog

    algos = _choose(args.algo)
    env = _setup(args)
    rank, P = dist.get_rank(), dist.get_world_size()
    log = JsonLog(args.json if rank == 0 else None, world_size=P, backend=env.backend)
    lengths = list(CHECK_LENGTHS) + [parse_size(s) // 4 for s in args.large]
    _, failures = check_cases(lengths, (torch.float32, torch.float64), env.device, log,
                              args.verbose, algos)
    dist.destroy_process_group()
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dpcourse.lab.allreduce",
                                     description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("bench", "check"):
        p = sub.add_parser(name, help={
            "bench": "ping-pong, α-β fit, every algorithm over message sizes",
            "check": "every algorithm against dist.all_reduce"}[name])
        p.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl", "mpi"])
        p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
        p.add_argument("--timeout", type=float, default=120, help="seconds a transfer may wait")
        p.add_argument("--json", "--log-json", dest="json", default=None,
                       help="rank 0 writes JSON lines here")
        p.add_argument("--ranks-per-node", type=int, default=None,
                       help="G for the hierarchical all-reduce: pretend the ranks are nodes of G "
                            "(default: the launcher's LOCAL_WORLD_SIZE, "
                            "the ranks really on one node)")
    b = sub.choices["bench"]
    b.add_argument("--algo", default="all",
                   help="all, or a comma list of: native, " + ", ".join(ALGORITHMS))
    b.add_argument("--sizes", type=parse_sizes, default=parse_sizes("1KiB:64MiB:4"),
                   help="message sizes in bytes: 1KiB,1MiB or LO:HI[:FACTOR] "
                        "(default 1KiB:64MiB:4)")
    b.add_argument("--repeats", type=int, default=5,
                   help="timed runs per point (the median counts)")
    b.add_argument("--pingpong-sizes", default="4B:64MiB:4",
                   help="sizes of the ping-pong that fits α, β")
    b.add_argument("--fit", default="exchange", choices=["exchange", "oneway"],
                   help="which ping-pong the model's α, β come from "
                        "(default: exchange, what a ring step does)")
    b.add_argument("--check", action="store_true",
                   help="first check every algorithm against dist.all_reduce "
                        "and the model's counts")
    b.add_argument("--no-gamma", dest="gamma", action="store_false",
                   help="the plain α-β model: leave out the time of the additions (γ)")
    c = sub.choices["check"]
    c.add_argument("--large", nargs="*", default=[], help="extra sizes, e.g. 64MiB (float32 only)")
    c.add_argument("--verbose", action="store_true", help="one line per case, not only failures")
    c.add_argument("--algo", default="all",
                   help="all, or a comma list of: " + ", ".join(ALGORITHMS))
    args = parser.parse_args(argv)
    if args.ranks_per_node:  # every rank reads it from its environment, as from the launcher's
        os.environ["DPCOURSE_RANKS_PER_NODE"] = str(args.ranks_per_node)
    return bench(args) if args.command == "bench" else check(args)


if __name__ == "__main__":
    sys.exit(main())
