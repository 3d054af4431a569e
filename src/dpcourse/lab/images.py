"""ImageNet-style data: ImageFolder trees, tar shards, node-local staging (notebook 10).

A data root holds ``train/`` and ``val/``, each in one of two layouts:

* **folders** (torchvision's ``ImageFolder``): ``train/<class>/<image>.JPEG``, one file per image.
  ImageNet ships like this: 1.28 million files, which a parallel filesystem serves slowly,
  because every open is a request to its metadata server.
* **shards**: ``train/shard-000000.tar``, ... holding ``<key>.jpg`` + ``<key>.cls`` pairs (the
  WebDataset convention, so ``webdataset`` reads them too), plus ``index.npz`` (where each image
  sits in which tar) and ``shards.json`` (class names, files). A few large files: one open per
  shard, then plain reads at known offsets, so the usual ``DistributedSampler`` still works.

    python -m dpcourse.lab.data make-imagefolder data/imagenet-mini  # small, learnable, no download
    python -m dpcourse.lab.data make-shards data/imagenet-mini data/imagenet-mini-shards
    # node-local copy
    python -m dpcourse.lab.data stage data/imagenet-mini-shards "$TMPDIR/imagenet"

Both datasets return (uint8 image [3, H, W], class) after a random-resized crop and flip (train)
or a resize and centre crop (val); the float conversion and normalisation happen on the device,
a whole batch at a time. The random crop of image i in epoch e is drawn from a generator seeded
with (seed, e, i), so it does not depend on which worker loads it: a resumed run sees the same
crops as an uninterrupted one.
"""
from __future__ import annotations

import colorsys
import fcntl
import functools
import io
import json
import math
import multiprocessing
import os
import random
import shutil
import sys
import tarfile
import warnings
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from dpcourse.lab.errors import CourseError
from dpcourse.lab.paths import own_folder

MEAN = (0.485, 0.456, 0.406)  # ImageNet's, per RGB channel, pixels in [0, 1]
STD = (0.229, 0.224, 0.225)
SHAPES = ("disc", "square", "triangle", "ring", "cross")
SHARDS_JSON = "shards.json"
STAGED = ".staged.json"
LOCK = ".stage.lock"  # in a staged copy: the lock that lets one process of a node copy
# torchvision 0.29 marks its JPEG decoder deprecated in favour of TorchCodec, which is not yet part
# of the course's pinned environment; decode_jpeg (CPU and nvJPEG) works and is what we teach.
warnings.filterwarnings("ignore",
                        message="The image decoding and encoding capabilities of TorchVision")


# ------------------------------------------------------------------ a learnable ImageFolder tree
def class_names(classes: int) -> list[str]:
    """'00_disc_h000', ...: class c is a shape (c mod 5) in a hue of its own."""
    return [f"{c:02d}_{SHAPES[c % len(SHAPES)]}_h{round(360 * _hue(c, classes)):03d}"
            for c in range(classes)]


def _hue(c: int, classes: int) -> float:
    return (c / classes) if classes <= 12 else (c * 0.618034) % 1.0  # spread out, distinct


def draw(c: int, classes: int, size: int, rng: random.Random):
    """One RGB image of class ``c``: its shape in its hue, placed, sized and lit at random, on a
    noisy background of another colour. A CNN learns these within a few epochs."""
    from PIL import Image, ImageDraw

    bg = tuple(int(255 * v) for v in colorsys.hsv_to_rgb(rng.random(), rng.uniform(0, .4),
                                                         rng.uniform(.2, .6)))
    noise = np.random.default_rng(rng.getrandbits(32)).integers(-25, 26, (size, size, 3))
    img = Image.fromarray(np.clip(np.array(bg) + noise, 0, 255).astype(np.uint8))
    hue = (_hue(c, classes) + rng.uniform(-.03, .03)) % 1.0
    fg = tuple(int(255 * v) for v in colorsys.hsv_to_rgb(hue, rng.uniform(.7, 1),
                                                         rng.uniform(.75, 1)))
    r = size * rng.uniform(.2, .38)
    cx, cy = (rng.uniform(r, size - r) for _ in range(2))
    d, shape = ImageDraw.Draw(img), SHAPES[c % len(SHAPES)]
    if shape == "disc":
        d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fg)
    elif shape == "ring":
        d.ellipse([cx - r, cy - r, cx + r, cy + r], outline=fg, width=max(2, round(r / 3)))
    elif shape == "square":
        d.rectangle([cx - r, cy - r, cx + r, cy + r], fill=fg)
    elif shape == "triangle":
        d.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fg)
    else:
        w = max(2, round(r / 3))
        d.rectangle([cx - r, cy - w, cx + r, cy + w], fill=fg)
        d.rectangle([cx - w, cy - r, cx + w, cy + r], fill=fg)
    return img


def make_imagefolder(dest, classes: int = 10, per_class: int = 20, val_per_class: int = 10,
                     size: int = 64, seed: int = 0, progress: bool | None = None) -> Path:
    """Write ``dest/train/<class>/*.JPEG`` and ``dest/val/<class>/*.JPEG``: the ImageNet layout,
    small (10 classes × 20 + 10 images of 64 px by default) and learnable. The same arguments
    always write the same images."""
    dest = Path(dest)
    if classes < 2 or per_class < 1 or val_per_class < 1 or size < 16:
        raise CourseError("make-imagefolder needs at least 2 classes, 1 image per class and split, "
                          "and 16 px.")
    names = class_names(classes)
    jobs = [(split, c, i) for split, n in (("train", per_class), ("val", val_per_class))
            for c in range(classes) for i in range(n)]
    for split, c, i in tqdm(jobs, desc=f"images in {dest}", unit="img", disable=_quiet(progress)):
        folder = dest / split / names[c]
        folder.mkdir(parents=True, exist_ok=True)
        rng = random.Random(f"{seed}-{split}-{c}-{i}")
        draw(c, classes, size, rng).save(folder / f"{split}_{c:02d}_{i:05d}.JPEG", quality=90)
    return dest


# ------------------------------------------------------------------------------ tar shards
def make_shards(src, dest, shard_size: int = 1000, seed: int = 0,
                progress: bool | None = None) -> Path:
    """Pack the ImageFolder tree ``src`` (train/ and val/) into tar shards of ``shard_size``
    images in ``dest``, in a shuffled order (every shard holds every class), with the index
    that lets a Dataset read image i without scanning."""
    from torchvision.datasets import ImageFolder

    src, dest = Path(src), Path(dest)
    splits = [s for s in ("train", "val") if (src / s).is_dir()]
    if not splits:
        raise CourseError(f"make-shards: {src} has no train/ or val/ folder "
                          "(the ImageFolder layout).")
    for split in splits:
        folder = ImageFolder(src / split)
        order = list(range(len(folder.samples)))
        random.Random(seed).shuffle(order)
        out = dest / split
        out.mkdir(parents=True, exist_ok=True)
        files, where, tar = [], {"shard": [], "offset": [], "size": [], "target": []}, None
        for n, i in enumerate(tqdm(order, desc=f"shards of {split}", unit="img",
                                   disable=_quiet(progress))):
            if n % shard_size == 0:
                if tar is not None:
                    tar.close()
                files.append(f"shard-{len(files):06d}.tar")
                tar = tarfile.open(out / files[-1], "w", format=tarfile.USTAR_FORMAT)
            path, target = folder.samples[i]
            key = f"{split}_{n:08d}"
            data = Path(path).read_bytes()
            info = tarfile.TarInfo(f"{key}.jpg")
            info.size = len(data)
            where["offset"].append(tar.offset + tarfile.BLOCKSIZE)  # a ustar header is one block
            tar.addfile(info, io.BytesIO(data))
            where["shard"].append(len(files) - 1)
            where["size"].append(len(data))
            where["target"].append(target)
            label = str(target).encode()
            info = tarfile.TarInfo(f"{key}.cls")
            info.size = len(label)
            tar.addfile(info, io.BytesIO(label))
        tar.close()
        np.savez(out / "index.npz", **{k: np.asarray(v, dtype=np.int64) for k, v in where.items()})
        (out / SHARDS_JSON).write_text(json.dumps({"format": "dpcourse-shards/1",
                                                   "classes": folder.classes, "files": files,
                                                   "images": len(order)}, indent=1))
    return dest


def layout(split_dir) -> str:
    """'shards', 'folders', or raise with what to do."""
    split_dir = Path(split_dir)
    if (split_dir / SHARDS_JSON).is_file():
        return "shards"
    if split_dir.is_dir() and any(p.is_dir() for p in split_dir.iterdir()):
        return "folders"
    raise CourseError(f"{split_dir}: neither class folders (ImageFolder) nor tar shards "
                      f"({SHARDS_JSON}). --data-root must hold train/ and val/; "
                      "for a small tree to practise on, run\n"
                      "    .venv/bin/python -m dpcourse.lab.data make-imagefolder "
                      "data/imagenet-mini")


# ------------------------------------------------------------------------ node-local staging
def stage(src, dest, progress: bool | None = None) -> Path:
    """Copy the data root ``src`` to ``dest`` (node-local disk) unless an identical copy is there.

    Safe to call from every process of a node at once: a file lock lets one copy while the
    others wait, and a finished copy is marked with the list of files and sizes it holds, so a
    half-finished copy (a killed job) is never taken for a whole one. ``dest`` must be the user's
    own (``own_folder``): made here, or theirs alone; the lock is inside it.
    """
    src, dest = Path(src).expanduser(), Path(dest).expanduser()
    if not src.is_dir():
        raise CourseError(f"stage: {src} is not a folder. "
                          "Give the data root that holds train/ and val/.")
    if src.resolve() == dest.resolve():
        return dest
    files = sorted(p for p in src.rglob("*") if p.is_file() and p.name not in (STAGED, LOCK))
    manifest = {str(p.relative_to(src)): p.stat().st_size for p in files}
    own_folder(dest)
    marker = dest / STAGED
    if _read_json(marker) == manifest:
        return dest
    try:
        lock = open(dest / LOCK, "w")
    except OSError as err:
        raise CourseError(f"stage: cannot write to {dest} ({err.strerror}); choose a node-local "
                          "folder you can write to, e.g. $TMPDIR/imagenet.") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _read_json(marker) == manifest:  # another process of this node copied it meanwhile
            return dest
        marker.unlink(missing_ok=True)
        check_room(dest, sum(size for rel, size in manifest.items()
                             if not ((dest / rel).exists()
                                     and (dest / rel).stat().st_size == size)))
        with tqdm(total=sum(manifest.values()), unit="B", unit_scale=True, desc=f"stage to {dest}",
                  disable=_quiet(progress)) as bar:
            for p in files:
                target = dest / p.relative_to(src)
                target.parent.mkdir(parents=True, exist_ok=True)
                if not (target.exists()
                        and target.stat().st_size == manifest[str(p.relative_to(src))]):
                    shutil.copyfile(p, target)
                bar.update(manifest[str(p.relative_to(src))])
        marker.write_text(json.dumps(manifest))
    return dest


def filesystem_type(path) -> str:
    """The type of the file system that holds ``path`` (its longest mount point in /proc/mounts)."""
    path, best, kind = os.path.realpath(path), "", "?"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                _, mount, fstype = line.split()[:3]
                mount = mount.replace("\\040", " ")
                if (path == mount or path.startswith(mount.rstrip("/") + "/")) \
                        and len(mount) > len(best):
                    best, kind = mount, fstype
    except OSError:
        pass
    return kind


def check_room(dest, needed: int) -> None:
    """Raise one CourseError, before anything is copied, when ``dest`` cannot take ``needed``
    more bytes.

    On many GPU systems the node's /tmp (or $TMPDIR) is a tmpfs: RAM, counted against the job's
    memory, so a copy that fills it ends the job (or the node) partway through instead of saying
    why.
    """
    free, ram = shutil.disk_usage(dest).free, filesystem_type(dest) == "tmpfs"
    # a tmpfs's free space is the node's; the job may hold far less
    left = memory_left() if ram else None
    if needed <= free and (left is None or needed <= left):
        return
    where = (f"only {_size(free)} free there"
             + (" (a tmpfs: RAM, counted against the job's memory)" if ram else "")
             if needed > free
             else f"{dest} is a tmpfs (RAM), and the job's memory limit leaves {_size(left)}")
    raise CourseError(
        f"stage: {_size(needed)} to copy to {dest}, but {where}. Stage to a larger node-local disk "
        "(ask your centre which: often $TMPDIR or /local), read the shards from the shared copy "
        "instead (no --stage-to), or train on fewer classes.")


def memory_left() -> int | None:
    """Bytes this process's cgroup (a Slurm job's, on most clusters) may still use, or None if
    unlimited or unknown: the tightest memory.max - memory.current of its cgroup and those above it
    (cgroup v2), or memory.limit_in_bytes - memory.usage_in_bytes (v1)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    best = None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2
            base, limit_name, usage_name = Path("/sys/fs/cgroup"), "memory.max", "memory.current"
        elif "memory" in controllers.split(","):  # v1
            base, limit_name, usage_name = (Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes",
                                            "memory.usage_in_bytes")
        else:
            continue
        here = base / path.lstrip("/")
        while True:
            try:
                limit, usage = ((here / limit_name).read_text().strip(),
                                int((here / usage_name).read_text()))
                if limit.isdigit() and int(limit) < 2**60:
                    best = int(limit) - usage if best is None else min(best, int(limit) - usage)
            except (OSError, ValueError):
                pass
            if here == base or base not in here.parents:
                break
            here = here.parent
    return best


def _size(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def staged_files(split_dir: Path) -> list[str] | None:
    """The files under ``split_dir`` as :func:`stage` recorded them (relative paths), or None when
    ``split_dir`` is not part of a finished staged copy. Saves each rank a walk of the tree."""
    split_dir = Path(split_dir)
    manifest = _read_json(split_dir.parent / STAGED)
    if not isinstance(manifest, dict):
        return None
    prefix = split_dir.name + "/"
    return [rel[len(prefix):] for rel in manifest if rel.startswith(prefix)]


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _quiet(progress: bool | None) -> bool:
    if progress is None:
        return (not sys.stderr.isatty()
                or bool(os.environ.get("CI") or os.environ.get("TQDM_DISABLE")))
    return not progress


# --------------------------------------------------------------------------------- datasets
def random_resized_crop(img: torch.Tensor, size: int, g: torch.Generator,
                        scale=(0.25, 1.0), ratio=(3 / 4, 4 / 3)) -> torch.Tensor:
    """torchvision's RandomResizedCrop + RandomHorizontalFlip, drawn from the generator ``g``."""
    from torchvision.transforms.v2 import functional as TF

    h, w = img.shape[-2:]
    r = lambda lo, hi: lo + (hi - lo) * torch.rand((), generator=g).item()  # noqa: E731
    for _ in range(10):
        area = h * w * r(*scale)
        aspect = math.exp(r(math.log(ratio[0]), math.log(ratio[1])))
        cw, ch = round(math.sqrt(area * aspect)), round(math.sqrt(area / aspect))
        if 0 < cw <= w and 0 < ch <= h:
            top, left = int(r(0, h - ch + 1)), int(r(0, w - cw + 1))
            break
    else:  # the central square
        ch = cw = min(h, w)
        top, left = (h - ch) // 2, (w - cw) // 2
    out = TF.resized_crop(img, top, left, ch, cw, [size, size], antialias=True)
    return TF.horizontal_flip(out) if r(0, 1) < 0.5 else out


def center_crop(img: torch.Tensor, size: int) -> torch.Tensor:
    """Resize the short side to size × 8/7 (256 for 224), then take the central size × size."""
    from torchvision.transforms.v2 import functional as TF

    return TF.center_crop(TF.resize(img, [round(size * 8 / 7)], antialias=True), [size, size])


class JpegImages(torch.utils.data.Dataset):
    """What both layouts share: read image i's bytes, decode, crop; ``targets`` and ``classes``.

    ``decode=False`` returns the JPEG bytes instead (a 1-D uint8 tensor): the batch is then
    decoded and cropped on the GPU by :func:`decode_batch` (``--decode-on device``).
    """

    def __init__(self, train: bool, size: int, seed: int = 0, decode: bool = True):
        self.train, self.size, self.seed, self.decode, self.epoch = train, size, seed, decode, 0

    def set_epoch(self, epoch: int) -> None:
        """New random crops each epoch (call it before the epoch's DataLoader is made)."""
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.targets)

    def generator(self, index: int) -> torch.Generator:
        return torch.Generator().manual_seed(
            ((self.seed * 1_000_003 + self.epoch) * 1_000_003 + index) % 2**63)

    def __getitem__(self, index: int):
        data = self.read(index)
        if not self.decode:
            return data, self.targets[index], index
        from torchvision.io import ImageReadMode, decode_jpeg

        img = decode_jpeg(data, mode=ImageReadMode.RGB)
        img = (random_resized_crop(img, self.size, self.generator(index)) if self.train
               else center_crop(img, self.size))
        return img, self.targets[index]


class JpegFolder(JpegImages):
    """An ImageFolder tree (``split_dir/<class>/*.JPEG``), one file read per image."""

    def __init__(self, split_dir, train: bool, size: int, seed: int = 0, decode: bool = True):
        from torchvision.datasets import ImageFolder

        super().__init__(train, size, seed, decode)
        listed = staged_files(split_dir)
        if listed is None:
            # a tree that was not staged: torchvision walks it (every file, on every rank)
            folder = ImageFolder(split_dir)  # finds the files and classes; decodes nothing
            samples, self.classes = folder.samples, folder.classes
        else:
            # a staged copy: the file list that stage() wrote once for the node,
            # in ImageFolder's order
            samples, self.classes = _folder_samples(Path(split_dir), listed)
        self.files = [path for path, _ in samples]
        self.targets = [target for _, target in samples]

    def read(self, index: int) -> torch.Tensor:
        from torchvision.io import read_file

        return read_file(self.files[index])


def _folder_samples(split_dir: Path,
                    listed: list[str]) -> tuple[list[tuple[str, int]], list[str]]:
    """ImageFolder's (samples, classes) from a list of relative paths: the class folders sorted, and
    in each, its images sorted as torchvision's os.walk order does (folder, then name)."""
    from torchvision.datasets.folder import IMG_EXTENSIONS

    # a thousand entries, not a million
    classes = sorted(d.name for d in os.scandir(split_dir) if d.is_dir())
    index = {c: i for i, c in enumerate(classes)}
    by_class: dict[str, list[tuple[str, str]]] = {c: [] for c in classes}
    for rel in listed:
        parts = rel.split("/")
        if len(parts) >= 2 and parts[0] in by_class and rel.lower().endswith(IMG_EXTENSIONS):
            by_class[parts[0]].append((os.path.dirname(rel), parts[-1]))
    empty = [c for c in classes if not by_class[c]]
    if empty:
        raise CourseError(f"{split_dir}: no images in the class folder(s) {', '.join(empty[:5])}: "
                          "stage the data again from a complete copy.")
    samples = [(os.path.join(split_dir, folder, name), index[c])
               for c in classes for folder, name in sorted(by_class[c])]
    return samples, classes


class TarShards(JpegImages):
    """Tar shards written by :func:`make_shards`: image i is ``size[i]`` bytes at ``offset[i]`` of
    shard ``shard[i]``. Each process opens a shard once and then only reads."""

    def __init__(self, split_dir, train: bool, size: int, seed: int = 0, decode: bool = True):
        super().__init__(train, size, seed, decode)
        self.dir = Path(split_dir)
        meta = json.loads((self.dir / SHARDS_JSON).read_text())
        index = np.load(self.dir / "index.npz")
        self.shards, self.offsets, self.sizes = index["shard"], index["offset"], index["size"]
        self.targets = index["target"].tolist()
        self.classes, self.files = meta["classes"], meta["files"]
        self._fds: dict[int, int] = {}
        self._pid = os.getpid()

    def read(self, index: int) -> torch.Tensor:
        if os.getpid() != self._pid:  # a DataLoader worker: its own descriptors
            self._fds, self._pid = {}, os.getpid()
        s = int(self.shards[index])
        if s not in self._fds:
            self._fds[s] = os.open(self.dir / self.files[s], os.O_RDONLY)
        data = os.pread(self._fds[s], int(self.sizes[index]), int(self.offsets[index]))
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)

    def __del__(self):
        for fd in getattr(self, "_fds", {}).values():
            try:
                os.close(fd)
            except OSError:
                pass


def image_dataset(split_dir, train: bool, size: int, seed: int = 0,
                  decode: bool = True) -> JpegImages:
    """A :class:`TarShards` or a :class:`JpegFolder`, whichever ``split_dir`` holds."""
    kind = TarShards if layout(split_dir) == "shards" else JpegFolder
    return kind(split_dir, train, size, seed, decode)


def collate_bytes(batch):
    """DataLoader collate for ``decode=False``: the JPEGs stay a list (their lengths differ)."""
    data, targets, index = zip(*batch)
    return list(data), torch.tensor(targets), torch.tensor(index)


def decode_batch(dataset: JpegImages, data: list, index: torch.Tensor, device) -> torch.Tensor:
    """Decode and crop a batch of JPEGs on ``device`` (nvJPEG on a GPU): uint8 [B, 3, H, W]."""
    from torchvision.io import ImageReadMode, decode_jpeg

    imgs = decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
    if dataset.train:
        imgs = [random_resized_crop(img, dataset.size, dataset.generator(int(i)))
                for img, i in zip(imgs, index)]
    else:
        imgs = [center_crop(img, dataset.size) for img in imgs]
    return torch.stack(imgs)


def normalize(images: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """uint8 [B, 3, H, W] on the device → normalised floats, one operation for the whole batch."""
    mean = torch.tensor(MEAN, device=images.device, dtype=dtype).view(1, 3, 1, 1) * 255
    std = torch.tensor(STD, device=images.device, dtype=dtype).view(1, 3, 1, 1) * 255
    return (images.to(dtype) - mean) / std


# ------------------------------------------------------------------------ input pipeline speed
def classic_imagefolder(split_dir, size: int):
    """The textbook pipeline, for comparison: torchvision's ImageFolder, PIL decoding and crops."""
    from torchvision import datasets, transforms

    tf = transforms.Compose([transforms.RandomResizedCrop(size, scale=(0.25, 1.0)),
                             transforms.RandomHorizontalFlip(), transforms.PILToTensor()])
    return datasets.ImageFolder(split_dir, transform=tf)


def loader_speed(dataset, batch: int = 64, workers: int = 2, batches: int = 30,
                 seed: int = 0) -> float:
    """Images per second a DataLoader with ``workers`` processes delivers from ``dataset``, in a
    shuffled order, cycling through it for ``batches`` batches after a first one (not timed:
    it waits for the workers to start)."""
    import time

    g = torch.Generator().manual_seed(seed)
    order = torch.cat([torch.randperm(len(dataset), generator=g)
                       for _ in range(1 + (batches + 1) * batch // len(dataset))])
    chunks = [order[i:i + batch].tolist() for i in range(0, (batches + 1) * batch, batch)]
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=chunks, num_workers=workers,
                                         prefetch_factor=4 if workers else None)
    it = iter(loader)
    next(it)
    start = time.perf_counter()
    n = sum(len(b[1]) for b in it)
    return n / (time.perf_counter() - start)


@functools.lru_cache(maxsize=None)
def _worker_start():
    """DataLoader workers start from a clean server process, not as forks of the training process: a
    fork copies a process whose other threads (gloo's, PyTorch's) may hold a lock that the child
    then waits on forever. torch, torchvision and this module are imported once in the server, not
    once per worker."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torchvision", "dpcourse.lab.images"])
    return context


def batch_loader(dataset, batches, workers: int, decode_on: str, device, worker_init_fn=None):
    """A DataLoader over ``batches`` (lists of indices: a rank's share, cut by its sampler),
    decoding in ``workers`` worker processes (``decode_on="workers"``) or handing over the JPEG
    bytes for the device to decode (``"device"``: ``to_device``)."""
    from torch.utils.data import DataLoader

    return DataLoader(dataset, batch_sampler=batches, num_workers=workers,
                      multiprocessing_context=_worker_start() if workers else None,
                      worker_init_fn=worker_init_fn, pin_memory=torch.device(device).type == "cuda",
                      prefetch_factor=4 if workers else None,
                      collate_fn=None if decode_on == "workers" else collate_bytes)


def to_device(dataset, batch, decode_on: str, device, memory_format=torch.contiguous_format):
    """A batch of ``batch_loader`` as normalised float images on ``device``, and its labels."""
    if decode_on == "device":  # JPEG bytes: decoded and cropped on the GPU (nvJPEG)
        data, y, index = batch
        x = decode_batch(dataset, data, index, device)
    else:
        x, y = batch
    x = normalize(x.to(device, non_blocking=True)).contiguous(memory_format=memory_format)
    return x, y.to(device, non_blocking=True)
