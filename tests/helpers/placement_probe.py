"""Which GPU and backend each srun task takes (dpcourse.lab.world.placement), on the test cluster's
pretend GPUs.

Test-only: torch here has no GPU, so its GPU count is faked from CUDA_VISIBLE_DEVICES, which Slurm
sets for each task as it would on a real GPU node. The labs never contain this shim."""
import json
import os

import torch

visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
torch.cuda.is_available = lambda: bool(visible)
torch.cuda.device_count = lambda: len(visible)

from dpcourse.lab import world  # noqa: E402

info = world.env_info()
placed = world.placement("auto", os.environ.get("PROBE_DEVICE", "auto"), info)
print(json.dumps({"rank": info.rank, "local_rank": info.local_rank,
                  "visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "backend": placed.backend,
                  "device": str(placed.device), "note": placed.note}), flush=True)
