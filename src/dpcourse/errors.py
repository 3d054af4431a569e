"""The one exception a learner sees.

``CourseError`` subclasses ``SystemExit``: raised in a script, Python prints just the message
and exits with status 1, with no traceback, on every rank that raises it. In a notebook the
cell stops with the message. Catch it as ``except CourseError`` when you want to handle it.
"""


class CourseError(SystemExit):
    """A problem a learner can fix; the message says what to do."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message
