"""The learner's environment: `make setup`, `make lab`, and the commands the README gives."""
import json
import re
import shlex
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import tomllib

from conftest import ROOT, run
from dpcourse.lab.data import _corrupt, _no_data_message
from dpcourse.lab.rendezvous import free_port


def test_jupyterlab_serves_the_student_notebook_without_nbgrader(tmp_path):
    """JupyterLab as `make lab` starts it: the course's notebooks, and none of nbgrader's menus and
    panels."""
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback, never a proxy
    port, token = free_port(), "dpcourse-test"
    base = f"http://127.0.0.1:{port}"
    log = tmp_path / "jupyter.log"
    # what `make lab` runs
    recipe = run(["make", "-s", "-n", "lab"]).stdout.strip().splitlines()[-1]
    assert "jupyter lab" in recipe, recipe
    with open(log, "w") as log_file:
        proc = subprocess.Popen([*shlex.split(recipe), "--no-browser", f"--port={port}",
                                 "--ServerApp.ip=127.0.0.1", f"--IdentityProvider.token={token}",
                                 "--allow-root"],
                                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log_file)
    try:
        # the checkout's top
        url = f"{base}/api/contents/notebooks/00_setup.ipynb?token={token}&content=0"
        # a cap for a hang: it starts in seconds alone, more beside the other worker
        deadline = time.time() + 180
        while True:
            try:
                with direct.open(url, timeout=5) as response:
                    info = json.load(response)
                break
            except OSError:
                if time.time() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.5)
        assert info["type"] == "notebook" and info["name"] == "00_setup.ipynb"
        # the labs the notebooks tell the learner to read are in the file browser too
        with direct.open(f"{base}/api/contents/labs/hello.py?token={token}&content=0",
                         timeout=10) as response:
            assert json.load(response)["name"] == "hello.py"
        with direct.open(f"{base}/?token={token}", timeout=10) as response:  # opens on notebook 00
            assert response.url.split("?")[0].endswith("/lab/tree/notebooks/00_setup.ipynb"), \
                response.url
        with direct.open(f"{base}/lab?token={token}", timeout=10) as response:
            assert response.status == 200
            page = response.read().decode()
        config = json.loads(re.search(
            r'<script id="jupyter-config-data" type="application/json">(.*?)</script>',
            page, re.S).group(1))
        federated = [ext["name"] for ext in config["federated_extensions"]]
        assert "@jupyter-widgets/jupyterlab-manager" in federated  # the page lists lab extensions
        shown = [name for name in federated
                 if "nbgrader" in name and name not in config["disabledExtensions"]]
        assert not shown, \
            f"JupyterLab shows nbgrader's lab extension {shown}: `make setup` disables it"

        loaded = re.findall(r"(\S+) \| extension was successfully loaded", log.read_text())
        assert "jupyterlab" in loaded, loaded
        assert not [name for name in loaded if "nbgrader" in name], \
            f"server extensions loaded: {loaded}"
        with pytest.raises(urllib.error.HTTPError, match="404"):
            direct.open(f"{base}/formgrader?token={token}", timeout=10)
        # no news pop-up over the notebook (`make setup` writes the override)
        news = f"{base}/lab/api/settings/@jupyterlab/apputils-extension:notification?token={token}"
        with direct.open(news, timeout=10) as response:
            defaults = {k: v.get("default")
                        for k, v in json.load(response)["schema"]["properties"].items()}
        assert defaults["fetchNews"] == "false" and defaults["checkForUpdates"] is False, defaults
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.skipif(not shutil.which("make"), reason="needs make")
def test_setup_installs_torch_from_the_index_it_is_given():
    pins = [req for req in
            tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
            if req.startswith(("torch==", "torchvision=="))]
    assert len(pins) == 2
    cpu = "https://download.pytorch.org/whl/cpu"
    # -n: print the commands, run none; -B: as on a fresh clone, even where .venv is installed
    lines = run(["make", "-n", "-B", "setup", f"TORCH_INDEX={cpu}"]).stdout.splitlines()
    first = [i for i, line in enumerate(lines) if f"--index-url {cpu} {' '.join(pins)}" in line]
    rest = [i for i, line in enumerate(lines) if "-e '.[dev]'" in line]
    assert first and rest and first[0] < rest[0], "\n".join(lines)
    # the default: PyPI's wheels
    assert "--index-url" not in run(["make", "-n", "-B", "setup"]).stdout


TOOLS = r"(?:python3?|torchrun|jupyter|pytest|pip)"  # what .venv provides


def test_readme_commands_run_in_the_course_environment():
    """A command typed by hand uses .venv: its block activates .venv first, or it names
    .venv/bin/…"""
    readme = (ROOT / "README.md").read_text()
    problems = []
    for block in re.findall(r"```(?:bash|sh)\n(.*?)```", readme, re.S):
        active = False
        for line in block.splitlines():
            active |= line.startswith("source .venv/bin/activate")
            if not active and re.search(rf"(?:^|\s){TOOLS}\s", line.split("#")[0]):
                problems.append(line)
    prose = re.sub(r"```.*?```", "", readme, flags=re.S)
    problems += [span for span in re.findall(r"`([^`\n]+)`", prose)
                 if re.match(rf"{TOOLS}\s", span)]
    assert not problems, ("README commands that need `source .venv/bin/activate` first:\n"
                          + "\n".join(problems))


def test_data_messages_name_the_course_python():
    root = Path("/data")
    for message in (str(_corrupt(root / "FashionMNIST/raw/x", "x is truncated", root)),
                    _no_data_message(root, Path("/usr/share/datasets/fashion-mnist"), "offline")):
        commands = re.findall(r"\S*python -m dpcourse\.lab\.data fetch", message)
        assert commands and all(c == ".venv/bin/python -m dpcourse.lab.data fetch"
                                for c in commands), message
