"""container/dpcourse.def without Apptainer (it cannot run here): the definition parses (spython),
its image is pinned, the files it copies exist, and its %test, %post's requirements and %runscript
scripts run in this environment as they would in the image."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

DEF = ROOT / "container" / "dpcourse.def"
VENV_BIN = Path(sys.executable).parent


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


@pytest.fixture(scope="module")
def parts():
    return sections(DEF.read_text())


def in_image_env(**extra):
    """This checkout standing in for /opt/dpcourse, the course's python and torchrun on PATH."""
    return {**os.environ, "PATH": f"{VENV_BIN}:{os.environ['PATH']}", "DPCOURSE_HOME": str(ROOT),
            "OMP_NUM_THREADS": "1", **extra}


def test_spython_parses_a_pinned_definition():
    from spython.main.parse.parsers import SingularityParser

    recipe = SingularityParser(str(DEF)).recipe["spython-base"]
    image = recipe.fromHeader
    assert re.fullmatch(r"nvcr\.io/nvidia/pytorch:\d\d\.\d\d-py3", image), f"pin an NGC release, not {image!r}"
    assert any(env.startswith("DPCOURSE_HOME=") for env in recipe.environ)
    assert recipe.labels and recipe.install  # %post parsed (spython turns %runscript into one of its steps)
    for line in recipe.files:  # what %files copies must be in the checkout the image is built from
        source = line.split()[0]
        assert (ROOT / source).exists(), f"%files copies {source}, which the checkout does not have"


def test_every_section_is_there(parts):
    assert {"labels", "help", "files", "environment", "post", "test", "runscript"} <= set(parts)
    assert parts["header"].splitlines()[0] == "Bootstrap: docker"
    assert "apptainer build" in parts["help"] and "--nv" in parts["help"]


def test_post_installs_the_kits_requirements_but_keeps_the_images_torch(parts):
    snippet = re.search(r"<<'PY'[^\n]*\n(.*?)\nPY\n", parts["post"], re.S).group(1)
    done = subprocess.run([sys.executable, "-c", snippet], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    wanted = done.stdout.split()
    assert wanted and not [r for r in wanted if r.startswith(("torch==", "torchvision=="))], wanted
    assert any(r.startswith("jupyterlab") for r in wanted) and any(r.startswith("ipywidgets") for r in wanted)
    assert "--no-deps -e /opt/dpcourse" in parts["post"]


@pytest.mark.slow
def test_the_test_section_passes_here(parts, tmp_path):
    """%test as `apptainer test` runs it (/bin/sh), with this checkout as /opt/dpcourse."""
    script = tmp_path / "test.sh"
    script.write_text(parts["test"])
    done = subprocess.run(["sh", str(script)], cwd=tmp_path, env=in_image_env(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=120)
    assert done.returncode == 0, done.stdout
    assert "dpcourse smoke test: ok" in done.stdout and "hello from rank 1 of 2" in done.stdout, done.stdout


def test_the_test_section_fails_when_the_sum_is_wrong(parts, tmp_path):
    """The smoke test cannot pass by accident: a torchrun that prints something else fails it."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "torchrun").write_text("#!/bin/sh\necho 'all_reduce(rank + 1) = 2 on every rank'\n")
    (fake / "torchrun").chmod(0o755)
    script = tmp_path / "test.sh"
    script.write_text(parts["test"])
    env = in_image_env()
    env["PATH"] = f"{fake}:{env['PATH']}"
    done = subprocess.run(["sh", str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=60)
    assert done.returncode == 1 and "wrong sum" in done.stdout, done.stdout


def test_runscript_starts_jupyterlab_on_the_port_given_and_keeps_its_token_to_its_owner(parts, tmp_path):
    """%runscript: JupyterLab on this host's own address (not 0.0.0.0), port retries off, the token in
    its environment and in a 0600 file, never in its arguments."""
    import socket

    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "jupyter").write_text('#!/bin/sh\necho "jupyter $*"\necho "token in env: $JUPYTER_TOKEN"\n')
    (fake / "jupyter").chmod(0o755)
    script = tmp_path / "run.sh"
    script.write_text(parts["runscript"])
    connect = tmp_path / "private" / "connect.txt"
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "CONNECT": str(connect)}
    env.pop("JUPYTER_TOKEN", None)
    done = subprocess.run(["sh", str(script), "--port", "9999", "--ServerApp.base_url=/x/"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    launched = next(line for line in done.stdout.splitlines() if line.startswith("jupyter "))
    host = socket.gethostname()
    assert launched.startswith(f"jupyter lab --no-browser --ip={host} --port=9999 --ServerApp.port_retries=0"), launched
    assert launched.rstrip().endswith("--ServerApp.base_url=/x/") and f"--ServerApp.root_dir={tmp_path}" in launched
    token = re.search(r"token=(\w+)", connect.read_text()).group(1)
    assert len(token) == 32 and token not in launched and f"token in env: {token}" in done.stdout
    assert oct(connect.stat().st_mode & 0o777) == "0o600" and f"cat {connect} (readable by you alone)" in done.stdout


def test_the_horovod_image_builds_on_the_course_image_and_its_test_runs_here():
    """container/horovod.def: dpcourse.sif plus `make horovod`'s script; its %test, run here where
    Horovod is built, passes."""
    horovod_def = ROOT / "container" / "horovod.def"
    part = sections(horovod_def.read_text())  # (spython parses docker bootstraps only)
    header = dict(line.split(":", 1) for line in part["header"].splitlines() if ":" in line and not line.startswith("#"))
    assert {k: v.strip() for k, v in header.items()} == {"Bootstrap": "localimage", "From": "dpcourse.sif"}
    assert all((ROOT / line.split()[0]).exists() for line in part["files"].splitlines() if line.strip())
    assert "tools/install_horovod.sh" in part["post"] and "HOROVOD_GPU_OPERATIONS=NCCL" in part["post"]
    if not (VENV_BIN / "horovodrun").exists():
        pytest.skip("Horovod is not built here (make horovod)")
    done = subprocess.run(["bash", "-c", part["test"]], env=in_image_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "Horovod 1 process(es): ok" in done.stdout, done.stdout + done.stderr
