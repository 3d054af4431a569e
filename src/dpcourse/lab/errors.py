"""The one exception a learner sees, and how an exercise not done yet is recognised.

``CourseError`` subclasses ``SystemExit``: raised in a script, Python prints just the message
and exits with status 1, with no traceback, on every rank that raises it. In a notebook the
cell stops with the message. Catch it as ``except CourseError`` when you want to handle it.
"""
from __future__ import annotations

import re
import warnings

# IPython adds "To exit: use 'exit', 'quit', or Ctrl-D." under every SystemExit a cell raises:
# not what a learner should read under a course error.
warnings.filterwarnings("ignore", message="To exit: use 'exit', 'quit', or Ctrl-D.")


class CourseError(SystemExit):
    """A problem a learner can fix; the message says what to do."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


# What every exercise stub says (dpcourse.kit.course writes them). Here, without torch, for the
# command lines that only read what a run said (make check).
STUB = "Exercise: see the hint above"
# A lab, a job script or a notebook cell that met a stub says so in one of these ways: Python's
# traceback ("NotImplementedError: Exercise: see the hint above"), dpcourse.lab.explain's excepthook
# on a rank in a process group ('File "labs/x.py", line N, in f: Exercise: see the hint above. This
# exercise of the lab is not done yet ...'), a lab's own verdict
# ("f: not done yet — NotImplementedError: Exercise: see the hint above"), a job script's echo, or
# a cell's own NotImplementedError("Exercise: ...") (run_ok's below).
_NOT_DONE = re.compile(rf"{re.escape(STUB)}|NotImplementedError: Exercise:")


def not_done(said: str | list[str]) -> bool:
    """Whether ``said`` (a text or its lines: a lab's output, a job's, an error's message) shows an
    exercise that is not done yet. The one recognition of a stub: ``run_ok``, the notebooks' checks
    and ``make check`` (dpcourse.kit.course) all ask it."""
    return bool(_NOT_DONE.search(said if isinstance(said, str) else "\n".join(said)))
