"""Every exercise check rejects plausible wrong answers, and accepts the solution.

For each ``check`` cell of each solution notebook, the exercise it checks (the nearest cell
above with a solution region) is filled in with a wrong answer that a learner could write, the
notebook's cheap cells run in this process, and the check must raise. A check cell without a
registered wrong answer fails the suite: add one when you add an exercise.
"""
import os
import re
import textwrap

import matplotlib
import nbformat
import pytest

from conftest import ROOT
from dpcourse.course import BEGIN, END

matplotlib.use("Agg")

# (notebook, check name) → {what the learner got wrong: the code between the solution markers}
WRONG = {
    ("01_minibatch_sgd.ipynb", "exercise 1"): {
        "gradient not cleared": "p -= lr * p.grad",
        "step uphill": "p += lr * p.grad\np.grad = None",
        "a new tensor, not an in-place update": "p = p - lr * p.grad\np.grad = None",
        "lr forgotten": "p -= p.grad\np.grad = None",
    },
    ("01_minibatch_sgd.ipynb", "exercise 2"): {
        "the batch gradient repeated B times": """
            gW, gb = torch.autograd.grad(loss_fn(W, b, X, y), (W, b))
            return gW.expand(len(X), *gW.shape), gb.expand(len(X), *gb.shape)""",
        "each example's gradient times B (a sum for a mean)": """
            gW, gb = [], []
            for i in range(len(X)):
                gi = torch.autograd.grad(loss_fn(W, b, X[i:i + 1], y[i:i + 1]), (W, b))
                gW.append(gi[0] * len(X)); gb.append(gi[1] * len(X))
            return torch.stack(gW), torch.stack(gb)""",
        "examples paired with the wrong labels": """
            gW, gb = [], []
            for i in range(len(X)):
                gi = torch.autograd.grad(loss_fn(W, b, X[i:i + 1], y.roll(1)[i:i + 1]), (W, b))
                gW.append(gi[0]); gb.append(gi[1])
            return torch.stack(gW), torch.stack(gb)""",
    },
}
SKIP = "nbval-ignore-output"  # timing, plot and widget cells: not needed by any check


def check_cells(nb):
    """(index of the check cell, its name, index of the exercise cell it checks)."""
    out, exercise = [], None
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        if BEGIN in cell.source:
            exercise = i
        if "check" in cell.metadata.get("tags", []):
            name = re.match(r"# CHECK: (exercise \d+)", cell.source).group(1)
            out.append((i, name, exercise))
    return out


def with_answer(source: str, body: str) -> str:
    """``source`` with the code between the solution markers replaced by ``body``."""
    lines = source.splitlines()
    begin = next(i for i, line in enumerate(lines) if BEGIN in line)
    end = next(i for i, line in enumerate(lines) if END in line)
    indent = lines[begin][:len(lines[begin]) - len(lines[begin].lstrip())]
    body = textwrap.indent(textwrap.dedent(body).strip("\n"), indent)
    return "\n".join(lines[:begin] + [body] + lines[end + 1:])


def run_check(nb, check, exercise, answer=None):
    """Run the cheap cells up to the check (the exercise with ``answer``); the check's error or None."""
    namespace = {"__name__": "__main__"}
    cwd = os.getcwd()
    os.chdir(ROOT / "solutions")
    try:
        for i, cell in enumerate(nb.cells[:check]):
            if cell.cell_type != "code" or SKIP in cell.metadata.get("tags", []) \
                    or "check" in cell.metadata.get("tags", []):
                continue
            source = with_answer(cell.source, answer) if (i == exercise and answer) else cell.source
            exec(compile(source, f"cell {i}", "exec"), namespace)
        try:
            exec(compile(nb.cells[check].source, f"cell {check}", "exec"), namespace)
        except Exception as err:  # noqa: BLE001 - any failure is a rejection
            return err
        return None
    finally:
        os.chdir(cwd)


NOTEBOOKS = sorted((ROOT / "solutions").glob("*.ipynb"))
CHECKS = [(path.name, *c) for path in NOTEBOOKS for c in check_cells(nbformat.read(path, as_version=4))]


def test_every_check_has_wrong_answers_registered():
    assert CHECKS, "no check cells found"
    missing = [(nb, name) for nb, _, name, _ in CHECKS if not WRONG.get((nb, name))]
    assert not missing, f"add plausible wrong answers for these checks to WRONG: {missing}"


@pytest.mark.parametrize("notebook, check, name, exercise", CHECKS, ids=[f"{c[0][:2]}-{c[2]}" for c in CHECKS])
def test_check_accepts_the_solution_and_rejects_wrong_answers(notebook, check, name, exercise, capsys):
    nb = nbformat.read(ROOT / "solutions" / notebook, as_version=4)
    assert run_check(nb, check, exercise) is None, "the check rejects the solution itself"
    for what, body in WRONG[(notebook, name)].items():
        err = run_check(nb, check, exercise, body)
        assert isinstance(err, AssertionError), f"{name}: the check accepts a wrong answer ({what}): {err!r}"


def test_with_answer_replaces_only_the_solution_region():
    src = "def f(x):\n    ### BEGIN SOLUTION (hint: double it)\n    return 2 * x\n    ### END SOLUTION\n"
    assert with_answer(src, "return x") == "def f(x):\n    return x"
