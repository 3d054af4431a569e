"""tests/nbreuse.py: nbval compares make course's executed copies only when they
stand for the notebook.

A small course of one notebook in a temporary folder: make course's run_course executes it into
build/, then pytest with nbval runs on it in a subprocess, as `make test` does.
"""
import json
import os
import sys

import nbformat
import pytest

from conftest import ROOT, run
from dpcourse.kit.course import run_course

pytestmark = pytest.mark.slow


def notebook(*sources, outputs):
    cells = []
    for i, (source, text) in enumerate(zip(sources, outputs), 1):
        cell = nbformat.v4.new_code_cell(source, execution_count=i)
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=text)]
        cells.append(cell)
    return nbformat.v4.new_notebook(cells=cells)


def nbval(course, **env):
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]),
           **env}
    return run([sys.executable, "-m", "pytest", "-p", "nbreuse", "--nbval", "--nbval-current-env",
                "-p", "no:cacheprovider", "-c", str(course / "pyproject.toml"), "solutions"],
               cwd=course, env=env, timeout=180)


def test_build_copies_are_compared_when_they_stand_for_the_notebook_and_executed_otherwise(
        tmp_path):
    course = tmp_path / "course"
    (course / "solutions").mkdir(parents=True)
    (course / "pyproject.toml").write_text('[project]\nname = "dpcourse"\n')
    (course / "lib.py").write_text("X = 1\n")
    path = course / "solutions" / "00_t.ipynb"
    nbformat.write(notebook("print(6 * 7)", "print('two')", outputs=["42\n", "two\n"]), path)
    assert run_course(course / "solutions", course / "build") == 0
    recorded = json.loads((course / "build" / "executed.json").read_text())
    assert recorded["notebooks"]["00_t.ipynb"]["ok"] and recorded["settings"]["threads"] >= 1

    same = nbval(course)
    assert same.returncode == 0 and "2 passed" in same.stdout, same.stdout
    assert ("1 notebook(s) compared from make course's run in build/, 0 executed here"
            in same.stdout), same.stdout

    # build/'s copy says something else than the committed output: the comparison fails, as
    # nbval's would.
    built = nbformat.read(course / "build" / "00_t.ipynb", as_version=4)
    built.cells[0].outputs[0]["text"] = "43\n"
    nbformat.write(built, course / "build" / "00_t.ipynb")
    differ = nbval(course)
    assert (differ.returncode == 1
            and "Cell outputs differ (make course's run in build/" in differ.stdout), differ.stdout
    assert "43" in differ.stdout and "1 failed, 1 passed" in differ.stdout

    # Another source file changed: nbval executes the notebook (its cells pass); CI's "require"
    # fails it, saying why.
    (course / "lib.py").write_text("X = 2\n")
    required = nbval(course, DPCOURSE_NBVAL_REUSE="require")
    assert ("executed 00_t.ipynb: 1 source file(s) changed since make course: lib.py"
            in required.stdout), required.stdout
    assert required.returncode == 1 and "1 failed, 1 passed" in required.stdout
    assert ("build/ cannot stand for this notebook: "
            "1 source file(s) changed since make course: lib.py" in required.stdout)


def test_a_notebook_that_failed_in_make_course_is_executed(tmp_path):
    from nbreuse import why_not_reused

    course = tmp_path / "course"
    (course / "solutions").mkdir(parents=True)
    (course / "pyproject.toml").write_text('[project]\nname = "dpcourse"\n')
    path = course / "solutions" / "00_t.ipynb"
    nbformat.write(notebook("raise ValueError('no')", "print('after')", outputs=["", "after\n"]),
                   path)
    assert run_course(course / "solutions", course / "build") == 1
    assert why_not_reused(path) == "it failed in make course"
    built = nbformat.read(course / "build" / "00_t.ipynb", as_version=4)
    # not the committed "after"
    assert built.cells[1].outputs == [] and built.cells[1].execution_count is None


def test_the_environment_is_what_is_installed_not_what_sys_path_holds(tmp_path, monkeypatch):
    """Importing setuptools puts its vendored packages on sys.path (autocommand, jaraco.*): that
    made make test's environment differ from make course's once, and every notebook ran again."""
    from dpcourse.kit.course import environment

    before = environment()
    (tmp_path / "vendored-1.0.dist-info").mkdir()
    (tmp_path / "vendored-1.0.dist-info" / "METADATA").write_text("Name: vendored\nVersion: 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert environment() == before
    assert any(p.startswith("torch==") for p in before["packages"])
