"""fashion_ddp.py is fashion_single.py plus the lines data parallelism needs, each marked with its
reason (issue 44, item 1): the diff that notebook 05 shows is the lesson, so every line it adds or
changes must say why it is there.

A line of the diff passes when it is blank or prose (a docstring), when it carries a mark
(`# DDP: …`, test_marks.MARK) or sits in a statement that does (any of its physical lines, or the
comment lines directly above it), when a mark on a line of its own heads its paragraph (the lines
above it up to a blank one, at its indentation: one reason for a group of imports), when a block
it belongs to is marked (an `if rank == 0:  # DDP:`
covers its body; a marked `def` covers a function that the diff adds whole), and when it opens a
block whose body is marked. A comment line passes when its comment block holds a mark.

Then the proof that the diff is only distribution: on one process, with the same options, the two
files train the same weights, bit for bit."""
from __future__ import annotations

import ast
import difflib
import io
import re
import tokenize

import pytest
import torch

from conftest import ROOT, lab_cmd, run, torchrun_cmd
from test_marks import MARK

LABS = ROOT / "solutions" / "labs"
SINGLE, DDP_LAB = LABS / "fashion_single.py", LABS / "fashion_ddp.py"
HOROVOD_LAB = LABS / "fashion_horovod.py"


def changed_lines(before: str, after: str) -> set[int]:
    """The numbers (from 1) of ``after``'s lines that the diff from ``before`` adds or changes."""
    matcher = difflib.SequenceMatcher(None, before.splitlines(), after.splitlines(),
                                      autojunk=False)
    return {j + 1 for tag, _, _, j1, j2 in matcher.get_opcodes() if tag in ("insert", "replace")
            for j in range(j1, j2)}


def _docstring_lines(tree: ast.AST) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            lines.update(range(node.lineno, node.end_lineno + 1))
    return lines


def unmarked(before: str, after: str) -> list[str]:
    """The lines ``after`` adds to ``before`` that no mark explains, as 'LINE: text'."""
    lines = after.splitlines()
    tree = ast.parse(after)
    changed = changed_lines(before, after)
    marked = {n for n, text in enumerate(lines, 1) if MARK.search(text)}
    comment = {n for n, text in enumerate(lines, 1) if text.strip().startswith("#")}
    docs = _docstring_lines(tree)
    parents, stmts = {}, []
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[child] = node
        if isinstance(node, ast.stmt):
            stmts.append(node)

    def block_above(n: int) -> set[int]:  # the comment lines directly above line n
        above = set()
        while n - 1 in comment:
            n -= 1
            above.add(n)
        return above

    def header(node: ast.stmt) -> set[int]:  # a block's own lines; a simple statement's all
        body = getattr(node, "body", None)
        last = body[0].lineno - 1 if isinstance(body, list) and body else node.end_lineno
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        return set(range(first, last + 1))

    def paragraph_mark(n: int) -> bool:  # a mark on its own line, above in n's paragraph
        indent = len(lines[n - 1]) - len(lines[n - 1].lstrip())
        while n > 1 and lines[n - 2].strip():
            n -= 1
            line = lines[n - 1]
            if (n in comment and n in marked and len(line) - len(line.lstrip()) == indent):
                return True
        return False

    def says_why(node: ast.stmt) -> bool:
        own = header(node)
        return bool((own | block_above(min(own))) & marked) or paragraph_mark(min(own))

    def body_marked(node: ast.stmt) -> bool:
        return any(says_why(s) for s in ast.walk(node) if isinstance(s, ast.stmt) and s is not node)

    def covered(node: ast.stmt) -> bool:  # by a marked block around it
        parent = parents.get(node)
        while isinstance(parent, ast.stmt):
            whole = set(range(parent.lineno, parent.end_lineno + 1))
            is_def = isinstance(parent, (ast.FunctionDef, ast.ClassDef))
            if says_why(parent) and (not is_def or whole <= changed | docs | {
                    n for n in whole if not lines[n - 1].strip()}):
                return True
            parent = parents.get(parent)
        return False

    bad = []
    for n in sorted(changed):
        text = lines[n - 1].strip()
        if not text or n in docs or text.startswith("### "):  # ### BEGIN/END SOLUTION
            continue
        if n in comment:
            block = {n} | block_above(n)
            below = n + 1
            while below in comment:
                block.add(below)
                below += 1
            if not block & marked:
                bad.append(f"{n}: {text}")
            continue
        inner = [s for s in stmts if s.lineno <= n <= s.end_lineno]
        node = min(inner, key=lambda s: s.end_lineno - s.lineno)
        in_header = n in header(node)
        if says_why(node) or covered(node) or (in_header and body_marked(node)):
            continue
        bad.append(f"{n}: {text}")
    return bad


@pytest.mark.parametrize("before, after, mark", [
    (SINGLE, DDP_LAB, "DDP"),  # notebook 05: one process → DDP
    (DDP_LAB, HOROVOD_LAB, "Horovod"),  # notebook 11: DDP → Horovod, siblings (issue 44, item 7)
], ids=["single-to-ddp", "ddp-to-horovod"])
def test_every_line_the_diff_adds_says_why(before, after, mark):
    bad = unmarked(before.read_text(), after.read_text())
    assert not bad, (f"lines of {after.name} that {before.name} does not have, with no "
                     f"# {mark}: reason:\n" + "\n".join(bad))


def test_the_horovod_lab_carries_no_ddp():
    """Horovod's lab says Horovod where the DDP lab says DDP: no torch.distributed, no DDP mark."""
    tokens = list(tokenize.generate_tokens(io.StringIO(HOROVOD_LAB.read_text()).readline))
    found = {t.string for t in tokens if t.type == tokenize.NAME} & {"dist", "DDP", "unwrap"}
    found |= {t.string for t in tokens if t.type == tokenize.COMMENT and "# DDP:" in t.string}
    assert not found, f"fashion_horovod.py: {sorted(found)}"


def test_the_twin_has_no_distribution():
    """No name of torch.distributed's, no process group, no rank, no mark: in code and comments."""
    tokens = list(tokenize.generate_tokens(io.StringIO(SINGLE.read_text()).readline))
    names = {t.string for t in tokens if t.type == tokenize.NAME}
    found = names & {"dist", "distributed", "DDP", "DistributedDataParallel",
                     "DistributedSampler", "rank0_first", "rank", "world_size", "all_reduce"}
    found |= {t.string for t in tokens if t.type == tokenize.COMMENT and MARK.search(t.string)}
    assert not found, f"fashion_single.py should train in one process, without: {sorted(found)}"


def _plant(text: str, after: str, line: str) -> str:
    assert after in text
    return text.replace(after, after + line, 1)


# Mutants: each must be found, at its line.
@pytest.mark.parametrize("mutate, expected", [
    # an unmarked statement added where the lesson happens
    (lambda t: _plant(t, "        self.opt.step()\n", "        torch.manual_seed(1)\n"),
     "torch.manual_seed(1)"),
    # the last barrier without its reason
    (lambda t: t.replace("dist.barrier()  # DDP: wait for rank 0's checkpoint", "dist.barrier()"),
     "dist.barrier()"),
    # a paragraph's mark does not reach past a blank line
    (lambda t: _plant(t, "        dist.all_reduce(votes, op=dist.ReduceOp.MAX)  # DDP: MAX: one "
                         "rank's vote stops them all\n", "\n        torch.manual_seed(2)\n"),
     "torch.manual_seed(2)"),
    # a plain comment is not a reason
    (lambda t: _plant(t, "        self.opt.zero_grad(set_to_none=True)\n",
                      "        # zero the gradients first\n"), "# zero the gradients first"),
    # a bare mark, without its reason
    (lambda t: t.replace("# DDP: the sum of every rank's losses", "# DDP"),
     "dist.all_reduce(loss_sum)"),
    # a marked def covers only a function that the diff adds whole
    (lambda t: _plant(t.replace("    def run_step(self, x, y, step):\n",
                                "    def run_step(self, x, y, step):  # DDP: the step\n"),
                      "        self.sched.step()\n", "        torch.manual_seed(1)\n"),
     "torch.manual_seed(1)"),
])
def test_the_check_finds_an_unmarked_line(mutate, expected):
    mutant = mutate(DDP_LAB.read_text())
    assert mutant != DDP_LAB.read_text()
    bad = unmarked(SINGLE.read_text(), mutant)
    assert any(expected in line for line in bad), bad


def test_the_notebooks_diff_counts_what_it_shows():
    """dpcourse.explore.diffs: the counts above the diff are those of the diff shown, and a mark
    whose label alone changed (DDP → Horovod, the same reason) is no change."""
    from dpcourse.explore.diffs import diff_counts, diff_lines

    before = ["a", "x = 1  # DDP: why", "b", "old"]
    after = ["a", "x = 1  # Horovod: why", "c  # Horovod: new", "b"]
    lines, n = diff_lines(before, after), diff_counts(before, after)
    assert (n["added"], n["removed"], n["marks"]) == (1, 1, 1)
    assert [line for line in lines if line[:1] in "+-"] == ["+c  # Horovod: new", "-old"]
    assert " x = 1  # Horovod: why" in lines  # unchanged, shown as the lab after has it


def test_changed_lines_are_the_diff():
    assert changed_lines("a\nb\nc\n", "a\nB\nc\nd\n") == {2, 4}
    assert changed_lines("a\nb\n", "a\nb\n") == set()


@pytest.mark.slow
def test_one_process_trains_the_same_weights(tmp_path, fashion_root):
    """The diff is distribution only: fashion_single.py and fashion_ddp.py on one process (under
    torchrun) give the same weights after 12 steps across an epoch's end, bit for bit."""
    common = ["--deterministic", "--train-images", "640", "--global-batch-size", "64",
              "--epochs", "2", "--max-steps", "12", "--width", "4", "--no-eval"]
    one = run(lab_cmd(1, SINGLE, *common, "--save-model", tmp_path / "single.pt"), timeout=120)
    assert one.returncode == 0, one.stdout + one.stderr
    ddp = run(torchrun_cmd(1, DDP_LAB, *common, "--save-model", tmp_path / "ddp.pt"), timeout=120)
    assert ddp.returncode == 0, ddp.stdout + ddp.stderr
    a, b = (torch.load(tmp_path / f, weights_only=True) for f in ("single.pt", "ddp.pt"))
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"one process, the same options, other weights in: {differ}"
    assert re.search(r"batch 64, lr 0\.15, 10 steps per epoch", one.stdout), one.stdout
