"""Notebook 09's container branch: with CONTAINER set, env.sh starts torchrun inside Apptainer.

The notebook decides it by one input, the CONTAINER variable, which its cell sets for a dry run of
slurm/multi_node.sbatch: no image and no container runtime are needed, and no Slurm. Here that cell
runs in this process (as tests/test_exercises.py runs the notebooks' cells), with and without a
CONTAINER of the kernel's own (JupyterLab run in the container, by slurm/jupyter.sbatch), and prints
what nbval compares in the committed notebook. A few seconds: three dry runs of a template each.
"""
import os

import nbformat
import pytest

from conftest import ROOT

NOTEBOOK = ROOT / "solutions" / "09_cluster.ipynb"


def cells():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    container = [cell for cell in code if 'CONTAINER"' in cell.source]
    assert len(container) == 1, "notebook 09 has one cell that sets CONTAINER for a dry run"
    return code[0], container[0]


@pytest.mark.parametrize("own", [None, "/home/me/dpcourse.sif"],
                         ids=["no CONTAINER", "the kernel's own CONTAINER"])
def test_the_container_cell_shows_the_launch_line_inside_apptainer(own, monkeypatch, capsys):
    imports, container = cells()
    assert "nbval-ignore-output" not in container.metadata.get("tags", []), \
        "its output is compared: it is the test"
    if own is None:
        monkeypatch.delenv("CONTAINER", raising=False)
    else:
        monkeypatch.setenv("CONTAINER", own)
    monkeypatch.chdir(ROOT / "solutions")  # where the notebook runs: TOP is the course folder
    namespace = {"__name__": "__main__"}
    exec(compile(imports.source, "cell 2", "exec"), namespace)
    capsys.readouterr()
    exec(compile(container.source, "the container cell", "exec"), namespace)  # its asserts hold
    printed = capsys.readouterr().out
    committed = "".join(o.get("text", "") for o in container.outputs
                        if o.get("output_type") == "stream")
    assert printed == committed and "apptainer exec --nv --bind" in printed, printed
    assert os.environ.get("CONTAINER") == own, \
        "the cell leaves the kernel's own CONTAINER as it was"
    without = namespace["plain"].training.argv
    assert "apptainer" not in without, \
        "the dry run without CONTAINER runs no container, even in one"
