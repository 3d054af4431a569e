"""The instructor's live view of a room: who is stuck where.

Each learner's ``make check ROOM=DIR`` (or ``python -m dpcourse.course check --room DIR``, or
$DPCOURSE_ROOM) leaves one small record per exercise in DIR, a folder on a file system that the
instructor and the learners share. The instructor reads the room with

    python -m dpcourse.course room DIR                    # a table in the terminal
    python -m dpcourse.course room DIR --html room.html   # a page that reloads itself every 15 s

which shows a grid of learner × exercise, how many pass each exercise, and the failure messages that
most learners meet.

What a record holds, and nothing else: the learner (the Unix user name), the notebook, the exercise,
the verdict (pass, fails, not done yet, not checked), the failure's one-line message, and the time.
The records stay in the folder the instructor chose; nothing is sent anywhere. Each learner writes
only under DIR/<user>/, one file per exercise, replaced whole (never half-written) at each check.
Writing never fails a learner's check: a record that cannot be written gives one warning line.
"""
from __future__ import annotations

import argparse
import getpass
import html
import json
import os
import re
import sys
import time
from collections import Counter
from pathlib import Path

ENV = "DPCOURSE_ROOM"
VERDICTS = ("pass", "fails", "not done yet", "not checked")
MARK = {"pass": "✓", "fails": "✗", "not done yet": "…", "not checked": "○"}
MESSAGE_CHARS = 300  # a failure's one line, as make check prints it, cut here


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower() or "check"


def verdict_of(mark: str, text: str) -> tuple[str, str, str]:
    """(exercise, verdict, message) from one line of ``check_results``: ("✗", "exercise 3 — the DDP
    lines — fails: AssertionError: ...")."""
    exercise = text.split(" — ", 1)[0].strip()
    said = text.rsplit(" — ", 1)[-1]
    if mark == "✓":
        return exercise, "pass", ""
    if said.startswith("fails: "):
        return exercise, "fails", said[len("fails: "):][:MESSAGE_CHARS]
    if mark == "○" or said.startswith("not checked"):
        return exercise, "not checked", said[:MESSAGE_CHARS]
    return exercise, "not done yet", ""


def record(room: str | os.PathLike, notebook: str, exercise: str, verdict: str, message: str = "",
           learner: str | None = None, when: float | None = None) -> str | None:
    """Write one learner's record of one exercise into ``room``; None once written, else the
    one-line warning to print. It never raises: a room that cannot be written must not fail a
    learner's check."""
    learner = learner or getpass.getuser()
    entry = {"learner": learner, "notebook": notebook, "exercise": exercise, "verdict": verdict,
             "message": message[:MESSAGE_CHARS], "time": round(when or time.time(), 3)}
    try:
        folder = Path(room) / _slug(learner)
        folder.mkdir(parents=True, exist_ok=True)
        folder.chmod(0o755)  # the instructor reads it, whatever the learner's umask (077 in a job)
        path = folder / f"{_slug(notebook)}.{_slug(exercise)}.json"
        tmp = folder / f".{path.name}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(entry))
        tmp.chmod(0o644)
        os.replace(tmp, path)  # whole or not at all: the view never reads half a record
        return None
    except Exception as err:  # noqa: BLE001 - whatever stops the write, the learner's check goes on
        return (f"warning: could not write this check's record into the room {room} "
                f"({type(err).__name__}: {err}); your check itself is not affected.")


def _owner(path: Path) -> str | None:
    """The user name of the file's owner, or None when root wrote it (the instructor's own tools)
    or the owner has no name here. In a room folder anyone may write (mode 1777), a learner could
    otherwise write records in another learner's name."""
    import pwd

    uid = path.stat().st_uid
    if uid == 0:
        return None
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return None


def read_room(room: str | os.PathLike) -> tuple[list[dict], list[str]]:
    """(records, problems): every record in ``room``; a file that is damaged or not a record is
    skipped, and named in ``problems``."""
    records, problems = [], []
    for path in sorted(Path(room).glob("*/*.json")):
        try:
            entry = json.loads(path.read_text())
            if not isinstance(entry, dict) \
                    or not {"learner", "notebook", "exercise", "verdict"} <= entry.keys() \
                    or entry["verdict"] not in VERDICTS:
                raise ValueError("not a record")
            if (owner := _owner(path)) not in (None, entry["learner"]):
                raise ValueError(f"written by {owner}, not by {entry['learner']}")
            records.append(entry)
        except (OSError, ValueError) as err:  # json.JSONDecodeError is a ValueError
            problems.append(f"{path.relative_to(room)}: skipped "
                            f"({type(err).__name__}: {str(err)[:80]})")
    return records, problems


def summary(records: list[dict]) -> dict:
    """The room: ``learners``, ``exercises`` (notebook, exercise), the ``grid`` {learner: {exercise:
    record}}, ``passing`` {exercise: how many pass}, and ``failures``: the most common failure
    messages, [(message, learners, exercises)], most learners first."""
    exercises = sorted({(r["notebook"], r["exercise"]) for r in records})
    grid: dict[str, dict] = {}
    for r in sorted(records, key=lambda r: r.get("time", 0)):  # the latest record of each wins
        grid.setdefault(r["learner"], {})[(r["notebook"], r["exercise"])] = r
    passing = {ex: sum(1 for row in grid.values() if row.get(ex, {}).get("verdict") == "pass")
               for ex in exercises}
    who, where = Counter(), {}
    for learner, row in grid.items():
        for ex, r in row.items():
            if r["verdict"] == "fails" and r.get("message"):
                who[r["message"]] += 1
                where.setdefault(r["message"], set()).add(f"{ex[0][:2]} {ex[1]}")
    failures = [(message, n, sorted(where[message])) for message, n in who.most_common()]
    return {"learners": sorted(grid), "exercises": exercises, "grid": grid, "passing": passing,
            "failures": failures}


def _label(ex: tuple[str, str]) -> str:
    return f"{ex[0][:2]} {ex[1].replace('exercise ', 'ex')}"


def text(records: list[dict], problems: list[str], top: int = 5) -> str:
    """The room as plain text: the grid, each exercise's passes, the commonest failures."""
    s = summary(records)
    if not s["learners"]:
        return "No records in this room yet: learners write them with make check " \
               "ROOM=<this folder>.\n" + \
               "".join(f"! {p}\n" for p in problems)
    labels = [_label(ex) for ex in s["exercises"]]
    width = max(len(name) for name in s["learners"] + ["learner"])
    lines = [f"{'learner':<{width}}  " + "  ".join(f"{label:>6}" for label in labels)]
    for learner in s["learners"]:
        row = s["grid"][learner]
        cells = [MARK[row[ex]["verdict"]] if ex in row else "·" for ex in s["exercises"]]
        lines.append(f"{learner:<{width}}  " + "  ".join(f"{c:>6}" for c in cells))
    lines.append(f"({MARK['pass']} pass, {MARK['fails']} fails, "
                 f"{MARK['not done yet']} not done yet, "
                 f"{MARK['not checked']} not checked, · no check yet)")
    lines.append("")
    n = len(s["learners"])
    lines += [f"{_label(ex):>8}: {s['passing'][ex]} of {n} pass" for ex in s["exercises"]]
    if s["failures"]:
        lines += ["", "Most common failures:"]
        lines += [f"  {count} learner{'s' * (count > 1)} ({', '.join(where)}): {message}"
                  for message, count, where in s["failures"][:top]]
    lines += [f"! {p}" for p in problems]
    return "\n".join(lines) + "\n"


def page(records: list[dict], problems: list[str], refresh_s: int = 15, top: int = 5) -> str:
    """The room as an HTML page that reloads itself every ``refresh_s`` seconds."""
    s, esc = summary(records), html.escape
    colours = {"pass": "#c8f0c8", "fails": "#f6c1c1", "not done yet": "#fbe9b7",
               "not checked": "#e4e4e4"}
    head = "".join(f"<th>{esc(_label(ex))}<br>"
                   f"<small>{s['passing'][ex]} of {len(s['learners'])} pass</small></th>"
                   for ex in s["exercises"])
    rows = []
    for learner in s["learners"]:
        row = s["grid"][learner]
        cells = []
        for ex in s["exercises"]:
            r = row.get(ex)
            if r is None:
                cells.append("<td></td>")
            else:
                tip = esc(r.get("message") or r["verdict"])
                cells.append(f'<td style="background:{colours[r["verdict"]]}" title="{tip}">'
                             f'{MARK[r["verdict"]]}</td>')
        rows.append(f"<tr><th>{esc(learner)}</th>{''.join(cells)}</tr>")
    failures = "".join(f"<li><b>{count}</b> learner{'s' * (count > 1)} ({esc(', '.join(where))}): "
                       f"<code>{esc(message)}</code></li>"
                       for message, count, where in s["failures"][:top])
    skipped = "".join(f"<li>{esc(p)}</li>" for p in problems)
    return f"""<!doctype html><html><head>\
<meta charset="utf-8"><meta http-equiv="refresh" content="{refresh_s}">
<title>The room: {len(s['learners'])} learners</title>
<style>body{{font-family:sans-serif;margin:1.5em}} table{{border-collapse:collapse}}
td,th{{border:1px solid #bbb;padding:.3em .6em;text-align:center}} \
tr th:first-child{{text-align:left}}</style></head>
<body><h2>The room: {len(s['learners'])} learners, {len(s['exercises'])} exercises</h2>
<p>{MARK['pass']} pass, {MARK['fails']} fails (hover for the message), \
{MARK['not done yet']} not done yet,
{MARK['not checked']} not checked, empty: no check yet. \
Updated {time.strftime('%H:%M:%S')}; reloads every {refresh_s} s.</p>
<table><tr><th>learner</th>{head}</tr>{''.join(rows)}</table>
<h3>Most common failures</h3><ul>{failures or '<li>none</li>'}</ul>
{f'<h3>Skipped files</h3><ul>{skipped}</ul>' if skipped else ''}</body></html>
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dpcourse.course room",
                                description=__doc__.split("\n")[0])
    p.add_argument("room", type=Path,
                   help="the room's folder (what the learners give make check as ROOM)")
    p.add_argument("--html", type=Path, default=None,
                   help="also write the page here (it reloads itself)")
    p.add_argument("--every", type=float, default=None, metavar="S",
                   help="rewrite the view every S seconds")
    args = p.parse_args(argv)
    if not args.room.is_dir():
        print(f"No room at {args.room}: create it (mkdir -m 1777 {args.room}, on a file system "
              "the learners share) and give it to the learners as make check ROOM=...",
              file=sys.stderr)
        return 1
    while True:
        records, problems = read_room(args.room)
        print(text(records, problems), flush=True)
        if args.html:
            args.html.write_text(page(records, problems))
        if not args.every:
            return 0
        time.sleep(args.every)


if __name__ == "__main__":
    sys.exit(main())
