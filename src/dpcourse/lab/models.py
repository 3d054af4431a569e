"""The course's models.

``FashionCNN`` is the FashionMNIST network of the labs: two conv blocks and one linear layer,
about 20k parameters. On two CPU cores it reaches 90 % test accuracy in under 30 s of
data-parallel training (see docs/design.md §6), and the same module runs on a GPU unchanged.

Its normalisation is **GroupNorm**, not BatchNorm, on purpose: GroupNorm normalises each
example on its own, so K workers with a global batch G compute exactly the gradient one process
computes with batch G. BatchNorm normalises over each worker's *shard* of the batch, and on a
CPU there is no ``SyncBatchNorm`` to make it global; ``norm="batch"`` is there to show that
difference (notebook 05).
"""
from __future__ import annotations

import math

import torch
from torch import nn

NORMS = ("group", "batch", "none")


def _norm(kind: str, channels: int) -> nn.Module:
    # 4 groups; fewer where 4 does not divide the channels (--width 6: 2, then 4)
    if kind == "group":
        return nn.GroupNorm(math.gcd(4, channels), channels)
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    if kind == "none":
        return nn.Identity()
    raise ValueError(f"norm must be one of {NORMS}, not {kind!r}")


class FashionCNN(nn.Sequential):
    """[conv 3×3 → norm → ReLU → max-pool 2] × 2 → linear: 28×28 → 14×14 → 7×7 → 10 classes."""

    def __init__(self, width: int = 16, norm: str = "group", classes: int = 10):
        super().__init__(
            nn.Conv2d(1, width, 3, padding=1, bias=False), _norm(norm, width), nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1, bias=False), _norm(norm, 2 * width),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(2 * width * 7 * 7, classes),
        )
        self.config = {"name": "FashionCNN", "width": width, "norm": norm, "classes": classes}

    def to(self, *args, **kwargs):
        """``nn.Module.to``; then, on a GPU, the first convolution's weight, which sees one input
        channel, keeps torch's default strides. With one input channel, ``channels_last`` holds the
        same bytes in the same order, but on a GPU its strides differ from those cuDNN gives the
        weight's gradient, and DDP, which compares them with its bucket's, warns on every rank
        ("Grad strides do not match bucket view strides"; seen on an H100). On the CPU the gradient
        comes back in the weight's own strides, and the CPU's convolution picks its kernel by them,
        so the CPU keeps them as they are."""
        module = super().to(*args, **kwargs)
        first = module[0].weight
        if first.is_cuda and first.shape[1] == 1 and first.stride()[1] != first[0, 0].numel():
            # same values, same order
            first.data = first.data.clone(memory_format=torch.contiguous_format)
        return module



def torchvision_model(arch: str, classes: int, stop) -> torch.nn.Module:
    """torchvision's ``arch`` (untrained) for ``classes`` classes; in a residual network the last
    BatchNorm of each block starts at zero (Goyal et al.), so that each block starts as the
    identity. An unknown name ends the run through ``stop(message)`` with names to try."""
    import torchvision

    if arch not in torchvision.models.list_models(torchvision.models):
        stop(f"--arch {arch}: torchvision has no such model. Try resnet18, resnet50, "
             "resnext50_32x4d, ... (the names of torchvision.models.list_models()).")
    residual = arch.startswith(("resnet", "resnext", "wide_resnet"))
    extra = {"zero_init_residual": True} if residual else {}
    return torchvision.models.get_model(arch, weights=None, num_classes=classes, **extra)
