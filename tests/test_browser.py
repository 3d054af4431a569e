"""A real browser: JupyterLab in headless Chromium runs notebook 01, and its widget slider redraws
the plot.

The other notebook tests run the kernel alone (nbval, nbclient); this one also runs what the
learner's browser runs: JupyterLab's page, the ipywidgets manager, the sliders. It starts
JupyterLab on 127.0.0.1 (its own port, token, workspace, settings and runtime folders) on a
copy of the notebook, and tests/browser/run_notebook.mjs drives Debian's `chromium` with
playwright-core (npm, no browser download): Run All Cells, no error output, one step of the
batch-size slider, a new plot. Screenshots go to build/browser/.

Skipped where chromium or node is missing, except in CI (CI=true), which installs them
(.ci/run): there a skip would hide a broken harness, so it fails.
"""
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
import uuid

import psutil
import pytest

from conftest import ROOT
from dpcourse.lab.rendezvous import free_port

pytestmark = pytest.mark.slow

NOTEBOOK = ROOT / "solutions" / "01_minibatch_sgd.ipynb"
DRIVER_DIR = ROOT / "tests" / "browser"
DRIVER = DRIVER_DIR / "run_notebook.mjs"
SHOTS = ROOT / "build" / "browser"
CHROMIUM = os.environ.get("DPCOURSE_CHROMIUM", "/usr/bin/chromium")
NODE_MAJOR = 18  # playwright-core's oldest (tests/browser/package.json pins it)
# The lab's settings for this run: no windowing (every cell in the page, so it can be checked
# and photographed), no news or update checks (a closed network; as `make setup` sets them).
LAB_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none", "scrollPastEnd": False},
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
}


def _missing(why: str):
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI needs the browser test's tools (.ci/run installs them): {why}",
                    pytrace=False)
    pytest.skip(why)


@pytest.fixture(scope="module")
def node() -> str:
    """Node with playwright-core installed in tests/browser/node_modules (npm ci when missing)."""
    if not os.access(CHROMIUM, os.X_OK):
        _missing(f"no Chromium at {CHROMIUM} (apt-get install chromium)")
    node = shutil.which("node")
    if node is None:
        _missing("no node (apt-get install nodejs npm)")
    version = subprocess.run([node, "--version"], capture_output=True, text=True,
                             timeout=30).stdout.strip()
    if int(version.lstrip("v").split(".")[0] or 0) < NODE_MAJOR:
        _missing(f"node {version} is older than playwright-core needs (v{NODE_MAJOR})")
    if not (DRIVER_DIR / "node_modules" / "playwright-core" / "package.json").exists():
        npm = shutil.which("npm")
        if npm is None:
            _missing("no npm to install playwright-core (apt-get install npm)")
        # Debian's chromium, not Playwright's
        env = {**os.environ, "PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD": "1"}
        try:
            done = subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"],
                                  cwd=DRIVER_DIR, env=env, capture_output=True, text=True,
                                  timeout=300)
        except subprocess.TimeoutExpired:
            _missing("npm ci of playwright-core took more than 300 s")
        if done.returncode != 0:
            _missing(f"npm ci of playwright-core failed:\n"
                     f"{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return node


def _stop(procs: list[psutil.Process], tag: str):
    """Terminate, then kill, these processes and any process whose command line names ``tag``."""
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(tag in arg for arg in proc.info["cmdline"] or ()):
                procs.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    procs = [p for p in dict.fromkeys(procs) if p.pid != os.getpid()]
    for proc in procs:
        try:
            proc.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=15)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=10)


@pytest.fixture
def lab(tmp_path, fashion_root):
    """JupyterLab on a copy of notebook 01, on 127.0.0.1: (url, token, server folder, log). Stopped
    after, with its kernels (each in its own session: found by the runtime folder their command
    lines name). Its own workspace and settings folders: it never reopens an earlier run's tabs."""
    base = tmp_path / "lab"
    serve, settings, workspaces, runtime = (base / name for name in
                                            ("root", "settings", "workspaces", "runtime"))
    for folder in (serve, settings, workspaces, runtime):
        folder.mkdir(parents=True)
    # The browser saves (and autosaves) this copy; the committed solution is never opened.
    shutil.copy2(NOTEBOOK, serve / NOTEBOOK.name)
    for plugin, values in LAB_SETTINGS.items():
        path = settings / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    port, token = free_port(), uuid.uuid4().hex
    env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(runtime),
           "JUPYTER_CONFIG_DIR": str(base / "config"), "IPYTHONDIR": str(base / "ipython"),
           "PYTHONUNBUFFERED": "1", "DPCOURSE_DATA": str(fashion_root)}
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
           f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
           f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={serve}",
           f"--LabApp.workspaces_dir={workspaces}", f"--LabApp.user_settings_dir={settings}"]
    if os.geteuid() == 0:
        cmd.append("--allow-root")
    log = tmp_path / "jupyter.log"
    with open(log, "w") as log_file:
        server = subprocess.Popen(cmd, cwd=serve, env=env, stdin=subprocess.DEVNULL,
                                  stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback, never a proxy
    try:
        # a cap for a hang (the server's exit ends the wait sooner)
        deadline = time.monotonic() + 180
        while True:
            try:
                with direct.open(f"{url}/api/status?token={token}", timeout=5) as response:
                    json.load(response)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"JupyterLab did not answer on {url} (exit status "
                                f"{server.poll()}):\n{log.read_text()[-3000:]}", pytrace=False)
                time.sleep(0.5)
        yield url, token, serve, log
    finally:
        try:
            server_proc = psutil.Process(server.pid)
            family = [server_proc, *server_proc.children(recursive=True)]
        except psutil.NoSuchProcess:
            family = []
        _stop(family, str(runtime))
        server.wait(timeout=30)


def test_notebook_01_runs_in_a_real_browser_and_its_slider_redraws_the_plot(node, lab):
    started = time.monotonic()
    url, token, serve, log = lab
    committed = NOTEBOOK.read_bytes()
    cells = json.loads(committed)["cells"]
    code_cells = sum(cell["cell_type"] == "code" for cell in cells)
    shutil.rmtree(SHOTS, ignore_errors=True)
    SHOTS.mkdir(parents=True)
    tag = f"dpcourse-browser-{uuid.uuid4().hex[:12]}"
    driver = subprocess.Popen([node, str(DRIVER), f"--url={url}", f"--token={token}",
                               f"--notebook={NOTEBOOK.name}", f"--out={SHOTS}",
                               f"--cells={len(cells)}", f"--chromium={CHROMIUM}", "--timeout=300",
                               f"--tag={tag}"],
                              cwd=DRIVER_DIR, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, start_new_session=True)
    try:
        stdout, stderr = driver.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        stdout, stderr = "", "the driver ran past 600 s"
    finally:  # the driver closes Chromium; if it could not, its processes carry the tag
        _stop([psutil.Process(driver.pid)] if driver.poll() is None else [], tag)
        driver.wait(timeout=30)
    lines = stdout.strip().splitlines()
    try:
        result = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        pytest.fail(f"the browser driver reported nothing (exit {driver.returncode}):\n"
                    f"{stdout[-2000:]}\n{stderr[-3000:]}\nJupyterLab's log:\n"
                    f"{log.read_text()[-3000:]}", pytrace=False)
    (SHOTS / "result.json").write_text(json.dumps(result, indent=1))
    seen = f"(driver's report: {SHOTS / 'result.json'}, screenshots in {SHOTS})"

    assert "failure" not in result, \
        f"the browser driver broke: {result['failure']}\n{stderr[-2000:]} {seen}"
    assert result["cells_rendered"] == len(cells) and result["code_cells"] == code_cells, seen
    assert not result["errors"], "cells raised in the browser:\n" + "\n\n".join(
        f"code cell {e['code_cell']}:\n{e['text']}" for e in result["errors"]) + f"\n{seen}"
    counts = result["execution_counts"]
    assert (result["cells_run"] == code_cells
            and counts == list(range(counts[0], counts[0] + code_cells))), \
        f"not every code cell ran, in order: {counts} {seen}"
    assert result["slider_moved"], f"the slider did not move: {result['slider']} {seen}"
    assert result["slider"]["label"] == "batch size", result["slider"]
    assert result["plot_changed"], \
        f"moving the slider did not redraw the plot: {result['slider']} {seen}"

    # What the browser saved: the run's own outputs, no error, in the copy only.
    assert result["saved"], seen
    saved = json.loads((serve / NOTEBOOK.name).read_text())
    ran = [cell for cell in saved["cells"] if cell["cell_type"] == "code"]
    assert [cell["execution_count"] for cell in ran] == counts
    assert not [out for cell in ran for out in cell["outputs"] if out["output_type"] == "error"]
    assert NOTEBOOK.read_bytes() == committed, "the committed solution notebook was modified"
    for shot in ("notebook.png", "widget_cell.png"):
        assert (SHOTS / shot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", shot

    took = time.monotonic() - started
    print(f"\nbrowser test: {took:.1f} s in the test ({result['timings']} in the driver); "
          f"screenshots: " + ", ".join(result["screenshots"]))
