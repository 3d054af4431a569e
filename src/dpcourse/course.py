"""The course's own tools: run every notebook, make the student copies, check a learner's work.

    python -m dpcourse.course run       # `make course`: execute solutions/*.ipynb into build/, print a table
    python -m dpcourse.course student   # `make student`: solutions/ → notebooks/ + labs/ (nbgrader as a library)
    python -m dpcourse.course check     # `make check`: run the learner's notebooks, report each exercise

Exercise regions use nbgrader's markers: ``### BEGIN SOLUTION`` / ``### END SOLUTION`` in code
(``.ipynb`` cells and ``.py`` labs alike), ``<!-- BEGIN SOLUTION -->`` / ``<!-- END SOLUTION -->``
in markdown. Text after the begin marker in parentheses is the hint the stub raises::

    ### BEGIN SOLUTION (hint: p -= lr * p.grad)
    ->  # YOUR CODE HERE
        raise NotImplementedError("Exercise: p -= lr * p.grad")

A code cell tagged ``check`` whose first line is ``# CHECK: <name>`` is a learner-facing check.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

import nbformat

from .data import project_root

BEGIN, END = "BEGIN SOLUTION", "END SOLUTION"
HINT = re.compile(r"BEGIN SOLUTION\s*\((?:hint:\s*)?(.*)\)\s*(?:-->)?\s*$")
STUB = '# YOUR CODE HERE\nraise NotImplementedError("Exercise: {hint}")'
TEXT_STUB = "*Your answer here.*"
CELL_TIMEOUT_S = 300


def _root() -> Path:
    top = project_root() or project_root(Path(__file__).parent)
    if top is None:
        raise SystemExit("Run this from inside the course checkout.")
    return top


def _solution_notebooks(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("*.ipynb") if not p.name.startswith("."))


def execute(path: Path, allow_errors: bool = False, timeout: int = CELL_TIMEOUT_S):
    """Run a notebook top to bottom in its own folder; return (notebook, seconds, error or None)."""
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", allow_errors=allow_errors,
                            coalesce_streams=True, resources={"metadata": {"path": str(path.parent)}},
                            extra_arguments=["--IPKernelApp.log_level=CRITICAL"])
    start = time.perf_counter()
    error = None
    try:
        client.execute()
    except CellExecutionError as err:
        error = str(err).strip().splitlines()[-1] if str(err).strip() else "cell failed"
    except Exception as err:  # a dead kernel, a timeout: report it in the table
        error = f"{type(err).__name__}: {err}".splitlines()[0]
    return nb, time.perf_counter() - start, error


# ---------------------------------------------------------------- make course
def run_course(folder: Path, out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for path in _solution_notebooks(folder):
        print(f"running {path.name} ...", flush=True)
        nb, seconds, error = execute(path)
        nbformat.write(nb, out / path.name)
        rows.append((path.name, seconds, "ok" if error is None else f"FAILED: {error}"))
    width = max(len(r[0]) for r in rows) if rows else 8
    print(f"\n{'notebook':<{width}}  {'seconds':>7}  status")
    for name, seconds, status in rows:
        print(f"{name:<{width}}  {seconds:7.1f}  {status}")
    failed = sum(status != "ok" for _, _, status in rows)
    print(f"\n{len(rows) - failed} of {len(rows)} notebooks ran; executed copies in {out}/")
    return 1 if failed or not rows else 0


# ---------------------------------------------------------------- make student
def _clear_solutions(cell) -> None:
    """nbgrader's ClearSolutions on one cell, with this cell's hint in the stub."""
    from nbgrader.preprocessors import ClearSolutions

    hints = [m.group(1).strip() for line in cell.source.splitlines() if (m := HINT.search(line))]
    hint = (hints[0] if hints else "write the missing code").replace('"', "'")
    pp = ClearSolutions(enforce_metadata=False, code_stub={"python": STUB.format(hint=hint)},
                        text_stub=TEXT_STUB)
    pp.preprocess_cell(cell, {"language": "python"}, 0)


def student_notebook(nb):
    """The learner's copy: solutions replaced by stubs, outputs and execution counts cleared."""
    from nbgrader.preprocessors import ClearOutput

    nb = nbformat.from_dict(nb)
    for cell in nb.cells:
        if BEGIN in cell.source:
            _clear_solutions(cell)
    nb, _ = ClearOutput().preprocess(nb, {})
    nb.metadata.pop("widgets", None)  # saved widget state belongs to the executed solution
    return nb


def student_script(text: str) -> str:
    """The learner's copy of a ``.py`` lab, with the same markers and stubs as notebooks."""
    cell = nbformat.v4.new_code_cell(text)
    if BEGIN in text:
        _clear_solutions(cell)
    return cell.source


def generate_student(src: Path, dest: Path) -> list[Path]:
    """Write ``dest/notebooks/*.ipynb`` and ``dest/labs/*.py`` from ``src`` (= solutions/)."""
    written = []
    (dest / "notebooks").mkdir(parents=True, exist_ok=True)
    (dest / "labs").mkdir(parents=True, exist_ok=True)
    for path in _solution_notebooks(src):
        nb = student_notebook(nbformat.read(path, as_version=4))
        target = dest / "notebooks" / path.name
        nbformat.write(nb, target)
        written.append(target)
    for path in sorted((src / "labs").glob("*.py")):
        target = dest / "labs" / path.name
        target.write_text(student_script(path.read_text()))
        written.append(target)
    return written


# ---------------------------------------------------------------- make check
def check_results(nb) -> list[tuple[str, str]]:
    """(exercise, verdict) for every ``check`` cell of an executed notebook."""
    results = []
    for cell in nb.cells:
        if cell.cell_type != "code" or "check" not in cell.metadata.get("tags", []):
            continue
        first = cell.source.splitlines()[0] if cell.source else ""
        name = first.split("CHECK:", 1)[-1].strip() if "CHECK:" in first else "check"
        errors = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
        if not errors:
            verdict = "pass"
        elif errors[0]["ename"] in ("NotImplementedError", "NameError"):
            verdict = "not done yet"
        else:
            verdict = f"fails: {errors[0]['ename']}: {errors[0]['evalue']}".splitlines()[0][:120]
        results.append((name, verdict))
    return results


def check_learner(folder: Path) -> int:
    rows = []
    for path in _solution_notebooks(folder):
        nb, _, _ = execute(path, allow_errors=True)
        rows += [(path.name, name, verdict) for name, verdict in check_results(nb)]
    if not rows:
        print(f"No exercises found in {folder}.")
        return 1
    for notebook, name, verdict in rows:
        mark = "✓" if verdict == "pass" else "✗"
        print(f"{mark} {notebook}: {name} — {verdict}")
    done = sum(v == "pass" for *_, v in rows)
    print(f"\n{done} of {len(rows)} exercises pass.")
    return 0 if done == len(rows) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dpcourse.course", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="execute every solution notebook into build/")
    p.add_argument("--out", type=Path, default=None)
    p = sub.add_parser("student", help="generate notebooks/ and labs/ from solutions/")
    p.add_argument("--out", type=Path, default=None, help="write here instead of the checkout")
    p = sub.add_parser("check", help="run the learner's notebooks and report each exercise")
    p.add_argument("folder", type=Path, nargs="?", default=None)
    args = parser.parse_args(argv)
    top = _root()
    os.environ.setdefault("DPCOURSE_DATA", str(top / "data"))
    if args.command == "run":
        return run_course(top / "solutions", args.out or top / "build")
    if args.command == "student":
        written = generate_student(top / "solutions", args.out or top)
        print(f"wrote {len(written)} student files")
        return 0
    return check_learner(args.folder or top / "notebooks")


if __name__ == "__main__":
    sys.exit(main())
