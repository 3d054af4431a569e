"""tests/workgroups.py: which tests `make test`'s two pytest-xdist workers keep together."""
import os
import re
import sys

from conftest import ROOT, run
from workgroups import _rank, durations, group


def test_tests_that_share_state_share_a_group():
    # a notebook's cells, its wrong answers and its guard run all write build/NN/
    cells = {group(f"solutions/03_collectives.ipynb::Cell {k}") for k in (0, 7)}
    wrong = {group(f"tests/test_exercises.py::test_check_rejects_wrong_answers[03-exercise {k}]")
             for k in (1, 2)}
    guard = group("tests/test_outputs.py::"
                  "test_compared_outputs_do_not_depend_on_the_cpu_dispatch_or_the_thread_count"
                  "[03_collectives.ipynb]")
    assert cells == wrong == {guard} == {"notebook 03"}
    assert (group("tests/test_exercises.py::test_check_rejects_wrong_answers[11-exercise 1]")
            == "notebook 11")
    # the guard's other tests, and any other module, are their module
    assert (group("tests/test_outputs.py::test_compared_cells_are_found_as_nbval_finds_them")
            == "tests/test_outputs.py")
    assert (group("tests/test_launch.py::test_a") == group("tests/test_launch.py::test_b[x]")
            == "tests/test_launch.py")
    # the local Slurm: the fixture's modules, notebook 09 (its own cluster),
    # test_dist (its pretend jobs' ports)
    assert {group("tests/test_slurm_templates.py::test_x[a]"),
            group("solutions/09_cluster.ipynb::Cell 4"),
            group("tests/test_exercises.py::test_check_rejects_wrong_answers[09-exercise 1]"),
            group("tests/test_dist.py::test_y")} == {"slurm"}


def test_every_module_that_uses_the_slurm_fixture_is_in_the_slurm_group():
    """What the collection check enforces, read from the sources: a module whose
    tests take `slurm`."""
    takes = re.compile(r"^def test_\w+\([^)]*\bslurm\b", re.M)
    modules = {f"tests/{p.name}" for p in (ROOT / "tests").glob("test_*.py")
               if takes.search(p.read_text())}
    assert {"tests/test_slurm.py", "tests/test_slurm_templates.py"} <= modules
    assert {m: group(f"{m}::test_x") for m in modules} == dict.fromkeys(modules, "slurm")


def _toy(tmp_path, *args):
    """pytest on a toy tree with workgroups loaded: its own `slurm` fixture, two test modules of the
    Slurm group (by their paths), one module outside it, one Slurm test outside it if asked."""
    (tmp_path / "conftest.py").write_text("import pytest\n\n@pytest.fixture\n"
                                          "def slurm():\n    return None\n")
    (tmp_path / "tests").mkdir()
    for name in ("test_slurm", "test_dist", "test_other"):
        uses = "slurm" if name == "test_slurm" else ""
        (tmp_path / "tests" / f"{name}.py").write_text(
            "".join(f"def test_{k}({uses}):\n    pass\n\n" for k in range(4)))
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    return run([sys.executable, "-m", "pytest", "-p", "workgroups", "-p", "no:cacheprovider",
                "-c", os.devnull, "--rootdir", str(tmp_path), "-n", "2", "--dist", "loadgroup",
                "-v", *args], cwd=tmp_path, env=env, timeout=120)


def test_two_workers_run_each_group_on_one_worker(tmp_path):
    done = _toy(tmp_path, "tests")
    assert done.returncode == 0, done.stdout
    ran = re.findall(r"\[(gw\d)\] .*PASSED (tests/test_\w+\.py)::", done.stdout)
    assert len(ran) == 12, done.stdout
    workers = {module: {gw for gw, m in ran if m == module} for _, module in ran}
    assert all(len(gws) == 1 for gws in workers.values()), workers  # a group never splits
    # one Slurm group
    assert workers["tests/test_slurm.py"] == workers["tests/test_dist.py"], workers


def test_a_slurm_test_outside_the_listed_modules_stops_the_run(tmp_path):
    """A module that takes the `slurm` fixture without being in SLURM_MODULES would start a second
    cluster on the other worker: the run stops at collection and says where to add it."""
    (tmp_path / "test_new.py").write_text("def test_on_slurm(slurm):\n    pass\n\n"
                                          "def test_plain():\n    pass\n")
    done = _toy(tmp_path, "tests", "test_new.py")
    assert done.returncode != 0 and "passed" not in done.stdout, done.stdout
    said = done.stdout.split("add their modules to SLURM_MODULES in tests/workgroups.py", 1)
    assert (len(said) == 2 and "'test_new.py::test_on_slurm'" in said[1]
            and "test_plain" not in said[1]), done.stdout


def test_groups_start_longest_first_by_their_measured_time(tmp_path):
    junit = tmp_path / "junit.xml"
    junit.write_text('<testsuites><testsuite name="pytest">'
                     '<testcase classname="solutions.03_collectives.ipynb" name="Cell 0" '
                     'time="1.5"/>'
                     '<testcase classname="tests.test_exercises" '
                     'name="test_check_rejects_wrong_answers[03-exercise 1]" time="40"/>'
                     '<testcase classname="tests.test_launch" name="test_a" time="2"/>'
                     '<testcase classname="tests.test_launch" name="test_b[x]" time="3.25"/>'
                     '<testcase classname="tests.test_slurm" name="test_c" time="9"/>'
                     '</testsuite></testsuites>')
    measured = durations(junit)
    assert measured == {"notebook 03": 41.5, "slurm": 9.0, "tests/test_launch.py": 5.2}, measured

    class Item:
        def __init__(self, nodeid, slow=False):
            self.nodeid, self.slow = nodeid, slow

        def get_closest_marker(self, name):
            return self.slow if name == "slow" else None

    items = [Item("tests/test_launch.py::test_a"), Item("tests/test_new.py::test_x"),
             Item("tests/test_new_slow.py::test_y", slow=True),
             Item("solutions/03_collectives.ipynb::Cell 0"), Item("tests/test_slurm.py::test_c")]
    order = sorted(items, key=lambda item: _rank(item, measured))
    # Slurm's first whatever it measured; then the longest; a new slow module guessed at a minute,
    # a new other at 10 s
    assert [group(i.nodeid) for i in order] == ["slurm", "tests/test_new_slow.py", "notebook 03",
                                                "tests/test_new.py", "tests/test_launch.py"]


def test_the_committed_durations_name_the_groups_of_this_suite():
    """tests/durations.json only orders the groups; a name in it that no test has any more is a
    stale measurement: measure again (the command is in tests/workgroups.py)."""
    import json

    measured = json.loads((ROOT / "tests" / "durations.json").read_text())
    modules = {f"tests/{p.name}" for p in (ROOT / "tests").glob("test_*.py")}
    notebooks = {f"notebook {p.name[:2]}" for p in (ROOT / "solutions").glob("[0-9][0-9]_*.ipynb")}
    stale = set(measured) - modules - notebooks - {"slurm"}
    assert not stale, f"tests/durations.json names groups that are gone: {stale}"
    assert measured["slurm"] > max(v for k, v in measured.items() if k != "slurm"), \
        "Slurm's group is the longest"
