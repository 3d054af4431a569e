"""The outputs nbval compares do not depend on the machine.

A compared output (a code cell without ``nbval-ignore-output``) is committed with the notebook and
must come out the same on any CPU: another vector unit, another BLAS, another thread count. A value
that varies in its last bits (a rounding difference, a loss) is printed as what the cell asserts
(``≤ 1e-12``, "equal") or its cell is tagged ``nbval-ignore-output`` and asserts it.

The guard below executes notebooks again with torch's CPU kernels forced to their plain C++ versions
(``ATEN_CPU_CAPABILITY=default`` instead of the machine's AVX2/AVX-512 ones) and another thread
count than the reference run (make course's, or nbval's when build/ could not be reused), and
asserts that every compared output is identical to the committed one. Executing all sixteen costs
more than the nbval run that tests/nbreuse.py saves, so each run takes one, in a rotation keyed by
the commit that alternates between those whose compared outputs are computed in floating point
(FLOAT) and the others, within GUARD_BUDGET_S of their measured guard times. ``DPCOURSE_GUARD=all``
takes every notebook (8.4 min). Each runs up to its last compared cell only.
"""
import json
import os
import subprocess
import sys

import nbformat
import pytest

from conftest import ROOT

SOLUTIONS = ROOT / "solutions"
NOTEBOOKS = sorted(p.name for p in SOLUTIONS.glob("*.ipynb"))
# Compared outputs computed in floating point: errors and losses printed to a few digits, accuracies
# of a trained model, float64 rounding. The others print counts, indices, tables and texts.
FLOAT = ["02_gradient_averaging.ipynb", "03_collectives.ipynb", "11_horovod.ipynb",
         "12_clinic.ipynb", "06_data_sharding.ipynb", "08_large_batches.ipynb",
         "01_minibatch_sgd.ipynb", "13_sharded_dp.ipynb"]
GUARD_BUDGET_S = 100  # of guard time per suite run
# Each notebook's guard time (one thread, plain kernels, up to its last compared cell), in seconds,
# measured on the 2-core development machine with nothing beside it:
# DPCOURSE_GUARD=all .venv/bin/python -m pytest tests/test_outputs.py --durations=20 (00-13: 501 s;
# 14 alone, with -k 14)
GUARD_SECONDS = {"00": 13, "01": 17, "02": 21, "03": 30, "04": 33, "05": 26, "06": 59, "07": 17,
                 "08": 47, "09": 26, "10": 30, "11": 31, "12": 97, "13": 54,
                 "14": 60}
# nbval's comparison: these keys are not compared (nbval.plugin.IPyNbFile.skip_compare, no nbdime)
SKIP_COMPARE = {"metadata", "traceback", "prompt_number", "output_type", "name", "execution_count",
                "application/vnd.jupyter.widget-view+json", "image/png", "image/jpeg"}
PROBE = ("import json as _j, torch as _t\n"
         "print(_j.dumps({'threads': _t.get_num_threads(), "
         "'capability': _t.backends.cpu.get_cpu_capability()}))")


def compared(cell, patterns) -> dict:
    """What nbval compares of a cell's outputs: {key: [sanitized values]}, streams coalesced."""
    import re

    from nbval.plugin import coalesce_streams, transform_streams_for_comparison

    def clean(value):
        if isinstance(value, str):
            for regex, replace in patterns:
                value = re.sub(regex, replace, value)
        return value

    out: dict = {}
    for output in transform_streams_for_comparison(
            coalesce_streams([nbformat.from_dict(o) for o in cell.outputs])):
        for key, value in output.items():
            if key in SKIP_COMPARE:
                continue
            for k, v in (value.items() if key == "data" else [(key, value)]):
                if k not in SKIP_COMPARE:
                    out.setdefault(k, []).append(clean(v))
    return out


def compared_cells(nb):
    """(code cell number as nbval counts it, cell) for each cell whose output nbval compares."""
    code = [c for c in nb.cells if c.cell_type == "code"]
    return [(i, c) for i, c in enumerate(code)
            if not {"nbval-ignore-output", "nbval-skip"} & set(c.metadata.get("tags", []))
            and c.execution_count is not None]


def reference_settings() -> dict:
    """The thread count and CPU dispatch of the run nbval compared: make course's when build/ was
    reused, otherwise nbval's own (this process's)."""
    import torch

    try:
        return json.loads((ROOT / "build" / "executed.json").read_text())["settings"]
    except (OSError, ValueError, KeyError):
        return {"threads": torch.get_num_threads(),
                "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def guarded() -> list[str]:
    """One notebook, in a rotation keyed by the commit (the same commit: the same choice): FLOAT's
    notebooks on even turns, the others on odd ones, the first from the turn on within
    GUARD_BUDGET_S."""
    if os.environ.get("DPCOURSE_GUARD") == "all":
        return NOTEBOOKS
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()
    turn = int(head[:8], 16) if head else 0
    pool = FLOAT if turn % 2 == 0 else [n for n in NOTEBOOKS if n not in FLOAT]
    for i in range(len(pool)):  # the first, from this turn on, that fits
        name = pool[(turn // 2 + i) % len(pool)]
        if GUARD_SECONDS.get(name[:2], GUARD_BUDGET_S + 1) <= GUARD_BUDGET_S:
            return [name]
    raise AssertionError(f"no notebook of {pool} fits the guard's budget of {GUARD_BUDGET_S} s")


def test_forcing_the_plain_cpu_kernels_takes_effect():
    """ATEN_CPU_CAPABILITY is read by torch when it loads: the guard's kernels do run the plain
    code."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default", "OMP_NUM_THREADS": "2"}
    forced = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                            timeout=120)
    assert json.loads(forced.stdout) == {"threads": 2, "capability": "DEFAULT"}, forced.stderr


def test_compared_cells_are_found_as_nbval_finds_them():
    nb = nbformat.read(SOLUTIONS / "11_horovod.ipynb", as_version=4)
    numbers = [i for i, _ in compared_cells(nb)]
    # the check whose rounding difference failed once
    assert 1 in numbers and all(i >= 0 for i in numbers)
    patterns = [("0x[0-9a-fA-F]+", "0xADDRESS")]
    cell = nbformat.v4.new_code_cell(outputs=[
        nbformat.v4.new_output("stream", name="stdout", text="at 0xdead\n"),
        nbformat.v4.new_output("stream", name="stdout", text="b\n")])
    assert compared(cell, patterns) == {"stdout": ["at 0xADDRESS\nb\n"]}


@pytest.mark.slow
@pytest.mark.parametrize("name", guarded())
def test_compared_outputs_do_not_depend_on_the_cpu_dispatch_or_the_thread_count(name, monkeypatch):
    from nbval.plugin import get_sanitize_patterns

    from dpcourse.kit.course import execute

    reference = reference_settings()
    threads = 1 if reference["threads"] != 1 else 2
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")  # the kernel started below inherits these
    monkeypatch.setenv("OMP_NUM_THREADS", str(threads))
    committed = nbformat.read(SOLUTIONS / name, as_version=4)
    nb = nbformat.from_dict(committed)
    # Up to the last compared cell: what comes after it cannot change a compared output (11: its
    # check is the last, and the two training runs, the plots and the dry run after it need not run
    # again).
    last = compared_cells(committed)[-1][1]
    nb.cells = nb.cells[:next(i for i, c in enumerate(committed.cells) if c is last) + 1]
    nb.cells.insert(0, nbformat.v4.new_code_cell(PROBE))
    nb, seconds, error = execute(SOLUTIONS / name, nb=nb)
    assert error is None, \
        f"{name} failed under ATEN_CPU_CAPABILITY=default, OMP_NUM_THREADS={threads}: {error}"
    probe = json.loads(nb.cells.pop(0).outputs[0]["text"])
    # the settings did reach the kernel
    assert probe == {"threads": threads, "capability": "DEFAULT"}, probe
    patterns = get_sanitize_patterns((ROOT / "tests" / "sanitize.cfg").read_text())
    ran = dict(compared_cells(nb))
    differ = [f"Cell {i}: committed {compared(cell, patterns)!r}\n"
              f"        here {compared(ran[i], patterns)!r}"
              for i, cell in compared_cells(committed)
              if compared(cell, patterns) != compared(ran[i], patterns)]
    assert not differ, (f"{name}: compared outputs differ between the reference run "
                        f"({reference['cpu_capability']}, {reference['threads']} thread(s)) "
                        f"and DEFAULT, {threads} thread(s): print what is asserted, "
                        "or tag the cell nbval-ignore-output and assert it there\n"
                        + "\n".join(differ))
