"""Single-source exercises: notebooks/ and labs/ are generated from solutions/ and leak nothing;
`make check` tells a learner where each exercise stands."""
import json
import re
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import nbformat
import pytest

from conftest import ROOT, run
from dpcourse.kit.course import (
    BEGIN,
    END,
    generate_student,
    lab_files,
    student_notebook,
    student_script,
)

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
    for path in sorted(lab_files(folder / "labs")) if (folder / "labs").exists() else []:
        out["labs/" + path.relative_to(folder / "labs").as_posix()] = path.read_text()
    return out


def stub_blocks(text: str) -> list[list[str]]:
    """Each generated stub: its lines from ``# YOUR CODE HERE`` to the ``raise``,
    indentation kept."""
    return [block.group(0).splitlines() for block in
            re.finditer(r"^[ \t]*# YOUR CODE HERE\n(?:[ \t]*#.*\n)*"
                        r"[ \t]*raise NotImplementedError\(.*$", text, re.M)]


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    out = tmp_path_factory.mktemp("student")
    generate_student(ROOT / "solutions", out)
    return out


def test_committed_student_copies_are_up_to_date(generated):
    def files(top: Path, kind: str) -> list[Path]:  # labs/ has subfolders (labs/bugs/)
        return lab_files(top / kind) if kind == "labs" else sorted((top / kind).glob("*.ipynb"))

    for kind in ("notebooks", "labs"):
        fresh = {p.relative_to(generated).as_posix(): p.read_bytes()
                 for p in files(generated, kind)}
        committed = {p.relative_to(ROOT).as_posix(): p.read_bytes() for p in files(ROOT, kind)}
        assert fresh.keys() == committed.keys(), \
            f"{kind}/ has other files than `make student` makes"
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
    for path in lab_files(generated / "labs"):
        text = path.read_text()
        assert "BEGIN SOLUTION" not in text
        assert not [line for line in solution_lines(
                        solutions["labs/" + path.relative_to(generated / "labs").as_posix()])
                    if line in text]


def test_student_notebooks_have_no_outputs_and_stubs_with_hints(generated):
    hints = 0
    for path in (generated / "notebooks").glob("*.ipynb"):
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None
                hints += sum(block[1].lstrip().startswith("# Hint: ") and len(block[1]) > 20
                             for block in stub_blocks(cell.source))
    assert hints >= 2, "notebook 01's two exercises should be stubs with a hint each"


def test_py_lab_markers_become_stubs_keeping_indentation():
    src = ("def step(p, lr):\n    with no_grad():\n"
           "        ### BEGIN SOLUTION (hint: p -= lr * p.grad)\n"
           "        p -= lr * p.grad\n        ### END SOLUTION\n    return p\n")
    out = student_script(src)
    assert ('        # YOUR CODE HERE\n        # Hint: p -= lr * p.grad\n'
            '        raise NotImplementedError("Exercise: see the hint above")\n'
            '    return p\n') in out
    assert "        p -= lr * p.grad\n" not in out
    compile(out, "lab.py", "exec")  # still valid Python
    assert student_script("print('no exercise')\n") == "print('no exercise')\n"
    usage = '"""torchrun --standalone --nproc-per-node 2 solutions/labs/x.py"""\n'
    # their own copy
    assert student_script(usage) == '"""torchrun --standalone --nproc-per-node 2 labs/x.py"""\n'


def test_stub_puts_the_hint_on_wrapped_comment_lines_keeping_indentation():
    hint = ("for each example, its own loss, then torch.autograd.grad of it w.r.t. (W, b); "
            "stack the results into one tensor per parameter, examples first")
    src = (f"def f(W, b, X, y):\n    for i in range(3):\n        if True:\n"
           f"            ### BEGIN SOLUTION (hint: {hint})\n"
           "            pass\n            ### END SOLUTION\n")
    [block] = stub_blocks(student_script(src))
    assert block[0] == "            # YOUR CODE HERE"
    assert block[1].startswith("            # Hint: for each example")
    assert all(line.startswith("            #       ") for line in block[2:-1]) and len(block) > 3
    assert block[-1] == '            raise NotImplementedError("Exercise: see the hint above")'
    assert " ".join(line.split("#", 1)[1].strip() for line in block[1:-1]) == "Hint: " + hint
    # "(...)" is never split
    assert max(map(len, block)) <= 88 and any("(W, b);" in line for line in block)


def test_every_generated_stub_line_fits_the_editor(generated):
    texts = {**sources(generated / "notebooks"),
             **{p.relative_to(generated).as_posix(): p.read_text()
                for p in lab_files(generated / "labs")}}
    blocks = [(name, block) for name, text in texts.items() for block in stub_blocks(text)]
    assert len(blocks) >= 2, "notebook 01's two exercises should be stubs"
    long = [(name, line) for name, block in blocks for line in block if len(line) > 100]
    assert not long, f"stub lines longer than 100 characters: {long}"


# ---------------------------------------------------------------- make check
# Untouched learners' notebooks whose checks run labs, checked in the test below beside notebook 01:
# each way a lab says that it stopped at a stub must read "not done yet" (notebook 06's exercise 2
# once read "fails: ...").
# 04: its check reads the log of labs/ring_allreduce.py, then run_ok; 06: its check runs
# labs/io_race.py under torchrun (a rank in a process group says it through dpcourse.lab.explain's
# excepthook); 09: its check dry-runs labs/first_job.sbatch (a job script's stub says it with
# echo). About 20 s for the three, beside 01's 35 s.
UNTOUCHED_WITH_LABS = ("04_allreduce_algorithms.ipynb", "06_data_sharding.ipynb",
                       "09_cluster.ipynb")


def runs_a_lab(cell) -> bool:
    return cell.cell_type == "code" and 'lab("' in cell.source


def is_check(cell) -> bool:
    return cell.cell_type == "code" and "check" in cell.metadata.get("tags", [])


def up_to_a_lab_check(nb):
    """``nb`` up to its first check that runs a lab, less the cells no check needs: those tagged
    check-skip (timing, plot, widget and cluster cells), and lab runs outside the checks (an
    untouched lab stops at a stub there first, which would mark the next check not done yet before
    its own run is read). Its check names."""
    cells = []
    for cell in nb.cells:
        if ("check-skip" in cell.metadata.get("tags", [])
                or (runs_a_lab(cell) and not is_check(cell))):
            continue
        cells.append(cell)
        if is_check(cell) and runs_a_lab(cell):
            break
    nb.cells = cells
    return [cell.source.splitlines()[0].split("CHECK:", 1)[1].strip()
            for cell in cells if is_check(cell)]


@contextmanager
def learner_folder():
    """A learner's folder in the checkout (build/ is git's to ignore), as notebooks/ is: its
    notebooks find labs/ and the course folder (and make check the course's checks in solutions/).
    Removed afterwards."""
    (ROOT / "build").mkdir(exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="check-", dir=ROOT / "build"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def notebook_01_with(update: str):
    """The learner's notebook 01 with exercise 1 (sgd_step's stub) answered by ``update``."""
    nb = nbformat.read(ROOT / "notebooks" / "01_minibatch_sgd.ipynb", as_version=4)
    for cell in nb.cells:
        if "def sgd_step" in cell.source:
            cell.source = re.sub(r"# YOUR CODE HERE\n(\s*#.*\n)*\s*raise NotImplementedError\(.*\)",
                                 update, cell.source)
    return nb


@pytest.mark.slow
def test_make_check_reports_each_exercise():
    """A learner completes exercise 1 of notebook 01 and leaves exercise 2: check says so. Notebooks
    04, 06 and 09, untouched, are "not done yet" at each exercise up to their first check that runs
    a lab, that one included."""
    with learner_folder() as folder:
        nbformat.write(notebook_01_with("p -= lr * p.grad\n            p.grad = None"),
                       folder / "01_minibatch_sgd.ipynb")
        checks = {}
        for name in UNTOUCHED_WITH_LABS:
            nb = nbformat.read(ROOT / "notebooks" / name, as_version=4)
            checks[name] = up_to_a_lab_check(nb)
            nbformat.write(nb, folder / name)
        result = run([sys.executable, "-m", "dpcourse.kit.course", "check", str(folder)],
                     timeout=300)
    out = result.stdout
    assert result.returncode == 1, out
    assert "✓ 01_minibatch_sgd.ipynb: exercise 1 — the SGD update step — pass" in out
    assert re.search(r"^✗ 01_minibatch_sgd.ipynb: exercise 2 — .* — not done yet$", out, re.M), out
    assert all(checks.values()), checks
    for name, names in checks.items():
        for check in names:
            assert f"✗ {name}: {check} — not done yet" in out, out
    # no other verdict, no other cell's error; the copies cut after their first lab check lack the
    # rest: those checks are not graded, and count as not passed
    assert not [line for line in out.splitlines() if line.startswith("! ")], out
    lost = [line for line in out.splitlines()
            if "not graded: its check and the cell before it are missing" in line]
    assert lost and all(line.startswith("✗ ") for line in lost), out
    assert {line.split(":", 1)[0][2:] for line in lost} <= set(UNTOUCHED_WITH_LABS), lost
    assert "fails" not in out, out
    assert f"1 of {2 + sum(map(len, checks.values())) + len(lost)} exercises pass." in out


def test_make_check_shows_a_bar_of_cells_in_a_terminal_and_none_in_a_log(tmp_path):
    """A notebook takes make check minutes: in a terminal it shows how far it is, cell by cell; in a
    pipe (a log, CI) the output is the verdicts alone."""
    import fcntl
    import os
    import pty
    import select
    import struct
    import termios
    import time

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("x = 1"), nbformat.v4.new_code_cell("y = x + 1"),
                nbformat.v4.new_code_cell("# CHECK: exercise 1 — y\nassert y == 2\nprint('✓ y')",
                                          metadata={"tags": ["check"]})]
    nbformat.write(nb, tmp_path / "01_tiny.ipynb")
    command = [sys.executable, "-m", "dpcourse.kit.course", "check", str(tmp_path)]
    env = {k: v for k, v in os.environ.items() if k != "TQDM_DISABLE"}
    main, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 100, 0, 0))
    proc = subprocess.Popen(command, stdin=child, stdout=child, stderr=child, env=env)
    os.close(child)
    seen, deadline = b"", time.monotonic() + 120  # a cap for a hang, not a measure
    while time.monotonic() < deadline:
        if not select.select([main], [], [], deadline - time.monotonic())[0]:
            break
        try:
            chunk = os.read(main, 4096)
        except OSError:  # the child's end closed
            break
        if not chunk:
            break
        seen += chunk
    else:
        proc.kill()
    assert proc.wait(timeout=30) == 0, seen
    os.close(main)
    terminal = seen.decode(errors="replace")
    assert re.search(r"01_tiny.ipynb: +\d+%\|.*\| [0-3]/3 \[", terminal), terminal
    assert "✓ 01_tiny.ipynb: exercise 1 — y — pass" in terminal, terminal
    logged = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert logged.returncode == 0, logged.stdout + logged.stderr
    assert "cell/s" not in logged.stdout + logged.stderr and "✓ 01_tiny.ipynb" in logged.stdout


def test_make_check_grades_with_the_courses_checks_not_the_learners_copy():
    """A learner solves exercise 1 of notebook 01 wrongly (the learning rate forgotten), edits its
    check to pass, and deletes exercise 2's check: make check grades with the course's checks, from
    solutions/, and says so."""
    with learner_folder() as folder:
        path = folder / "01_minibatch_sgd.ipynb"
        nb = notebook_01_with("p -= p.grad\n            p.grad = None")
        checks = [cell for cell in nb.cells if "check" in cell.metadata.get("tags", [])]
        checks[0].source = "# CHECK: exercise 1 — the SGD update step\npass  # mine"
        nb.cells.remove(checks[1])
        nbformat.write(nb, path)
        before = path.read_text()
        result = run([sys.executable, "-m", "dpcourse.kit.course", "check", str(folder)],
                     timeout=300)
        assert path.read_text() == before, "make check changed the learner's file"
    out = result.stdout
    assert result.returncode == 1, out
    assert ("! 01_minibatch_sgd.ipynb: the check of exercise 1 in your copy "
            "differs from the course's") in out, out
    assert "! 01_minibatch_sgd.ipynb: the check of exercise 2 is missing from your copy" in out, out
    assert ("✗ 01_minibatch_sgd.ipynb: exercise 1 — the SGD update step — fails: "
            "AssertionError: expected [-0.5, 0.0], got [-2.0, 2.0]") in out, out
    assert re.search(r"^✗ 01_minibatch_sgd.ipynb: exercise 2 — .* — not done yet$", out, re.M), out
    assert "0 of 2 exercises pass." in out, out


def test_course_checks_go_back_where_they_were():
    """with_course_checks: a deleted check goes back after the cell that precedes it in the course;
    an untagged copy of a check, found by its id, is the course's check again; other cells are
    the learner's."""
    from dpcourse.kit.course import with_course_checks

    code = nbformat.v4.new_code_cell
    course = nbformat.v4.new_notebook(cells=[
        code("x = 1", id="a"),
        code("# CHECK: exercise 1 — one\nassert x == 1", id="c1", metadata={"tags": ["check"]}),
        code("y = 2", id="b"),
        code("# CHECK: exercise 2 — two\nassert y == 2", id="c2", metadata={"tags": ["check"]})])
    mine = nbformat.v4.new_notebook(cells=[code("x = 5", id="a"), code("# my check\npass", id="c1"),
                                           code("y = 7", id="b")])
    graded, notes, lost = with_course_checks(mine, course)
    assert lost == [] and [c.source for c in graded.cells] == ["x = 5", course.cells[1].source,
                                                               "y = 7", course.cells[3].source]
    assert all("check" in graded.cells[i].metadata["tags"] for i in (1, 3))
    assert notes == ["the check of exercise 1 in your copy differs from the course's current one "
                     "(you edited it, or your copy is older than the course): graded with the "
                     "course's; your file keeps yours",
                     "the check of exercise 2 is missing from your copy: graded with the course's"]
    untouched, none, lost = with_course_checks(course, course)
    assert (none == lost == []
            and [c.source for c in untouched.cells] == [c.source for c in course.cells])
    # a copy that lost a whole part (the cell before the check too): the check is lost,
    # not run out of place
    fragment, notes, lost = with_course_checks(
        nbformat.v4.new_notebook(cells=course.cells[:2]), course)
    assert [c.source for c in fragment.cells] == [c.source for c in course.cells[:2]]
    assert notes == [] and lost == ["exercise 2"]
    # a check copied twice (the copy has a new id), once with its tag and once without: graded once
    twice = nbformat.v4.new_notebook(cells=[
        *course.cells[:2],
        code("# CHECK: exercise 1 — one\npass", id="d1", metadata={"tags": ["check"]}),
        code("# CHECK: exercise 1 — one\npass", id="d2"), *course.cells[2:]])
    graded, notes, lost = with_course_checks(twice, course)
    assert [c.source for c in graded.cells] == [c.source for c in course.cells] and lost == []
    assert notes == ["your copy has a second check cell for exercise 1: not run "
                     "(each exercise is graded once, with the course's check)"] * 2
    # a check the course no longer has: not run, said so
    older = nbformat.v4.new_notebook(cells=[
        *course.cells,
        code("# CHECK: exercise 9 — gone\nassert False", id="c9", metadata={"tags": ["check"]})])
    graded, notes, lost = with_course_checks(older, course)
    assert [c.source for c in graded.cells] == [c.source for c in course.cells] and lost == []
    assert notes == ["your copy has a check of exercise 9 that the course does not have "
                     "(any more): not run"]


def test_a_check_the_copy_lost_with_its_part_counts_as_not_passed(tmp_path):
    """A copy of 01_exercises that kept only its first cell: every check is lost with the cells
    before it. make check says so for each, in one line each, and exits 1; it does not call the
    copy exercise-free."""
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "dpcourse"\n')
    (tmp_path / "notebooks").mkdir()
    learner_notebooks(tmp_path / "notebooks")
    (tmp_path / "solutions").mkdir()
    shutil.copy(tmp_path / "notebooks" / "01_exercises.ipynb", tmp_path / "solutions")
    nb = nbformat.read(tmp_path / "notebooks" / "01_exercises.ipynb", as_version=4)
    nb.cells = nb.cells[:1]
    nbformat.write(nb, tmp_path / "notebooks" / "01_exercises.ipynb")
    result = run([sys.executable, "-m", "dpcourse.kit.course", "check", str(tmp_path / "notebooks"),
                  "--notebook", "01"], timeout=120)
    out = result.stdout
    assert result.returncode == 1, out
    assert "no exercises here" not in out and "running" not in out, out
    assert ("✗ 01_exercises.ipynb: exercise 1 — not graded: its check and the cell before it are "
            "missing from your copy (copy the notebook again to get that part back)") in out, out
    # optional: counts neither way
    assert "○ 01_exercises.ipynb: exercise 5 (optional) — not graded" in out, out
    assert (out.count("not graded") == 6
            and "0 of 5 exercises pass. (1 optional or not checked: ○ above.)" in out), out


def learner_notebooks(folder: Path) -> None:
    """A learner's copies: 00 without exercises; 01 with a typo, two untouched stubs,
    one done, one broken cell."""
    code, md = nbformat.v4.new_code_cell, nbformat.v4.new_markdown_cell

    def check(source):
        return code(source, metadata={"tags": ["check"]})

    solution = nbformat.v4.new_notebook(cells=[
        md("# Exercises"),
        code("raise ValueError('no data here')"),
        code("def double(x):\n    ### BEGIN SOLUTION (hint: twice x)\n    return 2 * x\n"
             "    ### END SOLUTION"),
        check("# CHECK: exercise 1 — double\nassert double(2) == 4"),
        code("### BEGIN SOLUTION (hint: set y to 3)\ny = 3\n### END SOLUTION"),
        check("# CHECK: exercise 2 — y\nassert y == 3"),
        code("def triple(x):\n    ### BEGIN SOLUTION (hint: three times x)\n    return 3 * x\n"
             "    ### END SOLUTION"),
        check("# CHECK: exercise 3 — triple\nassert triple(1) == 3"),
        code("def half(x):\n    ### BEGIN SOLUTION (hint: x over 2)\n    return x / 2\n"
             "    ### END SOLUTION"),
        check("# CHECK: exercise 4 — half\nassert half(4) == 2"),
        code("print(y + 1)"),  # fails because exercise 2 is not done: not worth a warning
        code("def nothing():\n    ### BEGIN SOLUTION (hint: None)\n    return None\n"
             "    ### END SOLUTION"),
        check("# CHECK: exercise 5 (optional) — nothing\nassert nothing() is None"),
        check("# CHECK: exercise 6 — needs a tool\n"
              "print('○ not checked: no tool here (make tool)')"),
    ])
    nb = student_notebook(solution)
    stub = re.compile(r"# YOUR CODE HERE\n(?:\s*#.*\n)*\s*raise NotImplementedError\(.*\)")
    nb.cells[2].source = stub.sub("return 2 * gard", nb.cells[2].source)  # a typo
    nb.cells[8].source = stub.sub("return x / 2", nb.cells[8].source)     # done
    nbformat.write(nb, folder / "01_exercises.ipynb")
    nbformat.write(nbformat.v4.new_notebook(cells=[code("print('hello')")]),
                   folder / "00_intro.ipynb")


@pytest.mark.slow
def test_check_tells_a_learners_error_from_an_unfinished_exercise(tmp_path):
    learner_notebooks(tmp_path)
    result = run([sys.executable, "-m", "dpcourse.kit.course", "check", str(tmp_path)], timeout=300)
    out = result.stdout
    assert result.returncode == 1, out
    assert "Save the notebook first (Ctrl+S): make check runs the saved file." in out
    assert "00_intro.ipynb: no exercises" in out
    assert ("✗ 01_exercises.ipynb: exercise 1 — double — fails: "
            "NameError: name 'gard' is not defined") in out
    # its exercise cell is a stub
    assert "✗ 01_exercises.ipynb: exercise 2 — y — not done yet" in out
    # the check calls a stub
    assert "✗ 01_exercises.ipynb: exercise 3 — triple — not done yet" in out
    assert ("! 01_exercises.ipynb: cell 2 raised ValueError: no data here; "
            "the checks after it may fail because of it") in out
    assert "cell 11" not in out  # print(y + 1) fails after unfinished exercises: not reported
    assert "✓ 01_exercises.ipynb: exercise 4 — half — pass" in out
    # an optional exercise not done yet is listed, and counts neither way
    assert "○ 01_exercises.ipynb: exercise 5 (optional) — nothing — not done yet" in out
    # a check that could not run here (what it needs is not installed) is not a pass either
    assert ("○ 01_exercises.ipynb: exercise 6 — needs a tool — "
            "not checked: no tool here (make tool)") in out
    assert out.rstrip().endswith("1 of 4 exercises pass. (2 optional or not checked: ○ above.)")


def test_check_one_notebook_by_its_number(tmp_path):
    learner_notebooks(tmp_path)
    check = [sys.executable, "-m", "dpcourse.kit.course", "check", str(tmp_path), "--notebook"]
    result = run([*check, "00"], timeout=120)
    assert result.returncode == 0, result.stdout
    assert "00_intro.ipynb: no exercises" in result.stdout and "01_exercises" not in result.stdout
    result = run([*check, "07"], timeout=120)
    assert result.returncode == 1
    assert 'starts with "07"' in result.stdout and "00_intro, 01_exercises" in result.stdout


def test_check_by_number_leaves_out_a_learners_copies(tmp_path):
    """JupyterLab's Duplicate makes 01_exercises-Copy1.ipynb: `make check NB=01`
    means the course's own."""
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "dpcourse"\n')
    (tmp_path / "notebooks").mkdir()
    learner_notebooks(tmp_path / "notebooks")
    (tmp_path / "solutions").mkdir()
    shutil.copy(tmp_path / "notebooks" / "01_exercises.ipynb", tmp_path / "solutions")
    shutil.copy(tmp_path / "notebooks" / "00_intro.ipynb",
                tmp_path / "notebooks" / "01_exercises-Copy1.ipynb")
    check = [sys.executable, "-m", "dpcourse.kit.course", "check", str(tmp_path / "notebooks"),
             "--notebook"]
    # `python -m dpcourse.kit.course check ... 01`, which then says whether it loaded torch: it
    # runs the notebook in a kernel of its own, and needs none itself
    as_m = ("import runpy, sys\n"
            "sys.argv[0] = 'course'\n"
            "try:\n"
            "    runpy.run_module('dpcourse.kit.course', run_name='__main__', alter_sys=True)\n"
            "finally:\n"
            "    print('loaded torch:', 'torch' in sys.modules)\n")
    result = run([sys.executable, "-c", as_m, *check[3:], "01"], timeout=120)
    assert "Not checked: 01_exercises-Copy1.ipynb" in result.stdout, result.stdout
    assert "loaded torch: False" in result.stdout, result.stdout
    assert ("01_exercises.ipynb: exercise 1" in result.stdout
            and "Copy1.ipynb: no exercises" not in result.stdout)
    result = run([*check, "01_exercises-Copy1"], timeout=120)
    assert "01_exercises-Copy1.ipynb: no exercises here" in result.stdout, result.stdout


@pytest.mark.skipif(not shutil.which("make") or not (ROOT / ".venv/bin/python").exists(),
                    reason="needs make and the course's .venv")
def test_make_check_ends_without_makes_error_line():
    # -o: use the environment as it is, never reinstall it from a test
    make = ["make", "--no-print-directory", "-o", ".venv/.installed-stamp", "check"]
    result = run([*make, "NB=00"], timeout=120)
    assert result.returncode == 0, result.stdout
    assert "00_setup.ipynb: no exercises" in result.stdout and "01_" not in result.stdout
    result = run([*make, "NB=zz"], timeout=120)
    assert result.returncode != 0
    assert 'starts with "zz"' in result.stdout
    assert "make:" not in result.stdout and "Error" not in result.stdout, result.stdout


def test_each_exercise_region_of_a_lab_gets_its_own_hint():
    src = ("def a():\n    ### BEGIN SOLUTION (hint: first hint)\n    return 1\n"
           "    ### END SOLUTION\n\n\n"
           "def b():\n        ### BEGIN SOLUTION (hint: second hint)\n        return 2\n"
           "        ### END SOLUTION\n")
    out = student_script(src)
    assert "    # Hint: first hint\n" in out and "        # Hint: second hint\n" in out
    assert "return 1" not in out and "return 2" not in out
    compile(out, "lab.py", "exec")


def test_make_student_keeps_a_learners_edited_copy(tmp_path):
    """A learner's saved work in notebooks/ is not overwritten unless asked (FORCE=1)."""
    clone = tmp_path / "kit"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    work = clone / "notebooks" / "01_minibatch_sgd.ipynb"
    work.write_text(work.read_text().replace("# YOUR CODE HERE", "# my answer", 1))
    refused = run([sys.executable, "-m", "dpcourse.kit.course", "student"], cwd=clone)
    assert refused.returncode == 1 and "notebooks/01_minibatch_sgd.ipynb" in refused.stdout
    assert "# my answer" in work.read_text()
    forced = run([sys.executable, "-m", "dpcourse.kit.course", "student", "--force"], cwd=clone)
    assert forced.returncode == 0 and "# my answer" not in work.read_text()


def test_make_course_writes_each_notebooks_time_for_the_instructor_guide(tmp_path, capsys):
    from dpcourse.kit.course import run_course

    (tmp_path / "nb").mkdir()
    for name, source in (("00_ok.ipynb", "print(1)"), ("01_fails.ipynb", "raise ValueError('no')")):
        nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source)]),
                       tmp_path / "nb" / name)
    assert run_course(tmp_path / "nb", tmp_path / "out") == 1
    times = json.loads((tmp_path / "out" / "times.json").read_text())
    assert times["00_ok.ipynb"]["status"] == "ok" and 0 < times["00_ok.ipynb"]["seconds"] < 60
    assert (times["01_fails.ipynb"]["status"].startswith("FAILED")
            and "ValueError" in times["01_fails.ipynb"]["status"])
