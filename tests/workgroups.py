"""How `make test` shares the suite between its two pytest-xdist workers (``-n 2 --dist loadgroup``).

While one test waits on a launcher, a daemon, a kernel or a Slurm job, the other worker's test has
the core: on one process, the suite left a quarter of the 2 cores idle (26 %, from /proc/stat). Tests that share
state run on one worker, in order (a *group*):
- a test module: its module fixtures and caches;
- a notebook's nbval cells: they run in one kernel, one after the other;
- a notebook's wrong answers (tests/test_exercises.py caches each notebook's namespace);
- every test on the local Slurm cluster (the ``slurm`` fixture): one cluster per run, started once.
  Their modules are SLURM_MODULES; a test that takes the fixture elsewhere fails at collection.

pytest-xdist's own ``loadgroup`` reads ``xdist_group`` marks by renaming each item's node id, which
pytest 9.2 no longer lets it do; this scheduler groups from the node id alone, on the controller.
"""
from __future__ import annotations

import re

import pytest

SLURM_MODULES = {"tests/test_slurm.py", "tests/test_slurm_templates.py", "tests/test_dist.py",
                 "tests/test_doctor.py", "tests/test_horovod.py", "tests/test_imagenet.py"}
EXERCISE = re.compile(r"tests/test_exercises\.py::test_check_rejects_wrong_answers\[(\d+)-")


def group(nodeid: str) -> str:
    """The group of a test, from its node id."""
    module = nodeid.split("::", 1)[0]
    if module in SLURM_MODULES:
        return "slurm"
    if wrong := EXERCISE.match(nodeid):
        return f"wrong answers {wrong[1]}"
    return module  # a test module, or a notebook (solutions/NN_x.ipynb::Cell K)


@pytest.hookimpl(optionalhook=True, tryfirst=True)  # before pytest-xdist's own choice of scheduler
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False  # the groups in the order the workers collected them (_rank)

    class GroupScheduling(LoadScopeScheduling):
        """pytest-xdist's loadscope (a whole group to one worker, the next group to whichever is free),
        with group() as the scope."""

        def _split_scope(self, nodeid: str) -> str:
            return group(nodeid)

    return GroupScheduling(config, log)


def _rank(item) -> int:
    """Which groups start first: the longest ones, so that the run does not end on one of them while
    the other worker idles. Slurm's (a third of the suite), then the wrong answers (a few lab runs
    each), the modules with multi-process runs, the other modules, and the notebooks last (compared
    from make course's run, they take seconds)."""
    name = group(item.nodeid)
    if name == "slurm":
        return 0
    if name.startswith("wrong answers"):
        return 1
    if name.endswith(".ipynb"):
        return 4
    return 2 if item.get_closest_marker("slow") else 3


def pytest_collection_modifyitems(config, items):
    if config.getoption("loadgroup", default=False):  # on a worker of --dist loadgroup: the groups' order (stable)
        first = {}
        for item in items:
            first.setdefault(group(item.nodeid), (_rank(item), len(first)))
        items.sort(key=lambda item: first[group(item.nodeid)])
    strays = [item.nodeid for item in items
              if "slurm" in getattr(item, "fixturenames", ()) and group(item.nodeid) != "slurm"]
    if strays:
        raise pytest.UsageError(f"these tests use the local Slurm cluster: add their modules to SLURM_MODULES in "
                                f"tests/workgroups.py (one cluster, one worker): {strays}")
