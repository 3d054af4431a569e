"""dpcourse.explore.launch: torchrun from a notebook cell, rank tags, logs, and stopping every
rank."""
import re
import tempfile
import time
from pathlib import Path

import pytest
import torch

from conftest import ROOT
from dpcourse.explore.launch import _cause, lab, load_lab, python, run_ok, torchrun
from dpcourse.lab.errors import CourseError


def test_torchrun_tags_lines_and_returns_rank0_log(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the launch keeps its logs
    run = torchrun(lab("hello", ROOT / "solutions"), nproc=2)
    assert list(tmp_path.iterdir()) == [], "the launch leaves no files behind"
    assert run.returncode == 0
    assert any(line.startswith("hello from rank 1") for line in run.rank_lines(1))
    assert run.log[0]["world_size"] == 2
    shown = capsys.readouterr().out
    assert ("$ torchrun --standalone --nproc-per-node=2" in shown
            and "[rank0]:hello from rank 0" in shown)
    assert "OMP_NUM_THREADS" not in shown  # torchrun's banner is not the learner's business


def test_the_agent_in_a_fork_of_this_process_runs_as_the_new_interpreter_does(monkeypatch):
    """With torch imported here, the agent is a fork of this process; DPCOURSE_FORK_LAUNCHER=0
    starts a new interpreter. The same lines, log and exit status either way, for a run that passes
    and one that fails."""
    import dpcourse.explore.launch as launch

    cmd = ["python", "-m", "dpcourse.lab.torchrun"]
    monkeypatch.delenv("DPCOURSE_FORK_LAUNCHER", raising=False)
    assert launch._can_fork(cmd) and "torch" in __import__("sys").modules
    runs = {}
    for fork in ("1", "0"):
        monkeypatch.setenv("DPCOURSE_FORK_LAUNCHER", fork)
        assert launch._can_fork(cmd) == (fork == "1")
        with monkeypatch.context() as m:  # CUDA started here: no fork, whatever the variable says
            m.setattr(torch.cuda, "is_initialized", lambda: True)
            assert not launch._can_fork(cmd)
        ok = torchrun(lab("hello", ROOT / "solutions"), nproc=2, echo=False)
        failed = torchrun(ROOT / "tests/helpers/fail.py", nproc=2, log_json=False, echo=False)
        runs[fork] = ok, failed
    for ok, failed in runs.values():
        assert ok.returncode == 0 and ok.log[0]["world_size"] == 2 and failed.returncode != 0
        assert any("hello from rank 1" in line for line in ok.lines)
    said = [sorted(re.sub(r"pid \d+", "pid N", line) for line in runs[fork][0].lines
                   if "hello from" in line)
            for fork in ("1", "0")]
    assert len(said[0]) == 2 and said[0] == said[1]
    assert runs["1"][1].returncode == runs["0"][1].returncode
    assert [launch.failure_summary(runs[fork][1].agent_lines, runs[fork][1].returncode)
            for fork in ("1", "0")] == \
           ["torchrun: rank 1 failed first (exit code 1); the other ranks were stopped. "
            "Its message is in the lines above."] * 2


def test_python_runs_one_plain_process_like_torchrun(capsys):
    run = python(lab("hello", ROOT / "solutions"))
    assert (run.returncode == 0 and run.log[0]["world_size"] == 1
            and run.log[0]["launcher"] == "none")
    assert run.rank_lines(0)[0].startswith("hello from rank 0 of 1")
    assert "$ python solutions/labs/hello.py" in capsys.readouterr().out
    failed = python(ROOT / "tests/helpers/fail.py", log_json=False)
    assert failed.returncode != 0
    assert "python exited with status" in capsys.readouterr().out


def test_a_line_the_rank_already_names_is_tagged_once(tmp_path):
    """The course's errors name their rank for a terminal ("[rank 0] ..."); torch's excepthook tags
    its lines "[rank0]: ...": under the launcher's own tag, once is enough."""
    script = tmp_path / "twice.py"
    script.write_text("print('[rank 0] the replicas have diverged')\n"
                      "print('[rank0]: Traceback (most recent call last):')\n"
                      "print('[rank 1] another rank, said on rank 0')\n")
    run = python(script, log_json=False, echo=False)
    assert run.lines == ["[rank0]:the replicas have diverged",
                         "[rank0]: Traceback (most recent call last):",
                         "[rank0]:[rank 1] another rank, said on rank 0"], run.lines


def test_a_process_with_the_lab_runtime_skips_the_last_collections_and_still_flushes(tmp_path):
    """dpcourse.lab freezes the objects alive at exit (gc.freeze), so that the interpreter's last
    collections do not walk torch's objects on every rank of every run; what reference counting
    frees (an open file's buffer) is still written."""
    import subprocess
    import sys

    kept = tmp_path / "kept.txt"
    probe = ("import atexit, gc\n"
             "atexit.register(lambda: print('frozen at exit:', gc.get_freeze_count() > 0))\n"
             "{imports}"
             f"f = open({str(kept)!r}, 'w')\n"
             "f.write('written, never closed')\n")
    said = {}
    for imports in ("", "import dpcourse.lab\n"):
        done = subprocess.run([sys.executable, "-c", probe.format(imports=imports)],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and not done.stderr, done.stderr
        said[imports] = done.stdout.strip()
        assert kept.read_text() == "written, never closed"
    assert said == {"": "frozen at exit: False", "import dpcourse.lab\n": "frozen at exit: True"}


def test_failure_is_summarised_not_a_traceback(capsys):
    run = torchrun(ROOT / "tests/helpers/fail.py", nproc=2, log_json=False)
    assert run.returncode != 0
    shown = capsys.readouterr().out
    assert "[rank1]:rank 1 gives up" in shown
    assert "rank 1 failed first" in shown and "ChildFailedError" not in shown
    with pytest.raises(CourseError,
                       match=r"fail.py failed \(exit status 1\): \[rank1\]:rank 1 gives up"):
        run_ok(run)


def test_a_failing_rank_that_was_not_shown_still_speaks(capsys):
    run = torchrun(ROOT / "tests/helpers/fail.py", nproc=2, log_json=False, ranks="0")
    shown = capsys.readouterr().out
    assert "[rank1]:rank 1 gives up" in shown and "rank 1 failed first" in shown
    assert shown.index("[rank1]:rank 1 gives up") < shown.index("rank 1 failed first")
    with pytest.raises(CourseError, match="rank 1 gives up"):
        run_ok(run)


def test_a_silent_failed_run_shows_its_last_lines_and_names_the_error(capsys):
    run = torchrun(ROOT / "tests/helpers/fail.py", nproc=2, log_json=False, echo=False)
    assert capsys.readouterr().out == ""
    with pytest.raises(CourseError, match="rank 1 gives up"):
        run_ok(run)
    assert "[rank1]:rank 1 gives up" in capsys.readouterr().out
    assert _cause(["[rank0]:step 1", "[rank1]:Traceback (most recent call last):",
                   "[rank1]:TypeError: unsupported operand", "[rank1]:  more"]) \
        == "[rank1]:TypeError: unsupported operand"
    # gloo's C++ check ends rank 0 without a Python error; its peer then reports the lost rank,
    # later: the verdict is rank 0's (notebook 12's shape mismatch), and a peer's echo only when
    # nobody said more
    crash = ["[rank0]:terminate called after throwing an instance of 'gloo::EnforceNotMet'",
             "[rank0]:  what():  [enforce fail at pair.cc:464] "
             "Received data size doesn't match expected size.",
             "[rank1]: lost another rank in the middle of all_gather at x.py:49 (main) "
             "(Connection reset by peer)."]
    assert "doesn't match expected size" in _cause(crash)
    assert "lost another rank" in _cause(crash[2:])


def test_timeout_stops_every_rank(tmp_path):
    """20 s: time for torchrun and both workers to start on a loaded machine (about 3 s alone); the
    workers would sleep an hour."""
    pids = tmp_path / "pids"
    with pytest.raises(CourseError, match="longer than 20 s"):
        torchrun(ROOT / "tests/helpers/sleep.py", str(pids), nproc=2, timeout=20, log_json=False)
    workers = list(map(int, pids.read_text().split()))
    assert len(workers) == 2, workers

    def gone(pid):
        try:
            return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"  # a zombie has ended
        except OSError:
            return True
    # SIGTERM, then SIGKILL after 5 s: only a survivor waits out the 30
    deadline = time.monotonic() + 30
    while not all(gone(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(gone(pid) for pid in workers), \
        f"workers {[p for p in workers if not gone(p)]} outlived the launch"


def test_lab_belongs_to_the_notebook_folder(root):
    assert lab("hello", root / "solutions") == root / "solutions" / "labs" / "hello.py"
    assert lab("hello", root / "notebooks") == root / "labs" / "hello.py"
    with pytest.raises(CourseError, match="No lab script"):
        lab("no_such_lab", root / "solutions")


def test_load_lab_imports_the_labs_file_as_saved_now_without_running_it(tmp_path, monkeypatch):
    """A notebook reads a lab's functions and options through load_lab: the copy lab() picks
    ($DPCOURSE_LABS here), its main() not run, and the file read again at each call, so that a
    learner's edit shows."""
    labs = tmp_path / "labs"
    labs.mkdir()
    (labs / "mine.py").write_text("ANSWER = 1\nif __name__ == '__main__':\n"
                                  "    raise SystemExit('main ran')\n")
    monkeypatch.setenv("DPCOURSE_LABS", str(labs))
    assert load_lab("mine").ANSWER == 1
    (labs / "mine.py").write_text("ANSWER = 2\n")  # the learner edits and saves
    assert load_lab("mine").ANSWER == 2
    monkeypatch.delenv("DPCOURSE_LABS")
    assert load_lab("fashion_ddp", ROOT / "solutions").__file__ \
        == str(ROOT / "solutions" / "labs" / "fashion_ddp.py")
    with pytest.raises(CourseError, match="No lab script"):
        load_lab("no_such_lab", ROOT / "solutions")


def test_dpcourse_torchrun_is_torchrun_with_its_exit_status(tmp_path):
    """dpcourse.lab.torchrun runs torch's own torchrun and leaves with its status: 0, or 1 with
    torchrun's report of the failed rank, which failure_summary reads."""
    import subprocess
    import sys

    from dpcourse.explore.launch import failure_summary

    # each rank leaves a file (two ranks' prints may interleave), then exits
    script = tmp_path / "exits.py"
    script.write_text("import os, sys\n"
                      "open(os.path.join(sys.argv[2], 'rank' + os.environ['RANK']), 'w').close()\n"
                      "sys.exit(int(sys.argv[1]) if os.environ['RANK'] == '1' else 0)\n")
    for status in (0, 3):
        ran = tmp_path / f"ran-{status}"
        ran.mkdir()
        done = subprocess.run([sys.executable, "-m", "dpcourse.lab.torchrun", "--standalone",
                               "--nproc-per-node=2", str(script), str(status), str(ran)],
                              capture_output=True, text=True, timeout=120)
        said = done.stdout + done.stderr
        assert sorted(p.name for p in ran.iterdir()) == ["rank0", "rank1"], said
        if status == 0:
            assert done.returncode == 0, said
        else:
            assert done.returncode == 1 and "ChildFailedError" in said, said
            # the traceback is torchrun's, as without the wrapper
            assert "dpcourse/lab/torchrun.py" not in said
            assert failure_summary(said.splitlines(), done.returncode).startswith(
                "torchrun: rank 1 failed first (exit code 3)")
