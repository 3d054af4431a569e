"""Single-source exercises: notebooks/ and labs/ are generated from solutions/ and leak nothing."""
import re
import shutil
import sys
from pathlib import Path

import nbformat
import pytest

from conftest import ROOT, run
from dpcourse.course import BEGIN, END, generate_student, student_script

pytest.importorskip("nbgrader")


def solution_lines(text: str) -> set[str]:
    """Substantial lines found only inside solution regions of ``text``."""
    inside, outside, active = set(), set(), False
    for line in text.splitlines():
        if BEGIN in line:
            active = True
        elif END in line:
            active = False
        elif len(line.strip()) >= 12:
            (inside if active else outside).add(line.strip())
    return inside - outside


def sources(folder: Path) -> dict[str, str]:
    out = {}
    for path in sorted(folder.glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        out[path.name] = "\n".join(cell.source for cell in nb.cells)
    for path in sorted((folder / "labs").glob("*.py")) if (folder / "labs").exists() else []:
        out["labs/" + path.name] = path.read_text()
    return out


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    out = tmp_path_factory.mktemp("student")
    generate_student(ROOT / "solutions", out)
    return out


def test_committed_student_copies_are_up_to_date(generated):
    for kind, pattern in (("notebooks", "*.ipynb"), ("labs", "*.py")):
        fresh = {p.name: p.read_bytes() for p in (generated / kind).glob(pattern)}
        committed = {p.name: p.read_bytes() for p in (ROOT / kind).glob(pattern)}
        assert fresh.keys() == committed.keys(), f"{kind}/ has other files than `make student` makes"
        stale = [name for name in fresh if fresh[name] != committed[name]]
        assert not stale, f"{kind}/ is out of date ({stale}): run `make student` and commit"


def test_generation_is_idempotent(generated, tmp_path):
    generate_student(ROOT / "solutions", tmp_path)
    for path in generated.rglob("*"):
        if path.is_file():
            assert path.read_bytes() == (tmp_path / path.relative_to(generated)).read_bytes(), path


def test_no_marker_and_no_solution_code_leaks(generated):
    solutions = sources(ROOT / "solutions")
    for name, text in sources(generated / "notebooks").items():
        assert "BEGIN SOLUTION" not in text and "END SOLUTION" not in text, name
        leaked = [line for line in solution_lines(solutions[name]) if line in text]
        assert not leaked, f"{name} leaks solution code: {leaked}"
    for path in (generated / "labs").glob("*.py"):
        text = path.read_text()
        assert "BEGIN SOLUTION" not in text
        assert not [line for line in solution_lines(solutions["labs/" + path.name]) if line in text]


def test_student_notebooks_have_no_outputs_and_stubs_with_hints(generated):
    hints = 0
    for path in (generated / "notebooks").glob("*.ipynb"):
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None
                hints += len(re.findall(r'raise NotImplementedError\("Exercise: .{8,}"\)', cell.source))
    assert hints >= 2, "notebook 01's two exercises should be stubs with a hint each"


def test_py_lab_markers_become_stubs_keeping_indentation():
    src = ("def step(p, lr):\n    with no_grad():\n        ### BEGIN SOLUTION (hint: p -= lr * p.grad)\n"
           "        p -= lr * p.grad\n        ### END SOLUTION\n    return p\n")
    out = student_script(src)
    assert '        raise NotImplementedError("Exercise: p -= lr * p.grad")' in out
    assert "p -= lr * p.grad\n" not in out.replace('"Exercise: p -= lr * p.grad"', "")
    compile(out, "lab.py", "exec")  # still valid Python
    assert student_script("print('no exercise')\n") == "print('no exercise')\n"


@pytest.mark.slow
def test_make_check_reports_each_exercise(tmp_path):
    """A learner completes exercise 1 of notebook 01 and leaves exercise 2: check says so."""
    path = tmp_path / "01_minibatch_sgd.ipynb"
    shutil.copy(ROOT / "notebooks" / path.name, path)
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if 'raise NotImplementedError("Exercise: move p in place' in cell.source:
            cell.source = re.sub(r"# YOUR CODE HERE\n\s*raise NotImplementedError\(.*\)",
                                 "p -= lr * p.grad\n            p.grad = None", cell.source)
    nbformat.write(nb, path)
    result = run([sys.executable, "-m", "dpcourse.course", "check", str(tmp_path)], timeout=300)
    assert result.returncode == 1, result.stdout
    assert "✓ 01_minibatch_sgd.ipynb: exercise 1 — the SGD update step — pass" in result.stdout
    assert "✗ 01_minibatch_sgd.ipynb: exercise 2" in result.stdout and "not done yet" in result.stdout
    assert "1 of 2 exercises pass." in result.stdout
