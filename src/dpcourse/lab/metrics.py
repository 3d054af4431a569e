"""The JSON-lines run log every lab writes (rank 0 only).

One object per line; at least ``event``, ``epoch``, ``step``, ``world_size``, ``global_batch``,
``train_loss``, ``test_accuracy``, ``samples_per_s``, ``elapsed_s`` for training events
(docs/design.md §3). Plots read these files, never numbers typed into a cell.

``StepTimer`` adds where the time of a step goes, and the bytes it sends (``--time-split``).
"""
from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist


class JsonLog:
    """Append-only JSON-lines writer; a no-op where ``path`` is None (the other ranks)."""

    def __init__(self, path: str | os.PathLike | None, append: bool = False,
                 elapsed_before: float = 0.0, **common):
        """``append`` keeps earlier records (a resumed run); ``elapsed_before`` is the time it
        had already trained, so ``elapsed_s`` goes on counting from there."""
        self.path = Path(path) if path else None
        self.common = common
        self.start = time.perf_counter() - elapsed_before
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if not (append and self.path.exists()):
                self.path.write_text("")

    def elapsed(self) -> float:
        """Seconds since the clock started (plus ``elapsed_before``)."""
        return time.perf_counter() - self.start

    def write(self, event: str, **fields) -> dict:
        record = {"event": event, **self.common, **fields,
                  "elapsed_s": round(self.elapsed(), 4)}
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
        return record


def read_log(path: str | os.PathLike) -> list[dict]:
    """All records of a JSON-lines log."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class StepTimer:
    """Where a training step's time goes, and how many bytes it hands to collectives.

    The lab closes each phase with ``lap(name)`` (data, forward, backward, optimizer, ...) between
    ``start()`` and ``stop()``; ``report()`` gives the mean milliseconds per step of every phase
    since the last report. The all-reduce is timed by wrapping DDP's communication hook with
    ``timed(hook)``: DDP calls the hook as soon as a bucket of gradients is ready, and backward()
    returns only when every bucket's all-reduce is done. So what backward spends after the *last*
    bucket became ready is all-reduce that no computation hid ("allreduce", exposed); the rest of
    backward is computation. ``comm_ms`` is the sum, over buckets, of launch → done: the whole
    all-reduce time, hidden or not.

    Bytes: while a step is open, calls of ``torch.distributed`` collectives made from Python (DDP
    hooks, PowerSGD, model averaging) are counted: how many calls, and the payload in bytes this
    rank hands over, in groups of more than one rank. DDP's built-in all-reduce runs in C++ and is
    not seen: time a run with a registered hook (``default_hooks.allreduce_hook`` does what the
    built-in does).

    The counting wraps those ``torch.distributed`` functions from ``start()`` to ``stop()`` only,
    and puts torch's own back after each step; ``close()`` (or leaving a ``with StepTimer(...)``
    block) puts them back if a step was left open. Nothing outside a timed step is wrapped.

    Disabled (``enabled=False``), every method returns at once: the lab keeps its lines either way.
    On a GPU, each lap synchronises the device so that the times are true, which costs a little.
    """

    COUNTED = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor",
               "reduce_scatter_tensor")

    def __init__(self, device, enabled: bool = True):
        self.enabled = enabled
        self.sync = (torch.cuda.synchronize if getattr(device, "type", device) == "cuda"
                     else (lambda: None))
        self._reset()
        self.open = False
        self._torch_own = None  # torch.distributed's collectives while ours count them

    def _wrap(self):
        if self._torch_own is None:
            self._torch_own = {name: getattr(dist, name) for name in self.COUNTED}
            for name, collective in self._torch_own.items():
                setattr(dist, name, self._counting(collective))

    def close(self):
        """Put torch.distributed's own collectives back (a step left open stops counting)."""
        if self._torch_own is not None:
            for name, collective in self._torch_own.items():
                setattr(dist, name, collective)
            self._torch_own = None
        self.open = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _reset(self):
        self.ms, self.steps, self.comm_s, self.bytes, self.buckets, self.calls = {}, 0, 0.0, 0, 0, 0

    def _counting(self, collective):
        def counted(*args, **kwargs):
            if self.open:
                tensor = args[1] if collective.__name__ in ("all_gather", "all_gather_into_tensor",
                                                            "reduce_scatter_tensor") else args[0]
                group = kwargs.get("group")
                if dist.get_world_size(group) > 1:
                    self.bytes += tensor.numel() * tensor.element_size()
                    self.calls += 1
            return collective(*args, **kwargs)
        counted.__name__ = collective.__name__
        return counted

    @contextmanager
    def paused(self):
        """Count no collective inside: a lab's own between its steps (its log's, its evaluation's)
        are not a step's."""
        was, self.open = self.open, False
        try:
            yield
        finally:
            self.open = was

    def start(self):
        if self.enabled:
            self.sync()
            self.t = time.perf_counter()
            self.last_ready = None
            self.open = True
            self._wrap()

    def lap(self, phase: str):
        """Close ``phase``: the time since the previous lap (or start) is added to it."""
        if not self.enabled:
            return
        self.sync()
        now = time.perf_counter()
        if phase == "backward" and self.last_ready is not None:  # split off the exposed all-reduce
            self._add("backward", self.last_ready - self.t)
            self._add("allreduce", now - self.last_ready)
        else:
            self._add(phase, now - self.t)
        self.t, self.last_ready = now, None

    def _add(self, phase, seconds):
        self.ms[phase] = self.ms.get(phase, 0.0) + 1000 * seconds

    def stop(self):
        if self.enabled:
            self.steps += 1
            self.close()

    def timed(self, hook):
        """A DDP communication hook that does what ``hook`` does, and times it."""
        if not self.enabled:
            return hook
        def timed_hook(state, bucket):
            self.sync()
            self.buckets += 1
            self.last_ready = launched = time.perf_counter()
            def done(fut):
                self.comm_s += time.perf_counter() - launched
                return fut.value()
            return hook(state, bucket).then(done)
        return timed_hook

    def report(self) -> dict:
        """Mean per step since the last report: ``split_ms`` by phase, ``comm_ms``, ``comm_bytes``,
        ``collectives`` (the calls that sent them) and ``buckets`` (DDP's hook calls per step, one
        per bucket; a hook may make more than one collective call per bucket, PowerSGD's three)."""
        if not self.enabled or not self.steps:
            return {}
        n = self.steps
        out = {"split_ms": {k: round(v / n, 3) for k, v in self.ms.items()},
               "comm_ms": round(1000 * self.comm_s / n, 3), "comm_bytes": round(self.bytes / n),
               "collectives": round(self.calls / n, 2), "buckets": round(self.buckets / n, 2)}
        self._reset()
        return out


def trace_profiler(path, wait: int = 5, active: int = 3):
    """torch.profiler over ``active`` steps after ``wait``, saved as a Chrome trace at ``path``
    (open it at https://ui.perfetto.dev or chrome://tracing); None without a path. Call ``step()``
    after each training step and ``stop()`` at the end."""
    if not path:
        return None
    prof = torch.profiler.profile(
        schedule=torch.profiler.schedule(wait=wait, warmup=1, active=active, repeat=1),
        on_trace_ready=lambda p: p.export_chrome_trace(str(path)))
    prof.start()
    return prof


# Dense bf16/fp16 tensor-core peaks in TFLOP/s, from the vendors' data sheets, for the model FLOP
# utilisation (MFU) in ImageNet's log: the first name found in the GPU's name gives its peak.
PEAK_TFLOPS = {"H200": 989, "H100 SXM": 989, "H100 80GB HBM3": 989, "H100 PCIe": 756, "H100": 756,
               "A100": 312, "L40S": 362, "A40": 150, "A10": 125, "V100": 125, "RTX 4090": 165}


def peak_tflops(device, given: float | None = None) -> float | None:
    """This GPU's dense tensor-core peak (``given``, else the table above); None on a CPU or an
    unknown GPU."""
    if given or torch.device(device).type != "cuda":
        return given
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def train_flops(model: torch.nn.Module, image_size: int) -> int:
    """FLOPs of one image's forward and backward, counted on a shape-only ("meta") copy of
    ``model``."""
    from copy import deepcopy

    from torch.utils.flop_counter import FlopCounterMode

    meta = deepcopy(model).to("meta")
    with FlopCounterMode(display=False) as counter:  # 2 images: BatchNorm refuses to train on one
        meta(torch.empty(2, 3, image_size, image_size, device="meta")).sum().backward()
    return counter.get_total_flops() // 2
