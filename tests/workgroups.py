"""How `make test` shares the suite between its two pytest-xdist workers (``-n 2 --dist loadgroup``).

While one test waits on a launcher, a daemon, a kernel or a Slurm job, the other worker's test has
the core: on one process, the suite left a quarter of the 2 cores idle (26 %, from /proc/stat). Tests
that share state run on one worker, one after the other (a *group*):
- a test module: its module fixtures and caches;
- a notebook: its nbval cells (one kernel, in order), its wrong answers (tests/test_exercises.py runs
  its cells in-process) and its guard run (tests/test_outputs.py) all write build/NN/;
- the local Slurm cluster: every test that uses it (the ``slurm`` fixture, in SLURM_MODULES; a test
  that takes the fixture elsewhere stops the run at collection), notebook 09 (it starts its own
  cluster, whose job numbers would meet the fixture's on the same ports: slurm/env.sh derives
  MASTER_PORT from the job id), and test_dist.py (its pretend Slurm jobs use those ports too).

pytest-xdist's own ``loadgroup`` reads ``xdist_group`` marks by renaming each item's node id, which
pytest 9.2 no longer lets it do; this scheduler groups from the node id alone, on the controller.
"""
from __future__ import annotations

import re

import pytest

SLURM_MODULES = {"tests/test_slurm.py", "tests/test_slurm_templates.py", "tests/test_dist.py",
                 "tests/test_doctor.py", "tests/test_horovod.py", "tests/test_imagenet.py"}
NOTEBOOK = re.compile(r"solutions/(\d\d)_[^/]*\.ipynb::"  # its cells
                      r"|tests/test_exercises\.py::test_check_rejects_wrong_answers\[(\d\d)-"  # its wrong answers
                      r"|tests/test_outputs\.py::test_compared_outputs_\w+\[(\d\d)_")  # its guard run
SLURM_NOTEBOOKS = {"09"}


def group(nodeid: str) -> str:
    """The group of a test, from its node id."""
    module = nodeid.split("::", 1)[0]
    if module in SLURM_MODULES:
        return "slurm"
    if found := NOTEBOOK.match(nodeid):
        number = next(n for n in found.groups() if n)
        return "slurm" if number in SLURM_NOTEBOOKS else f"notebook {number}"
    return module


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

        def _reschedule(self, node) -> None:
            """The next group only when this one is down to its last test (xdist: its last two), which
            a worker holds until it knows what follows: a group does not queue behind a long test
            while the other worker could start it."""
            if not node.shutting_down and self.workqueue and self._pending_of(self.assigned_work[node]) > 1:
                return
            super()._reschedule(node)

    return GroupScheduling(config, log)


def _rank(item) -> int:
    """Which groups start first: the longest ones, so that the run does not end on one of them while
    the other worker idles. Slurm's (a third of the suite), then the notebooks' (their wrong answers
    run labs; their cells, compared from make course's run, take seconds), the modules with
    multi-process runs, then the other modules."""
    name = group(item.nodeid)
    if name == "slurm":
        return 0
    if name.startswith("notebook"):
        return 1
    return 2 if item.get_closest_marker("slow") else 3


def pytest_collection_modifyitems(session, config, items):
    if config.getoption("loadgroup", default=False):  # on a worker of --dist loadgroup: the groups' order (stable)
        first = {}
        for item in items:
            first.setdefault(group(item.nodeid), (_rank(item), len(first)))
        items.sort(key=lambda item: first[group(item.nodeid)])
    strays = [item.nodeid for item in items
              if {"slurm", "slurm_cluster"} & set(getattr(item, "fixturenames", ())) and group(item.nodeid) != "slurm"]
    if strays:
        why = (f"these tests use the local Slurm cluster: add their modules to SLURM_MODULES in "
               f"tests/workgroups.py (one cluster, one worker): {strays}")
        if not hasattr(config, "workerinput"):
            raise pytest.UsageError(why)
        items.clear()  # on an xdist worker a UsageError crashes the controller: stop the run with the reason
        session.shouldstop = why
