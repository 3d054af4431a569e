"""The library is laid out by who reads it, and its imports flow one way (docs/design.md §2):

    dpcourse.kit  →  dpcourse.cluster  →  dpcourse.explore  →  dpcourse.lab

A lab's imports land in ``dpcourse.lab`` only, so a learner who follows a name from a lab never
lands among the room's or the cluster's modules. Read from the source files' imports (every
``import`` and ``from … import``, also inside functions), no module imported.
"""
import ast
from pathlib import Path

import pytest

from conftest import ROOT

LIBRARY = ROOT / "src" / "dpcourse"
LABS = ROOT / "solutions" / "labs"
# Each layer and the layers it may import (itself included).
MAY_IMPORT = {
    "lab": {"lab"},
    "explore": {"lab", "explore"},
    "cluster": {"lab", "explore", "cluster"},
    "kit": {"lab", "explore", "cluster", "kit"},
}
# Names a reader already gives torch.distributed's modules: `import torch.distributed as dist`.
TORCH_NAMES = {"dist", "distributed", "c10d"}


def imported_layers(path: Path, package: str) -> dict[str, int]:
    """The dpcourse layers a file imports (absolute or relative), each with its first line."""
    found = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the file's own package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names = [module] if module != "dpcourse" else [f"dpcourse.{a.name}" for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "dpcourse" and len(parts) > 1:
                found.setdefault(parts[1], node.lineno)
    return found


def violations(library: Path) -> list[str]:
    """Every import that points up or sideways, and every module outside a layer."""
    bad = []
    for path in sorted(library.rglob("*.py")):
        rel = path.relative_to(library)
        if len(rel.parts) == 1:
            if rel.name != "__init__.py":
                bad.append(f"{rel}: a module outside the layers {sorted(MAY_IMPORT)}")
            elif imported_layers(path, "dpcourse"):
                bad.append(f"{rel}: the package's map imports nothing")
            continue
        layer = rel.parts[0]
        if layer not in MAY_IMPORT:
            bad.append(f"{rel}: {layer}/ is not one of the layers {sorted(MAY_IMPORT)}")
            continue
        package = ".".join(("dpcourse",) + rel.parts[:-1])
        for target, line in imported_layers(path, package).items():
            if target not in MAY_IMPORT[layer]:
                bad.append(f"{rel}:{line}: dpcourse.{layer} imports dpcourse.{target}, which "
                           f"it may not (it may import {sorted(MAY_IMPORT[layer])})")
    return bad


def test_imports_flow_one_way():
    modules = list(LIBRARY.rglob("*.py"))
    assert len(modules) > 30, modules
    assert violations(LIBRARY) == []


def test_a_lab_imports_only_what_a_lab_imports():
    bad = []
    labs = sorted(LABS.rglob("*.py"))
    assert len(labs) > 30, labs
    for path in labs:
        for target, line in imported_layers(path, "labs").items():
            if target != "lab":
                bad.append(f"{path.relative_to(ROOT)}:{line}: imports dpcourse.{target}")
    assert bad == []


def reads_a_command_line(library: Path) -> list[str]:
    """Functions of ``dpcourse.lab`` (what the labs call) that take a lab's argparse namespace (a
    parameter named ``args``, or ``getattr(args, ...)``), in modules that do not parse a command
    line of their own."""
    found = []
    for path in sorted((library / "lab").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        if any(isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
               and node.func.attr == "ArgumentParser" for node in ast.walk(tree)):
            continue  # its own command line (python -m dpcourse.lab.data, ...allreduce)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names = [a.arg for a in node.args.args + node.args.kwonlyargs]
                if "args" in names:
                    found.append(f"{path.relative_to(library)}:{node.lineno}: {node.name}(args)")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id == "getattr" and node.args
                    and isinstance(node.args[0], ast.Name) and node.args[0].id == "args"):
                found.append(f"{path.relative_to(library)}:{node.lineno}: getattr(args, ...)")
    return found


def test_the_library_takes_values_not_a_lab_s_args():
    """A lab hands the library named values; the library never reads the lab's command line
    (a module that parses its own, like ``python -m dpcourse.lab.allreduce``, reads its own)."""
    assert reads_a_command_line(LIBRARY) == []


def test_the_values_check_finds_a_function_that_reads_args(tmp_path):
    (tmp_path / "lab").mkdir()
    (tmp_path / "lab" / "mod.py").write_text(
        "def batch_sizes(args, world_size):\n    return args.batch_size\n"
        "def accumulate(ns):\n    return getattr(args, 'accumulate', 1)\n")
    assert reads_a_command_line(tmp_path) == ["lab/mod.py:1: batch_sizes(args)",
                                              "lab/mod.py:4: getattr(args, ...)"]


def test_no_module_takes_a_name_torch_distributed_gives():
    clash = [p.relative_to(LIBRARY).as_posix() for p in LIBRARY.rglob("*.py")
             if p.stem in TORCH_NAMES]
    assert clash == []


@pytest.mark.parametrize("layer, target, allowed", [
    ("lab", "from dpcourse.explore.launch import torchrun", False),  # up the layers: refused
    ("lab", "from ..cluster import hub", False),  # relative, sideways
    ("explore", "from dpcourse.kit import course", False),
    ("cluster", "from dpcourse.kit.course import run", False),
    ("cluster", "import dpcourse.explore.plots", True),
    ("kit", "from dpcourse.cluster import room", True),
    ("lab", "from . import world", True),
])
def test_the_check_refuses_an_import_that_points_back(tmp_path, layer, target, allowed):
    """The rule is checked, not assumed: a library with one import added, in a temporary copy."""
    root = tmp_path / "dpcourse"
    for name in MAY_IMPORT:
        (root / name).mkdir(parents=True)
        (root / name / "__init__.py").write_text("")
    (root / "__init__.py").write_text('"""the map"""\n')
    (root / layer / "probe.py").write_text(f"def f():\n    {target}\n")
    found = violations(root)
    if allowed:
        assert found == []
    else:
        assert len(found) == 1, found
        assert f"{layer}/probe.py:2: dpcourse.{layer} imports" in found[0], found


def test_a_module_outside_the_layers_is_refused(tmp_path):
    root = tmp_path / "dpcourse"
    (root / "lab").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "dist.py").write_text("")
    assert violations(root) == [f"dist.py: a module outside the layers {sorted(MAY_IMPORT)}"]
