"""Runs a lab (argv[1], its options after it) in a process whose torch "sees" the GPUs
CUDA_VISIBLE_DEVICES names, read when torch asks, as CUDA reads it when first asked: torch here has
no GPU. Test-only: the labs never contain this shim."""
import functools
import os
import runpy
import sys

import torch


@functools.cache  # read once, when first asked, as CUDA does
def _visible() -> list[str]:
    return [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]


torch.cuda.is_available = lambda: bool(_visible())
torch.cuda.device_count = lambda: len(_visible())
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
