"""What a wrong answer to a lab exercise looks like, for tests/test_exercises.py and its
tests/wrong_answers_NN.py modules."""
from typing import NamedTuple


class Lab(NamedTuple):
    """A wrong answer to an exercise region of a lab: the region of ``file`` whose hint holds
    ``hint``."""
    file: str
    hint: str
    code: str
