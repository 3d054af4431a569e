"""Memory arithmetic of data parallelism: what each worker holds, and what it sends, per step.

Training with Adam keeps, for every one of the model's Ψ parameters (Rajbhandari et al.,
*ZeRO*, 2020):

    fp32      weights 4 B + gradients 4 B + Adam's two moments 8 B                    = 16 B
    mixed     weights 2 B + gradients 2 B (fp16/bf16) + the fp32 master weights and
              the two moments 12 B (the optimizer's "K = 12")                         = 16 B

Plain data parallelism keeps all of it on every worker. ZeRO shards it over the P workers:

    stage 0   plain DP (DDP)                        weights  + grads  + optimizer
    stage 1   ZeRO-1: optimizer state sharded       weights  + grads  + optimizer / P
    stage 2   ZeRO-2: + gradients sharded           weights  + (grads + optimizer) / P
    stage 3   ZeRO-3 / FSDP: + weights sharded      (weights + grads + optimizer) / P

These are the *model states* only: activations, temporary buffers (DDP's buckets, FSDP's
gathered layer) and the framework's own memory come on top.

Communication per worker and step, in parameters (each collective over P workers moves
(P-1)/P of its data through every worker): an all-reduce is a reduce-scatter plus an
all-gather, 2Ψ; ZeRO-1 and -2 reduce-scatter the gradients and all-gather the updated weights,
2Ψ too; ZeRO-3 gathers the weights twice (forward and backward) and reduce-scatters the
gradients, 3Ψ: 1.5 × DDP's traffic, for 1/P of its memory.
"""
from __future__ import annotations

STAGES = (0, 1, 2, 3)
STAGE_NAMES = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3 / FSDP"}
# bytes per parameter: (weights, gradients, optimizer state)
BYTES = {"fp32": (4, 4, 8), "mixed": (2, 2, 12)}
# Ψ: the parameters of the models of the lectures
MODELS = {"ResNet-50": 25.6e6, "ViT-L/16": 304e6, "GPT-2 XL": 1.5e9, "LLaMA 7B": 6.7e9,
          "GPT-3": 175e9}
GPUS = {"V100 16 GB": 16e9, "V100 32 GB": 32e9, "A100 40 GB": 40e9, "A100 80 GB": 80e9,
        "H100 80 GB": 80e9, "H200 141 GB": 141e9}


def _check(world_size: int, stage: int, precision: str):
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES} (0 = plain DP), not {stage!r}")
    if precision not in BYTES:
        raise ValueError(f"precision must be one of {tuple(BYTES)}, not {precision!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, not {world_size}")


def per_worker(params: float, world_size: int, stage: int, precision: str = "fp32") -> dict:
    """Bytes of model state one worker holds: ``weights``, ``grads``, ``optimizer`` and
    ``total``."""
    _check(world_size, stage, precision)
    w, g, o = (b * params for b in BYTES[precision])
    P = world_size
    held = {"weights": w / P if stage >= 3 else w,
            "grads": g / P if stage >= 2 else g,
            "optimizer": o / P if stage >= 1 else o}
    held["total"] = sum(held.values())
    return held


def comm_per_step(params: float, world_size: int, stage: int, precision: str = "fp32") -> float:
    """Bytes one worker sends (and receives) per step: 2Ψ (P-1)/P gradients' worth for DDP,
    ZeRO-1 and ZeRO-2, 3Ψ (P-1)/P for ZeRO-3, at the gradients' precision."""
    _check(world_size, stage, precision)
    element = BYTES[precision][1]
    return (3 if stage == 3 else 2) * params * (world_size - 1) / world_size * element


def fits(params: float, world_size: int, stage: int, gpu_bytes: float, precision: str = "fp32",
         headroom: float = 0.8) -> bool:
    """Whether the model states fit in ``headroom`` of a GPU (the rest for activations and
    buffers)."""
    return per_worker(params, world_size, stage, precision)["total"] <= headroom * gpu_bytes


def min_world_size(params: float, stage: int, gpu_bytes: float, precision: str = "fp32",
                   headroom: float = 0.8, limit: int = 1 << 20) -> int | None:
    """The fewest workers (a power of 2) on which the model states fit; None if none up to
    ``limit``."""
    P = 1
    while P <= limit:
        if fits(params, P, stage, gpu_bytes, precision, headroom):
            return P
        P *= 2
    return None


def human(nbytes: float) -> str:
    """1.6e+10 → '16.0 GB' (decimal units, as GPUs are sold)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(nbytes) < 1000 or unit == "TB":
            return f"{nbytes:.1f} {unit}" if unit != "B" else f"{nbytes:.0f} B"
        nbytes /= 1000


def explain(params: float, world_size: int, gpu: str, precision: str = "fp32") -> list[str]:
    """One line per stage: what a worker holds, whether it fits the GPU, and the traffic per
    step."""
    lines = []
    for stage in STAGES:
        held = per_worker(params, world_size, stage, precision)
        ok = fits(params, world_size, stage, GPUS[gpu], precision)
        need = min_world_size(params, stage, GPUS[gpu], precision)
        where = "fits" if ok else ("does not fit"
                                   + (f": needs {need} workers" if need else ": never"))
        lines.append(f"{STAGE_NAMES[stage]:<14} {human(held['total']):>9} per worker  "
                     f"{'✓' if ok else '✗'} {where:<28} "
                     f"sends {human(comm_per_step(params, world_size, stage, precision))}/step")
    return lines
