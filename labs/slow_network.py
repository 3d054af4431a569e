"""Data parallelism over a slow network: DDP's gradients over an emulated link, and two ways to
send less, top-k sparsification and 1-bit (sign) quantization, each with error feedback.

    torchrun --standalone --nproc-per-node 2 labs/slow_network.py --link wan
    torchrun --standalone --nproc-per-node 2 labs/slow_network.py --link wan \\
        --compress topk --ratio 0.01
    torchrun --standalone --nproc-per-node 2 labs/slow_network.py --compress sign
    torchrun --standalone --nproc-per-node 2 labs/slow_network.py --compress topk \\
        --no-error-feedback           # what the residual is for
    torchrun --standalone --nproc-per-node 2 labs/slow_network.py --bench  # planner

(Activate the course's environment first: source .venv/bin/activate.)

The course CNN trains --steps steps of SGD on the first --images FashionMNIST training images,
--batch-size per rank, as fashion_ddp.py does. Every collective pays the link --link names
(dpcourse/lab/links.py: α seconds per message and β per byte, added after the real transfer; none:
nothing added), and the link counts the bytes of each: DDP's gradient buckets through a
communication hook, the test's all-reduce through link.wait.

    --compress none   DDP's own all-reduce of each bucket (4 bytes a gradient)
    --compress topk   each rank sends the --ratio largest |entries| of each bucket, values
                      (4 bytes) and indices (8), all-gathered: the ranks pick different entries
    --compress sign   each rank sends one bit per entry, its sign, and one scale per parameter
                      tensor, its mean |entry| (Seide et al. 2014, "1-Bit Stochastic Gradient
                      Descent ..."; Karimireddy et al. 2019, "Error Feedback Fixes SignSGD ...",
                      whose code scales each tensor alike: github.com/epfml/error-feedback-SGD)

Both keep, on each rank, what they did not send (the residual) and add it to the next step's
gradient: error feedback (Seide et al.: the quantization error "carried forward across
minibatches"). Without it (--no-error-feedback) what a step does not send is lost, and signSGD
can fail to converge: Karimireddy et al. give "simple convex counter-examples where signSGD does
not converge to the optimum". SGD without momentum by default: error feedback as Karimireddy
et al. analyse it (with momentum, Lin et al. 2018, "Deep Gradient Compression", "locally
accumulate the velocity instead of the real gradient": their momentum correction). The first
step sends everything (as torch's PowerSGD does before start_powerSGD_iter): DDP rebuilds its
buckets after it, and the residuals are kept per bucket. These hooks compress and send before
they return, so backward waits for them: unlike DDP's own all-reduce, nothing they send is
hidden behind backward (the planner, dpcourse/lab/planner.py, counts them so).

--bench measures instead of training: in turns, forward and backward alone (under no_sync: no
communication), a whole step on this machine's own network and one over the link; the medians
of each, of the optimizer's step and of what the link added to each pair of steps, and DDP's
buckets (bytes each): the planner's inputs (dpcourse/lab/planner.py) and what it must predict.

Rank 0 prints and logs (--log-json, event "done"): ms per step (median, the first two steps
left out), the bytes each rank sent per step by each kind of collective, the seconds the link
added, the train loss of the last steps, the test accuracy on 10,000 images and the largest
weight difference between the replicas. Lines there because of distribution: `# DDP:`; because
of the slow network: `# LINK:`.
"""
import argparse
import itertools
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import BatchSampler, DistributedSampler

from dpcourse.lab import links, training, world
from dpcourse.lab.data import InMemoryFashionMNIST
from dpcourse.lab.metrics import JsonLog
from dpcourse.lab.models import FashionCNN


def setup(args):
    # DDP: rank and world size from torchrun, srun or mpirun; MASTER_ADDR/PORT set and checked.
    env = world.prepare(backend=args.backend, device=args.device)
    if env.device.type == "cuda":
        torch.cuda.set_device(env.device)  # DDP: one GPU per process, cuda:LOCAL_RANK
    dist.init_process_group(env.backend, rank=env.rank, world_size=env.world_size,  # DDP: join
                            timeout=timedelta(seconds=args.timeout))
    return env


def cleanup():
    dist.destroy_process_group()  # DDP: leave the process group so every rank exits cleanly.


def done(tensor):
    """A future that holds ``tensor`` already: what a hook that has finished returns."""
    fut = torch.futures.Future(devices=[tensor.device] if tensor.is_cuda else None)
    fut.set_result(tensor)
    return fut


def pack_bits(bits):
    """A bool tensor as bytes, eight to a byte (the last byte padded with zeros)."""
    bits = F.pad(bits.to(torch.uint8), (0, -len(bits) % 8)).view(-1, 8)
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    return (bits << shifts).sum(1, dtype=torch.uint8)


def unpack_bits(packed, n):
    """pack_bits undone: the first ``n`` bits, as bools."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(1) >> shifts) & 1).flatten()[:n].bool()


class Compressor:
    """The state of a communication hook that sends less than the bucket (as torch's PowerSGD
    keeps a state): ``compress`` (what this rank sends, and the residual it keeps) and
    ``exchange`` (every rank's share, decoded and averaged) are each method's own. It keeps one
    residual per bucket (error feedback), and the link pays for what is sent."""

    def __init__(self, link, world_size, error_feedback):
        self.link, self.world_size, self.error_feedback = link, world_size, error_feedback
        self.residuals = {}  # bucket index -> what this rank has not sent yet
        self.steps = 0  # steps done: the first sends everything (DDP rebuilds its buckets after)

    def gather(self, tensor):
        """``tensor`` from every rank (they may differ), to every rank; the link pays for it."""
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(out, tensor)  # DDP: what each rank sends, to every rank
        # LINK: the gathered tensor, every rank's share, crosses the link
        self.link.wait("all_gather", self.world_size * tensor.numel() * tensor.element_size())
        return out


def send_less_hook(state, bucket):
    """DDP's communication hook for a Compressor ``state``: this rank's bucket, with what it did
    not send before, compressed; every rank's, exchanged and averaged, in the bucket."""
    grad, i = bucket.buffer(), bucket.index()
    first = state.steps == 0
    state.steps += bucket.is_last()
    if first:  # DDP: the first step: plain all-reduce; the buckets are rebuilt after it
        return default_hooks.allreduce_hook(None, bucket).then(  # LINK: paid as DDP's
            lambda fut: (state.link.wait("all_reduce", grad), fut.value())[1])
    if state.error_feedback:
        grad = grad + state.residuals.get(i, 0)  # what the earlier steps did not send
    sizes = [p.numel() for p in bucket.parameters()]  # the bucket's tensors, one after another
    sent, residual = state.compress(grad, sizes)
    if state.error_feedback:
        state.residuals[i] = residual
    bucket.buffer().copy_(state.exchange(sent, sizes))  # DDP: the average of all ranks
    return done(bucket.buffer())


class TopK(Compressor):
    """Top-k sparsification: the ``ratio`` largest |entries|, values and indices."""

    def __init__(self, link, world_size, error_feedback, ratio):
        super().__init__(link, world_size, error_feedback)
        self.ratio = ratio

    def compress(self, grad, sizes):
        """(values, indices) of the k = ratio·n largest |entries|; the residual: grad less them."""
        # YOUR CODE HERE
        # Hint: k at least 1;
        #       the indices of the k largest |grad|, their values;
        #       the residual is grad with those k entries set to zero
        raise NotImplementedError("Exercise: see the hint above")
        return (grad[indices], indices), residual

    def exchange(self, sent, sizes):
        values, indices = sent
        dense = torch.zeros(sum(sizes), dtype=values.dtype, device=values.device)
        # DDP: each rank's entries added where they belong (two ranks may send the same index)
        for v, i in zip(self.gather(values), self.gather(indices)):
            dense.index_add_(0, i, v)
        return dense / self.world_size


class Sign(Compressor):
    """1-bit quantization: the sign of each entry, and one scale per parameter tensor (a layer's
    gradients and another's differ in size): the mean |entry| of that tensor."""

    def compress(self, grad, sizes):
        """(signs packed eight to a byte, scales); the residual: grad − scale·sign(grad)."""
        scales = torch.stack([part.abs().mean() for part in grad.split(sizes)])
        positive = grad >= 0
        scale = scales.repeat_interleave(torch.tensor(sizes, device=grad.device))
        residual = grad - torch.where(positive, scale, -scale)
        return (pack_bits(positive), scales), residual

    def exchange(self, sent, sizes):
        packed, scales = sent
        n = sum(sizes)
        total = torch.zeros(n, dtype=scales.dtype, device=scales.device)
        counts = torch.tensor(sizes, device=scales.device)
        for p, s in zip(self.gather(packed), self.gather(scales)):  # DDP: every rank's bits
            scale = s.repeat_interleave(counts)
            total += torch.where(unpack_bits(p, n), scale, -scale)
        return total / self.world_size


def evaluate(model, test_set, link, rank, world_size):
    """Accuracy on the test set, each rank testing images r, r+K, ...: each image once."""
    x, y = test_set[torch.arange(rank, len(test_set), world_size, device=test_set.labels.device)]
    with torch.no_grad():
        totals = torch.tensor([(model(x).argmax(1) == y).sum().item(), len(y)],
                              dtype=torch.float64, device=y.device)
    dist.all_reduce(totals)  # DDP: correct answers and images, summed over the ranks
    link.wait("all_reduce", totals)  # LINK: an explicit collective pays the link too
    return (totals[0] / totals[1]).item()


def bench(model, opt, batches, train_set, link, steps, sizes):
    """The planner's inputs, and what to check its prediction against, measured in turns so
    that a load on the machine slows each alike: forward and backward alone (under no_sync: no
    communication), a whole step on this machine's own network, and one over the link; their
    medians and the optimizer's. ``sizes``: filled by the hook, bucket by bucket."""
    times = {"compute_s": [], "update_s": [], "here_s": [], "step_s": []}

    def timed_step(x, y, key):
        start = time.perf_counter()
        F.cross_entropy(model(x), y).backward()  # DDP: the hook sends each bucket
        middle = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times[key].append(time.perf_counter() - start)
        times["update_s"].append(time.perf_counter() - middle)

    for idx in itertools.islice(batches, steps + 2):
        x, y = train_set[idx]
        start = time.perf_counter()
        with model.no_sync():  # DDP: no all-reduce: the compute alone
            F.cross_entropy(model(x), y).backward()
        times["compute_s"].append(time.perf_counter() - start)
        opt.zero_grad(set_to_none=True)
        with link.off():  # LINK: the same step over this machine's own network
            timed_step(x, y, "here_s")
        timed_step(x, y, "step_s")
    # the first two of each left out: warm-up, and DDP's buckets rebuilt after the first step
    added = [b - a for a, b in zip(times["here_s"][2:], times["step_s"][2:])]
    return {**{k: statistics.median(v[2 * (k == "update_s") + 2:]) for k, v in times.items()},
            "link_s": statistics.median(added),  # what the link added to a step, pair by pair
            "bucket_bytes": [sizes[i] for i in sorted(sizes)]}


def noting_sizes(hook, sizes):
    """``hook``, after it notes each bucket's bytes in ``sizes`` (for --bench)."""
    def noted(state, bucket):
        sizes[bucket.index()] = bucket.buffer().numel() * bucket.buffer().element_size()
        return hook(state, bucket)
    return noted


def main(args):
    env = setup(args)
    rank, world_size = dist.get_rank(), dist.get_world_size()  # DDP: who am I, how many are we?
    dev = env.device
    link = links.EmulatedLink(links.link(args.link), world_size)  # LINK: the network to pay
    if args.link != "none" and dev.type == "cuda":  # the link waits on CPU ranks' futures
        world.stop(env, "--link emulates a network for CPU ranks (gloo): add --device cpu, "
                        "or leave --link out")
    train_set = InMemoryFashionMNIST(args.data_root, train=True, device=dev, first=args.images)
    test_set = InMemoryFashionMNIST(args.data_root, train=False, device=dev)
    sampler = DistributedSampler(train_set, world_size, rank, seed=args.seed,  # DDP: my shard
                                 drop_last=True)
    torch.manual_seed(args.seed)
    model = DDP(FashionCNN(args.width).to(dev),  # DDP: rank 0's weights to all; buckets
                device_ids=[dev] if dev.type == "cuda" else None, bucket_cap_mb=args.bucket_cap_mb)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)

    def batches():  # this rank's batches, epoch after epoch
        for epoch in range(10**6):
            sampler.set_epoch(epoch)  # DDP: a new order each epoch, the same on every rank
            for idx in BatchSampler(sampler, args.batch_size, drop_last=True):
                yield torch.as_tensor(idx, device=dev)

    if args.compress == "none":
        state, hook = None, link.hook()  # LINK: DDP's all-reduce of each bucket, then the link
    else:
        kind = {"topk": lambda *a: TopK(*a, args.ratio), "sign": Sign}[args.compress]
        # DDP: the ranks that send, and average
        state, hook = kind(link, world_size, not args.no_error_feedback), send_less_hook
    sizes = {}  # bucket index -> bytes (--bench)
    # DDP: what DDP does with each bucket of gradients
    model.register_comm_hook(state, noting_sizes(hook, sizes) if args.bench else hook)

    log = JsonLog(args.log_json if rank == 0 else None, world_size=world_size)  # DDP: rank 0
    if args.bench:
        result = bench(model, opt, batches(), train_set, link, args.steps, sizes)
        if rank == 0:  # DDP: one rank reports
            print(", ".join(f"{k} {v}" for k, v in result.items()), flush=True)
        log.write("bench", link=args.link, compress=args.compress, width=args.width,
                  batch_size=args.batch_size, bucket_cap_mb=args.bucket_cap_mb, **result)
        return cleanup()

    seconds, losses = [], []
    for step, idx in zip(range(args.steps), batches()):
        start = time.perf_counter()
        x, y = train_set[idx]
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()  # DDP: the hook sends each bucket while backward runs
        opt.step()
        seconds.append(time.perf_counter() - start)
        losses.append(loss.item())
    accuracy = evaluate(model.module, test_set, link, rank, world_size)
    spread = training.replicas_max_diff(  # DDP: the largest |rank's weight - rank 0's|
        model.module, training.broadcast_from_rank0, training.max_over_ranks)
    tail = max(1, args.steps // 10)
    result = {"link": args.link, "compress": args.compress,
              "error_feedback": args.compress != "none" and not args.no_error_feedback,
              "ms_per_step": round(1000 * statistics.median(seconds[2:] or seconds), 2),
              "bytes_per_step": {op: n // args.steps for op, n in link.bytes.items()},
              "link_added_s": round(link.added, 3),
              "train_loss": round(statistics.mean(losses[-tail:]), 4),
              "test_accuracy": round(accuracy, 4), "replicas_max_diff": spread}
    if rank == 0:  # DDP: one rank reports
        print(", ".join(f"{k} {v}" for k, v in result.items()), flush=True)
    log.write("done", steps=args.steps, batch_size=args.batch_size, width=args.width, **result)
    cleanup()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--link", default="none", choices=["none", *links.PRESETS],
                        help="the emulated link every collective pays (none: this machine's)")
    parser.add_argument("--compress", default="none", choices=["none", "topk", "sign"])
    parser.add_argument("--ratio", type=float, default=0.001, help="topk: the share sent")
    parser.add_argument("--no-error-feedback", action="store_true",
                        help="drop what was not sent instead of keeping it for the next step")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--images", type=int, default=60000, help="the first N training images")
    parser.add_argument("--batch-size", type=int, default=64, help="per rank")
    parser.add_argument("--width", type=int, default=16, help="the CNN's channels")
    parser.add_argument("--lr", type=float, default=0.3)
    parser.add_argument("--momentum", type=float, default=0.0,
                        help="SGD's momentum: error feedback as analysed is for plain SGD")
    parser.add_argument("--bucket-cap-mb", type=float, default=25, help="DDP's bucket size")
    parser.add_argument("--bench", action="store_true", help="measure the planner's inputs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-root", default=None)
    parser.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl", "mpi"])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--timeout", type=float, default=60, help="seconds a collective may wait")
    parser.add_argument("--log-json", default=None, help="rank 0 writes JSON lines here")
    main(parser.parse_args())
