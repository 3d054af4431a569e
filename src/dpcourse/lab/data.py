"""FashionMNIST: found, verified and staged, without torch (held in memory: fashion_tensors.py).

Where the four IDX files come from, in this order:

1. the data root: ``--data-root``, else ``$DPCOURSE_DATA``, else ``data/`` at the top of the
   course checkout (``./data`` outside one); files live in ``<root>/FashionMNIST/raw/`` so that
   ``torchvision.datasets.FashionMNIST(root)`` reads the same copy;
2. Debian's package ``dataset-fashion-mnist`` (``/usr/share/datasets/fashion-mnist/*.gz``,
   or ``$DPCOURSE_SYSTEM_DATA``), unpacked into the data root;
3. torchvision's checksummed download, by rank 0 while the other ranks wait (a file lock
   when there is no process group);
4. otherwise one error that names these three ways.

Files are verified on their *uncompressed* bytes: Debian's ``.gz`` files have another gzip
header than the upstream ones, so the ``.gz`` checksums differ although the images are the
same. A truncated or corrupt file is reported by name and never used.

    .venv/bin/python -m dpcourse.lab.data fetch     # stage the data (with a progress bar)
    .venv/bin/python -m dpcourse.lab.data verify    # check what is there
    .venv/bin/python -m dpcourse.lab.data fetch --from /shared/course/data \\
        --data-root "$TMPDIR/data"
                                                # a node-local copy of a shared one (Slurm jobs)

ImageNet-style trees and shards (notebook 10, dpcourse/lab/images.py)::

    .venv/bin/python -m dpcourse.lab.data make-imagefolder data/imagenet-mini
                                                # 10 classes, 64 px JPEGs
    .venv/bin/python -m dpcourse.lab.data make-shards data/imagenet-mini data/imagenet-mini-shards
    .venv/bin/python -m dpcourse.lab.data stage data/imagenet-mini "$TMPDIR/imagenet"
"""
from __future__ import annotations

import argparse
import fcntl
import gzip
import hashlib
import os
import shutil
import socket
import sys
import tempfile
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm.auto import tqdm

from dpcourse.lab.errors import CourseError
from dpcourse.lab.paths import own_folder, project_root

# name -> (uncompressed size in bytes, official SHA-256 of the uncompressed file)
FILES = {
    "train-images-idx3-ubyte": (47_040_016,
                                "c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888"),
    "train-labels-idx1-ubyte": (60_008,
                                "bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9"),
    "t10k-images-idx3-ubyte": (7_840_016,
                               "5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b"),
    "t10k-labels-idx1-ubyte": (10_008,
                               "0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34"),
}
CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
           "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")
MEAN, STD = 0.2860, 0.3530  # of the 60k training images, pixels scaled to [0, 1]
SYSTEM_DIR = "/usr/share/datasets/fashion-mnist"
DOWNLOAD_TIMEOUT_S = 15



def default_root(root: str | os.PathLike | None = None) -> Path:
    """``root`` if given, else $DPCOURSE_DATA, else <checkout>/data, else ./data."""
    if root:
        return Path(root).expanduser()
    if os.environ.get("DPCOURSE_DATA"):
        return Path(os.environ["DPCOURSE_DATA"]).expanduser()
    top = project_root()
    return (top / "data") if top else Path("data")


def raw_dir(root: str | os.PathLike | None = None) -> Path:
    return default_root(root) / "FashionMNIST" / "raw"


def _sha256(path: Path, bar: tqdm | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            if bar is not None:
                bar.update(len(chunk))
    return h.hexdigest()


def check_file(path: Path, name: str, bar: tqdm | None = None) -> str | None:
    """None when ``path`` is the official ``name``; else what is wrong with it."""
    size, digest = FILES[name]
    actual = path.stat().st_size
    if actual != size:
        kind = "truncated" if actual < size else "too long"
        return f"{path} is {kind}: {actual:,} bytes, expected {size:,}"
    if _sha256(path, bar) != digest:
        return f"{path} is corrupt: its SHA-256 is not the official one"
    return None


def _corrupt(path: Path, problem: str, root: Path) -> CourseError:
    return CourseError(
        f"FashionMNIST: {problem}. It was not used. "
        "Delete it and stage the data again, in the course folder:\n"
        f"    rm {path}\n"
        f"    .venv/bin/python -m dpcourse.lab.data fetch --data-root {root}")


def _unpack(gz: Path, dest: Path, name: str) -> str | None:
    """Unpack ``gz`` (or copy it, when it is not a .gz file) to ``dest`` atomically if its content
    is the official file; else say why."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{name}.")
    try:
        with ((gzip.open if gz.suffix == ".gz" else open)(gz, "rb") as src,
              os.fdopen(fd, "wb") as out):
            shutil.copyfileobj(src, out, 1 << 20)
        problem = check_file(Path(tmp), name)
        if problem:
            return problem.replace(tmp, str(gz) + " (unpacked)")
        os.chmod(tmp, 0o644)  # a shared data folder is read by other users too
        os.replace(tmp, dest)
        return None
    except (OSError, EOFError, gzip.BadGzipFile) as err:
        return f"{gz} cannot be unpacked ({err})"
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _download(name: str, raw: Path) -> str | None:
    """torchvision's checksummed download of one file; None on success, else why not."""
    from torchvision.datasets import FashionMNIST
    from torchvision.datasets.utils import download_url

    md5 = dict(FashionMNIST.resources)[f"{name}.gz"]
    old = socket.getdefaulttimeout()
    socket.setdefaulttimeout(DOWNLOAD_TIMEOUT_S)  # an offline node answers within seconds
    errors = []
    try:
        for mirror in FashionMNIST.mirrors:
            try:
                download_url(f"{mirror}{name}.gz", str(raw), f"{name}.gz", md5)
            except Exception as err:  # noqa: BLE001 - urllib, socket and checksum errors all mean "try the next"
                errors.append(f"{mirror}: {err}")
                (raw / f"{name}.gz").unlink(missing_ok=True)  # never leave half a download behind
                continue
            gz = raw / f"{name}.gz"
            problem = _unpack(gz, raw / name, name)
            gz.unlink(missing_ok=True)
            return problem
    finally:
        socket.setdefaulttimeout(old)
    return "; ".join(errors) or "no mirror"


def _no_data_message(root: Path, system_dir: Path, why: str) -> str:
    return (
        "FashionMNIST is not here and could not be fetched. Any one of these fixes it:\n"
        f"  1. put the four IDX files (or their .gz) in {root / 'FashionMNIST' / 'raw'}, or point "
        "--data-root / DPCOURSE_DATA at a folder that has them;\n"
        f"  2. install Debian's package: sudo apt-get install dataset-fashion-mnist "
        f"(files in {system_dir});\n"
        "  3. connect to the internet and run, in the course folder: "
        ".venv/bin/python -m dpcourse.lab.data fetch (torchvision's checksummed download).\n"
        f"The download failed with: {why}")


@contextmanager
def _staging_lock(root: Path):
    """One process at a time writes into ``root`` (closing the file releases the lock)."""
    try:
        (root / "FashionMNIST" / "raw").mkdir(parents=True, exist_ok=True)
        f = open(root / ".fashion-mnist.lock", "w")
    except OSError as err:
        raise CourseError(f"FashionMNIST cannot be staged in {root} ({err.strerror}). Point "
                          "--data-root or DPCOURSE_DATA at a folder you can write to.") from None
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _missing_files(raw: Path, root: Path, progress: bool) -> list[str]:
    """Names not yet in ``raw``; raises if one that is there is damaged."""
    missing = []
    total = sum(size for size, _ in FILES.values())
    with tqdm(total=total, unit="B", unit_scale=True, desc="verify FashionMNIST",
              disable=not progress, leave=False) as bar:
        for name in FILES:
            path = raw / name
            if not path.exists():
                missing.append(name)
            elif problem := check_file(path, name, bar):
                raise _corrupt(path, problem, root)
    return missing


def _stage(root: Path, system_dir: Path, download: bool, progress: bool,
           source: Path | None = None) -> Path:
    raw = root / "FashionMNIST" / "raw"
    if not _missing_files(raw, root, progress):
        return raw  # all there and verified: nothing to write, no lock (the root may be read-only)
    with _staging_lock(root):
        # Another process may have staged files while we waited: they appear only once verified.
        missing = [name for name in FILES if not (raw / name).exists()]
        for name in tqdm(missing, desc="stage FashionMNIST", unit="file", disable=not progress):
            local_gz = raw / f"{name}.gz"  # a learner may drop the official .gz files in raw/
            system_gz = system_dir / f"{name}.gz"
            shared = source / "FashionMNIST" / "raw" / name if source else None  # fetch --from
            found = next((f for f in (shared, local_gz, system_gz) if f is not None and f.exists()),
                         None)
            if found is not None:
                if problem := _unpack(found, raw / name, name):
                    fix = (f"Delete {local_gz} and put the official file there."
                           if found == local_gz else
                           f"Stage that copy again: "
                           f".venv/bin/python -m dpcourse.lab.data fetch --data-root {source}"
                           if found == shared else
                           "Reinstall it: sudo apt-get install --reinstall dataset-fashion-mnist")
                    raise CourseError(f"FashionMNIST: {problem}. {fix}")
                continue
            why = _download(name, raw) if download else "not tried (this command never downloads)"
            # offline, or a mirror served something that is not the official file
            if why is not None:
                raise CourseError(_no_data_message(root, system_dir, why))
    return raw


def ensure_fashion_mnist(root: str | os.PathLike | None = None, download: bool = True,
                         progress: bool | None = None,
                         source: str | os.PathLike | None = None) -> Path:
    """Make sure the four verified IDX files are in ``<root>/FashionMNIST/raw`` and return that
    folder.

    With a process group, rank 0 stages first and the others wait (then find the files, or, on a
    node-local root, stage their own copy); a file lock keeps processes without a group from
    writing at the same time. ``source``: a data root whose verified copy is copied first (a
    shared folder, staged once to node-local disk); ``root`` must then be the user's own
    (``paths.own_folder``: made here with mode 0700, or theirs alone), as a node-local folder
    with a name others can guess may be another user's.
    """
    root = default_root(root)
    if source is not None:
        own_folder(root)
    system_dir = Path(os.environ.get("DPCOURSE_SYSTEM_DATA", SYSTEM_DIR))
    if progress is None:
        progress = sys.stderr.isatty() and not os.environ.get("CI")
    with _rank0_first():
        return _stage(root, system_dir, download, progress, Path(source) if source else None)


def _rank0_first():
    """world.rank0_first where a process group can exist: only where torch.distributed is loaded.
    Staging from the command line (``python -m dpcourse.lab.data fetch``, in every Slurm job)
    loads neither."""
    if "torch.distributed" in sys.modules:
        from dpcourse.lab.world import rank0_first

        return rank0_first()
    return nullcontext()


if TYPE_CHECKING:  # where an editor or a type checker finds them
    from dpcourse.lab.fashion_tensors import (  # noqa: F401
        InMemoryFashionMNIST,
        load_fashion_mnist,
        read_idx,
        torchvision_fashion_mnist,
    )

# The tensors (dpcourse/lab/fashion_tensors.py) are loaded when first asked for, with torch:
# `from dpcourse.lab.data import InMemoryFashionMNIST` works as before, and staging does not wait
# for torch to load (about a second per job).
_TENSORS = ("read_idx", "load_fashion_mnist", "InMemoryFashionMNIST", "torchvision_fashion_mnist")


def __getattr__(name: str):
    if name in _TENSORS:
        from dpcourse.lab import fashion_tensors

        return getattr(fashion_tensors, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_TENSORS])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dpcourse.lab.data",
                                     description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, what in (("fetch",
                        "stage FashionMNIST (from Debian's package, --from a copy, or the web)"),
                       ("verify", "check the staged FashionMNIST"),
                       ("where", "print FashionMNIST's folder")):
        p = sub.add_parser(name, help=what)
        p.add_argument("--data-root", default=None, help="folder for FashionMNIST (default: "
                       "$DPCOURSE_DATA or <checkout>/data)")
        if name == "fetch":
            p.add_argument("--from", dest="source", default=None, metavar="DIR",
                           help="copy from this data root first (e.g. a shared copy, to "
                                "node-local disk)")
    p = sub.add_parser("make-imagefolder",
                       help="write a small, learnable ImageNet-style tree (train/, val/)")
    p.add_argument("dest")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--per-class", type=int, default=20, help="training images per class")
    p.add_argument("--val-per-class", type=int, default=10, help="validation images per class")
    p.add_argument("--size", type=int, default=64, help="pixels (square)")
    p.add_argument("--seed", type=int, default=0)
    p = sub.add_parser("make-shards", help="pack an ImageFolder tree into tar shards with an index")
    p.add_argument("src")
    p.add_argument("dest")
    p.add_argument("--shard-size", type=int, default=1000, help="images per shard")
    p = sub.add_parser("stage", help="copy a data root to node-local disk, unless an identical "
                                     "copy is there")
    p.add_argument("src")
    p.add_argument("dest")
    args = parser.parse_args(argv)

    if args.command in ("make-imagefolder", "make-shards", "stage"):
        from dpcourse.lab import images  # errors are CourseErrors: one line, exit status 1
        if args.command == "make-imagefolder":
            out = images.make_imagefolder(args.dest, args.classes, args.per_class,
                                          args.val_per_class, args.size, args.seed)
            print(f"{args.classes} classes × ({args.per_class} train + {args.val_per_class} val) "
                  f"images of {args.size} px in {out}")
        elif args.command == "make-shards":
            out = images.make_shards(args.src, args.dest, args.shard_size)
            print(f"tar shards of {args.shard_size} images in {out}")
        else:
            print(f"{args.src} staged in {images.stage(args.src, args.dest)}")
        return 0
    if getattr(args, "source", None) and not (Path(args.source) / "FashionMNIST" / "raw").is_dir():
        raise SystemExit(f"--from {args.source}: no FashionMNIST/raw/ there. Give the data root "
                         f"of a staged copy (the folder that holds FashionMNIST/), e.g. the "
                         f"course's data/.")
    if args.command == "where":
        print(raw_dir(args.data_root))
        return 0
    raw = ensure_fashion_mnist(args.data_root, download=args.command == "fetch", progress=None,
                               source=getattr(args, "source", None))
    print(f"FashionMNIST ready and verified in {raw}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
