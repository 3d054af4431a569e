"""An exercise not done yet is "not done yet", wherever a check meets its stub: one recognition of a
stub (dpcourse.explore.launch.not_done), used by run_ok, by the notebooks' checks and by
`make check`.

These run no process: tests/test_student.py runs `make check` on untouched learners' notebooks."""
import re

import nbformat
import pytest

from conftest import ROOT
from dpcourse.explore.launch import STUB, Run, not_done, run_ok
from dpcourse.kit.course import check_results
from dpcourse.lab.errors import CourseError

# Each way a learner's lab (or job script) says that it stopped at one of its exercise stubs, as the
# course's labs print it.
STOPPED_AT_A_STUB = {
    # one process, or a rank before its process group is up: Python's own traceback
    "a traceback": ['[rank0]:  File "labs/io_race.py", line 81, in fetch_rank0_first',
                    '[rank0]:    raise NotImplementedError("Exercise: see the hint above")',
                    "[rank0]:NotImplementedError: Exercise: see the hint above"],
    # a rank in a process group: dpcourse.lab.explain's excepthook, one line (the line notebook 06's
    # check missed)
    "the excepthook's line": ['[rank0]:File "labs/io_race.py", line 81, in fetch_rank0_first: '
                              "Exercise: see the hint above. This exercise of the lab is not done "
                              "yet: complete it (its notebook's check says when it is right), or "
                              "run the complete lab in solutions/labs/."],
    # a lab that checks the learner's code itself (ddp_by_hand.py --check,
    # compose_allreduce.py --check)
    "a lab's own verdict": ["[rank0]:NaiveDDP: not done yet — NotImplementedError: Exercise: "
                            "see the hint above (line 57)"],
    # a job script's stub (labs/*.sbatch), in a dry run's output
    "a job script's echo": ["Exercise: see the hint above"],
}
NOT_A_STUB = {
    "another error": ["[rank1]:ValueError: too many values to unpack (expected 2)"],
    "torch's own NotImplementedError": ["[rank0]:NotImplementedError: Could not run 'aten::empty' "
                                        "with arguments from the 'Meta' backend."],
    "a word about exercises": ["[rank0]:this exercise is about rank 0: see the hint above "
                               "the cell"],
}


@pytest.mark.parametrize("how", STOPPED_AT_A_STUB)
def test_not_done_recognises_each_way_a_lab_stops_at_a_stub(how):
    lines = STOPPED_AT_A_STUB[how]
    assert not_done(lines) and not_done("\n".join(lines))


@pytest.mark.parametrize("what", NOT_A_STUB)
def test_not_done_takes_no_other_error_for_a_stub(what):
    assert not not_done(NOT_A_STUB[what])


def test_the_stub_recognised_is_the_one_make_student_writes():
    from dpcourse.kit.course import STUB_EXIT, STUB_RAISE, student_script

    assert STUB in STUB_RAISE and STUB in STUB_EXIT
    stubbed = student_script("def f():\n    ### BEGIN SOLUTION (hint: x)\n    return 1\n"
                             "    ### END SOLUTION\n")
    namespace = {}
    exec(stubbed, namespace)
    with pytest.raises(NotImplementedError) as raised:
        namespace["f"]()
    assert not_done(f"{type(raised.value).__name__}: {raised.value}")


@pytest.mark.parametrize("how", STOPPED_AT_A_STUB)
def test_run_ok_says_not_done_yet_for_a_lab_stopped_at_a_stub(how, capsys):
    run = Run(["python", "labs/io_race.py"], 1, lines=STOPPED_AT_A_STUB[how], echoed=False)
    with pytest.raises(NotImplementedError,
                       match=r"^Exercise: labs/io_race.py still has an exercise to do"):
        run_ok(run)
    assert STOPPED_AT_A_STUB[how][-1] in capsys.readouterr().out  # a silent run shows how it ended


def test_run_ok_names_the_file_whose_stub_the_run_met():
    """A run of sweep.py meets the stub of fashion_ddp.py, which fashion_study.py imports: the error
    names fashion_ddp.py and its line, not the script launched (a learner's trial of notebook
    08)."""
    lines = ['[rank0]:File "../labs/fashion_ddp.py", line 77, in load_data: Exercise: see the hint '
             "above. This exercise of the lab is not done yet: complete it"]
    run = Run(["python", "../labs/sweep.py", "--batch-size 32"], 1, lines=lines, echoed=True)
    with pytest.raises(NotImplementedError, match=r"^Exercise: \.\./labs/fashion_ddp\.py still "
                                                  r"has an exercise to do \(line 77\)\. "):
        run_ok(run)
    traceback = ['  File "../labs/sweep.py", line 50, in main',
                 '  File "../labs/fashion_ddp.py", line 77, in load_data',
                 '    raise NotImplementedError("Exercise: see the hint above")',
                 "NotImplementedError: Exercise: see the hint above"]
    with pytest.raises(NotImplementedError, match=r"^Exercise: \.\./labs/fashion_ddp\.py still "
                                                  r"has an exercise to do \(line 77\)"):
        run_ok(Run(["python", "../labs/sweep.py"], 1, lines=traceback, echoed=True))


def test_run_ok_names_another_failure_and_its_cause():
    run = Run(["python", "labs/io_race.py"], 1, lines=NOT_A_STUB["another error"])
    with pytest.raises(CourseError, match=r"labs/io_race.py failed \(exit status 1\): "
                                          r".*too many values to unpack"):
        run_ok(run)


def executed(*cells):
    """A notebook as `make check` gets it back from the kernel: (source, tags, error or None) per
    code cell."""
    nb = nbformat.v4.new_notebook()
    for count, (source, tags, error) in enumerate(cells, 1):
        cell = nbformat.v4.new_code_cell(source, metadata={"tags": tags})
        cell.execution_count = count
        if error is not None:
            ename, evalue = error
            cell.outputs = [nbformat.v4.new_output("error", ename=ename, evalue=evalue,
                                                   traceback=[])]
        nb.cells.append(cell)
    return nb


@pytest.mark.parametrize("how", STOPPED_AT_A_STUB)
def test_make_check_says_not_done_yet_when_a_checks_error_carries_a_stub(how):
    """A check that runs a lab and fails with what the lab said (its own assert, a CourseError) is
    not done yet when the lab met a stub: `make check` reads the error with the same recognition as
    run_ok."""
    said = "\n".join(STOPPED_AT_A_STUB[how])
    nb = executed(("import x", [], None),
                  ("# CHECK: exercise 1 — the lab", ["check"],
                   ("AssertionError", f"the lab failed:\n{said}")))
    assert check_results(nb) == [("✗", "exercise 1 — the lab — not done yet")]


def test_make_check_still_says_fails_for_any_other_error():
    nb = executed(("# CHECK: exercise 1 — the lab", ["check"],
                   ("AssertionError", "\n".join(NOT_A_STUB["another error"]))))
    [(mark, verdict)] = check_results(nb)
    assert mark == "✗" and verdict.startswith("exercise 1 — the lab — fails: AssertionError:")


# How a notebook would recognise a stub by itself: by the stub's own words, or by a traceback's.
_OWN_PATTERN = re.compile(rf"{re.escape(STUB)}|NotImplementedError: Exercise")


def test_no_notebook_recognises_a_stub_by_its_own_pattern():
    """Notebook 06 looked for "NotImplementedError: Exercise", while a rank in a process group says
    "... Exercise: see the hint above. This exercise of the lab is not done yet ...": its untouched
    exercise 2 was graded "fails". A notebook asks dpcourse (run_ok, not_done) instead."""
    own = [f"{path.name} cell {number}: {line.strip()}"
           for path in sorted((ROOT / "solutions").glob("*.ipynb"))
           for number, cell in enumerate(nbformat.read(path, as_version=4).cells, 1)
           if cell.cell_type == "code"
           for line in cell.source.splitlines() if _OWN_PATTERN.search(line)]
    assert not own, ("recognise a stub with dpcourse.explore.launch.run_ok or not_done, not by its "
                     "text:\n" + "\n".join(own))


def test_a_checks_own_assertion_is_its_verdict_even_after_another_exercises_stub():
    """Notebook 05, exercises 1 and 2 left undone, exercise 3 answered wrongly: the timing run
    between exercise 2's check and exercise 3's raises exercise 1's stub, and `make check` said
    exercise 3 was "not done yet", hiding its check's message (a learner's walkthrough). A check
    that judged the answer reports what it found; an error that is only a consequence of the stub
    above still reads "not done yet"."""
    stub = ("NotImplementedError",
            "Exercise: ../labs/ddp_by_hand.py still has an exercise to do (line 74). "
            "Complete it, save the file and run this cell again.")
    judged = ("AssertionError",
              "the evaluation counted 5000 test images, not 10,000: sum the totals over all ranks")
    nb = executed(("# CHECK: exercise 2 — by hand", ["check"], stub),
                  ("run(lab('ddp_by_hand'), '--steps', 30)", [], stub),
                  ("# CHECK: exercise 3 — the DDP lines", ["check"], judged))
    assert check_results(nb) == [("✗", "exercise 2 — by hand — not done yet"),
                                 ("✗", f"exercise 3 — the DDP lines — fails: AssertionError: "
                                       f"{judged[1]}")]
    consequence = executed(("x = run(lab('ddp_by_hand'))", [], stub),
                           ("# CHECK: exercise 3 — the DDP lines", ["check"],
                            ("NameError", "name 'x' is not defined")))
    assert check_results(consequence) == [("✗", "exercise 3 — the DDP lines — not done yet")]
    untouched = executed(('# YOUR CODE HERE\n'
                          'raise NotImplementedError("Exercise: write it")', [], stub),
                         ("# CHECK: exercise 1 — yours", ["check"],
                          ("AssertionError", "answer is None")))
    assert check_results(untouched) == [("✗", "exercise 1 — yours — not done yet")]
