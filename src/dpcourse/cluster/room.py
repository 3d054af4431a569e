"""The instructor's live view of a room: who is stuck where.

Each learner's ``make check ROOM=DIR`` (or ``python -m dpcourse.kit.course check --room DIR``, or
$DPCOURSE_ROOM) leaves one small record per exercise in DIR, a folder on a file system that the
instructor and the learners share. The instructor (as root) makes the room once, then reads it:

    # as root: DIR, one folder a learner
    python -m dpcourse.kit.course room DIR --setup --group GROUP
    python -m dpcourse.kit.course room DIR                   # a table in the terminal
    python -m dpcourse.kit.course room DIR --html room.html  # a page that reloads itself every 15 s

which shows a grid of learner × exercise, how many pass each exercise, and the failure messages that
most learners meet.

What a record holds, and nothing else: the learner (the Unix user name), the notebook, the exercise,
the verdict (pass, fails, not done yet, not checked), the failure's one-line message, and the time.
The records stay in the folder the instructor chose; nothing is sent anywhere.

Who may do what. The set-up makes DIR root's (mode 0711: anyone may pass through it, only root
may list it; 0751 and group READERS with --readers-group READERS) and in it DIR/<user>, the
learner's own folder (owned by the learner, group root or READERS, mode 2750). A learner writes
only into their own folder, one file per exercise (mode 0640), replaced whole (never half-written)
at each check; no learner can read another's records. The view is read by root, or by a member of
READERS.

The view trusts nothing in DIR: it never follows a link, opens a record only when it is a regular
file of at most RECORD_BYTES bytes in the folder of the learner it names and owned by that learner
(or by root: the instructor's own tools), reads at most that much, checks every field's type and
length, and takes control characters and bidi overrides out of every text it shows (the page also
escapes HTML). Anything else is skipped and named under the grid; one bad file never stops the view.
Writing never fails a learner's check: a record that cannot be written gives one warning line.
"""
from __future__ import annotations

import argparse
import getpass
import grp
import html
import json
import math
import os
import pwd
import re
import stat
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ENV = "DPCOURSE_ROOM"
VERDICTS = ("pass", "fails", "not done yet", "not checked")
MARK = {"pass": "✓", "fails": "✗", "not done yet": "…", "not checked": "○"}
MESSAGE_CHARS = 300  # a failure's one line, as make check prints it, cut here
# the longest each text field of a record may be (characters); a record's file at most RECORD_BYTES
FIELD_CHARS = {"learner": 64, "notebook": 120, "exercise": 120, "message": MESSAGE_CHARS}
RECORD_BYTES = 4096
FOLDER_FILES = 1000  # entries read in one learner's folder: one file per exercise is far fewer
FOLDER_PROBLEMS = 20  # problems named for one folder; the rest counted
# a user name that can be a folder's name as it is: no "/", no leading "." or "-"
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.@-]{0,63}")
# what never reaches the instructor's terminal or page: C0 controls and DEL, C1 controls (ESC's
# 8-bit forms among them), bidi marks, overrides and isolates, and lone surrogates (they cannot be
# printed in UTF-8)
_SPACES = re.compile("[\t\n\r\v\f\u2028\u2029]")
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069"
                     "\ud800-\udfff]")
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK


def clean(value) -> str:
    """``value`` as text that is safe in a terminal: line breaks and tabs become spaces, other
    control characters, bidi overrides and isolates become "?"."""
    return _UNSAFE.sub("?", _SPACES.sub(" ", str(value)))


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower()[:100] or "check"


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def _uid(name: str) -> int | None:
    try:
        return pwd.getpwnam(name).pw_uid
    except KeyError:
        return None


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


class _NotWritten(Exception):
    """Why record() wrote nothing, in words for the learner."""


def _own_folder(room, name: str) -> int:
    """An open descriptor of ``room``/``name``, the learner's own folder: a real folder (never a
    link) owned by this process's user. When it is missing it is made (mode 0750); nothing that
    exists is changed."""
    try:  # O_PATH: a learner may pass through the room, not list it
        top = os.open(room, getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY)
    except FileNotFoundError:
        raise _NotWritten("there is no such folder: ask the instructor for the room's "
                          "folder") from None
    except PermissionError:
        raise _NotWritten("you may not enter that folder: ask the instructor to run the room's "
                          "set-up (python -m dpcourse.kit.course room DIR --setup)") from None
    try:
        try:
            st = os.stat(name, dir_fd=top, follow_symlinks=False)
        except FileNotFoundError:
            try:
                os.mkdir(name, 0o700, dir_fd=top)
            except PermissionError:
                raise _NotWritten(f"you have no folder there ({name}/) and may not make one: ask "
                                  "the instructor to run the room's set-up (python -m "
                                  "dpcourse.kit.course room DIR --setup)") from None
            fd = os.open(name, _DIR, dir_fd=top)
            os.fchmod(fd, 0o750)  # its own new folder: the instructor reads it, not the others
            return fd
        if stat.S_ISLNK(st.st_mode):
            raise _NotWritten(f"{name} there is a link, not your folder: nothing was written; "
                              "tell the instructor")
        if not stat.S_ISDIR(st.st_mode):
            raise _NotWritten(f"{name} there is not a folder: nothing was written; "
                              "tell the instructor")
        if st.st_uid != os.geteuid():
            raise _NotWritten(f"the folder {name}/ there belongs to {_user(st.st_uid)}, not to "
                              "you: nothing was written; tell the instructor")
        fd = os.open(name, _DIR, dir_fd=top)  # O_NOFOLLOW: the folder just looked at, or nothing
        st = os.fstat(fd)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            os.close(fd)
            raise _NotWritten(f"the folder {name}/ there changed while it was opened: nothing "
                              "was written; tell the instructor")
        return fd
    finally:
        os.close(top)


def record(room: str | os.PathLike, notebook: str, exercise: str, verdict: str, message: str = "",
           learner: str | None = None, when: float | None = None) -> str | None:
    """Write one learner's record of one exercise into ``room``/<learner>/; None once written, else
    the one-line warning to print. It never raises: a room that cannot be written must not fail a
    learner's check. It writes only into a real folder (not a link) that this user owns, never
    follows a link, and changes the mode of nothing it did not make itself."""
    try:
        if learner is None:
            try:
                learner = pwd.getpwuid(os.geteuid()).pw_name
            except KeyError:
                learner = getpass.getuser()
        if not _NAME.fullmatch(learner):
            raise _NotWritten(f"the user name {learner!r} cannot name a folder")
        entry = {"learner": learner, "notebook": notebook[:FIELD_CHARS["notebook"]],
                 "exercise": exercise[:FIELD_CHARS["exercise"]], "verdict": verdict,
                 "message": message[:MESSAGE_CHARS], "time": round(when or time.time(), 3)}
        data = json.dumps(entry, ensure_ascii=False).encode("utf-8", "replace")
        folder = _own_folder(room, learner)
        try:
            name = f"{_slug(notebook)}.{_slug(exercise)}.json"
            tmp = f".{name}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o640,
                         dir_fd=folder)
            try:
                try:
                    os.fchmod(fd, 0o640)  # its own new file, whatever the umask (077 in a job)
                    while data:
                        data = data[os.write(fd, data):]
                finally:
                    os.close(fd)
                # whole or not at all: the view never reads half a record
                os.replace(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)
            except BaseException:
                try:
                    os.unlink(tmp, dir_fd=folder)
                except OSError:
                    pass
                raise
        finally:
            os.close(folder)
        return None
    except Exception as err:  # noqa: BLE001 - whatever stops the write, the learner's check goes on
        why = err if isinstance(err, _NotWritten) else f"{type(err).__name__}: {err}"
        return (f"warning: could not write this check's record into the room {room} "
                f"({why}); your check itself is not affected.")


def _entry(data: bytes, folder: str) -> dict:
    """The record in ``data``, found in ``folder``, with every field checked; ValueError if it is
    not one."""
    entry = json.loads(data.decode("utf-8"))
    if not isinstance(entry, dict):
        raise ValueError("not a record")
    out = {}
    for key, most in FIELD_CHARS.items():
        value = entry.get(key, "" if key == "message" else None)
        if not isinstance(value, str):
            raise ValueError(f"not a record: its {key} is {type(value).__name__}, not text")
        if len(value) > most:
            raise ValueError(f"not a record: its {key} is longer than {most} characters")
        out[key] = clean(value)
    if entry["learner"] != folder:
        raise ValueError(f"names {clean(entry['learner'])}, in {folder}'s folder")
    verdict = entry.get("verdict")
    if not isinstance(verdict, str) or verdict not in VERDICTS:
        raise ValueError(f"not a record: its verdict is not one of {', '.join(VERDICTS)}")
    out["verdict"] = verdict
    when = entry.get("time", 0)
    try:
        if isinstance(when, bool) or not isinstance(when, (int, float)):
            raise TypeError
        when = float(when)
        if not math.isfinite(when):
            raise ValueError
    except (TypeError, ValueError, OverflowError):
        raise ValueError("not a record: its time is not a number of seconds") from None
    out["time"] = when
    return out


def _read_record(name: str, folder_fd: int, folder: str, owners: tuple[int, ...]) -> dict:
    """One record file, opened without following a link and without waiting (a FIFO), read only
    when it is a small regular file with one name, owned by ``owners``."""
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY, dir_fd=folder_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("not a regular file")
        if st.st_nlink != 1:
            raise ValueError("a file with other names too (a hard link)")
        if st.st_uid not in owners:
            raise ValueError(f"written by {_user(st.st_uid)}, not by {folder}")
        if st.st_size > RECORD_BYTES:
            raise ValueError(f"{st.st_size} bytes, more than a record's {RECORD_BYTES}")
        data = b""
        while len(data) <= RECORD_BYTES:  # at most RECORD_BYTES + 1, whatever its size says
            chunk = os.read(fd, RECORD_BYTES + 1 - len(data))
            if not chunk:
                break
            data += chunk
        if len(data) > RECORD_BYTES:
            raise ValueError(f"more than a record's {RECORD_BYTES} bytes")
    finally:
        os.close(fd)
    return _entry(data, folder)


def _read_folder(room_fd: int, folder: str, records: list, problems: list) -> None:
    """The records in one learner's folder, appended to ``records``; what is skipped, named in
    ``problems``."""
    said = []

    def skip(what: str, why) -> None:
        said.append(f"{what}: skipped ({clean(why)[:160]})")

    try:
        fd = os.open(folder, _DIR, dir_fd=room_fd)
    except OSError as err:
        problems.append(f"{folder}/: skipped ({type(err).__name__}: {err.strerror})")
        return
    try:
        st = os.fstat(fd)
        uid = _uid(folder)
        if not stat.S_ISDIR(st.st_mode):
            problems.append(f"{folder}/: skipped (not a folder)")
            return
        if st.st_uid != 0 and uid is None:
            problems.append(f"{folder}/: skipped (no user has that name; the folder belongs to "
                            f"{_user(st.st_uid)})")
            return
        if st.st_uid not in (0, uid):
            problems.append(f"{folder}/: skipped (a folder in {folder}'s name that belongs to "
                            f"{_user(st.st_uid)}; look at it, remove it and run the set-up "
                            "again)")
            return
        owners = (0,) if uid is None else (0, uid)
        names, more = [], False
        with os.scandir(fd) as entries:
            for n, e in enumerate(entries):
                if n == FOLDER_FILES:
                    more = True
                    break
                if e.name.endswith(".json"):
                    names.append(e)
        for e in sorted(names, key=lambda e: e.name):
            where = f"{folder}/{e.name}"
            try:
                if e.is_symlink():
                    raise ValueError("a link")
                if not e.is_file(follow_symlinks=False):
                    raise ValueError("not a regular file")
                records.append(_read_record(e.name, fd, folder, owners))
            except ValueError as err:  # json.JSONDecodeError and UnicodeDecodeError among them
                skip(where, err if type(err) is ValueError else f"{type(err).__name__}: {err}")
            except Exception as err:  # noqa: BLE001 - one bad file never stops the view
                skip(where, f"{type(err).__name__}: {getattr(err, 'strerror', None) or err}")
        if more:
            said.append(f"{folder}/: more than {FOLDER_FILES} files; only the first were read")
    finally:
        os.close(fd)
    problems += said[:FOLDER_PROBLEMS]
    if len(said) > FOLDER_PROBLEMS:
        problems.append(f"{folder}/: {len(said) - FOLDER_PROBLEMS} more files skipped")


def read_room(room: str | os.PathLike) -> tuple[list[dict], list[str]]:
    """(records, problems): every record in ``room``; a file or folder that is damaged, not a
    record, not where it belongs or not whose it says is skipped, and named in ``problems``.
    OSError when ``room`` itself cannot be read."""
    records, problems = [], []
    top = os.open(room, os.O_RDONLY | os.O_DIRECTORY)  # the instructor's own choice: links followed
    try:
        with os.scandir(top) as found:
            entries = sorted(found, key=lambda e: e.name)
        for e in entries:
            if e.is_symlink():
                problems.append(f"{e.name}: skipped (a link, not a learner's folder)")
            elif not e.is_dir(follow_symlinks=False):
                problems.append(f"{e.name}: skipped (not a folder)")
            else:
                _read_folder(top, e.name, records, problems)
    finally:
        os.close(top)
    return records, [clean(p) for p in problems]


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
    """The room as plain text: the grid, each exercise's passes, the commonest failures. Every line
    passes through clean(): nothing a learner wrote can move the cursor or change the terminal."""
    s = summary(records)
    if not s["learners"]:
        lines = ["No records in this room yet: learners write them with make check "
                 "ROOM=<this folder>."] + [f"! {p}" for p in problems]
        return "".join(f"{clean(line)}\n" for line in lines)
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
    return "".join(f"{clean(line)}\n" for line in lines)


def page(records: list[dict], problems: list[str], refresh_s: int = 15, top: int = 5) -> str:
    """The room as an HTML page that reloads itself every ``refresh_s`` seconds; every text a
    learner wrote passes through clean() and is escaped."""
    s = summary(records)

    def esc(value) -> str:
        return html.escape(clean(value))

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
<meta charset="utf-8"><meta http-equiv="refresh" content="{int(refresh_s)}">
<title>The room: {len(s['learners'])} learners</title>
<style>body{{font-family:sans-serif;margin:1.5em}} table{{border-collapse:collapse}}
td,th{{border:1px solid #bbb;padding:.3em .6em;text-align:center}} \
tr th:first-child{{text-align:left}}</style></head>
<body><h2>The room: {len(s['learners'])} learners, {len(s['exercises'])} exercises</h2>
<p>{MARK['pass']} pass, {MARK['fails']} fails (hover for the message), \
{MARK['not done yet']} not done yet,
{MARK['not checked']} not checked, empty: no check yet. \
Updated {time.strftime('%H:%M:%S')}; reloads every {int(refresh_s)} s.</p>
<table><tr><th>learner</th>{head}</tr>{''.join(rows)}</table>
<h3>Most common failures</h3><ul>{failures or '<li>none</li>'}</ul>
{f'<h3>Skipped files</h3><ul>{skipped}</ul>' if skipped else ''}</body></html>
"""


def _write_page(path: Path, content: str) -> None:
    """``content`` into ``path``, whole: a new file renamed over the old one (the browser never
    reloads half a page, and a link left at ``path`` is replaced, never followed). Its mode is what
    a plain write would give: 0666 less the umask."""
    mask = os.umask(0)
    os.umask(mask)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            os.fchmod(out.fileno(), 0o666 & ~mask)
            out.write(content)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class SetupError(Exception):
    """What the set-up refused to do; ``done`` lists what it did before."""

    def __init__(self, message: str, done: list[str] | None = None):
        super().__init__(message)
        self.done = done or []


def _members(group: str) -> list[str]:
    try:
        g = grp.getgrnam(group)
    except KeyError:
        raise SetupError(f"no group named {group} on this machine") from None
    return list(g.gr_mem) + [p.pw_name for p in pwd.getpwall() if p.pw_gid == g.gr_gid]


def setup(room: str | os.PathLike, group: str | None = None, users=(),
          readers_group: str | None = None) -> list[str]:
    """Make the room (as root): ``room`` itself, root's, mode 0711 (0751 and group
    ``readers_group`` with one), and in it a folder for each learner, ``room``/<user>, owned by
    that learner, group root (or ``readers_group``), mode 2750 (its records take its group). The
    learners: the members of ``group`` (as grp lists them, and the accounts whose primary group
    it is) and ``users``. Run it again to add new learners; it changes nothing that exists.
    Returns what it did, one line each; SetupError (its ``done``: what it did before) when
    something is not as it must be: a ``room`` that others may write or that is not root's, a
    learner's name in it that is a link, not a folder, or another user's folder."""
    if os.geteuid() != 0:
        raise SetupError("the room's set-up runs as root (sudo): it gives each learner a folder "
                         "of their own")
    names = list(users) + (_members(group) if group else [])
    names = sorted(dict.fromkeys(names))
    if not names:
        raise SetupError(f"no learners: the group {group} lists no members on this machine; "
                         "give them by name (--user NAME)" if group else
                         "no learners: give a group (--group GROUP) or user names (--user NAME)")
    if readers_group is not None and readers_group == group:
        raise SetupError(f"--readers-group {readers_group} is the learners' own group: every "
                         "learner would read every record; give the instructors' group")
    if readers_group is not None:
        try:
            readers = grp.getgrnam(readers_group).gr_gid
        except KeyError:
            raise SetupError(f"no group named {readers_group} on this machine") from None
    else:
        readers = 0
    mode = 0o751 if readers_group else 0o711
    room = Path(room)
    done: list[str] = []
    try:
        st = os.lstat(room)
    except FileNotFoundError:
        room.parent.mkdir(parents=True, exist_ok=True)
        os.mkdir(room, 0o700)
        fd = os.open(room, _DIR)
        try:
            os.fchown(fd, 0, readers)
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
        done.append(f"{room}/: made (root's, group {grp.getgrgid(readers).gr_name}, "
                    f"mode {mode:04o})")
    else:
        m = stat.S_IMODE(st.st_mode)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or m & 0o022:
            raise SetupError(f"{room} is there and is not a folder of root's that only root may "
                             f"write (owner {_user(st.st_uid)}, mode {m:04o}): give a new folder, "
                             "or chown root and chmod go-w it (a folder that learners could write "
                             "may hold folders made in another's name)")

        def through(uid, groups, bits):  # may these pass (bits 1) or list and pass (5)
            return (m & bits == bits or st.st_gid in groups and m & bits << 3 == bits << 3
                    or uid == 0)

        learners = [pwd.getpwnam(n) for n in names if _uid(n) is not None]
        if not all(through(u.pw_uid, os.getgrouplist(u.pw_name, u.pw_gid), 1) for u in learners) \
                or readers and not through(-1, (readers,), 5):
            raise SetupError(f"{room} is there with mode {m:04o}: the learners could not pass "
                             "through it" + (" or the readers could not list it" if readers else "")
                             + f"; chmod {mode:04o} it" + (f" and chgrp {readers_group} it"
                                                          if readers else "")
                             + ", or give a new folder")
        done.append(f"{room}/: there already (root's, mode {m:04o}), left as it is")
    refused = []
    top = os.open(room, _DIR)
    try:
        for name in names:
            path = room / name
            uid = _uid(name)
            if uid is None or not _NAME.fullmatch(name):
                refused.append(f"{path}: not made ({name!r} is not a user name that can name a "
                               "folder here)")
                continue
            try:
                st = os.stat(name, dir_fd=top, follow_symlinks=False)
            except FileNotFoundError:
                os.mkdir(name, 0o700, dir_fd=top)
                fd = os.open(name, _DIR, dir_fd=top)
                try:
                    os.fchown(fd, uid, readers)
                    os.fchmod(fd, 0o2750)
                finally:
                    os.close(fd)
                done.append(f"{path}/: made ({name}'s, mode 2750)")
                continue
            if stat.S_ISLNK(st.st_mode):
                what = "a link, not a folder"
            elif not stat.S_ISDIR(st.st_mode):
                what = "not a folder"
            elif st.st_uid != uid:
                what = f"a folder of {_user(st.st_uid)}'s, not of {name}'s"
            else:
                done.append(f"{path}/: there already ({name}'s), left as it is")
                continue
            refused.append(f"{path}: refused, it is {what}: look at it, remove it (rm, not "
                           "rm -r, for a link) and run the set-up again")
    finally:
        os.close(top)
    if refused:
        raise SetupError("\n".join(clean(r) for r in refused), done)
    return done


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m dpcourse.kit.course room", description=__doc__.split("\n")[0],
        epilog="The view reads the learners' folders: run it as root (sudo) or, when the set-up "
               "was given --readers-group READERS, as a member of READERS. The learners never "
               "read one another's records.")
    p.add_argument("room", type=Path,
                   help="the room's folder (what the learners give make check as ROOM)")
    p.add_argument("--html", type=Path, default=None,
                   help="also write the page here (it reloads itself; it shows every learner's "
                        "records: keep it where only you read it)")
    p.add_argument("--every", type=float, default=None, metavar="S",
                   help="rewrite the view every S seconds")
    s = p.add_argument_group("the set-up (as root, once before the workshop; again to add "
                             "learners)")
    s.add_argument("--setup", action="store_true",
                   help="make the room: the folder (root's, mode 0711: learners pass through, "
                        "only root lists it; 0751 with --readers-group) and in it a folder of "
                        "their own for each learner (theirs, mode 2750); it changes nothing that "
                        "is already there")
    s.add_argument("--group", metavar="GROUP",
                   help="the learners: the members of this Unix group (and the accounts whose "
                        "primary group it is)")
    s.add_argument("--user", action="append", default=[], metavar="NAME",
                   help="a learner by user name (again for more)")
    s.add_argument("--readers-group", metavar="READERS",
                   help="who may read the room besides root: this group's members, the "
                        "instructors (not the learners' group)")
    args = p.parse_args(argv)
    if args.setup:
        try:
            for line in setup(args.room, args.group, args.user, args.readers_group):
                print(line)
        except SetupError as err:
            for line in err.done:
                print(line)
            print(err, file=sys.stderr)
            return 1
        except OSError as err:
            print(f"the set-up stopped: {err} (a file system that maps root to nobody, NFS's "
                  "root_squash, needs its set-up where root is root)", file=sys.stderr)
            return 1
        print(f"The learners give make check ROOM={args.room}; the view: python -m "
              f"dpcourse.kit.course room {args.room} (as root"
              + (f" or a member of {args.readers_group})" if args.readers_group else ")"))
        return 0
    if args.group or args.user or args.readers_group:
        p.error("--group, --user and --readers-group belong to --setup")
    if not args.room.is_dir():
        print(f"No room at {args.room}: make it (as root, on a file system the learners share) "
              f"with python -m dpcourse.kit.course room {args.room} --setup --group GROUP, "
              "and give it to the learners as make check ROOM=...", file=sys.stderr)
        return 1
    while True:
        try:
            records, problems = read_room(args.room)
        except OSError as err:
            print(f"cannot read the room {args.room} ({type(err).__name__}: {err.strerror}): run "
                  "the view as root (sudo), or as a member of the room's readers group",
                  file=sys.stderr)
            if not args.every:
                return 1
        else:
            print(text(records, problems), flush=True)
            if args.html:
                _write_page(args.html, page(records, problems))
        if not args.every:
            return 0
        time.sleep(args.every)


if __name__ == "__main__":
    sys.exit(main())
