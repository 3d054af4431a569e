"""The one exception a learner sees.

``CourseError`` subclasses ``SystemExit``: raised in a script, Python prints just the message
and exits with status 1, with no traceback, on every rank that raises it. In a notebook the
cell stops with the message. Catch it as ``except CourseError`` when you want to handle it.
"""
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
