"""What the notebooks use: a lab run from a cell (``launch``), studies (``scaling``), explorers
(``widgets``, ``memory``) and plots drawn from the labs' logs (``plots``).

Imports ``dpcourse.lab`` and its own modules, never the course's machinery or cluster operations.
"""

# Set by dpcourse.kit.course.execute in the kernels it starts (make course, make check, tests); a
# kernel that nbval starts inherits pytest's own PYTEST_CURRENT_TEST instead
# (pytest sets it while a test runs).
UNDER_TEST = "DPCOURSE_UNDER_TEST"
