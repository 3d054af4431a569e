"""FashionMNIST held in memory as tensors: the IDX files that dpcourse.lab.data found and verified,
read into uint8 tensors, and the dataset the labs train on. ``from dpcourse.lab.data import
InMemoryFashionMNIST`` imports this module (dpcourse.lab.data itself does not load torch)."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from dpcourse.lab.data import MEAN, STD, default_root, ensure_fashion_mnist
from dpcourse.lab.errors import CourseError


def read_idx(path: str | os.PathLike) -> torch.Tensor:
    """An IDX file (the MNIST format) as a uint8 tensor: images [N, 28, 28], labels [N]."""
    data = Path(path).read_bytes()
    magic = int.from_bytes(data[0:4], "big")
    if magic >> 8 != 0x08:  # 0x08 = unsigned byte
        raise CourseError(f"{path} is not a uint8 IDX file (magic {magic:#x}).")
    ndim = magic & 0xFF
    shape = [int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    array = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if array.size != int(np.prod(shape)):
        raise CourseError(f"{path} holds {array.size} values, its header says {shape}.")
    return torch.from_numpy(array.copy()).reshape(shape)


def load_fashion_mnist(root: str | os.PathLike | None = None, train: bool = True,
                       download: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(images uint8 [N, 28, 28], labels int64 [N]) of the training (60k) or test (10k) split."""
    raw = ensure_fashion_mnist(root, download)
    prefix = "train" if train else "t10k"
    images = read_idx(raw / f"{prefix}-images-idx3-ubyte")
    labels = read_idx(raw / f"{prefix}-labels-idx1-ubyte").long()
    return images, labels


class InMemoryFashionMNIST(torch.utils.data.Dataset):
    """The whole split as one uint8 tensor, on the CPU or the GPU.

    Indexing with a tensor of indices returns a whole normalised batch in one operation, which
    is what makes it fast: no per-sample Python, no worker processes::

        ds = InMemoryFashionMNIST(train=True)
        x, y = ds[torch.randperm(len(ds))[:256]]   # x: [256, 1, 28, 28] float, y: [256]
    """

    def __init__(self, root=None, train: bool = True, device: str | torch.device = "cpu",
                 download: bool = True, first: int | None = None):
        """``first``: keep only the split's first N images (a quick run; a sampler over this set
        then draws from those N, in any loader that it feeds)."""
        images, labels = load_fashion_mnist(root, train, download)
        if first is not None:
            if not 0 < first <= len(labels):
                raise CourseError(f"the first {first:,} images: the "
                                  f"{'training' if train else 'test'} set has {len(labels):,}; "
                                  f"give a number from 1 to {len(labels):,}.")
            images, labels = images[:first], labels[:first]
        self.images = images.to(device)
        self.labels = labels.to(device)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index):
        x = self.images[index].float().div_(255).sub_(MEAN).div_(STD).unsqueeze(-3)
        return x, self.labels[index]


def torchvision_fashion_mnist(root=None, train: bool = True, download: bool = True):
    """The classic per-sample path (PIL image → ToTensor → Normalize), for comparison."""
    from torchvision import datasets, transforms

    ensure_fashion_mnist(root, download)
    tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize((MEAN,), (STD,))])
    return datasets.FashionMNIST(str(default_root(root)), train=train, transform=tf, download=False)
