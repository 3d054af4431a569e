"""A lab read as the diff from its twin: what notebook 05 shows of fashion_single.py →
fashion_ddp.py (the lines data parallelism adds, each marked with its reason), and notebook 11 of
fashion_ddp.py → fashion_horovod.py (DDP's lines and Horovod's in their place).

``lab_diff("fashion_single", "fashion_ddp")`` finds both where ``launch.lab`` finds labs (the
learner's own copies in ``labs/``, or ``solutions/labs/``), and returns Markdown that JupyterLab
renders in colour: a line of counts, then the unified diff. The exercise regions' ``### BEGIN/END
SOLUTION`` lines are left out of it, so that the solutions' diff reads as the learner's will once
the exercises are done.
"""
from __future__ import annotations

import difflib
import re

from dpcourse.explore import launch

MARK = re.compile(r"#\s*(DDP|ZeRO(?:-\d)?|FSDP|Horovod):\s*\S")  # as tests/test_marks.py has it


def _lines(name: str) -> list[str]:
    text = launch.lab(name).read_text()
    return [line for line in text.splitlines() if not line.lstrip().startswith("### ")]


def diff_counts(before: list[str], after: list[str]) -> dict:
    """How many lines the diff from ``before`` to ``after`` removes, adds (new or changed) and
    how many of the added carry a mark (``# DDP: …``)."""
    added, removed = [], 0
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, before, after,
                                                        autojunk=False).get_opcodes():
        if tag in ("replace", "delete"):
            removed += i2 - i1
        if tag in ("replace", "insert"):
            added += after[j1:j2]
    return {"removed": removed, "added": len(added),
            "marks": sum(bool(MARK.search(line)) for line in added),
            "lines": (len(before), len(after))}


def lab_diff(before: str, after: str, context: int = 2):
    """The unified diff from lab ``before`` to lab ``after``, as IPython Markdown: its counts, then
    the diff, ``context`` unchanged lines around each change."""
    from IPython.display import Markdown

    a, b = _lines(before), _lines(after)
    n = diff_counts(a, b)
    body = "\n".join(difflib.unified_diff(a, b, f"{before}.py", f"{after}.py", n=context,
                                          lineterm=""))
    head = (f"`{before}.py` {n['lines'][0]} lines → `{after}.py` {n['lines'][1]} lines: "
            f"**{n['added']} lines added or changed**, {n['marks']} of them with a mark "
            f"(`# DDP: …`, `# Horovod: …`); {n['removed']} lines removed or changed.")
    return Markdown(f"{head}\n\n```diff\n{body}\n```")
