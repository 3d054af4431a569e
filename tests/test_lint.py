"""The linter (issue 27, item 7): ruff, configured in pyproject.toml ([tool.ruff]), finds nothing in
the course's code. It checks what pyflakes checks (unused imports and variables, undefined names),
the import order, and that every `# noqa` names a rule the linter runs (RUF100): a comment that
silences nothing goes. The learner's generated copies (labs/, notebooks/) are left out: their stubs
are unfinished on purpose. The second test shows that the configuration is the one in force, so that
a clean result cannot come from a linter that checks nothing."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT


def ruff() -> str:
    """The ruff of the course's environment (make setup installs it from pyproject.toml's
    dev extras)."""
    beside = Path(sys.executable).parent / "ruff"
    found = str(beside) if beside.exists() else shutil.which("ruff")
    if not found:
        if os.environ.get("CI"):
            pytest.fail("ruff is not installed: make setup installs it "
                        "(pyproject.toml, dev extras)")
        pytest.skip("ruff is not installed (make setup installs it)")
    return found


def test_ruff_finds_nothing_in_the_course():
    done = subprocess.run([ruff(), "check", "--no-cache", "--output-format", "concise", "."],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, \
        f"ruff check (pyproject.toml's [tool.ruff]) found:\n{done.stdout}{done.stderr}"


def test_the_configuration_in_force_finds_what_it_should():
    """The repository's configuration, given a lab's text with one fault of each kind it checks (on
    stdin, as if it were a file of solutions/labs/: nothing is written there), names each one."""
    probe = ("import sys\nimport os\n\nx = lambda: 1\ntry:\n    pass\nexcept Exception:\n    pass\n"
             "import json\ny = 1  # noqa: F401\nprint(undefined_name)\n")
    done = subprocess.run([ruff(), "check", "--no-cache", "--output-format", "concise",
                           "--stdin-filename", "solutions/labs/probe.py", "-"],
                          cwd=ROOT, input=probe, capture_output=True, text=True, timeout=120)
    for rule in ("I001", "F401", "E731", "BLE001", "E402", "F821", "RUF100"):
        assert rule in done.stdout, \
            f"ruff's configuration does not catch {rule}:\n{done.stdout}{done.stderr}"


def test_lines_are_at_most_100_characters_but_an_exercise_hint_may_be_longer():
    """E501 at 101 characters, not at 100; an exercise's `### BEGIN SOLUTION (hint: ...)` line
    (which the learner's copy turns into a comment) is exempt, however long; a plain comment of
    the same length is not."""
    hint = "    ### BEGIN SOLUTION (hint: " + "a long hint " * 15 + ")"
    probe = ("def f():\n" + hint + "\n    x = 1\n    ### END SOLUTION\n    return x\n"
             + "y = '" + "z" * 94 + "'\n"      # 100 characters: fine
             + "w = '" + "z" * 95 + "'\n"      # 101: too long
             + "# plain " + "words " * 20 + "\n")
    done = subprocess.run([ruff(), "check", "--no-cache", "--output-format", "concise",
                           "--stdin-filename", "solutions/labs/probe.py", "-"],
                          cwd=ROOT, input=probe, capture_output=True, text=True, timeout=120)
    flagged = sorted(int(line.split(":")[1]) for line in done.stdout.splitlines() if "E501" in line)
    assert flagged == [7, 8], (f"E501 on lines {flagged}, expected 7 (101 characters) and 8 (a "
                               f"comment):\n{done.stdout}{done.stderr}")


def test_the_solutions_are_linted_and_the_learner_copies_are_not():
    """`labs` in extend-exclude once matched solutions/labs/ too, so the labs went unlinted: the
    exclusions are anchored at the root (./labs, ./notebooks), and this names the files ruff
    actually reads."""
    done = subprocess.run([ruff(), "check", "--no-cache", "--show-files", "."], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    files = {Path(line).resolve().relative_to(ROOT).as_posix() for line in done.stdout.split()
             if line.endswith(".py")}
    for lab in ("solutions/labs/fashion_ddp.py", "solutions/labs/bugs/no_set_epoch.py",
                "src/dpcourse/lab/world.py"):
        assert lab in files, f"ruff does not read {lab}: check [tool.ruff] extend-exclude"
    assert not any(f.startswith(("labs/", "notebooks/")) for f in files), \
        "ruff lints the learner's copies"
