"""container/*.def without Apptainer (it cannot run here): the definitions parse (spython, and
section by section), the image's torch and torchvision are the kit's pins and its base's CUDA is
that torch's, and the %test, %environment and %runscript scripts run in this environment as they
would in the image: the CPU part of %test for real, its GPU part with a stand-in nvidia-smi."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from conftest import ROOT

DEF = ROOT / "container" / "dpcourse.def"
HOROVOD_DEF = ROOT / "container" / "horovod.def"
VENV_BIN = Path(sys.executable).parent
# nvidia/cuda:<CUDA>-devel-ubuntu<release>, optionally pinned by digest
BASE = re.compile(r"nvidia/cuda:(?P<cuda>\d+\.\d+)\.\d+-devel-ubuntu\d\d\.\d\d"
                  r"(@sha256:[0-9a-f]{64})?")


def sections(text: str) -> dict[str, str]:
    """The definition's header ('header') and each %section's body, verbatim."""
    out, name, lines = {}, "header", []
    for line in text.splitlines():
        if m := re.match(r"^%(\w+)\s*$", line):
            out[name] = "\n".join(lines).strip("\n") + "\n"
            name, lines = m.group(1), []
        else:
            lines.append(line)
    out[name] = "\n".join(lines).strip("\n") + "\n"
    return out


def header(part: dict[str, str]) -> dict[str, str]:
    return {k: v.strip() for k, v in (line.split(":", 1) for line in part["header"].splitlines()
                                      if ":" in line and not line.startswith("#"))}


def pins(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, str]:
    """pyproject.toml's exact pins of torch and torchvision."""
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return dict(d.split("==") for d in deps if d.startswith(("torch==", "torchvision==")))


@pytest.fixture(scope="module")
def parts():
    return sections(DEF.read_text())


def in_image_env(**extra):
    """This checkout standing in for /opt/dpcourse, the course's python and torchrun on PATH."""
    return {**os.environ, "PATH": f"{VENV_BIN}:{os.environ['PATH']}", "DPCOURSE_HOME": str(ROOT),
            "OMP_NUM_THREADS": "1", **extra}


def stand_ins(tmp_path, **scripts) -> Path:
    """A folder of executables (name: sh script body) to put first on PATH."""
    folder = tmp_path / "bin"
    folder.mkdir(exist_ok=True)
    for name, body in scripts.items():
        (folder / name).write_text("#!/bin/sh\n" + body)
        (folder / name).chmod(0o755)
    return folder


NO_GPU = "echo 'No devices were found'\nexit 6\n"  # what nvidia-smi says on a node without GPUs


def gpus(n: int) -> str:
    """nvidia-smi that lists n GPUs, one line each, as `nvidia-smi -L` does."""
    return "".join(f"echo 'GPU {i}: NVIDIA H100 80GB HBM3 "
                   f"(UUID: GPU-00000000-0000-0000-0000-00000000000{i})'\n"
                   for i in range(n))


# torchrun as hello.py answers it: the sum over --nproc-per-node ranks,
# and the arguments it was given
TORCHRUN = ('n=$(echo "$*" | sed -n "s/.*--nproc-per-node=\\([0-9]*\\).*/\\1/p")\n'
            'echo "torchrun $*"\n'
            'echo "all_reduce(rank + 1) = $((n * (n + 1) / 2)) on every rank"\n')


def run_test_section(part, tmp_path, path_first=None, timeout=120, **env):
    """%test as `apptainer test` runs it (/bin/sh), with this checkout as /opt/dpcourse."""
    script = tmp_path / "test.sh"
    script.write_text(part["test"])
    environ = in_image_env(**env)
    if path_first:
        environ["PATH"] = f"{path_first}:{environ['PATH']}"
    return subprocess.run(["sh", str(script)], cwd=tmp_path, env=environ, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)


def test_spython_parses_a_definition_on_a_cuda_devel_base(parts):
    from spython.main.parse.parsers import SingularityParser

    recipe = SingularityParser(str(DEF)).recipe["spython-base"]
    image = recipe.fromHeader
    assert BASE.fullmatch(image), f"a CUDA devel base with its release in the tag, not {image!r}"
    assert f"org.opencontainers.image.base.name {image}" in parts["labels"], \
        "the label names the same base as From:"
    assert any(env.startswith("DPCOURSE_HOME=") for env in recipe.environ)
    # %post parsed (spython turns %runscript into one of its steps)
    assert recipe.labels and recipe.install
    for line in recipe.files:  # what %files copies must be in the checkout the image is built from
        source = line.split()[0]
        assert (ROOT / source).exists(), f"%files copies {source}, which the checkout does not have"


def test_every_section_is_there(parts):
    assert {"labels", "help", "files", "environment", "post", "test", "runscript"} <= set(parts)
    assert parts["header"].splitlines()[0] == "Bootstrap: docker"
    assert "apptainer build" in parts["help"] and "--nv" in parts["help"]


def test_the_image_installs_the_kits_pins_from_pyproject(parts):
    """%post installs the kit with its dependencies, so pyproject.toml's pins are the image's; every
    version the definitions and container/README.md name (%help among them) is that pin, and every
    CUDA release they name is the base's: a pin changed on one side only fails here."""
    wanted = pins()
    assert set(wanted) == {"torch", "torchvision"}, \
        "pyproject.toml pins torch and torchvision exactly (==)"
    assert "pyproject.toml /opt/dpcourse/pyproject.toml" in parts["files"]
    install = [line for line in parts["post"].splitlines() if "pip install" in line]
    # with the room's extra: the hub's servers run batchspawner-singleuser inside the image
    assert any(line.rstrip().endswith("-e '/opt/dpcourse[room]'") and "--no-deps" not in line
               for line in install), install
    # nothing overrides the pins
    assert "PIP_CONSTRAINT" not in DEF.read_text() and " -c " not in " ".join(install)
    assert ({f"{name}=={version}" for name, version in wanted.items()}
            <= set(re.findall(r"\w+==[\w.]+", parts["help"])))
    cuda = BASE.fullmatch(header(parts)["From"])["cuda"]
    for path in (DEF, HOROVOD_DEF, ROOT / "container" / "README.md"):
        text = path.read_text()
        for name, version in re.findall(r"\b(torch|torchvision)(?:==| )(\d+\.\d+\.\d+)", text):
            assert version == wanted[name], \
                f"{path.name} names {name} {version}; pyproject.toml pins {wanted[name]}"
        for release in re.findall(r"\bCUDA (\d+\.\d+)\b", text):
            assert release == cuda, \
                f"{path.name} names CUDA {release}; the base image has CUDA {cuda}"


def test_the_bases_cuda_is_the_pinned_torchs():
    """The base's CUDA release is the one the pinned torch (PyPI's, as in .venv) was built with:
    horovod.def compiles against the base's toolkit, and a torch pin moved to another CUDA
    must move the base too."""
    import torch

    base = BASE.fullmatch(header(sections(DEF.read_text()))["From"])
    if torch.__version__.split("+")[0] != pins()["torch"] or not torch.version.cuda:
        pytest.skip(f"this environment's torch ({torch.__version__}) is not the pinned CUDA build")
    assert base["cuda"] == torch.version.cuda, \
        (f"base image has CUDA {base['cuda']}, the pinned torch {torch.__version__} "
         f"was built with {torch.version.cuda}")


def test_environment_keeps_user_site_packages_out(parts, tmp_path):
    script = tmp_path / "env.sh"
    script.write_text(parts["environment"])
    done = subprocess.run(["sh", "-c",
                           f'. "{script}"; echo "$PYTHONNOUSERSITE $PATH $DPCOURSE_HOME"'],
                          capture_output=True, text=True, timeout=30)
    nousersite, path, home = done.stdout.split()
    assert (nousersite == "1" and path.startswith("/opt/venv/bin:")
            and home == "/opt/dpcourse"), done.stdout
    assert ("python3 -m venv /opt/venv" in parts["post"]
            and "/opt/venv/bin/python -m pip install" in parts["post"])


@pytest.mark.slow
def test_the_test_section_passes_here(parts, tmp_path):
    """The versions, pip check and the real two-process gloo torchrun; nvidia-smi finds no GPU:
    CPU only."""
    done = run_test_section(parts, tmp_path, stand_ins(tmp_path, **{"nvidia-smi": NO_GPU}))
    assert done.returncode == 0, done.stdout
    want = pins()
    assert (f"torchvision {want['torchvision']}" in done.stdout
            and f"torch {want['torch']}" in done.stdout)
    assert "No broken requirements found" in done.stdout
    assert ("dpcourse smoke test: ok" in done.stdout
            and "hello from rank 1 of 2" in done.stdout), done.stdout
    assert "lists no GPU here, so the CPU test only" in done.stdout, done.stdout


def test_the_test_section_fails_when_the_sum_is_wrong(parts, tmp_path):
    """The smoke test cannot pass by accident: a torchrun that prints something else fails it."""
    fake = stand_ins(tmp_path, torchrun="echo 'all_reduce(rank + 1) = 2 on every rank'\n",
                     **{"nvidia-smi": NO_GPU})
    done = run_test_section(parts, tmp_path, fake, timeout=60)
    assert done.returncode == 1 and "wrong sum" in done.stdout, done.stdout


def test_the_test_section_fails_when_torch_is_not_the_pin(parts, tmp_path):
    """An image whose torch is not pyproject.toml's pin (an NGC torch, say) fails its
    %test at once."""
    home = tmp_path / "opt-dpcourse"
    home.mkdir()
    pinned = pins()["torch"]
    (home / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text().replace(
        f'"torch=={pinned}"', '"torch==2.6.0"'))
    done = run_test_section(parts, tmp_path, stand_ins(tmp_path, **{"nvidia-smi": NO_GPU}),
                            timeout=60, DPCOURSE_HOME=str(home))
    from importlib.metadata import version

    assert done.returncode == 1, done.stdout
    assert (f"dpcourse image test: torch is {version('torch')}, pyproject.toml pins 2.6.0"
            in done.stdout), done.stdout
    assert "smoke test" not in done.stdout


def test_the_test_section_fails_when_pip_check_does(parts, tmp_path):
    real = VENV_BIN / "python"
    python = ('if [ "$*" = "-m pip check" ]; then '
              'echo "foo 1.0 requires bar, which is not installed."; exit 1; fi\n'
              f'exec "{real}" "$@"\n')
    done = run_test_section(parts, tmp_path,
                            stand_ins(tmp_path, python=python, **{"nvidia-smi": NO_GPU}),
                            timeout=60)
    assert (done.returncode == 1
            and "pip check found broken requirements" in done.stdout), done.stdout
    assert "smoke test" not in done.stdout


def test_the_gpu_branch_runs_nccl_over_the_gpus_torch_sees(parts, tmp_path):
    """nvidia-smi -L lists four GPUs and torch sees three (CUDA_VISIBLE_DEVICES, say; stand-ins):
    an NCCL torchrun with one process per GPU torch sees, and the sum over three ranks
    (1 + 2 + 3) checked."""
    real = VENV_BIN / "python"
    python = ('case "$*" in *torch.cuda.device_count*) echo 3; exit 0;; esac\n'
              f'exec "{real}" "$@"\n')
    fake = stand_ins(tmp_path, python=python, torchrun=TORCHRUN, **{"nvidia-smi": gpus(4)})
    done = run_test_section(parts, tmp_path, fake, timeout=60)
    assert done.returncode == 0, done.stdout
    nccl = [line for line in done.stdout.splitlines()
            if line.startswith("torchrun") and "nccl" in line]
    assert nccl == ["torchrun --standalone --nproc-per-node=3 solutions/labs/hello.py "
                    "--backend nccl --device cuda"], done.stdout
    assert ("dpcourse GPU test: NCCL all_reduce over 3 GPU(s) (nvidia-smi -L lists 4): ok"
            in done.stdout)


def test_the_gpu_branch_without_a_gpu_says_why(parts, tmp_path):
    """nvidia-smi -L lists two GPUs, but this machine has none: the NCCL branch is taken, and it
    stops with one clear line instead of a torchrun traceback."""
    fake = stand_ins(tmp_path, torchrun=TORCHRUN, **{"nvidia-smi": gpus(2)})
    done = run_test_section(parts, tmp_path, fake, timeout=60, CUDA_VISIBLE_DEVICES="0,1")
    assert done.returncode == 1, done.stdout
    assert "dpcourse smoke test: ok" in done.stdout  # the CPU part ran first
    assert ("dpcourse GPU test: nvidia-smi -L lists 2 GPU(s), but torch sees none "
            "(CUDA_VISIBLE_DEVICES=0,1); "
            "torch's CUDA 13.0 build needs an NVIDIA driver >= 580") in done.stdout, done.stdout
    assert "--backend nccl" not in done.stdout


# JupyterLab as the runscript sees it: `jupyter --runtime-dir`, and `jupyter lab ... --ip=H
# --port=P`, which binds (H, P) itself (P=0: a port the system gives it), listens, and writes the
# port it took to jpserver-<pid>.json in its runtime folder, as jupyter_server does
FAKE_JUPYTER = """#!{python}
import json, os, socket, sys, time
if sys.argv[1:] == ["--runtime-dir"]:
    sys.exit(print(os.environ["JUPYTER_RUNTIME_DIR"]))
print("jupyter", *sys.argv[1:], flush=True)
print("token in env:", os.environ.get("JUPYTER_TOKEN"), flush=True)
options = dict(a[2:].split("=", 1) for a in sys.argv[2:] if a.startswith("--") and "=" in a)
server = socket.create_server((options["ip"], int(options["port"])))
with open(os.path.join(os.environ["JUPYTER_RUNTIME_DIR"], f"jpserver-{{os.getpid()}}.json"),
          "w") as info:
    json.dump({{"pid": os.getpid(), "port": server.getsockname()[1]}}, info, indent=2,
              sort_keys=True)
time.sleep(300)
"""


def _runscript(parts, tmp_path, *args):
    """%runscript run by sh here, with FAKE_JUPYTER as jupyter: (its output, the connection file,
    the port the server listens on), once the runscript has written the file."""
    import psutil

    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    (fake / "jupyter").write_text(FAKE_JUPYTER.format(python=sys.executable))
    (fake / "jupyter").chmod(0o755)
    script = tmp_path / "run.sh"
    script.write_text(parts["runscript"])
    connect = tmp_path / f"private-{len(args)}" / "connect.txt"
    (tmp_path / "runtime").mkdir(exist_ok=True)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "CONNECT": str(connect),
           "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime")}
    env.pop("JUPYTER_TOKEN", None)
    run = subprocess.Popen(["sh", str(script), *args], cwd=tmp_path, env=env, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           start_new_session=True)
    try:
        lines = []
        for line in run.stdout:  # until the runscript says where; EOF if it ended first
            lines.append(line)
            if line.startswith("JupyterLab runs on"):
                break
        assert connect.exists(), "".join(lines)
        # the runscript execs jupyter: the server is the process sh started
        listens = [c.laddr.port for c in psutil.Process(run.pid).net_connections("tcp")
                   if c.status == psutil.CONN_LISTEN]
        return "".join(lines), connect, listens
    finally:
        os.killpg(run.pid, 15)
        run.communicate(timeout=30)


def test_runscript_starts_jupyterlab_and_names_the_port_it_took_to_its_owner_alone(
        parts, tmp_path):
    """%runscript: JupyterLab on this host's own address (not 0.0.0.0), port retries off, the token
    in its environment and in a 0600 file, never in its arguments. Without --port, JupyterLab gets
    --port=0 and binds a port the system gives it; the address in the file names the port the
    server listens on (read from its runtime file), never one the script picked and let go."""
    import socket

    from dpcourse.lab.rendezvous import free_port

    assert "socket.socket()" not in parts["runscript"] and ".bind(" not in parts["runscript"]
    out, connect, listens = _runscript(parts, tmp_path)
    launched = next(line for line in out.splitlines() if line.startswith("jupyter "))
    host = socket.gethostname()
    assert launched.startswith(f"jupyter lab --no-browser --ip={host} --port=0 "
                               "--ServerApp.port_retries=0"), launched
    assert f"--ServerApp.root_dir={tmp_path}" in launched
    port = int(re.search(r"port (\d+): http://", connect.read_text()).group(1))
    assert listens == [port] and f"{host}:{port}/lab?token=" in connect.read_text(), (listens, out)
    token = re.search(r"token=(\w+)", connect.read_text()).group(1)
    assert len(token) == 32 and token not in launched and f"token in env: {token}" in out
    assert (oct(connect.stat().st_mode & 0o777) == "0o600"
            and f"port {port}; the address to open (with its token): cat {connect} (readable by "
                "you alone)" in out), out
    # --port N: that port, and the options after it reach JupyterLab
    asked = free_port()
    out, connect, listens = _runscript(parts, tmp_path, "--port", str(asked),
                                       "--ServerApp.base_url=/x/")
    launched = next(line for line in out.splitlines() if line.startswith("jupyter "))
    assert (f"--port={asked} " in launched
            and launched.rstrip().endswith("--ServerApp.base_url=/x/")
            and listens == [asked] and f"port {asked}: http://" in connect.read_text()), out


def test_the_horovod_image_builds_on_the_course_image():
    """container/horovod.def: dpcourse.sif plus `make horovod`'s script, with NCCL and an MPI; its
    %test checks the pins exactly as dpcourse.def's does."""
    part = sections(HOROVOD_DEF.read_text())  # (spython parses docker bootstraps only)
    assert header(part) == {"Bootstrap": "localimage", "From": "dpcourse.sif"}
    assert all((ROOT / line.split()[0]).exists()
               for line in part["files"].splitlines() if line.strip())
    assert ("HOROVOD_GPU_OPERATIONS=NCCL bash /opt/dpcourse/tools/install_horovod.sh "
            "/opt/venv/bin/python" in part["post"])
    assert "libopenmpi-dev" in part["post"]  # mpicxx: the MPI controller that srun --mpi starts
    pin_check = re.compile(r"python - <<'PY'\n.*?\nPY\n", re.S)
    assert (pin_check.search(part["test"])[0]
            == pin_check.search(sections(DEF.read_text())["test"])[0])
    assert "pip check" in part["test"]


def horovod_test(tmp_path, path_first=None):
    if not (VENV_BIN / "horovodrun").exists():
        pytest.skip("Horovod is not built here (make horovod)")
    return run_test_section(sections(HOROVOD_DEF.read_text()), tmp_path, path_first)


def test_the_horovod_images_test_runs_here(tmp_path):
    """Its %test, run here where Horovod is built: pins, pip check, the build, one process."""
    done = horovod_test(tmp_path, stand_ins(tmp_path, **{"nvidia-smi": NO_GPU}))
    assert done.returncode == 0 and "Horovod 1 process(es): ok" in done.stdout, done.stdout
    assert ("as pyproject.toml pins them" in done.stdout
            and "No broken requirements found" in done.stdout)


def test_the_horovod_images_gpu_branch_asks_for_nccl(tmp_path):
    """Where nvidia-smi lists GPUs, the Horovod image must have NCCL; the Horovod built here has
    none (no CUDA toolkit), so the branch, once taken, fails and says why."""
    done = horovod_test(tmp_path, stand_ins(tmp_path, **{"nvidia-smi": gpus(2)}))
    nccl = subprocess.run([sys.executable, "-c",
                           "import horovod.torch as hvd; print(bool(hvd.nccl_built()))"],
                          capture_output=True, text=True, timeout=60).stdout.strip()
    if nccl == "True":
        assert done.returncode == 0 and "NCCL built" in done.stdout, done.stdout
    else:
        assert done.returncode == 1 and "Horovod was built without NCCL" in done.stdout, done.stdout
