"""Checkpoints and failures in numbers (notebook 14): what a distributed checkpoint's metadata says,
how often large jobs fail, and how often to save.

    from dpcourse.explore import checkpoints
    checkpoints.pieces("ck/step-0000012")       # [(key, file, bytes)]: which rank's file holds what
    checkpoints.young_daly_s(save_s=0.02, mtbf_s=checkpoints.mtbf_s(512))

The failure rate is the one Meta published for Llama 3's pre-training: 419 unexpected
interruptions in a 54-day period on 16,384 H100 GPUs (Llama Team, AI @ Meta, "The Llama 3 Herd of
Models", arXiv:2407.21783, 2024, §3.3.4 and its Table 5). Spread evenly over the GPUs, that is one
interruption per 50,677 GPU-hours; a job on G GPUs, which stops when any of them does, meets one
every 50,677 / G hours (3.1 h on all 16,384). The interval is Young's first-order optimum,
√(2·C·M) for a save that takes C and a mean time between failures M (J. W. Young, "A first order
approximation to the optimum checkpoint interval", Communications of the ACM 17(9), 1974; Daly's
higher-order estimate, Future Generation Computer Systems 22(3), 2006, is within a few per cent of
it while C is much smaller than M).
"""
from __future__ import annotations

import math
from pathlib import Path

LLAMA3_INTERRUPTIONS = 419  # unexpected interruptions ...
LLAMA3_DAYS = 54  # ... in this many days of pre-training ...
LLAMA3_GPUS = 16_384  # ... on this many H100 GPUs (arXiv:2407.21783, §3.3.4, Table 5)
GPU_MTBF_H = LLAMA3_DAYS * 24 * LLAMA3_GPUS / LLAMA3_INTERRUPTIONS  # hours per GPU between two


def mtbf_s(gpus: int, gpu_mtbf_h: float = GPU_MTBF_H) -> float:
    """Seconds between two interruptions of a job on ``gpus`` GPUs, any one of which stops it."""
    return gpu_mtbf_h * 3600 / gpus


def young_daly_s(save_s: float, mtbf_s: float) -> float:
    """The interval between two saves that loses the least time: √(2·C·M) (Young, 1974)."""
    return math.sqrt(2 * save_s * mtbf_s)


def waste(interval_s: float, save_s: float, mtbf_s: float, restart_s: float = 0.0) -> float:
    """The fraction of a job's time lost to checkpoints and failures, to first order: a save of
    ``save_s`` every ``interval_s``, and at each failure (one every ``mtbf_s``) the restart and,
    on average, half an interval of work done again."""
    return save_s / interval_s + (interval_s / 2 + restart_s) / mtbf_s


def human_s(seconds: float) -> str:
    """A duration the way a person says it: 45 s, 12.5 min, 3.1 h, 2.0 days."""
    for unit, size in (("days", 86400), ("h", 3600), ("min", 60)):
        if seconds >= 2 * size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.3g} s"


def pieces(path: str | Path) -> list[tuple[str, str, int]]:
    """Which file of the distributed checkpoint at ``path`` holds which piece: (key, file, bytes)
    for each stored piece, from its .metadata (a tensor cut in shards has a row per shard)."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(path)).read_metadata()
    return sorted((index.fqn, info.relative_path, info.length)
                  for index, info in meta.storage_data.items())


def by_file(rows: list[tuple[str, str, int]]) -> dict[str, tuple[int, int]]:
    """The pieces and bytes in each file of ``pieces()``'s rows: {file: (pieces, bytes)}."""
    files: dict[str, tuple[int, int]] = {}
    for _, name, size in rows:
        count, total = files.get(name, (0, 0))
        files[name] = (count + 1, total + size)
    return dict(sorted(files.items()))
