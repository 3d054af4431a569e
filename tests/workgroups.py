"""How `make test` shares the suite between its two pytest-xdist workers
(``-n 2 --dist loadgroup``).

While one test waits on a launcher, a daemon, a kernel or a Slurm job, the other worker's test has
the core: on one process, the suite left a quarter of the 2 cores idle (26 %, from /proc/stat).
Tests that share state run on one worker, one after the other (a *group*):
- a test module: its module fixtures and caches;
- a notebook: its nbval cells (one kernel, in order), its wrong answers and the harness's positive
  control (tests/test_exercises.py runs its cells in-process) and its guard run
  (tests/test_outputs.py) all write build/NN/;
- the local Slurm cluster: every test that uses it (the ``slurm`` fixture, in SLURM_MODULES; a test
  that takes the fixture elsewhere stops the run at collection), notebook 09 (it starts its own
  cluster, whose job numbers would meet the fixture's on the same ports: slurm/env.sh derives
  MASTER_PORT from the job id), and test_dist.py (its pretend Slurm jobs use those ports too).
  A module whose other tests do not need the cluster keeps its cluster tests in a module of their
  own (test_horovod_slurm.py, test_imagenet_slurm.py): its other tests run on either worker.

pytest-xdist's own ``loadgroup`` reads ``xdist_group`` marks by renaming each item's node id, which
pytest 9.2 no longer lets it do; this scheduler groups from the node id alone, on the controller.
"""
from __future__ import annotations

import json
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

SLURM_MODULES = {"tests/test_slurm.py", "tests/test_slurm_templates.py", "tests/test_dist.py",
                 "tests/test_doctor.py", "tests/test_horovod_slurm.py",
                 "tests/test_imagenet_slurm.py", "tests/test_hub.py", "tests/test_hubspawner.py"}
NOTEBOOK = re.compile(r"solutions/(\d\d)_[^/]*\.ipynb::"  # its cells
                      # its wrong answers
                      r"|tests/test_exercises\.py::test_check_rejects_wrong_answers\[(\d\d)-"
                      r"|tests/test_exercises\.py::test_the_harness_passes_the_solution_through_a_labs_copy\[(\d\d)-"
                      # its guard run
                      r"|tests/test_outputs\.py::test_compared_outputs_\w+\[(\d\d)_")
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

    # the groups in the order the workers collected them (_rank)
    config.option.loadscopereorder = False

    class GroupScheduling(LoadScopeScheduling):
        """pytest-xdist's loadscope (a whole group to one worker, the next group to whichever is
        free), with group() as the scope."""

        def _split_scope(self, nodeid: str) -> str:
            return group(nodeid)

        def _reschedule(self, node) -> None:
            """The next group only when this one is down to its last test (xdist: its last two),
            which a worker holds until it knows what follows: a group does not queue behind a long
            test while the other worker could start it."""
            if not node.shutting_down and self.workqueue \
                    and self._pending_of(self.assigned_work[node]) > 1:
                return
            super()._reschedule(node)

    return GroupScheduling(config, log)


# How long each group took in a measured `make test` (seconds, both workers' junit times summed
# per group): only the order in which the groups start depends on it. Measure again after adding
# or moving slow tests:
#     make test PYTEST_ARGS=--junitxml=/tmp/junit.xml &&
#     .venv/bin/python tests/workgroups.py /tmp/junit.xml
DURATIONS = Path(__file__).with_name("durations.json")


def _measured() -> dict[str, float]:
    try:
        return json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        return {}


def _rank(item, measured: dict[str, float]) -> tuple[int, float]:
    """Which groups start first: the longest ones, so that the run ends on short groups on both
    workers, not on a long one while the other worker idles (the longest first is the classic rule
    for two machines). Slurm's (a third of the suite) first; then by measured time. A group not
    measured yet is guessed: a notebook's (its wrong answers run labs) or one with multi-process
    runs (slow) at a minute, another at ten seconds."""
    name = group(item.nodeid)
    if name == "slurm":
        return 0, 0.0
    guess = 60.0 if name.startswith("notebook") or item.get_closest_marker("slow") else 10.0
    return 1, -measured.get(name, guess)


def pytest_collection_modifyitems(session, config, items):
    # on a worker of --dist loadgroup: the groups' order (stable)
    if config.getoption("loadgroup", default=False):
        first, measured = {}, _measured()
        for item in items:
            first.setdefault(group(item.nodeid), (_rank(item, measured), len(first)))
        items.sort(key=lambda item: first[group(item.nodeid)])
    strays = [item.nodeid for item in items
              if {"slurm", "slurm_cluster"} & set(getattr(item, "fixturenames", ()))
              and group(item.nodeid) != "slurm"]
    if strays:
        why = (f"these tests use the local Slurm cluster: add their modules to SLURM_MODULES in "
               f"tests/workgroups.py (one cluster, one worker): {strays}")
        if not hasattr(config, "workerinput"):
            raise pytest.UsageError(why)
        # on an xdist worker a UsageError crashes the controller: stop the run with the reason
        items.clear()
        session.shouldstop = why


def durations(junit: str | Path) -> dict[str, float]:
    """Seconds per group from a junit XML of the suite (pytest --junitxml)."""
    out: dict[str, float] = {}
    for case in ET.parse(junit).iter("testcase"):
        module, _, rest = case.get("classname", "").partition(".")
        # tests.test_x / solutions.01_x.ipynb
        path = f"{module}/{rest}" + ("" if rest.endswith(".ipynb") else ".py")
        name = group(f"{path}::{case.get('name')}")
        out[name] = round(out.get(name, 0.0) + float(case.get("time", 0)), 1)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


if __name__ == "__main__":  # python tests/workgroups.py JUNIT.xml: write tests/durations.json
    DURATIONS.write_text(json.dumps(durations(sys.argv[1]), indent=1) + "\n")
    print(f"wrote {DURATIONS}")
