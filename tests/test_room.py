"""The instructor's live view of a room (issues 28 and 42): make check ROOM=DIR leaves one record
per exercise, `python -m dpcourse.kit.course room DIR` shows the room. A room of simulated learners,
a damaged and a half-written record among theirs, a room that cannot be written, and make check's
own writing; then, as root, real local accounts in a room made by the set-up, and what a learner
can leave in a room to stop, flood, fool or hijack the instructor's view or another learner's
check."""
import json
import os
import secrets
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import nbformat
import pytest

from conftest import ROOT
from dpcourse.cluster import hub, room

MESSAGE = ("AssertionError: the evaluation counted 5000 test images, not 10,000: "
           "sum the totals over all ranks")
OTHER = ("AssertionError: epoch 1 began with the same images as epoch 0: "
         "does the lab call sampler.set_epoch(epoch)?")


@pytest.fixture
def classroom(tmp_path):
    """Five learners at notebook 05 (exercises 1-3) and one at 06;
    two damaged files among theirs."""
    where = tmp_path / "room"
    where.mkdir()  # the instructor's (the set-up, as root, in a real room)
    answers = {"ada": ("pass", "pass", "pass"), "bob": ("pass", "pass", "fails"),
               "cy": ("pass", "not done yet", "fails"), "dee": ("pass", "fails", "not done yet"),
               "eve": ("not done yet", "not done yet", "not done yet")}
    messages = {"bob": MESSAGE, "cy": MESSAGE, "dee": OTHER}
    for t, (learner, verdicts) in enumerate(answers.items()):
        for n, verdict in enumerate(verdicts, 1):
            message = messages[learner] if verdict == "fails" else ""
            assert room.record(where, "05_one_process_to_ddp", f"exercise {n}", verdict, message,
                               learner=learner, when=1000.0 + t) is None
    assert room.record(where, "06_data_sharding", "exercise 3", "pass", learner="ada") is None
    (where / "bob" / "05-one-process-to-ddp.exercise-9.json").write_text("{not json")  # damaged
    # written halfway
    (where / "cy" / "06-data-sharding.exercise-1.json").write_text('{"learner": "cy", "notebo')
    return where


def test_the_room_shows_the_grid_the_passes_and_the_commonest_failures(classroom):
    records, problems = room.read_room(classroom)
    assert len(records) == 16 and len(problems) == 2, problems
    assert all("skipped" in p for p in problems) and any("exercise-9" in p for p in problems)
    s = room.summary(records)
    assert s["learners"] == ["ada", "bob", "cy", "dee", "eve"]
    assert s["passing"][("05_one_process_to_ddp", "exercise 3")] == 1
    assert s["passing"][("05_one_process_to_ddp", "exercise 1")] == 4
    # the message two learners meet comes first
    assert s["failures"][0] == (MESSAGE, 2, ["05 exercise 3"])
    shown = room.text(records, problems)
    assert "05 ex3: 1 of 5 pass" in shown and "2 learners (05 exercise 3): " + MESSAGE in shown
    # bob has not reached notebook 06
    assert shown.splitlines()[2].split() == ["bob", "✓", "✓", "✗", "·"]
    assert shown.count("skipped") == 2
    html = room.page(records, problems, refresh_s=15)
    assert ('http-equiv="refresh" content="15"' in html and "1 of 5 pass" in html
            and "sum the totals" in html)


def test_a_later_check_replaces_the_learners_record(classroom):
    assert room.record(classroom, "05_one_process_to_ddp", "exercise 3", "pass", learner="bob",
                       when=2000.0) is None
    records, _ = room.read_room(classroom)
    s = room.summary(records)
    assert s["passing"][("05_one_process_to_ddp", "exercise 3")] == 2
    assert s["failures"][0] == (MESSAGE, 1, ["05 exercise 3"])
    assert len(list((classroom / "bob").glob("*.tmp"))) == 0  # written whole, then renamed


def test_a_room_that_cannot_be_written_gives_one_warning_and_never_raises(tmp_path):
    not_a_folder = tmp_path / "room"
    not_a_folder.write_text("a file, not a folder")
    warning = room.record(not_a_folder, "05_one_process_to_ddp", "exercise 1", "pass",
                          learner="ada")
    assert (warning.startswith("warning: could not write") and "not affected" in warning
            and "\n" not in warning)


def test_the_room_command_prints_the_view_and_writes_the_page(classroom, tmp_path):
    page = tmp_path / "room.html"
    done = subprocess.run([sys.executable, "-m", "dpcourse.kit.course", "room", str(classroom),
                           "--html", str(page)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert ("5 pass" in done.stdout and "Most common failures:" in done.stdout
            and page.read_text().startswith("<!doctype"))
    missing = subprocess.run([sys.executable, "-m", "dpcourse.kit.course", "room",
                              str(tmp_path / "none")],
                             cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert missing.returncode == 1 and "--setup --group GROUP" in missing.stderr


def _tiny_notebook(folder):
    """A learner's notebook with one exercise that passes and one that fails its check."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("answer = 41", metadata={}),
                nbformat.v4.new_code_cell("# CHECK: exercise 1 — the sum\nassert 1 + 1 == 2",
                                          metadata={"tags": ["check"]}),
                nbformat.v4.new_code_cell("# CHECK: exercise 2 — the answer\n"
                                          "assert answer == 42, 'answer is 41, not 42'",
                                          metadata={"tags": ["check"]})]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nbformat.write(nb, folder / "01_tiny.ipynb")


def test_make_checks_verdicts_reach_the_room_and_an_unwritable_room_does_not_fail_the_check(
        tmp_path):
    folder = tmp_path / "mine"
    folder.mkdir()
    _tiny_notebook(folder)
    where = tmp_path / "room"
    where.mkdir()
    cmd = [sys.executable, "-m", "dpcourse.kit.course", "check", str(folder)]
    done = subprocess.run(cmd + ["--room", str(where)], cwd=ROOT, capture_output=True, text=True,
                          timeout=180)
    assert "1 of 2 exercises pass" in done.stdout, done.stdout + done.stderr
    records, problems = room.read_room(where)
    verdicts = {r["exercise"]: (r["verdict"], r["message"]) for r in records}
    assert verdicts == {"exercise 1": ("pass", ""),
                        "exercise 2": ("fails", "AssertionError: answer is 41, not 42")}
    assert not problems and {r["notebook"] for r in records} == {"01_tiny"}
    blocked = tmp_path / "blocked"
    blocked.write_text("a file")
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180,
                           env={**__import__("os").environ, room.ENV: str(blocked)})
    assert again.returncode == done.returncode and "1 of 2 exercises pass" in again.stdout
    assert again.stdout.count("warning: could not write") == 1, again.stdout
    assert json.loads(next(where.glob("*/01-tiny.exercise-2.json")).read_text())["learner"]


def test_a_record_written_under_a_private_umask_is_still_readable_by_the_instructor(tmp_path):
    """A learner's server job runs with umask 077 (dpcourse.cluster.hub): the record must still be
    readable by the readers of the room (the set-up's group), other users: 0640 for the file
    record() makes, 0750 for a folder it makes (the set-up's own folders are 2750)."""
    old = os.umask(0o077)
    try:
        assert room.record(tmp_path, "05_one_process_to_ddp", "1", "pass", learner="ana") is None
    finally:
        os.umask(old)
    folder = tmp_path / "ana"
    assert folder.stat().st_mode & 0o777 == 0o750
    assert all(p.stat().st_mode & 0o777 == 0o640 for p in folder.iterdir())


def test_a_record_in_another_learner_s_name_is_skipped_and_named(tmp_path):
    """A record whose file belongs to one user but sits in another learner's folder (a folder
    made writable, say) is not counted, and is listed under the grid."""
    if os.geteuid() != 0:
        pytest.skip("needs root to write a file as another user")
    assert room.record(tmp_path, "05_one_process_to_ddp", "1", "pass", learner="ana") is None
    forged = tmp_path / "ana" / "05_one_process_to_ddp.2.json"
    forged.write_text(json.dumps({"learner": "ana", "notebook": "05_one_process_to_ddp",
                                  "exercise": "2", "verdict": "pass", "message": "", "time": 1}))
    os.chown(forged, 65534, 65534)  # nobody's file, in ana's name
    records, problems = room.read_room(tmp_path)
    assert [(r["learner"], r["exercise"]) for r in records] == [("ana", "1")]
    assert any("not by ana" in p for p in problems), problems


# --- As root: real learners, the set-up, and what a learner can leave in a room ------------------

SRC = ROOT / "src"
NOTEBOOK = "05_one_process_to_ddp"
# ESC [2J clears the screen, OSC 52 writes the terminal's clipboard, 0x9b is ESC [ in one byte (C1),
# U+202E turns the rest of the line around
HOSTILE = "\x1b[2J\x1b]52;c;ZXZpbA==\x07\x9b31m\u202e"
RECORD = ("print(room.record(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5])"
          " or 'written')")
MAIN = "sys.exit(room.main(sys.argv[1:]))"


def _missing(why: str):
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI runs the room's tests as root, with useradd and setfacl (.ci/run): {why}",
                    pytrace=False)
    pytest.skip(why)


def _unsafe(shown: str) -> list[str]:
    """What in ``shown`` must never reach the instructor's terminal or page: C0 controls but the
    line break, DEL and C1 controls, bidi overrides and isolates, lone surrogates."""
    return sorted({c for c in shown if (ord(c) < 32 and c != "\n") or 0x7f <= ord(c) <= 0x9f
                   or 0x202a <= ord(c) <= 0x202e or 0x2066 <= ord(c) <= 0x2069
                   or 0xd800 <= ord(c) <= 0xdfff})


@pytest.fixture(scope="module")
def learners():
    """Three local accounts, called ada, bob and eve here (random names), each with a home of mode
    0700, all in one group, each allowed through to the course's Python (dpcourse.cluster.hub's
    lend_access). Afterwards: accounts, homes, group and ACLs gone or as they were."""
    import pwd
    from contextlib import ExitStack
    from types import SimpleNamespace

    if os.geteuid() != 0:
        _missing("needs root: it makes local accounts and writes records as them")
    for tool in ("useradd", "userdel", "groupadd", "groupdel", "setfacl", "getfacl"):
        if shutil.which(tool) is None:
            _missing(f"no {tool} (apt-get install passwd acl)")
    group = f"dprg{secrets.token_hex(3)}"
    names = {role: f"dpr{secrets.token_hex(3)}" for role in ("ada", "bob", "eve")}
    with ExitStack() as undo:
        subprocess.run(["groupadd", group], check=True, capture_output=True)
        undo.callback(subprocess.run, ["groupdel", group], capture_output=True)
        for n in names.values():
            undo.callback(subprocess.run, ["userdel", "--remove", n], capture_output=True)
            subprocess.run(["useradd", "--create-home", "--shell", "/bin/sh", "--groups", group, n],
                           check=True, capture_output=True)
            os.chmod(pwd.getpwnam(n).pw_dir, 0o700)
            undo.enter_context(hub.lend_access(n, hub.course_paths(ROOT)))
        yield SimpleNamespace(group=group, **names,
                              pw={n: pwd.getpwnam(n) for n in names.values()})


@pytest.fixture
def shared():
    """A folder that the test's learners may pass through (pytest's own is root's 0700)."""
    where = Path(tempfile.mkdtemp(prefix="dpcourse-room-"))
    where.chmod(0o755)
    yield where
    shutil.rmtree(where, ignore_errors=True)


def _as(learners, user: str, code: str, *args, umask: int = 0o022, groups=()):
    """Run ``code`` as ``user`` (only their own groups, and ``groups``), with dpcourse.cluster.room
    imported as ``room`` and sys.argv[1:] = ``args``; a hang fails, never waits."""
    pw = learners.pw[user]
    prelude = (f"import os, sys; os.umask({umask:#o}); sys.path.insert(0, {str(SRC)!r}); "
               "from dpcourse.cluster import room\n")
    return subprocess.run([sys.executable, "-I", "-c", prelude + code, *map(str, args)],
                          user=pw.pw_uid, group=pw.pw_gid, extra_groups=list(groups),
                          env={"PATH": "/usr/bin:/bin", "HOME": pw.pw_dir, "LANG": "C.UTF-8"},
                          cwd=pw.pw_dir, capture_output=True, text=True, timeout=60)


def _view(where: Path, page: Path) -> str:
    """The view as the instructor runs it (root), in a process of its own: a view that hangs or
    reads without end fails the test at the timeout instead of stopping the suite."""
    done = subprocess.run([sys.executable, "-m", "dpcourse.cluster.room", str(where), "--html",
                           str(page)], cwd=ROOT, capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    return done.stdout.decode("utf-8")  # strict: the view prints valid UTF-8, whatever it read


def _modes(*paths: Path) -> dict:
    """Each path's owner, mode and listing: what must not change outside the room."""
    return {p: (p.lstat().st_uid, p.lstat().st_mode, sorted(os.listdir(p))) for p in paths}


def test_the_set_up_gives_each_learner_a_folder_that_only_they_write_and_only_root_reads(
        learners, shared):
    ada, bob, eve, pw = learners.ada, learners.bob, learners.eve, learners.pw
    where = shared / "room"
    made = subprocess.run([sys.executable, "-m", "dpcourse.cluster.room", str(where), "--setup",
                           "--user", ada, "--user", bob],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    st = where.lstat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, 0, 0o711)
    for n in (ada, bob):
        st = (where / n).lstat()
        assert stat.S_ISDIR(st.st_mode)
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (pw[n].pw_uid, 0, 0o2750)
    # eve joins the group after the set-up: her check says whom to ask, and writes nothing
    says = _as(learners, eve, RECORD, where, NOTEBOOK, "exercise 1", "pass", "")
    assert says.stdout.startswith("warning: could not write") and \
        "ask the instructor to run the room's set-up" in says.stdout, says.stdout + says.stderr
    assert not (where / eve).exists()
    # the set-up again, by group: eve's folder added, the others left as they are
    again = room.setup(where, group=learners.group)
    assert [line for line in again if "made" in line] == [f"{where / eve}/: made ({eve}'s, mode "
                                                           "2750)"]
    assert sum("left as it is" in line for line in again) == 3  # the room, ada's, bob's
    for n in (ada, bob, eve):  # under a server job's umask 077
        says = _as(learners, n, RECORD, where, NOTEBOOK, "exercise 1", "pass", "", umask=0o077)
        assert says.stdout.strip() == "written", says.stdout + says.stderr
    (record,) = (where / ada).iterdir()
    st = record.lstat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (pw[ada].pw_uid, 0, 0o640)
    # a learner can neither list the room nor read another's folder
    peek = _as(learners, bob, "for p in sys.argv[1:]:\n"
                              "    try:\n        os.listdir(p); print('read')\n"
                              "    except PermissionError:\n        print('refused')",
               where, where / ada)
    assert peek.stdout.split() == ["refused", "refused"], peek.stdout + peek.stderr
    records, problems = room.read_room(where)
    assert sorted(r["learner"] for r in records) == sorted([ada, bob, eve]) and not problems
    # the set-up is root's; a learner's view is refused with what to do
    theirs = _as(learners, bob, MAIN, where, "--setup", "--user", bob)
    assert theirs.returncode == 1 and "runs as root" in theirs.stderr
    view = _as(learners, bob, MAIN, where)
    assert view.returncode == 1 and "run the view as root" in view.stderr


def test_a_readers_group_reads_the_room_and_the_learners_do_not(learners, shared):
    import grp

    ada, eve = learners.ada, learners.eve
    readers = f"dprr{secrets.token_hex(3)}"
    subprocess.run(["groupadd", readers], check=True, capture_output=True)
    try:
        gid = grp.getgrnam(readers).gr_gid
        where = shared / "room"
        with pytest.raises(room.SetupError, match="the learners' own group"):
            room.setup(where, group=learners.group, readers_group=learners.group)
        room.setup(where, users=[ada], readers_group=readers)
        st = where.lstat()
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, gid, 0o751)
        assert _as(learners, ada, RECORD, where, NOTEBOOK, "exercise 1", "pass", "",
                   umask=0o077).stdout.strip() == "written"
        (record,) = (where / ada).iterdir()
        assert (record.stat().st_gid, stat.S_IMODE(record.stat().st_mode)) == (gid, 0o640)
        reader = _as(learners, eve, MAIN, where, groups=[gid])  # eve, as an instructor would be
        assert reader.returncode == 0 and ada in reader.stdout, reader.stdout + reader.stderr
        learner = _as(learners, eve, MAIN, where)
        assert learner.returncode == 1 and "cannot read the room" in learner.stderr
    finally:
        subprocess.run(["groupdel", readers], capture_output=True)


# bob, in his own folder: files that would stop, flood, crash or fool the view
ATTACK = r'''
import json
folder, other, me = sys.argv[1:4]
def rec(**change):
    r = {"learner": me, "notebook": "05_one_process_to_ddp", "exercise": "exercise 3",
         "verdict": "pass", "message": "", "time": 1.0}
    r.update(change)
    return json.dumps(r).encode()
def put(name, data):
    with open(os.path.join(os.fsencode(folder), name), "wb") as f:
        f.write(data)
os.symlink("/dev/zero", os.path.join(folder, "zero.json"))      # read without end
os.mkfifo(os.path.join(folder, "fifo.json"))                     # an open that waits for good
put(b"huge.json", rec())
os.truncate(os.path.join(folder, "huge.json"), 2 ** 30)          # 1 GiB, sparse
os.mkdir(os.path.join(folder, "dir.json"))
put(b"soon.json", rec(time="soon"))                              # crashed the sort
put(b"list.json", rec(exercise=["exercise 3"]))                  # crashed the set
put(b"nan.json", rec(time=float("nan")))
put(b"bool.json", rec(time=True))
put(b"verdict.json", rec(verdict=["pass"]))
put(b"long.json", rec(message="x" * 1000))
put(b"other.json", rec(learner=other))                           # in another learner's name
put(b"deep.json", b"[" * 3000)
put(b"bytes.json", b"\xff\xfe{")
put(b"twice.json", rec(exercise="exercise 4"))
os.link(os.path.join(folder, "twice.json"), os.path.join(folder, "again.json"))
put("\x1b[2J\x1b]52;c;ZXZpbA==\x07.json".encode(), rec(learner=other))  # a name with escapes
put(b"\x9b2J\xff.json", rec(learner=other))                      # C1 and not UTF-8 at all
print("attacked")
'''
BAD = {"zero.json": "a link", "fifo.json": "not a regular file", "dir.json": "not a regular file",
       "huge.json": "1073741824 bytes, more than a record's 4096",
       "soon.json": "its time is not a number", "list.json": "its exercise is list, not text",
       "nan.json": "its time is not a number", "bool.json": "its time is not a number",
       "verdict.json": "its verdict is not one of", "long.json": "longer than 300 characters",
       "other.json": "names ADA, in BOB's folder", "deep.json": "RecursionError",
       "bytes.json": "UnicodeDecodeError", "twice.json": "a hard link", "again.json": "a hard link",
       "?[2J?]52;c;ZXZpbA==?.json": "names ADA", "?2J?.json": "names ADA"}


def test_the_view_reads_a_hostile_room_in_seconds_shows_every_good_record_and_names_each_bad_one(
        learners, shared):
    ada, bob, eve = learners.ada, learners.bob, learners.eve
    where = shared / "room"
    room.setup(where, users=[ada, bob, eve])
    homes = [Path(p.pw_dir) for p in learners.pw.values()]
    before, mode = _modes(*homes), shared.lstat().st_mode
    for n, verdict, message in ((1, "pass", ""), (2, "fails", MESSAGE)):
        assert _as(learners, ada, RECORD, where, NOTEBOOK, f"exercise {n}", verdict,
                   message).stdout.strip() == "written"
    # bob's own failure message carries escape sequences (his code printed them)
    says = _as(learners, bob, RECORD, where, NOTEBOOK, f"exercise 2 {HOSTILE}", "fails",
               f"AssertionError: {HOSTILE} boom")
    assert says.stdout.strip() == "written", says.stdout + says.stderr
    attack = _as(learners, bob, ATTACK, where / bob, ada, bob)
    assert attack.stdout.strip() == "attacked", attack.stderr
    page = shared / "room.html"
    shown = _view(where, page)
    html = page.read_text(encoding="utf-8")
    assert _unsafe(shown) == [] and _unsafe(html) == [], (_unsafe(shown), _unsafe(html))
    # every good record: ada's two, bob's one (its text shown, its escapes not)
    records, problems = room.read_room(where)
    assert sorted((r["learner"], r["exercise"][:10]) for r in records) == \
        sorted([(ada, "exercise 1"), (ada, "exercise 2"), (bob, "exercise 2")])
    rows = {line.split()[0]: line.split()[1:] for line in shown.splitlines()[1:3]}
    assert rows == {ada: ["✓", "✗", "·"], bob: ["·", "·", "✗"]}, shown
    assert "AssertionError: ?[2J?]52;c;ZXZpbA==??31m? boom" in shown and "boom" in html
    # and each bad file named, once, as skipped, in the terminal and on the page
    assert len(problems) == len(BAD), problems
    for name, why in BAD.items():
        line = f"! {bob}/{name}: skipped ("
        assert shown.count(line) == 1, (name, shown)
        said = shown.split(line, 1)[1].split("\n", 1)[0]
        assert why.replace("ADA", ada).replace("BOB", bob) in said, (name, said)
        assert f"{bob}/{name}: skipped" in html.replace("&#x27;", "'")
    assert _modes(*homes) == before and shared.lstat().st_mode == mode


def test_a_record_opened_after_a_swap_is_still_never_followed_nor_waited_for(tmp_path):
    """Between the listing and the open a file may change: the open itself refuses a link
    (O_NOFOLLOW) and does not wait for a FIFO's writer (O_NONBLOCK)."""
    os.symlink("/dev/zero", tmp_path / "zero.json")
    os.mkfifo(tmp_path / "fifo.json")
    code = ("import os, sys; from dpcourse.cluster import room\n"
            "fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)\n"
            "for name in ('zero.json', 'fifo.json'):\n"
            "    try:\n        room._read_record(name, fd, 'ada', (os.geteuid(),))\n"
            "    except (OSError, ValueError) as err:\n        print(name, type(err).__name__)")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.stdout.split("\n")[:2] == ["zero.json OSError", "fifo.json ValueError"], \
        done.stdout + done.stderr


def test_in_a_room_that_all_may_write_a_squatted_folder_or_a_link_costs_a_warning_not_a_home(
        learners, shared):
    """The advice before issue 42, a room of mode 1777: eve makes bob's folder before his first
    check, links ada's name to ada's home, and her own name to her own home. No one's record is
    written where it should not be, no mode outside the room changes, and the view names each."""
    ada, bob, eve, pw = learners.ada, learners.bob, learners.eve, learners.pw
    homes = [Path(p.pw_dir) for p in pw.values()]
    where = shared / "open-room"
    where.mkdir()
    where.chmod(0o1777)
    before, mode = _modes(*homes), shared.lstat().st_mode
    squat = _as(learners, eve, "os.mkdir(sys.argv[1]); os.chmod(sys.argv[1], 0o777)\n"
                               "os.symlink(sys.argv[3], sys.argv[2])\n"
                               "os.symlink(sys.argv[5], sys.argv[4])",
                where / bob, where / ada, pw[ada].pw_dir, where / eve, pw[eve].pw_dir)
    assert squat.returncode == 0, squat.stderr
    said = {n: _as(learners, n, RECORD, where, NOTEBOOK, "exercise 1", "pass", "").stdout
            for n in (ada, bob, eve)}
    assert f"the folder {bob}/ there belongs to {eve}, not to you: nothing was written" in said[bob]
    assert f"{ada} there is a link, not your folder: nothing was written" in said[ada]
    assert f"{eve} there is a link, not your folder: nothing was written" in said[eve]
    assert all(s.startswith("warning: could not write") and s.count("\n") == 1
               for s in said.values()), said
    assert os.listdir(where / bob) == [] and _modes(*homes) == before
    shown = _view(where, shared / "room.html")
    assert f"! {ada}: skipped (a link, not a learner's folder)" in shown
    assert f"! {eve}: skipped (a link, not a learner's folder)" in shown
    assert f"! {bob}/: skipped (a folder in {bob}'s name that belongs to {eve};" in shown
    # the set-up refuses a room that others may write ...
    with pytest.raises(room.SetupError, match="not a folder of root's that only root may write"):
        room.setup(where, users=[ada])
    # ... and in a root's room that holds them, names the squatted folder and the link, makes
    # the other folders, and changes neither
    fixed = shared / "fixed"
    fixed.mkdir()
    fixed.chmod(0o711)
    (fixed / bob).mkdir()
    os.chown(fixed / bob, pw[eve].pw_uid, pw[eve].pw_gid)
    os.symlink(pw[ada].pw_dir, fixed / ada)
    with pytest.raises(room.SetupError) as refused:
        room.setup(fixed, users=[ada, bob, eve])
    message = str(refused.value)
    assert f"{fixed / bob}: refused, it is a folder of {eve}'s, not of {bob}'s" in message
    assert f"{fixed / ada}: refused, it is a link, not a folder" in message
    assert any(line.startswith(f"{fixed / eve}/: made") for line in refused.value.done)
    assert (fixed / bob).lstat().st_uid == pw[eve].pw_uid
    assert os.readlink(fixed / ada) == pw[ada].pw_dir
    assert _modes(*homes) == before and shared.lstat().st_mode == mode
