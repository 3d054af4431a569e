"""dpcourse.explore.scaling and dpcourse.explore.plots: a real study (torchrun, FashionMNIST), its
resume, its maths."""
import json
import os
import re
import sys

import matplotlib
import pytest

matplotlib.use("Agg")

from conftest import ROOT, run
from dpcourse.explore import plots, scaling
from dpcourse.lab.errors import CourseError

LAB = ROOT / "solutions" / "labs" / "fashion_study.py"
NAMES = ["strong-k1", "strong-k2", "weak-k1", "weak-k2"]


def study_cmd(out, *extra, data_root):
    return [sys.executable, "-m", "dpcourse.explore.scaling", "run", "--lab", LAB, "--workers",
            "1", "2", "--mode", "strong", "weak", "--batch-size", "32", "--out", out, *extra,
            "--", "--max-steps", "20", "--no-eval", "--data-root", data_root]


@pytest.fixture(scope="module")
def study(tmp_path_factory, fashion_root):
    """A real 4-run study (K = 1, 2, strong and weak), run once for this module's tests."""
    out = tmp_path_factory.mktemp("study")
    result = run(study_cmd(out, data_root=fashion_root), timeout=240)
    assert result.returncode == 0, result.stdout
    return out, result.stdout


@pytest.mark.slow
def test_study_end_to_end(study, tmp_path):
    out, output = study
    assert sorted(p.name for p in out.glob("*.jsonl")) == [f"{n}.jsonl" for n in NAMES]
    facts = json.loads((out / "study.json").read_text())
    assert facts["machine"]["cores"] >= 1 and facts["machine"]["threads"] == 1
    assert [r["name"] for r in facts["runs"]] == NAMES
    assert all("--log-json" in r["command"] and f"--nproc-per-node={r['workers']}" in r["command"]
               for r in facts["runs"])
    for name in NAMES:  # one progress line per run, with its throughput
        mode, k = name.split("-k")
        assert re.search(rf"^{mode} +K={k}: +[\d,.]+ samples/s", output, re.M), output

    rows = scaling.table(out)
    assert [(r["mode"], r["workers"]) for r in rows] == \
        [("strong", 1), ("strong", 2), ("weak", 1), ("weak", 2)]
    # Throughputs measured minutes apart on a shared machine: their ratio is not bounded, its
    # definition is.
    k1 = {r["mode"]: r["samples_per_s"] for r in rows if r["workers"] == 1}
    assert all(r["complete"] and r["samples_per_s"] > 0 for r in rows), rows
    assert all(r["speedup"] == pytest.approx(r["samples_per_s"] / k1[r["mode"]]) and
               r["efficiency"] == pytest.approx(r["speedup"] / r["workers"]) for r in rows), rows
    assert [r["global_batch"] for r in rows] == [64, 64, 32, 64]
    assert [r["batch_size"] for r in rows] == [64, 32, 32, 32]

    text = run([sys.executable, "-m", "dpcourse.explore.scaling", "table", out], timeout=60)
    assert (text.returncode == 0 and "efficiency" in text.stdout
            and "weak" in text.stdout), text.stdout
    png = tmp_path / "fig.png"
    drawn = run([sys.executable, "-m", "dpcourse.explore.scaling", "plot", out, "--save", png],
                timeout=60)
    assert drawn.returncode == 0, drawn.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert "speedup" in drawn.stdout  # the table, printed too


@pytest.mark.slow
def test_an_interrupted_study_resumes(study, fashion_root):
    out, _ = study
    before = {n: (out / f"{n}.jsonl").read_bytes() for n in NAMES}
    again = run(study_cmd(out, data_root=fashion_root), timeout=60)
    assert again.returncode == 0, again.stdout
    assert again.stdout.count("skipped, its log is complete") == 4, again.stdout
    assert {n: (out / f"{n}.jsonl").read_bytes() for n in NAMES} == before

    # weak-k1 interrupted: its log lacks the final "done" record. Only it runs again.
    log = out / "weak-k1.jsonl"
    log.write_text("".join(line + "\n" for line in before["weak-k1"].decode().splitlines()[:-1]))
    assert not scaling.table(out)[2]["complete"]
    resumed = run(study_cmd(out, data_root=fashion_root), timeout=120)
    assert resumed.returncode == 0, resumed.stdout
    assert resumed.stdout.count("skipped, its log is complete") == 3, resumed.stdout
    assert re.search(r"^weak +K=1: +[\d,.]+ samples/s", resumed.stdout, re.M), resumed.stdout
    assert all((out / f"{n}.jsonl").read_bytes() == before[n] for n in NAMES if n != "weak-k1")
    assert all(r["complete"] for r in scaling.table(out))

    # A job-array task runs its own run only; a task number outside the plan is named.
    task = run(study_cmd(out, "--task", "3", data_root=fashion_root), timeout=60)
    assert (task.returncode == 0 and task.stdout.count("skipped") == 1
            and "weak   K=2" in task.stdout), task.stdout
    wrong = run(study_cmd(out, "--task", "4", data_root=fashion_root), timeout=60)
    assert (wrong.returncode == 1 and "numbered 0 to 3" in wrong.stdout
            and "Traceback" not in wrong.stdout)


@pytest.mark.slow
def test_a_folder_holds_one_study(study, fashion_root):
    """The same run names with other options would take the old logs for new runs: refused."""
    out, _ = study
    other = study_cmd(out, data_root=fashion_root)
    other[other.index("32")] = "64"  # --batch-size 64, weak runs only
    other.remove("strong")
    result = run(other, timeout=60)
    assert (result.returncode == 1 and "--batch-size 32" in result.stdout
            and "Traceback" not in result.stdout)
    with pytest.raises(CourseError, match="lab options"):
        scaling.run(out, LAB, modes=("weak",), workers=(1, 2), batch_size=32,
                    lab_args=("--max-steps", "5"))
    # where the data is read from does not change a run (each task of a Slurm array stages its own
    # copy)
    elsewhere = study_cmd(out, data_root=fashion_root)
    elsewhere[-1] = str(fashion_root.resolve()) + "/."
    again = run(elsewhere, timeout=60)
    assert again.returncode == 0 and again.stdout.count("skipped, its log is complete") == 4, \
        again.stdout


@pytest.mark.slow
def test_a_log_is_reused_only_for_the_same_lab_file(study, fashion_root, tmp_path):
    """A learner who edits the lab and runs the study again gets new runs, not the old lab's logs: a
    log counts as done only beside the hash of the lab file that started it (<name>.lab-sha256)."""
    out, _ = study
    edited = tmp_path / LAB.name
    edited.write_text(LAB.read_text() + "# an edit\n")
    lesson = tmp_path / "fashion_ddp.py"  # the lesson it imports, beside it as in labs/
    lesson.write_text((LAB.parent / lesson.name).read_text())
    cmd = study_cmd(out, "--task", "0", data_root=fashion_root)  # strong-k1 only: one process
    cmd[cmd.index("--lab") + 1] = edited
    again = run(cmd, timeout=120)
    assert again.returncode == 0, again.stdout
    assert ("strong K=1: its log was written by another version of fashion_study.py: run again"
            in again.stdout)
    assert ("skipped" not in again.stdout
            and re.search(r"^strong +K=1: +[\d,.]+ samples/s", again.stdout, re.M))
    assert scaling.table(out)[0]["complete"]
    # strong-k1 is the edit's now; the other three logs are still the course lab's (the study runs
    # them again with the edited lab, or strong-k1 with the course's)
    made_by = {n: (out / f"{n}.lab-sha256").read_text().strip() for n in NAMES}
    digest = {f: scaling.lab_digest(f) for f in (LAB, edited)}
    assert made_by == {"strong-k1": digest[edited], **{n: digest[LAB] for n in NAMES[1:]}}, made_by


def test_an_edit_to_the_lesson_the_study_imports_is_another_lab(tmp_path):
    """fashion_study.py runs fashion_ddp.py's code: a learner's edit there counts too."""
    study, lesson = tmp_path / LAB.name, tmp_path / "fashion_ddp.py"
    study.write_text(LAB.read_text())
    lesson.write_text((LAB.parent / lesson.name).read_text())
    before = scaling.lab_digest(study)
    lesson.write_text(lesson.read_text() + "# an edit\n")
    edited = scaling.lab_digest(study)
    assert edited != before
    (tmp_path / "other.py").write_text("# a file the study does not import\n")
    assert scaling.lab_digest(study) == edited


# ------------------------------------------------------------------ the table's maths
def record(event, step, rate):
    return {"event": event, "step": step, "samples_per_s": rate, "elapsed_s": 0.0}


def write_study(out, runs, cores=2):
    """study.json for ``runs`` (from scaling.plan) and the logs {name: records}."""
    planned = []
    for r in runs:
        planned.append({**r, "lab": "fashion_study.py", "lab_args": [], "log": f"{r['name']}.jsonl",
                        "command": "-"})
    facts = {"host": "testhost", "cores": cores, "cpu": "a CPU", "threads": runs[0]["threads"],
             "gpus": 0, "cuda_device": None, "torch": "x", "python": "3", "date": "today"}
    (out / "study.json").write_text(json.dumps({"runs": planned, "machine": facts}))


def write_log(out, name, records):
    (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


# A run's windows: 50 warm-up steps (dropped), then 50 steps at R and 200 at R/2, then "done"
# with no new step. Steady state: 250 steps in 50/R + 400/R seconds = R / 1.8.
def windows(rate):
    return [{"event": "epoch_start", "step": 0, "elapsed_s": 0.0}, record("train", 50, rate / 10),
            record("train", 100, rate), record("epoch", 300, rate / 2), record("done", 300, None)]


def test_throughput_is_samples_over_seconds_after_the_warm_up():
    assert scaling.throughput(windows(1800.0)) == pytest.approx(1000.0)
    # one window (a run shorter than the log interval): that window is all there is
    assert scaling.throughput([record("done", 20, 500.0)]) == pytest.approx(500.0)
    # a resumed run counts its steps from the checkpoint's step
    resumed = [record("train", 50, 10.0), record("train", 100, 300.0),
               {"event": "resume", "step": 100}, record("train", 110, 1.0),
               record("done", 400, 600.0)]
    assert scaling.throughput(resumed) == pytest.approx(350 / (50 / 300 + 10 / 1 + 290 / 600))
    assert scaling.throughput([]) is None and not scaling.is_complete(windows(1.0)[:-1])


def test_table_speedup_efficiency_and_oversubscription(tmp_path):
    runs = scaling.plan(("strong", "weak"), (1, 2, 4), batch_size=32)
    write_study(tmp_path, runs, cores=2)
    rates = {"strong-k1": 1800.0, "strong-k2": 3240.0, "strong-k4": 3600.0,
             "weak-k1": 900.0, "weak-k2": 1710.0, "weak-k4": 1800.0}
    for name, rate in rates.items():
        write_log(tmp_path, name, windows(rate))
    rows = {(r["mode"], r["workers"]): r for r in scaling.table(tmp_path)}
    assert rows["strong", 1]["samples_per_s"] == pytest.approx(1000.0)
    assert (rows["strong", 2]["speedup"] == pytest.approx(1.8)
            and rows["strong", 2]["efficiency"] == pytest.approx(0.9))
    assert (rows["strong", 4]["speedup"] == pytest.approx(2.0)
            and rows["strong", 4]["efficiency"] == pytest.approx(0.5))
    assert (rows["weak", 2]["speedup"] == pytest.approx(1.9)
            and rows["weak", 2]["efficiency"] == pytest.approx(0.95))
    assert rows["weak", 4]["efficiency"] == pytest.approx(0.5)  # weak, K=1 its own: 500 samples/s
    assert [r["global_batch"] for r in (rows["strong", 4], rows["weak", 4])] == [128, 128]
    assert [k for (m, k), r in rows.items() if r["oversubscribed"]] == [4, 4]
    assert all(r["complete"] for r in rows.values())
    text = scaling.format_table(list(rows.values()))
    assert text.count("oversubscribed") == 2 and "0.95" in text

    fig = plots.scaling(list(rows.values()))  # drawn from these rows: the data on the axes
    throughput_ax, speedup_ax, efficiency_ax = fig.axes[:3]
    assert list(speedup_ax.lines[0].get_ydata()) == pytest.approx([1.0, 1.8, 2.0])
    assert list(efficiency_ax.get_xticks()) == [1, 2, 4]
    hollow = [ln for ln in throughput_ax.lines
              if ln.get_marker() == "o" and ln.get_markerfacecolor() == "none"]
    assert len(hollow) == 2  # K=4, strong and weak
    assert "oversubscribed" in " ".join(
        t.get_text() for t in efficiency_ax.get_legend().get_texts())
    assert "1 thread per worker" in fig.get_suptitle() and "2 cores" in fig.get_suptitle()


def test_threads_count_in_oversubscription_and_a_missing_k1(tmp_path):
    runs = scaling.plan(("weak",), (1, 2), batch_size=32, threads=2)
    write_study(tmp_path, runs, cores=2)
    write_log(tmp_path, "weak-k2", windows(1800.0))  # no weak-k1 log (not run yet)
    rows = scaling.table(tmp_path)
    assert [(r["workers"], r["oversubscribed"], r["complete"]) for r in rows] == \
        [(1, False, False), (2, True, True)]
    assert rows[0]["samples_per_s"] is None
    assert (rows[1]["samples_per_s"] == pytest.approx(1000.0) and rows[1]["speedup"] is None
            and rows[1]["efficiency"] is None)
    assert "—" in scaling.format_table(rows)


def test_plan_batches_and_errors():
    runs = scaling.plan(("strong", "weak"), (1, 2, 4), batch_size=16)
    assert [(r["name"], r["args"]) for r in runs[:3]] == [
        ("strong-k1", ["--global-batch-size", "64"]), ("strong-k2", ["--global-batch-size", "64"]),
        ("strong-k4", ["--global-batch-size", "64"])]
    assert [r["args"] for r in runs[3:]] == [["--batch-size", "16"]] * 3
    with pytest.raises(ValueError, match=r"K = 3 does not divide 128") as err:
        scaling.plan(("strong",), (1, 2, 3), global_batch_size=128)
    usable = int(re.search(r"--global-batch-size (\d+)", str(err.value)).group(1))
    assert usable % 2 == 0 and usable % 3 == 0 and abs(usable - 128) < 6
    scaling.plan(("weak",), (1, 2, 3), global_batch_size=128)  # weak ignores the global batch
    with pytest.raises(CourseError, match="--global-batch-size 12"):
        scaling.main(["run", "--lab", str(LAB), "--mode", "strong", "--workers", "3", "4",
                      "--global-batch-size", "10"])


# ------------------------------------------------------------------ the other plots
def test_curves_draw_the_records_that_have_y(tmp_path):
    write_log(tmp_path, "a", [{"event": "train", "elapsed_s": 1.0, "test_accuracy": None},
                              {"event": "eval", "elapsed_s": 2.0, "test_accuracy": 0.8},
                              {"event": "done", "elapsed_s": 3.0, "test_accuracy": 0.85}])
    fig = plots.curves({"K=2": tmp_path / "a.jsonl",
                        "typed": [{"elapsed_s": 1, "test_accuracy": 0.5}]})
    ax = fig.axes[0]
    assert [ln.get_label() for ln in ax.lines] == ["K=2", "typed"]
    assert (list(ax.lines[0].get_xdata()) == [2.0, 3.0]
            and list(ax.lines[0].get_ydata()) == [0.8, 0.85])
    with pytest.raises(CourseError, match="no record"):
        plots.curves({"K=2": tmp_path / "a.jsonl"}, y="test_loss")


def test_stacked_split_writes_the_allreduce_share():
    fig = plots.stacked_split({"K=1": {"forward": 4.0, "backward": 6.0},
                               "K=2": {"data": 1.0, "forward": 4.0, "backward": 6.0,
                                       "allreduce": 6.0, "optimizer": 3.0}})
    ax = fig.axes[0]
    assert [t.get_text().strip() for t in ax.texts] == ["all-reduce 0%", "all-reduce 30%"]
    widths = {b.get_label() for b in ax.containers}
    assert widths == {"data", "forward", "backward", "allreduce", "optimizer"}
    assert [round(t.get_position()[0], 6) for t in ax.texts] == [10.0, 20.0]  # at each bar's end


# ------------------------------------------------------------------ notebook 08's committed study
def test_the_committed_study_is_what_its_command_made():
    """results/08_large_batches: every run that study.py names has a complete log, and the log
    says it ran with that run's options (a log left from another command would not)."""
    import importlib.util
    import shlex

    from dpcourse.explore.widgets import peak_lr
    from dpcourse.lab.metrics import read_log

    here = ROOT / "results" / "08_large_batches"
    spec = importlib.util.spec_from_file_location("study08", here / "study.py")
    study_py = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(study_py)
    study = json.loads((here / "study.json").read_text())
    assert list(study["runs"]) == list(study_py.RUNS), "run study.py: some runs have no log yet"
    assert study["machine"]["threads"] == 1 and study["workers"] == study_py.WORKERS
    for name, facts in study["runs"].items():
        assert facts["command"] == "OMP_NUM_THREADS=1 " + shlex.join(study_py.command(name))
        args = study_py.RUNS[name][2]
        option = lambda flag, default=None: args[args.index(flag) + 1] if flag in args else default  # noqa: E731
        records = read_log(here / f"{name}.jsonl")
        first, done = records[0], records[-1]
        G = int(option("--batch-size")) * study_py.WORKERS
        assert done["event"] == "done" and done["epoch"] == 2.0, name
        assert (first["world_size"], first["global_batch"], first["threads"]) \
            == (study_py.WORKERS, G, 1), name
        assert first["peak_lr"] == pytest.approx(
            peak_lr(option("--lr-scaling"), float(option("--lr", 0.15)), G)), name
        closing, last = [], 0  # the records that close a stretch of steps carry its time split
        for r in records:
            if r["event"] in ("train", "eval", "epoch", "done") and r["step"] > last:
                closing.append(r)
                last = r["step"]
        assert closing and all("split_ms" in r and "comm_bytes" in r for r in closing), name
        assert done["test_images"] == 10_000, name


# ------------------------------------------------------------------ notebook 11's committed study
def test_notebook_11s_committed_study_is_what_its_command_made():
    """results/11_horovod: the commands in study.json are the ones study.py runs, in its order
    (2 side-by-side runs, then ROUNDS rounds of plain and wrapped on one process); the two
    side-by-side logs are complete runs of those options; overhead.json is the median of
    study.json's rounds, as notebook 11 reads it."""
    import importlib.util
    import shlex
    import statistics

    from dpcourse.lab.metrics import read_log

    here = ROOT / "results" / "11_horovod"
    spec = importlib.util.spec_from_file_location("study11", here / "study.py")
    study_py = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(study_py)
    study = json.loads((here / "study.json").read_text())

    def shown(cmd, threads):  # as study.run records a command: paths relative to the checkout
        return f"OMP_NUM_THREADS={threads} " + shlex.join(
            os.path.relpath(c, study_py.ROOT) if c.startswith("/") else c for c in cmd)

    side = [shown(study_py.command(lab, 2, study_py.SIDE_BY_SIDE, here / f"{name}.jsonl"), 1)
            for name, lab in (("ddp", study_py.DDP), ("horovod", study_py.HVD))]
    rounds = [shown(study_py.command(lab, 1, study_py.ONE + extra, here / "tmp.jsonl"), 2)
              for _ in range(study_py.ROUNDS)
              for lab, plain in ((study_py.DDP, "--no-ddp"), (study_py.HVD, "--no-hvd"))
              for extra in ([plain], [])]
    assert [r["command"] for r in study["runs"]] == side + rounds, \
        "run study.py again: study.json is not its runs"
    assert all(len(v) == study_py.ROUNDS for v in study["rounds"].values()), study["rounds"]
    overhead = json.loads((here / "overhead.json").read_text())
    assert overhead == {k: statistics.median(v) for k, v in study["rounds"].items()}
    steps = int(study_py.SIDE_BY_SIDE[study_py.SIDE_BY_SIDE.index("--max-steps") + 1])
    for name, framework in (("ddp", None), ("horovod", "horovod")):
        records = read_log(here / f"{name}.jsonl")
        first, done = records[0], records[-1]
        assert (first["world_size"], first["global_batch"], first.get("framework")) \
            == (2, 128, framework), name
        assert (done["event"], done["step"], done["stop"], done["test_images"]) \
            == ("done", steps, "max_steps", 10_000), name
