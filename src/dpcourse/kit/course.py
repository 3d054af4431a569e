"""The course's own tools: run every notebook, make the student copies, check a learner's work.

    .venv/bin/python -m dpcourse.kit.course run       # `make course`: execute solutions/*.ipynb
                                                    into build/
    .venv/bin/python -m dpcourse.kit.course student   # `make student`: solutions/
                                                    → notebooks/ + labs/
    .venv/bin/python -m dpcourse.kit.course check     # `make check`: run the learner's notebooks,
                                                    report each exercise
    .venv/bin/python -m dpcourse.kit.course room DIR  # the instructor's view of the records
                                                    make check ROOM=DIR left

Exercise regions use nbgrader's markers: ``### BEGIN SOLUTION`` / ``### END SOLUTION`` in code
(``.ipynb`` cells and ``.py`` labs alike), ``<!-- BEGIN SOLUTION -->`` / ``<!-- END SOLUTION -->``
in markdown. Text after the begin marker in parentheses is the hint, wrapped into comment lines
above the stub's ``raise``::

    ### BEGIN SOLUTION (hint: p -= lr * p.grad)
    ->  # YOUR CODE HERE
        # Hint: p -= lr * p.grad
        raise NotImplementedError("Exercise: see the hint above")

A code cell tagged ``check`` whose first line is ``# CHECK: <name>`` is a learner-facing check;
a name with "(optional)" in it is an optional exercise, which `make check` lists but does not
count against the learner until it is attempted.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import textwrap
import time
from pathlib import Path

import nbformat

from dpcourse.lab.errors import STUB, not_done
from dpcourse.lab.paths import project_root

BEGIN, END = "BEGIN SOLUTION", "END SOLUTION"
HINT = re.compile(r"BEGIN SOLUTION\s*\((?:hint:\s*)?(.*)\)\s*(?:-->)?\s*$")
STUB_RAISE = f'raise NotImplementedError("{STUB}")'
# A job script's exercise (labs/*.sbatch) stops the job the same way, in its own language.
STUB_EXIT = f'echo "{STUB}" >&2; exit 1'
STUB_WIDTH = 88  # the hint's comment lines, indentation included
# An exercise still as generated: its stub's comment lines, then the raise.
UNTOUCHED = re.compile(r'# YOUR CODE HERE\n(?:[ \t]*#.*\n)*'
                       r'[ \t]*raise NotImplementedError\("Exercise:')
TEXT_STUB = "*Your answer here.*"
CELL_TIMEOUT_S = 300


def _root() -> Path:
    top = project_root() or project_root(Path(__file__).parent)
    if top is None:
        raise SystemExit("Run this from inside the course checkout.")
    return top


def _solution_notebooks(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("*.ipynb") if not p.name.startswith("."))


def execute(path: Path, allow_errors: bool = False, timeout: int = CELL_TIMEOUT_S, nb=None,
            done=None):
    """Run a notebook (``nb``, or the file at ``path``) top to bottom in the folder of ``path``;
    return (notebook, seconds, error or None). ``done(cell)`` is called after each code cell.

    Its kernel runs under test (``dpcourse.explore.UNDER_TEST`` set): nobody watches an
    explorer's output area here, so an error in its drawing fails the cell instead of being shown
    there."""
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    from dpcourse.explore import UNDER_TEST

    nb = nbformat.read(path, as_version=4) if nb is None else nb
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", allow_errors=allow_errors,
                            coalesce_streams=True,
                            resources={"metadata": {"path": str(path.parent)}},
                            extra_arguments=["--IPKernelApp.log_level=CRITICAL"])
    if done is not None:
        client.on_cell_executed = lambda cell, **_: done(cell)
    start = time.perf_counter()
    error = None
    try:
        client.execute(env={**os.environ, UNDER_TEST: "1"})
    except CellExecutionError as err:
        error = str(err).strip().splitlines()[-1] if str(err).strip() else "cell failed"
    except Exception as err:  # noqa: BLE001 - a dead kernel, a timeout: report it in the table
        error = f"{type(err).__name__}: {err}".splitlines()[0]
    return nb, time.perf_counter() - start, error


# ---------------------------------------------------------------- make course
# What `make course` ran, so that `make test` can compare these executed copies with the committed
# outputs instead of running every notebook a second time (tests/nbreuse.py): valid only for the
# same sources and the same installed environment. Written by run_course, read by the tests.
EXECUTED = "executed.json"
# Not sources: what the course writes (builds, data, runs, environments)
# and what git ignores anyway.
_NOT_SOURCES = {".git", ".venv", "build", "data", "runs", "__pycache__", ".pytest_cache",
                "node_modules", ".ipynb_checkpoints"}


def notebook_inputs(nb) -> str:
    """A digest of what a notebook runs: each cell's type, source and tags (not its outputs)."""
    import hashlib

    cells = [[c.cell_type, c.source, sorted(c.metadata.get("tags", []))] for c in nb.cells]
    return hashlib.sha256(json.dumps(cells).encode()).hexdigest()


def _source_files(top: Path) -> list[Path]:
    """Every file a notebook could read: git's tracked and untracked-but-not-ignored files (a walk
    without git), less the solution notebooks themselves (their inputs are digested one by one)."""
    import subprocess

    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=top,
            capture_output=True, timeout=60, check=True).stdout.decode().split("\0")
        files = [top / name for name in listed if name]
    except (OSError, subprocess.SubprocessError):
        files = [p for p in top.rglob("*")
                 if p.is_file() and not _NOT_SOURCES & set(p.relative_to(top).parts)
                 and not p.name.endswith(".egg-info")]
    return sorted(p for p in files
                  if p.is_file() and not (p.parent == top / "solutions" and p.suffix == ".ipynb"))


def source_digests(top: Path) -> dict[str, str]:
    """{path relative to ``top``: SHA-256 of its bytes} for every file a notebook could read."""
    import hashlib

    return {str(path.relative_to(top)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in _source_files(top)}


def environment() -> dict:
    """What else decides a notebook's outputs: Python, every installed package and version, the
    CPU."""
    import platform
    import sysconfig
    from importlib import metadata

    cpuinfo = Path("/proc/cpuinfo")
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                if line.startswith("model name")), "") if cpuinfo.exists() else ""
    # The environment's own site-packages only: sys.path can hold more (setuptools puts its vendored
    # packages there once it is imported), which says nothing about what a notebook runs with.
    site = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    packages = sorted({f"{d.metadata['Name'].lower()}=={d.version}"
                       for d in metadata.distributions(path=site) if d.metadata["Name"]})
    return {"python": sys.version, "machine": platform.machine(),
            "cpu": cpu or platform.processor(), "packages": packages}


def execution_key(top: Path) -> dict:
    return {"sources": source_digests(top), "environment": environment()}


def run_course(folder: Path, out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    top = project_root(folder)
    key = execution_key(top) if top else None
    rows, executed = [], {}
    for path in _solution_notebooks(folder):
        print(f"running {path.name} ...", flush=True)
        source = nbformat.read(path, as_version=4)
        for cell in source.cells:  # a cell after a failure must not keep the committed output
            if cell.cell_type == "code":
                cell.outputs, cell.execution_count = [], None
        nb, seconds, error = execute(path, nb=nbformat.from_dict(source))
        nbformat.write(nb, out / path.name)
        rows.append((path.name, seconds, "ok" if error is None else f"FAILED: {error}"))
        executed[path.name] = {"inputs": notebook_inputs(source), "ok": error is None}
    width = max(len(r[0]) for r in rows) if rows else 8
    print(f"\n{'notebook':<{width}}  {'seconds':>7}  status")
    for name, seconds, status in rows:
        print(f"{name:<{width}}  {seconds:7.1f}  {status}")
    failed = sum(status != "ok" for _, _, status in rows)
    # What docs/instructor.md builds its schedules from: the machine time of each notebook.
    (out / "times.json").write_text(json.dumps(
        {name: {"seconds": round(seconds, 1), "status": status} for name, seconds, status in rows},
        indent=1) + "\n")
    if key is not None:
        import torch

        settings = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
                    "threads": torch.get_num_threads(),
                    "ATEN_CPU_CAPABILITY": os.environ.get("ATEN_CPU_CAPABILITY"),
                    "cpu_capability": torch.backends.cpu.get_cpu_capability()}
        (out / EXECUTED).write_text(json.dumps(
            {"key": key, "settings": settings, "notebooks": executed}, indent=1) + "\n")
    print(f"\n{len(rows) - failed} of {len(rows)} notebooks ran; "
          f"executed copies and times.json in {out}/")
    return 1 if failed or not rows else 0


# ---------------------------------------------------------------- make student
def stub(hint: str, indent: int = 0, last: str = STUB_RAISE) -> str:
    """What an exercise region becomes: the hint on comment lines that fit the editor, then a raise.

    Each clause of the hint (they end with ";") starts a line; a long one wraps, never inside
    "(...)".
    """
    hint = hint.strip() or "write the missing code"
    # textwrap keeps \xa0 joined
    hint = re.sub(r"\([^()]*\)", lambda m: m.group(0).replace(" ", "\xa0"), hint)
    width = STUB_WIDTH - indent - len("# Hint: ")
    lines = [line.replace("\xa0", " ") for clause in re.split(r"(?<=;)\s+", hint)
             for line in textwrap.wrap(clause, width, break_long_words=False,
                                       break_on_hyphens=False)]
    hint_lines = ["# Hint: " + lines[0]] + ["#       " + line for line in lines[1:]]
    return "\n".join(["# YOUR CODE HERE", *hint_lines, last])


def _clear_solutions(cell, last: str = STUB_RAISE) -> None:
    """nbgrader's ClearSolutions on one cell, each exercise region with its own hint and indent."""
    from nbgrader.preprocessors import ClearSolutions

    chunks, current = [], []  # one region per chunk: nbgrader's stub is the same for a whole cell
    for line in cell.source.splitlines(keepends=True):
        current.append(line)
        if END in line:
            chunks.append("".join(current))
            current = []
    chunks.append("".join(current))
    cleared = []
    for chunk in chunks:
        if BEGIN in chunk:
            marker = next(line for line in chunk.splitlines() if BEGIN in line)
            hint = m.group(1) if (m := HINT.search(marker)) else ""
            # indented like the marker
            code_stub = stub(hint, indent=len(marker) - len(marker.lstrip()), last=last)
            part = (nbformat.v4.new_code_cell(chunk) if cell.cell_type == "code"
                    else nbformat.v4.new_markdown_cell(chunk))
            ClearSolutions(enforce_metadata=False, code_stub={"python": code_stub},
                           text_stub=TEXT_STUB).preprocess_cell(part, {"language": "python"}, 0)
            chunk = part.source + ("\n" if chunk.endswith("\n") and not part.source.endswith("\n")
                                   else "")
        cleared.append(chunk)
    cell.source = "".join(cleared)


def student_notebook(nb):
    """The learner's copy: solutions replaced by stubs, outputs and execution counts cleared."""
    from nbgrader.preprocessors import ClearOutput

    nb = nbformat.from_dict(nb)
    for cell in nb.cells:
        if BEGIN in cell.source:
            _clear_solutions(cell)
        # when the solution last ran: noise in the learner's copy
        cell.metadata.pop("execution", None)
    nb, _ = ClearOutput().preprocess(nb, {})
    nb.metadata.pop("widgets", None)  # saved widget state belongs to the executed solution
    return nb


def student_script(text: str, shell: bool = False) -> str:
    """The learner's copy of a lab (``.py``, or a ``.sbatch`` job script with ``shell``), with the
    same markers and stubs as notebooks; its usage lines name the learner's own labs/, so a
    copied command runs their copy."""
    cell = nbformat.v4.new_code_cell(text.replace("solutions/labs/", "labs/"))
    if BEGIN in text:
        _clear_solutions(cell, last=STUB_EXIT if shell else STUB_RAISE)
    return cell.source


def _edited_copies(top: Path) -> list[str]:
    """Files under notebooks/ and labs/ that differ from git's last commit (a learner's work)."""
    import subprocess

    try:
        out = subprocess.run(["git", "status", "--porcelain", "--", "notebooks", "labs"], cwd=top,
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []  # no git: nothing to compare with
    return [line[3:] for line in out.splitlines() if line[:2].strip() and not line.startswith("??")]


def lab_files(folder: Path) -> list[Path]:
    """The labs under ``folder``, its subfolders included (labs/bugs/): Python labs and Slurm job
    scripts."""
    return sorted(p for p in folder.rglob("*")
                  if p.suffix in (".py", ".sbatch") and "__pycache__" not in p.parts)


def generate_student(src: Path, dest: Path) -> list[Path]:
    """Write ``dest/notebooks/*.ipynb`` and ``dest/labs/*.py``, ``*.sbatch`` from ``src``
    (= solutions/)."""
    written = []
    (dest / "notebooks").mkdir(parents=True, exist_ok=True)
    (dest / "labs").mkdir(parents=True, exist_ok=True)
    for path in _solution_notebooks(src):
        nb = student_notebook(nbformat.read(path, as_version=4))
        target = dest / "notebooks" / path.name
        nbformat.write(nb, target)
        written.append(target)
    for path in lab_files(src / "labs"):
        target = dest / "labs" / path.relative_to(src / "labs")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(student_script(path.read_text(), shell=path.suffix == ".sbatch"))
        target.chmod(path.stat().st_mode & 0o777)
        written.append(target)
    return written


# ---------------------------------------------------------------- make check
# A check cell that cannot run where it is (what it needs is not installed) prints a line that
# starts with this, and what to do; make check reports it as not checked, not as a pass.
NOT_CHECKED = "○ not checked:"


def _is_check(cell) -> bool:
    return cell.cell_type == "code" and "check" in cell.metadata.get("tags", [])


def _is_stub(error) -> bool:
    """Whether a cell's error says that it met an exercise not done yet: a stub's
    NotImplementedError, a check's NotImplementedError("Exercise: ..."), or an error that quotes a
    lab's stub (errors.not_done)."""
    return not_done(f"{error['ename']}: {error['evalue']}")


def _error_line(error) -> str:
    line = f"{error['ename']}: {error['evalue']}".splitlines()[0]
    return line if len(line) <= 600 else line[:600] + " …"  # a check's message in full; not a dump


def check_results(nb, stopped: str | None = None) -> list[tuple[str, str]]:
    """What `make check` says about an executed notebook, in cell order:
    ("✓" or "✗", "<exercise> — <verdict>") for each ``check`` cell ("○" for an optional exercise
    not done yet), and ("!", "cell N raised ...") for another cell's error.

    A failing check is "not done yet" when it met a stub: the stub's NotImplementedError, an
    exercise cell above it (since the previous check) that still holds its stub untouched, or a cell
    above it that raised a stub's error, unless the check's own error is its assertion: a check that
    got as far as judging the answer says what is wrong with it, even where a cell between raised
    another exercise's stub (notebook 05's timing run of exercise 1's lab, before exercise 3's
    check). Once an exercise is unfinished or failing, later cells' errors are not reported: they
    may well come from it.
    """
    results, untouched, stub_above, failing = [], False, False, False
    for number, cell in enumerate(nb.cells, 1):
        if cell.cell_type != "code":
            continue
        errors = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
        if not _is_check(cell):
            untouched |= bool(UNTOUCHED.search(cell.source))
            stub_above |= untouched or any(map(_is_stub, errors))
            failing |= stub_above
            if errors and not failing:
                results.append(("!", f"cell {number} raised {_error_line(errors[0])}; "
                                     "the checks after it may fail because of it"))
            continue
        first = cell.source.splitlines()[0] if cell.source else ""
        name = first.split("CHECK:", 1)[-1].strip() if "CHECK:" in first else "check"
        said = "".join(o.get("text", "") for o in cell.get("outputs", [])
                       if o.get("output_type") == "stream")
        unchecked = re.search(rf"^{NOT_CHECKED}(.*)$", said, re.M)
        if cell.get("execution_count") is None:
            verdict = f"not run: the notebook stopped before it ({stopped or 'it did not finish'})"
        elif unchecked and not errors:  # the check could not run here (e.g. no Horovod): not a pass
            results.append(("○", f"{name} — not checked:{unchecked.group(1)}"))
            untouched = stub_above = False
            continue
        elif not errors:
            verdict = "pass"
        elif untouched or _is_stub(errors[0]) \
                or (stub_above and errors[0].get("ename") != "AssertionError"):
            verdict = "not done yet"
        else:
            verdict = f"fails: {_error_line(errors[0])}"
        optional = verdict == "not done yet" and "(optional)" in name
        results.append(("✓" if verdict == "pass" else "○" if optional else "✗",
                        f"{name} — {verdict}"))
        untouched = stub_above = False
        failing = failing or verdict != "pass"
    return results


def _check_name(cell) -> str:
    first = cell.source.splitlines()[0] if cell.source else ""
    return first.split("CHECK:", 1)[-1].split("—", 1)[0].strip() if "CHECK:" in first else ""


def _looks_like_check(cell) -> bool:
    """A check cell, or a copy of one that lost its tag (its first line still says "# CHECK:")."""
    return _is_check(cell) or (cell.cell_type == "code"
                               and cell.source.lstrip().startswith("# CHECK:"))


def with_course_checks(nb, course) -> tuple[object, list[str], list[str]]:
    """The learner's notebook ``nb`` with every check cell as the course's notebook ``course`` has
    it: what make check grades with, so that a check edited, duplicated or deleted in a copy is not
    a silent pass. A check is found by its cell id, else by its name ("exercise 2"); one that is
    missing goes back after the cell that precedes it in the course, when that cell is there (a
    check deleted from its place); when that cell is gone too, the copy has lost that part of the
    notebook, and the check is not run: it is returned as lost. Any other check cell of the copy (a
    second copy of a check, with its tag or without) is left out of the run. Returns (the notebook
    to run, one note per check that was changed, missing or repeated in the learner's copy, the
    names of the lost checks). The learner's file is not touched."""
    nb = nbformat.from_dict(nb)
    notes, lost, ours_all = [], [], []
    for k, cell in enumerate(course.cells):
        if not _is_check(cell):
            continue
        name = _check_name(cell) or "a check"
        # not placed yet
        free = [i for i, c in enumerate(nb.cells) if not any(c is o for o in ours_all)]
        mine = [i for i in free if nb.cells[i].get("id") == cell.get("id")] or \
               [i for i in free
                if _looks_like_check(nb.cells[i]) and _check_name(nb.cells[i]) == _check_name(cell)]
        ours = nbformat.from_dict({**cell, "outputs": [], "execution_count": None})
        if mine:
            if nb.cells[mine[0]].source != cell.source or not _is_check(nb.cells[mine[0]]):
                notes.append(f"the check of {name} in your copy differs from the course's current "
                             "one (you edited it, or your copy is older than the course): graded "
                             "with the course's; your file keeps yours")
            nb.cells[mine[0]] = ours
            ours_all.append(ours)
            continue
        ids = [c.get("id") for c in nb.cells]
        if k and course.cells[k - 1].get("id") in ids:
            nb.cells.insert(ids.index(course.cells[k - 1].get("id")) + 1, ours)
            ours_all.append(ours)
            notes.append(f"the check of {name} is missing from your copy: graded with the course's")
        else:
            lost.append(name)
    extra = [c for c in nb.cells if _looks_like_check(c) and not any(c is o for o in ours_all)]
    known = {_check_name(c) for c in course.cells if _is_check(c)}
    for cell in extra:
        name = _check_name(cell) or "an exercise"
        notes.append(f"your copy has a second check cell for {name}: not run (each exercise is "
                     "graded once, with the course's check)" if name in known else
                     f"your copy has a check of {name} that the course does not have "
                     "(any more): not run")
    nb.cells = [c for c in nb.cells if not any(c is e for e in extra)]
    return nb, notes, lost


def _shown(folder: Path) -> str:
    """``folder`` as the learner would type it: relative to here when it is below here."""
    try:
        return str(folder.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(folder)


def check_learner(folder: Path, prefix: str = "", room: str | None = None) -> int:
    """Run the learner's saved notebooks whose names start with ``prefix``; print each exercise's
    verdict, and, with ``room`` (or $DPCOURSE_ROOM), leave one record of each in that folder
    (dpcourse.cluster.room)."""
    from tqdm import tqdm

    from dpcourse.cluster import room as rooms

    room = room or os.environ.get(rooms.ENV) or None
    warned = False
    everything = _solution_notebooks(folder)
    paths = [p for p in everything if p.name.startswith(prefix)]
    if not paths:
        print(f'No notebook in {_shown(folder)}/ starts with "{prefix}"; '
              f'the notebooks are {", ".join(p.stem for p in everything) or "none"}.')
        return 1
    top = project_root(folder)
    course = {p.name for p in _solution_notebooks(top / "solutions")} if top else set()
    # "13": the course's notebook, not a copy of it
    if prefix and any(p.name in course for p in paths):
        copies = [p.name for p in paths if p.name not in course]
        paths = [p for p in paths if p.name in course]
        if copies:
            print(f"Not checked: {', '.join(copies)} (your copies; to check one, give its name: "
                  f"--notebook {Path(copies[0]).stem}).")
    print("Save the notebook first (Ctrl+S): make check runs the saved file.")
    passed = failed = skipped = 0
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        # the course's checks: the single source
        source = top / "solutions" / path.name if top else None
        notes, lost = [], []
        if source is not None and source.exists():
            nb, notes, lost = with_course_checks(nb, nbformat.read(source, as_version=4))
        if not any(map(_is_check, nb.cells)) and not lost:
            print(f"- {path.name}: no exercises here")
            continue
        if any(map(_is_check, nb.cells)):
            print(f"  running {path.name} ...", flush=True)
        for note in notes:
            print(f"! {path.name}: {note}", flush=True)
        results = []
        if any(map(_is_check, nb.cells)):
            # a notebook takes minutes: a bar of its cells in a terminal (off in logs and CI)
            with tqdm(total=sum(c.cell_type == "code" for c in nb.cells), unit="cell",
                      desc=f"  {path.name}", leave=False, file=sys.stdout,
                      disable=True if os.environ.get("TQDM_DISABLE") else None) as bar:
                nb, _, stopped = execute(path, allow_errors=True, nb=nb,
                                         done=lambda cell: bar.update())
            results = check_results(nb, stopped)
        results += [("○" if "(optional)" in name else "✗",
                     f"{name} — not graded: its check and the cell before it are missing from "
                     "your copy (copy the notebook again to get that part back)") for name in lost]
        for mark, text in results:
            print(f"{mark} {path.name}: {text}", flush=True)
            passed, failed, skipped = (passed + (mark == "✓"), failed + (mark == "✗"),
                                       skipped + (mark == "○"))
            if room and not text.startswith("cell ") and not warned:  # "!" lines are not exercises
                warning = rooms.record(room, path.stem, *rooms.verdict_of(mark, text))
                if warning:
                    print(warning, flush=True)
                    warned = True  # one line, not one per exercise
    if passed + failed:
        print(f"\n{passed} of {passed + failed} exercises pass."
              + (f" ({skipped} optional or not checked: ○ above.)" if skipped else ""))
    return 0 if failed == 0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dpcourse.kit.course",
                                     description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="execute every solution notebook into build/")
    p.add_argument("--out", type=Path, default=None)
    p = sub.add_parser("student", help="generate notebooks/ and labs/ from solutions/")
    p.add_argument("--out", type=Path, default=None, help="write here instead of the checkout")
    p.add_argument("--force", action="store_true",
                   help="overwrite edited copies in notebooks/ and labs/")
    p = sub.add_parser("check", help="run the learner's notebooks and report each exercise")
    p.add_argument("folder", type=Path, nargs="?", default=None)
    p.add_argument("--notebook", default="", metavar="PREFIX",
                   help="only the notebooks whose names start so (01)")
    p.add_argument("--room", default=None, metavar="DIR",
                   help="also leave one record per exercise in this folder, for the instructor's "
                        "view (default: $DPCOURSE_ROOM; see python -m dpcourse.cluster.room)")
    # the instructor's view: its own options
    if (argv if argv is not None else sys.argv[1:])[:1] == ["room"]:
        from dpcourse.cluster import room as rooms

        return rooms.main((argv if argv is not None else sys.argv[1:])[1:])
    sub.add_parser("room", help="the instructor's view of a room's records "
                                "(python -m dpcourse.kit.course room -h)")
    args = parser.parse_args(argv)
    top = _root()
    os.environ.setdefault("DPCOURSE_DATA", str(top / "data"))
    if args.command == "run":
        return run_course(top / "solutions", args.out or top / "build")
    if args.command == "student":
        if args.out is None and not args.force and (edited := _edited_copies(top)):
            print(f"Not written: {', '.join(edited[:4])}{' …' if len(edited) > 4 else ''} "
                  "changed since the last commit, and make student would overwrite that work. "
                  "Commit or move it first, or run `make student FORCE=1` to overwrite.")
            return 1
        written = generate_student(top / "solutions", args.out or top)
        print(f"wrote {len(written)} student files")
        return 0
    return check_learner(args.folder or top / "notebooks", args.notebook, args.room)


if __name__ == "__main__":
    sys.exit(main())
