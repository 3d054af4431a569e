"""nbval without running each notebook twice: compare `make course`'s executed copies in build/.

`make course` executes every solution notebook into build/ and records in build/executed.json what
it ran: a digest of each notebook's cells, of every other source file, and of the environment
(Python, the installed packages, the CPU). When those still match here, nbval's items for that
notebook compare build/'s outputs with the committed ones instead of executing it again: the same
items (``solutions/NN_x.ipynb::Cell N``), the same sanitizers (tests/sanitize.cfg), the same tags
(``nbval-ignore-output``, ``nbval-skip``, ``raises-exception``), and a cell that raised fails the
same way. Anything else (no build/, a changed file, another package, a notebook that failed there)
is executed by nbval as before, so `make test` run alone stays complete.

``DPCOURSE_NBVAL_REUSE=require`` (CI, right after `make course`) turns a notebook that cannot be
reused into a failure that says why, so that the suite cannot silently get slower;
``DPCOURSE_NBVAL_REUSE=never`` executes every notebook as plain nbval does.

That an output does not depend on the machine, the thread count or the CPU's vector unit is
tests/test_outputs.py's to show: it executes notebooks again under other settings.
"""
from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path

import nbformat
import pytest


@lru_cache(maxsize=None)
def _here(root: Path) -> dict:
    from dpcourse.kit.course import execution_key

    return execution_key(root)


@lru_cache(maxsize=None)
def _recorded(root: Path) -> dict | None:
    from dpcourse.kit.course import EXECUTED

    try:
        return json.loads((root / "build" / EXECUTED).read_text())
    except (OSError, ValueError):
        return None


def why_not_reused(path: Path) -> str | None:
    """None when build/ holds an executed copy of ``path`` (solutions/NN.ipynb) made from these
    sources in this environment; otherwise the reason, in a few words."""
    from dpcourse.kit.course import notebook_inputs

    root = path.resolve().parents[1]
    if path.parent.name != "solutions" or not (root / "pyproject.toml").exists():
        return "not a solution notebook"
    recorded = _recorded(root)
    if recorded is None:
        return "no build/executed.json: `make course` has not run here"
    entry = recorded["notebooks"].get(path.name)
    if entry is None or not (root / "build" / path.name).exists():
        return "make course did not run it"
    if not entry["ok"]:
        return "it failed in make course"
    if entry["inputs"] != notebook_inputs(nbformat.read(path, as_version=4)):
        return "its cells changed since make course"
    key, here = recorded["key"], _here(root)
    if key["sources"] != here["sources"]:
        old, new = key["sources"], here["sources"]
        changed = sorted(name for name in old.keys() | new.keys() if old.get(name) != new.get(name))
        return (f"{len(changed)} source file(s) changed since make course: {', '.join(changed[:4])}"
                + (" …" if len(changed) > 4 else ""))
    if key["environment"] != here["environment"]:
        old, new = key["environment"], here["environment"]
        changed = sorted(set(old["packages"]) ^ set(new["packages"]))
        what = [k for k in ("python", "machine", "cpu") if old[k] != new[k]]
        return "the environment changed since make course: " + ", ".join(what + changed[:6])
    return None


def missing_needs(path: Path) -> str | None:
    """What a notebook declares it needs (metadata ``dpcourse.needs``: {module: how to get it}) and
    this environment lacks, in words; None when nothing is missing. Without it the notebook takes
    another path (notebook 11 shows a committed run), whose outputs are not the committed ones."""
    from importlib.util import find_spec

    needs = nbformat.read(path, as_version=4).metadata.get("dpcourse", {}).get("needs", {})
    missing = [f"{module} ({how})" for module, how in needs.items() if find_spec(module) is None]
    return ", ".join(missing) or None


@pytest.hookimpl(trylast=True)  # after nbval's own pytest_configure
def pytest_configure(config):
    if not config.option.nbval:
        return
    from nbval import plugin

    # nbval's collector, through these subclasses: its own hook would collect every notebook again.
    config.pluginmanager.unregister(plugin)

    class ReusingNbFile(plugin.IPyNbFile):
        """One notebook: its build/ copy compared when it may be, executed by nbval otherwise."""

        def collect(self):
            mode = os.environ.get("DPCOURSE_NBVAL_REUSE", "")
            self.reason = ("DPCOURSE_NBVAL_REUSE=never" if mode == "never"
                           else why_not_reused(Path(self.fspath)))
            built = Path(self.fspath).resolve().parents[1] / "build" / Path(self.fspath).name
            self.built = None if self.reason else nbformat.read(built, as_version=4)
            config.stash.setdefault(REPORT, []).append((Path(self.fspath).name, self.reason))
            self.required = (self.reason if mode == "require"
                             and self.reason != "not a solution notebook" else None)
            missing = missing_needs(Path(self.fspath))
            for cell in super().collect():
                item = ReusingNbCell.from_parent(self, name=cell.name, cell_num=cell.cell_num,
                                                 cell=cell.cell, options=cell.options)
                # Without it: skipped, as the Slurm tests are without Slurm; CI insists
                # (its first cell fails).
                if missing and (os.environ.get("CI") != "true" or item.cell_num > 0):
                    item.add_marker(pytest.mark.skip(
                        reason=f"{Path(self.fspath).name} needs {missing}"))
                item.missing = missing
                yield item

        def setup(self):
            if self.built is None:
                super().setup()
            else:
                self.setup_sanitize_files()  # no kernel: nothing runs

        def built_cell(self, cell_num: int):
            cells = [c for c in self.built.cells if c.cell_type == "code"]
            return cells[cell_num]

    class ReusingNbCell(plugin.IPyNbCell):
        def runtest(self):
            if self.missing:
                self.raise_cell_error(
                    f"CI needs {self.missing}: this notebook's outputs come from it")
            if self.parent.built is None:
                super().runtest()  # executed, as plain nbval does
                if self.parent.required and self.cell_num == 0:
                    self.raise_cell_error(
                        "DPCOURSE_NBVAL_REUSE=require, and build/ cannot stand for this "
                        f"notebook: {self.parent.required}. It was executed instead (slower). "
                        "Run `make course` again after a change, or unset the variable.")
                return
            if self.options["skip"]:
                pytest.skip()
            built = self.parent.built_cell(self.cell_num)
            # the digest says they are the same: never expected
            if built.source != self.cell.source:
                self.raise_cell_error("build/'s copy of this cell differs from the notebook's")
            outs = plugin.coalesce_streams([nbformat.from_dict(o) for o in built.outputs])
            self.test_outputs = outs
            errors = [o for o in outs if o.output_type == "error"]
            if errors and not self.options["check_exception"]:
                self.raise_cell_error(
                    "Cell execution caused an exception (in make course's run, build/)",
                    "\n" + "\n".join(errors[0].get("traceback", [])))
            if self.cell.execution_count is None and self.cell.outputs:
                self.raise_cell_error("Unrun reference cell has outputs")
            if self.options["check"] and self.cell.execution_count is not None:
                if not self.compare_outputs(outs, plugin.coalesce_streams(self.cell.outputs)):
                    self.raise_cell_error("Cell outputs differ (make course's run in build/ "
                                          "against the committed output)",
                                          "\n".join(self.comparison_traceback))

    class Collector:
        @staticmethod
        def pytest_collect_file(file_path, parent):
            if file_path.suffix == ".ipynb":
                return ReusingNbFile.from_parent(parent, path=file_path)

    config.pluginmanager.register(Collector(), "nbreuse-collector")


REPORT = pytest.StashKey[list]()


def pytest_sessionfinish(session):
    """On a pytest-xdist worker: hand what it collected to the controller, which prints
    the summary."""
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["nbreuse"] = session.config.stash.get(REPORT, [])


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: a worker has finished
def pytest_testnodedown(node, error):
    seen = node.config.stash.setdefault(REPORT, [])
    for name, reason in getattr(node, "workeroutput", {}).get("nbreuse", []):
        if (name, reason) not in seen:  # every worker collects every notebook
            seen.append((name, reason))


def pytest_terminal_summary(terminalreporter, config):
    seen = config.stash.get(REPORT, [])
    if not seen:
        return
    reused = [name for name, reason in seen if reason is None]
    executed = [(name, reason) for name, reason in seen if reason is not None]
    line = terminalreporter.write_line
    line(f"nbval: {len(reused)} notebook(s) compared from make course's run in build/, "
         f"{len(executed)} executed here")
    for name, reason in executed:
        line(f"  executed {name}: {reason}")
