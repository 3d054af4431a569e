"""The JSON-lines run log every lab writes (rank 0 only).

One object per line; at least ``event``, ``epoch``, ``step``, ``world_size``, ``global_batch``,
``train_loss``, ``test_accuracy``, ``samples_per_s``, ``elapsed_s`` for training events
(docs/design.md §3). Plots read these files, never numbers typed into a cell.

``StepTimer`` adds where the time of a step goes, and the bytes it sends (``--time-split``).
"""
from __future__ import annotations

import json
import math
import os
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from dpcourse.lab import world
from dpcourse.lab.whoami import env_info


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


# The bytes of one element of each dtype, by the name the flight recorder gives it (c10's).
DTYPE_BYTES = {"Bool": 1, "Byte": 1, "Char": 1, "Short": 2, "Half": 2, "BFloat16": 2, "Int": 4,
               "Float": 4, "Long": 8, "Double": 8, "ComplexFloat": 8, "ComplexDouble": 16}


def flight_recorder() -> dict:
    """What PyTorch's flight recorder holds now: this process's last collectives, on every backend
    (``TORCH_FR_BUFFER_SIZE`` of them, set before ``init_process_group``; 0 turns it off). Its
    ``entries`` (oldest first) say which collective, on which group, with which tensors' shapes and
    dtypes, and when it was created (``time_created_ns``, the wall clock of ``time.time_ns()``).
    The time split counts a step's bytes with it."""
    from torch._C import _distributed_c10d as c10d

    dump = getattr(c10d, "_dump_fr_trace_json", None) or c10d._dump_nccl_trace_json
    return json.loads(dump(includeCollectives=True, onlyActive=False))


def write_flight_recorder(folder: str | os.PathLike, rank: int) -> Path:
    """This rank's flight recorder, as PyTorch's reader reads it: the pickle of
    ``_dump_fr_trace`` (its collectives with their sequence numbers, sizes and Python stacks),
    written to ``folder/rank_<rank>``, the name ``python -m torch.distributed.flight_recorder.
    fr_trace folder`` looks for. Gloo dumps nothing by itself on a timeout (only NCCL's watchdog
    does), so a lab calls this in a ``finally`` around its collectives. No collective: it reads
    this process's own recorder.

    The one repair (torch 2.14.1): a gloo group files itself in the dump's ``pg_config`` under an
    empty name, because it is built before it is named, while its entries name it (``'0'``); the
    reader then stops at ``KeyError: ('0', 0)``. The default group is filed again under the name
    its entries use, where it is missing; the other groups' entries stay as they are. Drop the
    repair once the reader reads an unrepaired gloo dump."""
    import pickle

    from torch._C import _distributed_c10d as c10d

    dump = pickle.loads(c10d._dump_fr_trace(includeCollectives=True, includeStackTraces=True))
    group = dist.group.WORLD
    name, configs = group.group_name, dump.setdefault("pg_config", {})
    if name not in configs:  # the repair; every other group's entry is kept as it is
        unnamed = configs.pop("", None) or {"desc": group.group_desc,
                                            "ranks": str(dist.get_process_group_ranks(group))}
        configs[name] = {**unnamed, "name": name}
    path = Path(folder) / f"rank_{rank}"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        pickle.dump(dump, f)
    return path


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

    Bytes: the timer only notes when each step was open (``start()`` to ``stop()``, less what
    ``paused()`` leaves out). ``report()`` reads PyTorch's flight recorder (``flight_recorder()``),
    which records every collective the process group runs, from Python or from C++ (DDP's built-in
    all-reduce, PowerSGD's all-reduces launched from gloo's thread), and counts those created while
    a step was open, in groups of more than one rank: how many, and the payload in bytes this rank
    handed over. Nothing of ``torch.distributed`` is replaced. The recorder must hold every
    collective between two reports (``TORCH_FR_BUFFER_SIZE``): a report that finds some gone says
    so and stops the run, rather than count too few.

    Disabled (``enabled=False``), every method returns at once: the lab keeps its lines either way.
    On a GPU, each lap synchronises the device so that the times are true, which costs a little.
    """

    def __init__(self, device, enabled: bool = True):
        self.enabled = enabled
        self.sync = (torch.cuda.synchronize if getattr(device, "type", device) == "cuda"
                     else (lambda: None))
        self._reset()
        self.open = False
        self.seen = None  # the flight recorder's last entry already counted (or passed over)

    def _reset(self):
        self.ms, self.steps, self.comm_s, self.buckets = {}, 0, 0.0, 0
        # [created after, created before] in ns: when a step was open (one still open goes on)
        self.windows = [[time.time_ns(), None]] if getattr(self, "open", False) else []

    def _open(self):
        self.windows.append([time.time_ns(), None])
        self.open = True

    def _shut(self):
        if self.open:
            self.windows[-1][1] = time.time_ns()
            self.open = False

    @contextmanager
    def paused(self):
        """Count no collective inside: a lab's own between its steps (its log's, its evaluation's)
        are not a step's."""
        was = self.open
        self._shut()
        try:
            yield
        finally:
            if was:
                self._open()

    def start(self):
        if self.enabled:
            if self.seen is None:  # the first step: what the recorder holds now is not a step's
                self.seen = max((e["record_id"] for e in flight_recorder().get("entries", [])),
                                default=-1)
            self.sync()
            self.t = time.perf_counter()
            self.last_ready = None
            self._open()

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
            self._shut()

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

    def _sent(self) -> tuple[int, int]:
        """(bytes, collectives) the flight recorder holds from the open steps since the last
        report, in groups of more than one rank."""
        recorded = flight_recorder()
        if "entries" not in recorded and self.windows:
            world.stop(env_info(), "--time-split counts a step's bytes with PyTorch's flight "
                       "recorder, which records nothing here: run without TORCH_FR_BUFFER_SIZE=0")
        new = sorted((e for e in recorded.get("entries", []) if e["record_id"] > self.seen),
                     key=lambda e: e["record_id"])
        if new and new[0]["record_id"] != self.seen + 1:
            made = new[-1]["record_id"] - self.seen
            world.stop(env_info(), f"the flight recorder keeps the last {len(new)} collectives, "
                       f"and {made} were made between two records of the time split: log more "
                       f"often (--log-every), or keep more "
                       f"(TORCH_FR_BUFFER_SIZE={2 * made} or more, set before the run)")
        self.seen = new[-1]["record_id"] if new else self.seen
        groups = dist.distributed_c10d._world.pg_names.items()  # {group: its name}
        ranks = {name: group.size() for group, name in groups}
        now = time.time_ns()
        sent = [e for e in new if ranks.get(e["process_group"][0], 1) > 1
                and any(a <= e["time_created_ns"] <= (b or now) for a, b in self.windows)]
        size = sum(math.prod(shape) * DTYPE_BYTES[dtype] for e in sent
                   for shape, dtype in zip(e["input_sizes"], e["input_dtypes"]))
        return size, len(sent)

    def report(self) -> dict:
        """Mean per step since the last report: ``split_ms`` by phase, ``comm_ms``, ``comm_bytes``,
        ``collectives`` (the calls that sent them) and ``buckets`` (DDP's hook calls per step, one
        per bucket; a hook may make more than one collective call per bucket, PowerSGD's three)."""
        if not self.enabled or not self.steps:
            return {}
        n, (size, calls) = self.steps, self._sent()
        out = {"split_ms": {k: round(v / n, 3) for k, v in self.ms.items()},
               "comm_ms": round(1000 * self.comm_s / n, 3), "comm_bytes": round(size / n),
               "collectives": round(calls / n, 2), "buckets": round(self.buckets / n, 2)}
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
