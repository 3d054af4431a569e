"""A lab read as the diff from its twin: what notebook 05 shows of fashion_single.py →
fashion_ddp.py (the lines data parallelism adds, each marked with its reason), and notebook 11 of
fashion_ddp.py → fashion_horovod.py (DDP's lines and Horovod's in their place).

``lab_diff("fashion_single", "fashion_ddp")`` finds both where ``launch.lab`` finds labs (the
learner's own copies in ``labs/``, or ``solutions/labs/``) and returns HTML that a notebook shows
in colour, in a box that scrolls: a line of counts, then the unified diff. The exercise regions'
``### BEGIN/END SOLUTION`` lines are left out, so that the solutions' diff reads as the learner's
will once the exercises are done; a line whose only change is its mark's label (``# DDP:`` →
``# Horovod:``, the same reason) counts as unchanged.
"""
from __future__ import annotations

import difflib
import html
import re

from dpcourse.explore import launch

MARK = re.compile(r"#\s*(DDP|ZeRO(?:-\d)?|FSDP|Horovod):\s*\S")  # as tests/test_marks.py has it
LABEL = re.compile(r"#\s*(DDP|ZeRO(?:-\d)?|FSDP|Horovod):")
COLOURS = {"+": "#e6ffec", "-": "#ffebe9", "@": "#ddf4ff", " ": "transparent"}


def _lines(name: str) -> list[str]:
    text = launch.lab(name).read_text()
    return [line for line in text.splitlines() if not line.lstrip().startswith("### ")]


def _matcher(before: list[str], after: list[str]) -> difflib.SequenceMatcher:
    """Lines compared with their marks' labels made alike: a label swapped is no change."""
    same = [LABEL.sub("# mark:", line) for line in before]
    return difflib.SequenceMatcher(None, same, [LABEL.sub("# mark:", line) for line in after],
                                   autojunk=False)


def diff_counts(before: list[str], after: list[str]) -> dict:
    """How many lines the diff from ``before`` to ``after`` removes and adds (new or changed), and
    how many of the added carry a mark of their own (``# DDP: …``) — from the diff ``lab_diff``
    shows."""
    added, removed = [], 0
    for tag, i1, i2, j1, j2 in _matcher(before, after).get_opcodes():
        if tag in ("replace", "delete"):
            removed += i2 - i1
        if tag in ("replace", "insert"):
            added += after[j1:j2]
    return {"removed": removed, "added": len(added),
            "marks": sum(bool(MARK.search(line)) for line in added),
            "lines": (len(before), len(after))}


def diff_lines(before: list[str], after: list[str], context: int = 2) -> list[str]:
    """The unified diff, as difflib writes it ("@@", "-", "+", " "), of the same matcher that
    ``diff_counts`` counts; an unchanged line is shown as ``after`` has it."""
    out = []
    for group in _matcher(before, after).get_grouped_opcodes(context):
        (_, i1, _, j1, _), (_, _, i2, _, j2) = group[0], group[-1]
        out.append(f"@@ -{i1 + 1},{i2 - i1} +{j1 + 1},{j2 - j1} @@")
        for tag, a1, a2, b1, b2 in group:
            if tag == "equal":
                out += [" " + line for line in after[b1:b2]]
                continue
            out += ["-" + line for line in before[a1:a2]]
            out += ["+" + line for line in after[b1:b2]]
    return out


def lab_diff(before: str, after: str, context: int = 2, height: str = "36em"):
    """The diff from lab ``before`` to lab ``after`` as IPython HTML: its counts, then the
    unified diff with added lines green and removed ones red, ``context`` unchanged lines around
    each change, in a box ``height`` high that scrolls."""
    from IPython.display import HTML

    a, b = _lines(before), _lines(after)
    n = diff_counts(a, b)
    rows = "".join(f'<div style="background:{COLOURS[line[:1] or " "]}">'
                   f"{html.escape(line) or '&nbsp;'}</div>" for line in diff_lines(a, b, context))
    head = (f"<p><code>{before}.py</code> {n['lines'][0]} lines → <code>{after}.py</code> "
            f"{n['lines'][1]} lines: <b>{n['added']} lines added or changed</b>, {n['marks']} of "
            f"them with a mark of their own; {n['removed']} lines removed or changed.</p>")
    box = (f'<div style="max-height:{height};overflow:auto;font-family:monospace;'
           f'white-space:pre;font-size:12px;border:1px solid #d0d7de">{rows}</div>')
    return HTML(head + box)
