"""dpcourse: the small library shared by the course's notebooks, labs and tests.

One module per idea (see docs/design.md §2): ``dist`` (who am I, process groups), ``data``
(FashionMNIST found, verified and held in memory), ``launch`` (torchrun from a notebook cell),
``metrics`` (the JSON-lines run log), ``widgets`` (ipywidgets explorers over pure functions).
"""
from .errors import CourseError

__version__ = "0.1.0"
__all__ = ["CourseError", "__version__"]
