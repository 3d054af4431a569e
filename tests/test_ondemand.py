"""The Open OnDemand app (room/ondemand/dpcourse_jupyter): its YAML is valid and complete, its ERB
templates render with Debian's ruby as Open OnDemand renders them (trim mode "-", the form's values
as local names), the job script they make passes shellcheck in both environments, a form value
never becomes YAML or shell syntax, and the .venv variant really starts JupyterLab behind
/node/HOST/PORT/ with the session's secret.

Skipped where ruby or shellcheck is missing, except in CI (CI=true), which installs them.
"""
import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request

import pytest

from conftest import ROOT
from dpcourse.rendezvous import free_port

APP = ROOT / "room" / "ondemand" / "dpcourse_jupyter"
FORM = {"shared_course": str(ROOT), "course_dir": str(ROOT), "environment": "venv",
        "container_image": "",
        "bc_account": "trn01", "bc_queue": "gpu", "reservation": "workshop", "bc_num_hours": "2",
        "num_cores": "8", "memory_gb": "16", "num_gpus": "1"}
# Open OnDemand's job script: its header, its find_port and create_passwd, then before.sh and
# script.sh (as its basic template puts them together)
OOD_STUB = """#!/usr/bin/env bash
host={host}
find_port() {{ echo {port}; }}
create_passwd() {{ tr -dc A-Za-z0-9 </dev/urandom | head -c "$1"; }}
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
    for name in ("submit.yml.erb", "template/script.sh.erb", "template/before.sh.erb"):
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


def job_script(host: str, port: int, **values) -> str:
    script = render("template/script.sh.erb", **values).split("\n", 1)[1]  # its shebang: the stub's
    return (OOD_STUB.format(host=host, port=port) + render("template/before.sh.erb", **values)
            + "\n" + script)


@pytest.mark.parametrize("environment", ["venv", "container"])
def test_the_job_script_passes_shellcheck(environment, tmp_path):
    path = tmp_path / "job.sh"
    path.write_text(job_script("node1", 8888, environment=environment,
                               container_image="/shared/dpcourse.sif"))
    done = subprocess.run([_tool("shellcheck"), "--severity=style", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + path.read_text()


def test_a_hostile_course_folder_stays_one_word(tmp_path):
    text = render("template/script.sh.erb", course_dir='x"; touch /tmp/owned #')
    assert "COURSE=x\\\"\\;\\ touch\\ /tmp/owned\\ \\#" in text, text


@pytest.mark.slow
def test_the_venv_variant_serves_jupyterlab_behind_the_ood_path(tmp_path):
    """The rendered job, run here: JupyterLab answers at /node/HOST/PORT/ with the session's secret,
    and refuses without it."""
    port = free_port()
    path = tmp_path / "job.sh"
    path.write_text(job_script("127.0.0.1", port).replace(
        "password=$(create_passwd 32)", "password=ood-test-secret"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER", "JPY_"))}
    env.update(HOME=str(tmp_path), JUPYTER_RUNTIME_DIR=str(tmp_path / "rt"),
               JUPYTER_CONFIG_DIR=str(tmp_path / "cfg"), JUPYTER_DATA_DIR=str(tmp_path / "data"))
    job = subprocess.Popen(["bash", str(path)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
    base = f"http://127.0.0.1:{port}/node/127.0.0.1/{port}"
    try:
        deadline, status = time.monotonic() + 90, None
        while time.monotonic() < deadline and job.poll() is None:
            try:
                with urllib.request.urlopen(f"{base}/api/status?token=ood-test-secret",
                                            timeout=5) as r:
                    status = json.loads(r.read())
                    break
            except OSError:
                time.sleep(0.5)
        assert status is not None, f"JupyterLab did not answer at {base}"
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"{base}/api/status", timeout=5)
        assert refused.value.code == 403
    finally:
        os.killpg(job.pid, 15)
        out = job.communicate(timeout=30)[0]
    assert "ood-test-secret" not in out, "the secret reached the job's log"
