"""The bug-hunt labs of notebook 12 (solutions/labs/bugs/): each buggy script is its fixed twin
with one defect, the one tests/wrong_answers_12.py registers as that exercise's first wrong
answer. The notebook (nbval) runs every buggy script and asserts its symptom; test_exercises
runs each check on the fixed twin (the symptom is gone) and on the bug (the check rejects it)."""
import textwrap

import pytest

from conftest import ROOT
from dpcourse.kit.course import BEGIN, END
from wrong_answers_12 import BUGS

BUG_LABS = ROOT / "solutions" / "labs" / "bugs"


def twin(fixed: str, bug: str, name: str) -> str:
    """The buggy script: the fixed one with its exercise region replaced by ``bug`` (dropped
    when "")."""
    lines = fixed.replace(f"{name}_fixed.py", f"{name}.py").splitlines()
    begin = next(i for i, line in enumerate(lines) if BEGIN in line)
    end = next(i for i, line in enumerate(lines) if END in line)
    indent = lines[begin][:len(lines[begin]) - len(lines[begin].lstrip())]
    body = textwrap.indent(textwrap.dedent(bug).strip("\n"), indent).splitlines() if bug else []
    return "\n".join(lines[:begin] + body + lines[end + 1:]) + "\n"


def test_every_bug_lab_has_a_fixed_twin_and_a_registered_defect():
    buggy = {p.stem for p in BUG_LABS.glob("*.py") if not p.stem.endswith("_fixed")}
    fixed = {p.stem[:-len("_fixed")] for p in BUG_LABS.glob("*_fixed.py")}
    assert buggy == fixed == set(BUGS), (buggy, fixed, set(BUGS))
    assert len(BUGS) == 9


@pytest.mark.parametrize("name", sorted(BUGS))
def test_the_buggy_script_is_its_fixed_twin_with_one_defect(name):
    fixed = (BUG_LABS / f"{name}_fixed.py").read_text()
    assert fixed.count(BEGIN) == 1, "one exercise region per fixed twin"
    assert (BUG_LABS / f"{name}.py").read_text() == twin(fixed, BUGS[name], name), \
        (f"labs/bugs/{name}.py is out of step with {name}_fixed.py: "
         "regenerate it with tests/test_clinic.py:twin")
