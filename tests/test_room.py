"""The instructor's live view of a room (issue 28): make check ROOM=DIR leaves one record per
exercise, `python -m dpcourse.course room DIR` shows the room. A room of simulated learners, a
damaged and a half-written record among theirs, a room that cannot be written, and make check's
own writing."""
import json
import os
import subprocess
import sys

import nbformat
import pytest

from conftest import ROOT
from dpcourse import room

MESSAGE = ("AssertionError: the evaluation counted 5000 test images, not 10,000: "
           "sum the totals over all ranks")
OTHER = ("AssertionError: epoch 1 began with the same images as epoch 0: "
         "does the lab call sampler.set_epoch(epoch)?")


@pytest.fixture
def classroom(tmp_path):
    """Five learners at notebook 05 (exercises 1-3) and one at 06;
    two damaged files among theirs."""
    where = tmp_path / "room"
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
    done = subprocess.run([sys.executable, "-m", "dpcourse.course", "room", str(classroom),
                           "--html", str(page)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert ("5 pass" in done.stdout and "Most common failures:" in done.stdout
            and page.read_text().startswith("<!doctype"))
    missing = subprocess.run([sys.executable, "-m", "dpcourse.course", "room",
                              str(tmp_path / "none")],
                             cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert missing.returncode == 1 and "mkdir -m 1777" in missing.stderr


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
    cmd = [sys.executable, "-m", "dpcourse.course", "check", str(folder)]
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
    """A learner's server job runs with umask 077 (dpcourse.hub): the record must still be readable
    by the instructor's view, another user."""
    old = os.umask(0o077)
    try:
        assert room.record(tmp_path, "05_one_process_to_ddp", "1", "pass", learner="ana") is None
    finally:
        os.umask(old)
    folder = tmp_path / "ana"
    assert folder.stat().st_mode & 0o777 == 0o755
    assert all(p.stat().st_mode & 0o777 == 0o644 for p in folder.iterdir())


def test_a_record_in_another_learner_s_name_is_skipped_and_named(tmp_path):
    """The room folder is writable by all (1777): a record whose file belongs to one user but names
    another learner is not counted, and is listed under the grid."""
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
