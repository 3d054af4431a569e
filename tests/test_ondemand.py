"""The Open OnDemand app (room/ondemand/dpcourse_jupyter): its YAML is valid and complete, its ERB
templates render with Debian's ruby as Open OnDemand renders them (trim mode "-", the form's values
as local names), the job script they make passes shellcheck in both environments, a form value
never becomes YAML or shell syntax, the job gets no more hours, CPUs, memory or GPUs than the form
allows whatever is posted, the connection file names the port the session's server listens on
(a port taken between find_port and JupyterLab's bind is left for another), and the .venv variant
really starts JupyterLab behind /node/HOST/PORT/ with the session's secret.

Skipped where ruby or shellcheck is missing, except in CI (CI=true), which installs them.
"""
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from conftest import ROOT
from dpcourse.lab.rendezvous import free_port

APP = ROOT / "room" / "ondemand" / "dpcourse_jupyter"
FORM = {"shared_course": str(ROOT), "course_dir": str(ROOT), "environment": "venv",
        "container_image": "",
        "bc_account": "trn01", "bc_queue": "gpu", "reservation": "workshop", "bc_num_hours": "2",
        "num_cores": "8", "memory_gb": "16", "num_gpus": "1"}
# Open OnDemand's job script for a "basic" app (ood_core's BatchConnect::Template), cut down to what
# the app uses: the helpers (find_port here hands out the test's ports in turn), host, before.sh
# sourced, script.sh started in the background, after.sh sourced, and then the connection file
# written from host, port and password
OOD_WRAPPER = """#!/usr/bin/env bash
find_port() {{
    local ports=({ports}) n
    n=$(cat "{work}/find_port.calls" 2>/dev/null || echo 0)
    echo $((n + 1)) > "{work}/find_port.calls"
    echo "${{ports[n]}}"
}}
create_passwd() {{ tr -dc A-Za-z0-9 </dev/urandom | head -c "$1"; }}
export -f find_port create_passwd
host={host}
export host port
{before}
./script.sh &
SCRIPT_PID=$!
{after}
(umask 077 && printf 'host: %s\\nport: %s\\npassword: %s\\n' "$host" "$port" "$password" \\
    > connection.yml)
wait "$SCRIPT_PID"
"""

def _tool(name: str) -> str:
    found = shutil.which(name)
    if not found:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI needs {name} (.ci/run installs it)", pytrace=False)
        pytest.skip(f"no {name} (apt-get install {name})")
    return found


def ruby(script: str, payload) -> str:
    done = subprocess.run([_tool("ruby"), "-e", script], input=json.dumps(payload),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


RENDER = """require "erb"; require "json"
args = JSON.parse(STDIN.read)
print ERB.new(File.read(args["path"]), trim_mode: "-").result_with_hash(args["values"])"""
YAML_TO_JSON = """require "yaml"; require "json"
print JSON.generate(YAML.safe_load(JSON.parse(STDIN.read)["text"]))"""


def render(name: str, **values) -> str:
    return ruby(RENDER, {"path": str(APP / name), "values": {**FORM, **values}})


def yaml(text: str):
    return json.loads(ruby(YAML_TO_JSON, {"text": text}))


def test_the_app_files_are_valid_yaml_and_the_form_is_complete():
    manifest = yaml((APP / "manifest.yml").read_text())
    assert manifest["role"] == "batch_connect" and manifest["category"] == "Interactive Apps"
    form = yaml((APP / "form.yml").read_text())
    smart = {"bc_account", "bc_queue", "bc_num_hours"}  # Open OnDemand's own attributes
    assert set(form["form"]) <= set(form["attributes"]) | smart
    assert set(FORM) == set(form["form"]), "the test's sample form is not the app's form"
    for name in ("submit.yml.erb", "template/script.sh.erb", "template/before.sh.erb",
                 "template/after.sh.erb"):
        assert (APP / name).exists(), name
    # Open OnDemand renders script.sh.erb to script.sh with the same mode, then runs ./script.sh
    assert os.access(APP / "template" / "script.sh.erb", os.X_OK), "script.sh.erb is not executable"
    mode = subprocess.run(["git", "ls-files", "-s", "room/ondemand/dpcourse_jupyter/template/"
                           "script.sh.erb"], cwd=ROOT, capture_output=True, text=True).stdout
    assert not mode or mode.startswith("100755"), f"git keeps it without its x bit: {mode}"


def test_submit_yml_renders_to_slurm_options_and_a_form_value_stays_a_word():
    submit = yaml(render("submit.yml.erb"))
    assert submit["batch_connect"]["template"] == "basic"
    native = submit["script"]["native"]
    assert ("--cpus-per-task=8" in native and "--gpus-per-node=1" in native
            and "--mem=16G" in native), native
    assert submit["script"]["wall_time"] == 2 * 3600
    assert submit["script"]["reservation_id"] == "workshop"
    cpu_only = yaml(render("submit.yml.erb", num_gpus="0", reservation=""))["script"]
    assert not any(o.startswith("--gpus") for o in cpu_only["native"]), cpu_only
    assert "reservation_id" not in cpu_only
    hostile = yaml(render("submit.yml.erb", reservation='ws"\n  uid: "0'))["script"]
    assert hostile["reservation_id"] == "wsuid0" and "uid" not in hostile, hostile


@pytest.mark.parametrize("posted, hours, cpus, memory, gpus", [
    # what the form cannot send but a request made by hand can: each held to form.yml's max ...
    ({"bc_num_hours": "720", "num_cores": "999", "memory_gb": "100000", "num_gpus": "8"},
     8, 32, 64, 1),
    # ... or its min: below it, negative, not a number, empty
    ({"bc_num_hours": "0", "num_cores": "-4", "memory_gb": "1", "num_gpus": "-1"}, 1, 1, 4, 0),
    ({"bc_num_hours": "-3", "num_cores": "many", "memory_gb": "lots", "num_gpus": "all"},
     1, 1, 4, 0),
    ({"bc_num_hours": "", "num_cores": "", "memory_gb": "", "num_gpus": ""}, 1, 1, 4, 0),
])
def test_the_job_gets_no_more_than_the_form_allows_whatever_is_posted(posted, hours, cpus,
                                                                      memory, gpus):
    """The form's min and max are the browser's: submit.yml.erb holds hours (Slurm's --time, from
    wall_time, which takes the place of Open OnDemand's own unclamped bc_num_hours × 3600), CPUs,
    memory and GPUs within the same limits, and form.yml says the same ones."""
    script = yaml(render("submit.yml.erb", **posted))["script"]
    native = script["native"]
    assert script["wall_time"] == hours * 3600, script
    assert f"--cpus-per-task={cpus}" in native and f"--mem={memory}G" in native, native
    assert [o for o in native if o.startswith("--gpus")] == (
        [f"--gpus-per-node={gpus}"] if gpus else []), native
    limits = yaml((APP / "form.yml").read_text())["attributes"]
    assert [(limits[k]["min"], limits[k]["max"]) for k in
            ("bc_num_hours", "num_cores", "memory_gb", "num_gpus")] == [
        (1, 8), (1, 32), (4, 64), (0, 1)], "form.yml's limits are not submit.yml.erb's"


def session(work: Path, host: str, ports: list[int], **values) -> Path:
    """The rendered app in ``work`` as Open OnDemand stages it (script.sh, executable), and the job
    script that runs it (OOD_WRAPPER), whose path this returns."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "script.sh").write_text(render("template/script.sh.erb", **values))
    (work / "script.sh").chmod(0o755)
    wrapper = work / "job.sh"
    wrapper.write_text(OOD_WRAPPER.format(
        work=work, host=host, ports=" ".join(map(str, ports)),
        before=render("template/before.sh.erb", **values),
        after=render("template/after.sh.erb", **values)))
    return wrapper


@pytest.mark.parametrize("environment", ["venv", "container"])
def test_the_job_scripts_pass_shellcheck(environment, tmp_path):
    """The job script (with before.sh and after.sh in it, as Open OnDemand sources them) and
    script.sh, which it starts."""
    wrapper = session(tmp_path, "node1", [8888], environment=environment,
                      container_image="/shared/dpcourse.sif")
    script = tmp_path / "script-checked.sh"
    script.write_text("#!/usr/bin/env bash\nhost=node1 password=secret\n"
                      + (tmp_path / "script.sh").read_text().split("\n", 1)[1])
    for path in (wrapper, script):
        done = subprocess.run([_tool("shellcheck"), "--severity=style", str(path)],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + path.read_text()


def test_a_hostile_course_folder_stays_one_word(tmp_path):
    text = render("template/script.sh.erb", course_dir='x"; touch /tmp/owned #')
    assert "COURSE=x\\\"\\;\\ touch\\ /tmp/owned\\ \\#" in text, text


def start_session(wrapper: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen(["bash", str(wrapper)], cwd=wrapper.parent, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def connection_of(job: subprocess.Popen, wrapper: Path, cap_s: float) -> dict:
    """The session's connection file, once the job script has written it (after after.sh)."""
    connection = wrapper.parent / "connection.yml"
    deadline = time.monotonic() + cap_s  # a cap for a hang only
    while not connection.exists() and job.poll() is None:
        assert time.monotonic() < deadline, "no connection file"
        time.sleep(0.2)
    assert connection.exists(), "the job ended without a connection file"
    assert oct(connection.stat().st_mode & 0o777) == "0o600"
    return yaml(connection.read_text())


def listener(port: int, job: subprocess.Popen):
    """The process that listens on ``port``: one the session's job script started."""
    import psutil

    found = [psutil.Process(c.pid) for c in psutil.net_connections("tcp")
             if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
    assert len(found) == 1 and job.pid in [p.pid for p in found[0].parents()], found
    return found[0]


# JupyterLab as script.sh sees it: `jupyter lab ... --ip=H --port=P --ServerApp.base_url=B` binds
# (H, P) or stops, as jupyter_server does with port_retries=0, then writes its runtime file
# (jpserver-PID.json in JUPYTER_RUNTIME_DIR, with the port), and answers B + api/status with 200
# to the session's token alone
FAKE_JUPYTER = """#!{python}
import http.server, json, os, sys, time
time.sleep(1.5)  # a real one takes seconds to start: the job script polls meanwhile
options = dict(a[2:].split("=", 1) for a in sys.argv[2:] if a.startswith("--") and "=" in a)
status = options["ServerApp.base_url"] + "api/status"


class Status(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        token = self.headers.get("Authorization") == "token " + os.environ["JUPYTER_TOKEN"]
        self.send_response(200 if token and self.path == status else 403)
        self.end_headers()


try:
    server = http.server.HTTPServer((options["ip"], int(options["port"])), Status)
except OSError as err:
    sys.exit(f"[C] ERROR: the Jupyter server could not be started: {{err}}")
if runtime := os.environ.get("JUPYTER_RUNTIME_DIR"):  # jupyter_server's default is ~/.local/...
    with open(os.path.join(runtime, f"jpserver-{{os.getpid()}}.json"), "w") as f:
        json.dump({{"port": int(options["port"]), "pid": os.getpid()}}, f, indent=2)
server.serve_forever()
"""


def test_a_port_taken_before_jupyterlab_binds_it_never_reaches_the_connection_file(tmp_path):
    """Open OnDemand's path /node/HOST/PORT/ names the port, so script.sh must pick it (find_port)
    before JupyterLab starts, and another program may take it in between. Here the first port
    find_port hands out is taken so: JupyterLab (a stand-in that binds as jupyter_server does)
    stops, the script picks the next one, and the connection file Open OnDemand reads names the
    port the session's server listens on, written once that server's runtime file says it holds
    the port. The program that took the port never receives the session's secret: it could be
    another user's, waiting for it."""
    course = tmp_path / "course"
    (course / ".venv" / "bin").mkdir(parents=True)
    (course / "pyproject.toml").write_text("")
    (course / ".venv" / "bin" / "jupyter").write_text(FAKE_JUPYTER.format(python=sys.executable))
    (course / ".venv" / "bin" / "jupyter").chmod(0o755)
    taken = socket.create_server(("127.0.0.1", 0))  # another program's, between pick and bind
    taken.settimeout(0.2)
    first, port = taken.getsockname()[1], free_port()
    wrapper = session(tmp_path / "session", "127.0.0.1", [first, port], course_dir=str(course))
    job = start_session(wrapper, {**os.environ, "HOME": str(tmp_path)})
    try:
        info = connection_of(job, wrapper, 300)  # a cap for a hang, not a timing
        assert info["host"] == "127.0.0.1" and info["port"] == port, info
        assert f"--port={port}" in listener(port, job).cmdline()
        received = b""  # what the script sent to the program that took the port, if anything
        while True:
            try:
                conn = taken.accept()[0]
            except TimeoutError:
                break
            conn.settimeout(0.5)
            try:
                received += conn.recv(65536)
            except TimeoutError:
                pass
            conn.close()
        assert info["password"].encode() not in received, received
    finally:
        os.killpg(job.pid, 15)
        out = job.communicate(timeout=30)[0]
        taken.close()
    assert (f"port {first} was taken before JupyterLab could bind it: another one (try 1 of 3)"
            in out), out


@pytest.mark.slow
def test_the_venv_variant_serves_jupyterlab_behind_the_ood_path(tmp_path):
    """The rendered job, run here with the course's JupyterLab: the connection file Open OnDemand
    reads names the port the session's JupyterLab listens on, and JupyterLab answers at
    /node/HOST/PORT/ with the session's secret, and refuses without it."""
    port = free_port()
    wrapper = session(tmp_path / "session", "127.0.0.1", [port])
    wrapper.write_text(wrapper.read_text().replace("password=$(create_passwd 32)",
                                                   "password=ood-test-secret"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER", "JPY_"))}
    env.update(HOME=str(tmp_path), JUPYTER_RUNTIME_DIR=str(tmp_path / "rt"),
               JUPYTER_CONFIG_DIR=str(tmp_path / "cfg"), JUPYTER_DATA_DIR=str(tmp_path / "data"))
    job = start_session(wrapper, env)
    try:
        info = connection_of(job, wrapper, 300)
        assert (info["host"], info["port"], info["password"]) == (
            "127.0.0.1", port, "ood-test-secret"), info
        assert (f"--ServerApp.base_url=/node/127.0.0.1/{port}/"
                in listener(port, job).cmdline())
        base = f"http://127.0.0.1:{port}/node/127.0.0.1/{port}"
        with urllib.request.urlopen(f"{base}/api/status?token=ood-test-secret", timeout=5) as r:
            assert r.status == 200
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"{base}/api/status", timeout=5)
        assert refused.value.code == 403
    finally:
        os.killpg(job.pid, 15)
        out = job.communicate(timeout=30)[0]
    assert "ood-test-secret" not in out, "the secret reached the job's log"
