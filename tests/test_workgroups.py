"""tests/workgroups.py: which tests `make test`'s two pytest-xdist workers keep together."""
import os
import sys

from conftest import ROOT, run
from workgroups import SLURM_MODULES, group


def test_tests_that_share_state_share_a_group():
    # a notebook's cells run in one kernel
    assert group("solutions/03_collectives.ipynb::Cell 0") == group("solutions/03_collectives.ipynb::Cell 7") \
        == "solutions/03_collectives.ipynb"
    # a notebook's wrong answers share its cached namespace; another notebook's go elsewhere
    first, second = (group(f"tests/test_exercises.py::test_check_rejects_wrong_answers[12-exercise {k}]") for k in (1, 9))
    assert first == second != group("tests/test_exercises.py::test_check_rejects_wrong_answers[11-exercise 1]")
    # a module's tests share its fixtures; every module on the local Slurm shares the one cluster
    assert group("tests/test_launch.py::test_a") == group("tests/test_launch.py::test_b[x]") == "tests/test_launch.py"
    assert {group(f"{module}::test_x") for module in SLURM_MODULES} == {"slurm"}


def test_a_slurm_test_outside_the_listed_modules_stops_the_run(tmp_path):
    """A module that takes the `slurm` fixture without being in SLURM_MODULES would start a second
    cluster on the other worker: the run stops at collection and says where to add it."""
    (tmp_path / "conftest.py").write_text("import pytest\n\n@pytest.fixture\ndef slurm():\n    return None\n")
    (tmp_path / "test_new.py").write_text("def test_on_slurm(slurm):\n    pass\n\ndef test_plain():\n    pass\n")
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    done = run([sys.executable, "-m", "pytest", "-p", "workgroups", "-p", "no:cacheprovider", "-c", os.devnull,
                "--rootdir", str(tmp_path), str(tmp_path)], cwd=tmp_path, env=env, timeout=60)
    assert done.returncode != 0, done.stdout
    assert "add their modules to SLURM_MODULES in tests/workgroups.py" in done.stdout and "test_on_slurm" in done.stdout, done.stdout
    assert "test_plain" not in done.stdout.split("SLURM_MODULES", 1)[1], done.stdout
