"""`make lab`: JupyterLab starts from this environment and serves the course's notebooks."""
import json
import subprocess
import sys
import time
import urllib.request

from conftest import ROOT
from dpcourse.dist import free_port


def test_jupyterlab_serves_the_student_notebook():
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback, never a proxy
    port, token = free_port(), "dpcourse-test"
    proc = subprocess.Popen([sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}",
                             "--ServerApp.ip=127.0.0.1", f"--IdentityProvider.token={token}",
                             "--allow-root"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}/api/contents/notebooks/00_setup.ipynb?token={token}&content=0"
        deadline = time.time() + 60
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
        with direct.open(f"http://127.0.0.1:{port}/lab?token={token}", timeout=10) as response:
            assert response.status == 200 and b"JupyterLab" in response.read()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
