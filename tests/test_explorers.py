"""The explorers (notebooks 01, 04, 08, 13, 14) can fail under test.

An explorer draws inside ``with out:`` (an ipywidgets ``Output``), and in a kernel ``Output`` shows
an error raised there in its output area and swallows it: a notebook's explorer cell passed nbval
and `make course` whatever its drawing raised. A learner moving a slider needs that output area (a
slider's callback has no cell to fail); under test (pytest, nbval, dpcourse.kit.course.execute) the
error is raised.

No notebook runs here but one of a single cell: ``Output`` is given what it finds in a kernel
(``get_ipython()``), and matplotlib's ``subplots`` a bug.
"""

import matplotlib
import matplotlib.pyplot as plt
import nbformat
import pytest
import torch
from ipywidgets.widgets import widget_output

from dpcourse.explore import widgets

matplotlib.use("Agg")
UNDER_TEST = "DPCOURSE_UNDER_TEST"  # what dpcourse.kit.course.execute sets in its kernels


def small_data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(256, 8, generator=g), torch.randint(0, 3, (256,), generator=g)


# Each explorer: how it is built in its notebook (small), and one slider moved as a learner would.
EXPLORERS = {
    "01 lr × batch size": (lambda: widgets.lr_batch_explorer(*small_data(), samples=64),
                           lambda box: setattr(box.children[0].children[1], "value", 256)),
    "04 all-reduce cost model": (lambda: widgets.allreduce_explorer(5e-5, 1e-9, 0.0),
                                 lambda box: setattr(box.children[0].children[0], "value", 8)),
    "08 learning-rate rules": (lambda: widgets.lr_rules_explorer(base_lr=0.15, epochs=2),
                               lambda box: setattr(box.children[0].children[1], "value", 4)),
    "13 memory per worker": (lambda: widgets.memory_explorer(model="GPT-3", world_size=64,
                                                            gpu="A100 80 GB", precision="mixed"),
                             lambda box: setattr(box.children[1].children[1], "value", 16)),
    "14 checkpoint interval": (lambda: widgets.interval_explorer(save_s=0.02, restart_s=10.0),
                               lambda box: setattr(box.children[0].children[0], "value", 16384)),
}
def explorers():
    return list(EXPLORERS)


class Kernel:
    """What ``Output`` finds as ``get_ipython()`` in a notebook's kernel:
    it shows an error there."""

    kernel = None  # (a real kernel's messages are not needed here)

    def __init__(self):
        self.shown = []

    def showtraceback(self, exc_tuple, tb_offset=None):
        self.shown.append(exc_tuple[1])


class Bug(Exception):
    pass


@pytest.fixture
def kernel(monkeypatch):
    shell = Kernel()
    monkeypatch.setattr(widget_output, "get_ipython", lambda: shell)
    yield shell
    plt.close("all")


def broken_drawing(monkeypatch):
    def subplots(*args, **kwargs):
        raise Bug("the drawing failed")

    monkeypatch.setattr(plt, "subplots", subplots)


def run_as(who, monkeypatch):
    """The environment of the explorer's kernel: under nbval a kernel inherits pytest's
    PYTEST_CURRENT_TEST; dpcourse.kit.course.execute sets DPCOURSE_UNDER_TEST; in JupyterLab (a
    learner) neither is set. (Called in the test itself: pytest sets PYTEST_CURRENT_TEST again as
    each phase of a test begins.)"""
    monkeypatch.delenv(UNDER_TEST, raising=False)
    if who != "pytest or nbval":
        monkeypatch.delenv("PYTEST_CURRENT_TEST")
    if who == "dpcourse.kit.course.execute":
        monkeypatch.setenv(UNDER_TEST, "1")


UNDER_TESTS = ["pytest or nbval", "dpcourse.kit.course.execute"]


@pytest.mark.parametrize("who", UNDER_TESTS)
@pytest.mark.parametrize("name", explorers())
def test_an_explorer_cell_fails_under_test_when_its_drawing_fails(name, who, kernel, monkeypatch):
    run_as(who, monkeypatch)
    build, _ = EXPLORERS[name]
    broken_drawing(monkeypatch)
    with pytest.raises(Bug):
        build()


@pytest.mark.parametrize("who", UNDER_TESTS)
@pytest.mark.parametrize("name", explorers())
def test_a_sliders_callback_fails_under_test_when_the_drawing_fails(name, who, kernel, monkeypatch):
    run_as(who, monkeypatch)
    build, move = EXPLORERS[name]
    box = build()
    broken_drawing(monkeypatch)
    with pytest.raises(Bug):
        move(box)


@pytest.mark.parametrize("name", EXPLORERS)
def test_a_learner_sees_the_drawings_error_in_the_output_area(name, kernel, monkeypatch):
    run_as("a learner", monkeypatch)
    build, move = EXPLORERS[name]
    box = build()
    broken_drawing(monkeypatch)
    move(box)  # no error here: the callback's error is shown in the explorer's output area
    assert [type(err) for err in kernel.shown] == [Bug]


def test_a_notebook_whose_explorer_fails_fails_in_make_course(tmp_path):
    """dpcourse.kit.course.execute (make course, make check, and the build/ copies nbval compares)
    runs its kernels under test: a drawing's error fails the cell."""
    from dpcourse.kit.course import execute

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "import matplotlib.pyplot as plt\n"
        "from dpcourse.explore import widgets\n"
        "def subplots(*args, **kwargs):\n"
        "    raise RuntimeError('the drawing failed')\n"
        "plt.subplots = subplots\n"
        "widgets.lr_rules_explorer();")])
    path = tmp_path / "explorer.ipynb"
    nbformat.write(nb, path)
    _, _, error = execute(path, timeout=120)
    assert error is not None and "the drawing failed" in error, error
