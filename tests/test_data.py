"""dpcourse.lab.data on the real FashionMNIST: staging, verification, the learner's error
messages."""
import gzip
import shutil
import sys
import time

import pytest
import torch

from conftest import AT_ONCE_S, OFFLINE, ROOT, run, torchrun_cmd
from dpcourse.lab.data import (
    FILES,
    SYSTEM_DIR,
    InMemoryFashionMNIST,
    ensure_fashion_mnist,
    load_fashion_mnist,
    torchvision_fashion_mnist,
)
from dpcourse.lab.errors import CourseError

NO_SOURCES = {"DPCOURSE_SYSTEM_DATA": "/nonexistent/fashion-mnist", **OFFLINE}


@pytest.fixture
def staged(tmp_path, fashion_root):
    """A private copy of the verified raw files, to damage."""
    raw = tmp_path / "FashionMNIST" / "raw"
    shutil.copytree(fashion_root / "FashionMNIST" / "raw", raw)
    return tmp_path


def test_real_fashion_mnist_loads(fashion_root):
    images, labels = load_fashion_mnist(fashion_root, train=True)
    assert images.shape == (60_000, 28, 28) and images.dtype == torch.uint8
    assert torch.bincount(labels).tolist() == [6000] * 10
    images, labels = load_fashion_mnist(fashion_root, train=False)
    assert images.shape == (10_000, 28, 28) and torch.bincount(labels).tolist() == [1000] * 10


def test_stage_from_debian_package_verifies_uncompressed_bytes(tmp_path):
    # Debian's .gz files differ from upstream's in their gzip header; the content must match.
    raw = ensure_fashion_mnist(tmp_path, download=False)
    for name, (size, _) in FILES.items():
        assert (raw / name).stat().st_size == size
        assert (raw / name).stat().st_mode & 0o777 == 0o644
    assert not list(raw.glob(".*")), "no temporary files left behind"


def test_official_gz_dropped_in_raw_is_used(tmp_path):
    raw = tmp_path / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    for name in FILES:
        shutil.copy(f"{SYSTEM_DIR}/{name}.gz", raw)
    ensure_fashion_mnist(tmp_path, download=False)  # no system copy, no network needed
    assert all((raw / name).exists() for name in FILES)


def test_truncated_file_is_named_and_not_used(staged):
    path = staged / "FashionMNIST" / "raw" / "train-labels-idx1-ubyte"
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(CourseError) as err:
        load_fashion_mnist(staged)
    msg = str(err.value)
    assert str(path) in msg and "truncated" in msg and "1,000 bytes" in msg
    assert "python -m dpcourse.lab.data fetch" in msg and "rm " in msg


def test_corrupt_file_of_the_right_size_is_named(staged):
    path = staged / "FashionMNIST" / "raw" / "t10k-images-idx3-ubyte"
    data = bytearray(path.read_bytes())
    data[5000] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CourseError, match="t10k-images-idx3-ubyte is corrupt"):
        load_fashion_mnist(staged, train=False)


def test_corrupt_system_gz_is_reported(tmp_path):
    system = tmp_path / "system"
    system.mkdir()
    for name in FILES:
        shutil.copy(f"{SYSTEM_DIR}/{name}.gz", system)
    with gzip.open(system / "train-labels-idx1-ubyte.gz", "wb") as f:
        f.write(b"\x00\x00\x08\x01" + b"\x00" * 100)
    result = run([sys.executable, "-m", "dpcourse.lab.data", "fetch", "--data-root",
                  str(tmp_path / "d")], env={**OFFLINE, "DPCOURSE_SYSTEM_DATA": str(system)})
    assert result.returncode == 1
    assert "train-labels-idx1-ubyte.gz (unpacked) is truncated" in result.stdout
    assert "Traceback" not in result.stdout


def test_no_data_anywhere_gives_one_clear_message_fast(tmp_path):
    start = time.perf_counter()
    result = run([sys.executable, "-m", "dpcourse.lab.data", "fetch", "--data-root", str(tmp_path)],
                 env=NO_SOURCES, timeout=2 * AT_ONCE_S)
    elapsed = time.perf_counter() - start
    assert result.returncode == 1
    assert elapsed < AT_ONCE_S
    out = result.stdout
    assert "FashionMNIST is not here and could not be fetched" in out
    assert ("--data-root" in out and "apt-get install dataset-fashion-mnist" in out
            and "dpcourse.lab.data fetch" in out)
    assert "Traceback" not in out


def test_make_course_stops_fast_with_the_data_message(tmp_path):
    """`make course` with no data root, no Debian package and no network (the venv already
    built)."""
    if not (ROOT / ".venv" / ".installed-stamp").exists():
        pytest.skip("needs the checkout's .venv (run through `make test`)")
    start = time.perf_counter()
    result = run(["make", "-s", "course"], timeout=2 * AT_ONCE_S,
                 env={**NO_SOURCES, "DPCOURSE_DATA": str(tmp_path / "empty")})
    assert result.returncode != 0
    assert time.perf_counter() - start < AT_ONCE_S
    assert result.stdout.count("FashionMNIST is not here and could not be fetched") == 1
    assert "Traceback" not in result.stdout and "running 00_setup" not in result.stdout


def test_two_ranks_stage_once_and_agree(tmp_path, root):
    """rank 0 stages while rank 1 waits; both then read the same verified files."""
    result = run(torchrun_cmd(2, root / "tests/helpers/stage.py", tmp_path), timeout=120)
    assert result.returncode == 0, result.stdout
    assert result.stdout.count("staged by rank 0") == 1
    assert result.stdout.count("OK 60000") == 2


def test_two_ranks_without_data_print_one_message(tmp_path, root):
    start = time.perf_counter()
    result = run(torchrun_cmd(2, root / "tests/helpers/stage.py", tmp_path), env=NO_SOURCES,
                 timeout=2 * AT_ONCE_S)
    assert result.returncode != 0
    assert time.perf_counter() - start < AT_ONCE_S
    assert result.stdout.count("FashionMNIST is not here and could not be fetched") == 1
    assert "Traceback (most recent call last):\n  File \"" + str(root) not in result.stdout


def test_in_memory_dataset_matches_torchvision_per_sample(fashion_root):
    fast = InMemoryFashionMNIST(fashion_root, train=False)
    slow = torchvision_fashion_mnist(fashion_root, train=False)
    idx = torch.tensor([0, 1, 4321, 9999])
    x, y = fast[idx]
    assert x.shape == (4, 1, 28, 28) and x.dtype == torch.float32
    for j, i in enumerate(idx.tolist()):
        xs, ys = slow[i]
        assert ys == y[j].item()
        torch.testing.assert_close(x[j], xs, atol=1e-5, rtol=0)
    assert abs(fast[torch.arange(len(fast))][0].mean().item()) < 0.05  # normalised


def test_the_first_n_images_are_the_splits_first_and_a_bad_n_is_one_message(fashion_root):
    """--train-images N of the FashionMNIST labs: a quick run on the first N images; the sampler
    over the dataset then draws indices below N, which also index torchvision's dataset the same
    way."""
    whole, first = (InMemoryFashionMNIST(fashion_root, train=True),
                    InMemoryFashionMNIST(fashion_root, train=True, first=600))
    assert len(first) == 600
    idx = torch.tensor([0, 299, 599])
    assert torch.equal(first[idx][0], whole[idx][0]) and torch.equal(first[idx][1], whole[idx][1])
    for bad in (0, 60_001):
        with pytest.raises(CourseError, match="give a number from 1 to 60,000"):
            InMemoryFashionMNIST(fashion_root, train=True, first=bad)


def test_a_bad_download_is_refused_and_removed(tmp_path, monkeypatch):
    """A mirror that serves the wrong bytes: torchvision's MD5 check fails, nothing is left in
    raw/."""
    import http.server
    import threading

    from torchvision.datasets import FashionMNIST

    class Junk(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"not the file" * 100)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Junk)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(FashionMNIST, "mirrors", [f"http://127.0.0.1:{server.server_port}/"])
    monkeypatch.setenv("DPCOURSE_SYSTEM_DATA", str(tmp_path / "no-system-copy"))
    for var in ("http_proxy", "HTTP_PROXY"):
        monkeypatch.delenv(var, raising=False)
    try:
        with pytest.raises(CourseError, match="could not be fetched(.|\n)*corrupted"):
            ensure_fashion_mnist(tmp_path / "d", progress=False)
    finally:
        server.shutdown()
    assert list((tmp_path / "d" / "FashionMNIST" / "raw").iterdir()) == []


def test_processes_without_a_group_share_one_staging(tmp_path):
    """Two independent `fetch` commands into one root at once: the file lock serialises them."""
    import subprocess

    cmd = [sys.executable, "-m", "dpcourse.lab.data", "fetch", "--data-root", str(tmp_path)]
    procs = [subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for _ in range(2)]
    outs = [(p.wait(timeout=120), p.stdout.read()) for p in procs]
    assert all(code == 0 for code, _ in outs), outs
    raw = tmp_path / "FashionMNIST" / "raw"
    assert sorted(p.name for p in raw.iterdir()) == sorted(FILES)  # no temporary files either
    ensure_fashion_mnist(tmp_path, download=False)  # and they verify


def test_a_staged_root_is_used_without_writing(staged):
    """A shared, read-only data folder on a cluster: staged and verified, it needs no lock."""
    (staged / ".fashion-mnist.lock").mkdir()  # the lock cannot be opened (root ignores chmod)
    images, _ = load_fashion_mnist(staged, train=False)
    assert len(images) == 10_000
    (staged / "FashionMNIST" / "raw" / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(CourseError, match=f"cannot be staged in {staged}.*folder you can write to"):
        load_fashion_mnist(staged, train=False)


def test_a_bad_gz_dropped_in_raw_is_named_with_its_fix(tmp_path):
    raw = tmp_path / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    (raw / "train-images-idx3-ubyte.gz").write_bytes(b"not gzip at all")
    with pytest.raises(CourseError,
                       match=r"train-images-idx3-ubyte.gz cannot be unpacked.*Delete "):
        ensure_fashion_mnist(tmp_path, download=False)


def test_fetch_from_a_shared_copy_to_node_local_disk(tmp_path, staged):
    """`fetch --from SHARED --data-root LOCAL`: what a Slurm job does once per node. The shared
    copy is the only source (no Debian package, no network), and a damaged one is refused."""
    local = tmp_path / "node-local"
    # `python -m dpcourse.lab.data fetch ...`, which then says whether it loaded torch: staging
    # does not (every Slurm job stages; torch takes about a second to load)
    as_m = ("import runpy, sys\n"
            "sys.argv[0] = 'data'\n"
            "try:\n"
            "    runpy.run_module('dpcourse.lab.data', run_name='__main__', alter_sys=True)\n"
            "finally:\n"
            "    print('loaded torch:', 'torch' in sys.modules)\n")
    done = run([sys.executable, "-c", as_m, "fetch", "--from", staged, "--data-root", local],
               env=NO_SOURCES)
    assert done.returncode == 0 and "ready and verified" in done.stdout, done.stdout
    assert "loaded torch: False" in done.stdout, done.stdout
    assert sorted(p.name for p in (local / "FashionMNIST" / "raw").iterdir()) == sorted(FILES)
    labels = staged / "FashionMNIST" / "raw" / "t10k-labels-idx1-ubyte"
    labels.write_bytes(labels.read_bytes()[:100])
    bad = run([sys.executable, "-m", "dpcourse.lab.data", "fetch", "--from", staged,
               "--data-root", tmp_path / "other"], env=NO_SOURCES)
    assert (bad.returncode == 1 and "truncated" in bad.stdout
            and f"--data-root {staged}" in bad.stdout), bad.stdout
    assert "Traceback" not in bad.stdout
    nothing = run([sys.executable, "-m", "dpcourse.lab.data", "fetch", "--from",
                   tmp_path / "nowhere"], env=NO_SOURCES)
    assert (nothing.returncode != 0
            and "no FashionMNIST/raw/ there" in nothing.stdout), nothing.stdout
